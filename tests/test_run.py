"""Ranks: one process per stage through submitit's local executor, every schedule, checked
against the unsplit model trained on the same data; tied weights stay tied across ranks."""

import glob
import json
import os
import time

import pytest

from ppsplit import CheckFailed, PpsplitError
from ppsplit.app.cli import run
from ppsplit.config.schedules import plan_ranks
from conftest import run_cli
from helpers import compose_cfg

MODELS = ("gpt2", "llama", "bert", "t5")
TIED = {"gpt2": 1, "llama": 0, "bert": 2, "t5": 1}  # tie groups in each model


def run_report(tmp_path, *overrides):
    cfg = compose_cfg(*overrides)
    code = run(cfg, str(tmp_path))
    data = json.loads((tmp_path / "report.json").read_text())
    return code, data


def assert_matches_unsplit(run_section, steps=3):
    assert run_section["ok"]
    assert len(run_section["losses"]) == steps == len(run_section["reference_losses"])
    assert run_section["max_loss_rel_diff"] <= 1e-5
    assert run_section["grad_max_abs_diff"] <= 1e-5, run_section["worst_grad"]
    for tie in run_section["ties"]:
        assert tie["copies_bitwise_equal"], tie
        assert tie["max_abs_diff_vs_reference"] <= 1e-5, tie  # the reference sums the whole batch in another order


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("model", MODELS)
def test_local_ranks_match_unsplit_model(tmp_path, model, stages):
    code, data = run_report(tmp_path, f"model={model}", f"stages={stages}", "launcher=local")
    assert code == 0
    run_section = data["run"]
    assert run_section["launcher"] == "local" and run_section["ranks"] == stages
    assert_matches_unsplit(run_section)
    assert len(run_section["ties"]) == TIED[model]
    assert run_section["step_time_s"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("schedule,ranks,per_rank", [
    ("gpipe", 4, 1), ("interleaved_1f1b", 2, 2), ("looped_bfs", 2, 2),
    ("interleaved_zb", 2, 2), ("zbv", 2, 2), ("dualpipev", 2, 2),
])
def test_every_schedule_at_four_stages(tmp_path, schedule, ranks, per_rank):
    code, data = run_report(tmp_path, "model=gpt2", "stages=4", f"schedule={schedule}")
    assert code == 0
    assert (data["run"]["ranks"], data["run"]["stages_per_rank"]) == (ranks, per_rank)
    assert_matches_unsplit(data["run"])


@pytest.mark.slow
def test_eight_stages_for_an_eight_layer_llama(tmp_path):
    code, data = run_report(tmp_path, "model=llama", "model.config.num_hidden_layers=8", "stages=8",
                            "microbatches=8", "batch_size=8", "steps=2", "timeout_s=240")
    assert code == 0 and data["stages"] == 8 and data["run"]["ranks"] == 8
    assert_matches_unsplit(data["run"], steps=2)


def test_a_head_only_stage_trains_with_its_tie_across_ranks(tmp_path):
    # split=flops puts GPT2's final norm and tied head on a rank of their own at three stages.
    code, data = run_report(tmp_path, "model=gpt2", "split=flops", "stages=3")
    assert code == 0 and data["split_points"][-1] == "transformer.ln_f"
    head = data["stage_info"][-1]
    assert head["begins_at"] == "transformer.ln_f" and head["num_blocks"] == 0
    assert data["fqn_check"]["tied"][0]["stages"] == [0, 2]
    assert_matches_unsplit(data["run"])


@pytest.mark.slow
def test_adamw_keeps_tied_copies_bitwise_equal_every_step(tmp_path):
    code, data = run_report(tmp_path, "model=gpt2", "stages=4", "optimizer=adamw", "debug.check_ties=true")
    assert code == 0
    run_section = data["run"]
    assert run_section["max_loss_rel_diff"] <= 1e-5 and run_section["grad_max_abs_diff"] <= 1e-5
    for tie in run_section["ties"]:  # bitwise equal across ranks after every step (check_ties)
        assert tie["copies_bitwise_equal"] and tie["max_abs_diff_vs_reference"] <= 1e-5
    assert data["run"]["tie_comm_groups"] == [
        {"keys": ["transformer.wte.weight", "lm_head.weight"], "ranks": [0, 3]}]


@pytest.mark.slow
def test_inline_and_local_give_the_same_result(tmp_path):
    _, inline = run_report(tmp_path / "inline", "model=t5", "launcher=inline")
    _, local = run_report(tmp_path / "local", "model=t5", "launcher=local")
    for a, b in zip(inline["run"]["losses"], local["run"]["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert inline["run"]["ties"][0]["copies_bitwise_equal"]


@pytest.mark.slow
def test_tie_group_inside_one_stage_needs_no_communication(tmp_path):
    code, data = run_report(tmp_path, "model=bert", "stages=2")
    assert code == 0
    comm = [g["keys"] for g in data["run"]["tie_comm_groups"]]
    assert ["bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"] in comm
    assert not any("cls.predictions.bias" in keys for keys in comm)  # one stage, one tensor


@pytest.mark.parametrize("schedule,stages,extra,match", [
    ("zbv", 6, ["schedule.stages_per_rank=3"], "exactly 2 stages per rank"),
    ("interleaved_1f1b", 3, [], "not divisible"),
    ("gpipe", 4, ["+schedule.stages_per_rank=2"], "one stage per rank"),
    ("interleaved_1f1b", 4, ["microbatches=1", "batch_size=1"], "microbatches >= ranks"),
])
def test_impossible_schedules_are_refused_before_any_process(tmp_path, schedule, stages, extra, match):
    cfg = compose_cfg("model=llama", "model.config.num_hidden_layers=6", f"schedule={schedule}",
                      f"stages={stages}", *extra)
    with pytest.raises(PpsplitError, match=match):
        run(cfg, str(tmp_path))
    assert not (tmp_path / "submitit").exists()


def test_plan_places_stages_in_loop_and_v():
    from ppsplit.config.schedules import stages_of_rank

    assert plan_ranks("interleaved_1f1b", 4, 2, 4).ranks == 2
    assert [stages_of_rank(r, 2, 2, "loop") for r in range(2)] == [[0, 2], [1, 3]]
    assert [stages_of_rank(r, 2, 2, "v") for r in range(2)] == [[0, 3], [1, 2]]


def rank_pids(folder):
    return [int(open(f).read().split()[0]) for f in glob.glob(os.path.join(folder, "ranks", "rank*.pid"))]


def processes_gone(folder):
    pids = rank_pids(folder)
    assert pids
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and
                 "zombie" not in open(f"/proc/{p}/status").read()]
        if not alive:
            return True
        time.sleep(0.5)
    return False


@pytest.mark.slow
@pytest.mark.parametrize("mode,expect", [
    ("raise", "rank 1 failed: RuntimeError: injected crash on rank 1 at step 1"),
    ("exit", "rank 1 exited with status 3 without reporting an error"),
    ("base", "rank 1 failed: InjectedBaseException: injected BaseException on rank 1 at step 1"),
])
def test_a_failing_rank_fails_the_run_naming_it(tmp_path, mode, expect):
    cfg = compose_cfg("model=gpt2", "debug.crash_rank=1", "debug.crash_step=1", f"debug.crash_mode={mode}")
    start = time.monotonic()
    with pytest.raises(CheckFailed) as info:
        run(cfg, str(tmp_path))
    assert expect in str(info.value)
    assert time.monotonic() - start < 120
    assert processes_gone(tmp_path)
    assert not (tmp_path / "report.json").exists()


@pytest.mark.slow
def test_a_hanging_rank_is_named_with_its_step(tmp_path):
    cfg = compose_cfg("model=gpt2", "debug.crash_rank=0", "debug.crash_step=1", "debug.crash_mode=hang",
                      "timeout_s=10")
    start = time.monotonic()
    with pytest.raises(CheckFailed) as info:
        run(cfg, str(tmp_path))
    message = str(info.value)
    assert message.startswith("no progress for timeout_s=10: rank 0 in step 2/3 at ppsplit/faults.py:"), message
    assert "rank(s) 1 wait on it" in message
    assert time.monotonic() - start < 60
    assert processes_gone(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("model,launcher", [("gpt2", "local"), ("t5", "local"), ("bert", "inline")])
def test_checkpoint_loads_into_a_fresh_unsplit_model(tmp_path, model, launcher):
    import torch.distributed.checkpoint as dcp

    from ppsplit.models import build
    from ppsplit.config.spec import from_config
    from ppsplit.parallel.stage_state import tensor_digest

    code, data = run_report(tmp_path, f"model={model}", f"launcher={launcher}", "checkpoint.save=true")
    assert code == 0
    ckpt = data["run"]["checkpoint"]
    s = from_config(compose_cfg(f"model={model}")).model
    fresh = build.build_model(s.class_name, s.config, seed=1234)  # other values than trained
    state = fresh.state_dict()
    saved = set(dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata)
    assert {k for k in saved if not k.startswith("optim.")} == set(state)  # no key missing, none left over
    names_of = {}  # the optimizer's state too, by FQN: under one of a tied tensor's names
    for name, p in fresh.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    for names in names_of.values():
        assert any(f"optim.param_groups.{n}.lr" in saved for n in names), names
    dcp.load(state, checkpoint_id=ckpt)
    fresh.load_state_dict(state)
    digests = data["run"]["final_state_digests"]
    assert set(digests) == set(state)
    for key, tensor in fresh.state_dict().items():
        assert tensor_digest(tensor) == digests[key], key
