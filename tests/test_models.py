"""Models beyond the four: more families from their configs, and any transformers class (or a
local folder alone) from the command line through model=hf, with inputs and loss from its task."""

import json

import pytest

from conftest import MORE_MODELS, run_cli
from test_config import TINY_QWEN2

TASKS = {"qwen2_moe": "causal_lm", "bart": "seq2seq", "vit": "image_classification", "albert": "masked_lm"}


def report_of(run_dir):
    return json.loads((run_dir / "report.json").read_text())


def assert_exact(data, ranks):
    assert data["fqn_check"]["ok"], data["fqn_check"]
    assert data["numerics"]["ok"] and data["numerics"]["grad_max_abs_diff"] <= 1e-5
    run = data["run"]
    assert run["ok"] and run["ranks"] == ranks
    assert run["max_loss_rel_diff"] <= 1e-5 and run["grad_max_abs_diff"] <= 1e-5, run["worst_grad"]
    for tie in run["ties"]:
        assert tie["copies_bitwise_equal"], tie


@pytest.mark.slow
@pytest.mark.parametrize("model", MORE_MODELS)
def test_more_families_run_on_two_ranks(tmp_path, model):
    out = run_cli(f"model={model}", "stages=2", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    data = report_of(tmp_path / "run")
    assert data["model"] == model and data["stages"] == 2
    assert_exact(data, ranks=2)


def test_a_local_folder_alone_names_its_class_and_task(tmp_path):
    import transformers

    folder = tmp_path / "bart"
    config = transformers.BartConfig(encoder_layers=2, decoder_layers=2, d_model=32, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, encoder_attention_heads=2, decoder_attention_heads=2,
                                     vocab_size=500, max_position_embeddings=64, dropout=0.0)
    transformers.BartForConditionalGeneration(config).save_pretrained(folder)
    out = run_cli("model=hf", f"model.pretrained={folder}", "launcher=inline",
                  f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    data = report_of(tmp_path / "run")
    assert data["model_class"] == "BartForConditionalGeneration"
    assert data["fqn_check"]["ok"] and data["numerics"]["ok"] and data["run"]["ok"]


@pytest.mark.parametrize("overrides,named", [
    ([], "model=hf needs model.model_class"),
    (["model.model_class=LlamaForCasualLM"], "did you mean LlamaForCausalLM"),
    (["model.model_class=LlamaModel"], "'LlamaModel' has no task ppsplit can train"),
    (TINY_QWEN2 + ["model.inputs=seq2seq"], "is not an encoder-decoder"),
    (["model.pretrained=NOWHERE"], "config.json cannot be read"),
], ids=["no-class", "typo", "no-task", "not-seq2seq", "no-folder"])
def test_a_model_without_a_usable_class_or_task_is_refused(tmp_path, overrides, named):
    out = run_cli("model=hf", *[o.replace("NOWHERE", str(tmp_path / "nowhere")) for o in overrides],
                  "launcher=inline", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("model", MORE_MODELS)
def test_inputs_and_loss_follow_the_task(cfg_for, model):
    from ppsplit.config.spec import from_config
    from ppsplit.config.tasks import task_of

    spec = from_config(cfg_for(f"model={model}")).model
    assert spec.inputs == spec.loss == TASKS[model] == task_of(spec.class_name)


SHARED = "albert.encoder.albert_layer_groups.0"


def test_a_shared_layer_splits_between_its_calls():
    import ppsplit
    from helpers import model_and_batch

    net, mbs, loss_fn = model_and_batch("albert")
    args, kwargs = mbs[0].args, mbs[0].kwargs
    assert ppsplit.find_blocks(net) == []  # no block list: the calls of the one layer are the blocks
    for how in ({"stages": 4}, {"points": [f"{SHARED}@2"]}, {"stages": 2, "strategy": "flops"},
                {"stages": 3, "strategy": "params"}):
        split = ppsplit.split(net, args, kwargs, **how)
        assert split.blocks == [SHARED, f"{SHARED}@1", f"{SHARED}@2", f"{SHARED}@3"]
        keys = [set(stage.state_dict()) for stage in split.stages]
        assert set().union(*keys) == set(net.state_dict())  # the original FQNs, no "@" copies
        layer = {k for k in net.state_dict() if k.startswith(SHARED + ".")}
        assert all(layer <= k for k, runs in zip(keys, split.stage_blocks()) if runs)
        assert [layer & set(g) for g in split.tie_groups if len(g) == 1]  # kept in step like a tie
        assert ppsplit.verify_fqns(net, split).ok
        numerics = ppsplit.verify_numerics(net, split, mbs, loss_fn)
        assert numerics.ok(1e-6), numerics
    for end in (f"{SHARED}:end", f"{SHARED}@2:end"):  # the end of which call: refused
        with pytest.raises(ppsplit.PpsplitError, match="runs more than once"):
            ppsplit.split(net, args, kwargs, points=[end])


@pytest.mark.slow
def test_a_shared_layer_stays_in_step_across_ranks_under_adamw(tmp_path):
    out = run_cli("model=albert", "stages=4", "optimizer=adamw", "tie_tolerance=1e-5",
                  f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    data = report_of(tmp_path / "run")
    assert data["split_points"] == [f"{SHARED}@1", f"{SHARED}@2", f"{SHARED}@3"]
    assert_exact(data, ranks=4)
    shared = [t for t in data["run"]["ties"] if t["keys"][0].startswith(SHARED + ".")]
    assert len(shared) == 16 and all(t["copies_bitwise_equal"] for t in shared)
    assert max(t["max_abs_diff_vs_reference"] for t in shared) <= 1e-5
    assert f"shared {SHARED}.albert_layers.0 (16 keys): copies bitwise equal" in out.stdout


@pytest.mark.slow
def test_a_trained_hf_folder_runs_again_by_its_path_alone(tmp_path):
    out = run_cli("model=vit", "launcher=inline", "checkpoint.save=true", "checkpoint.hf=true",
                  f"hydra.run.dir={tmp_path / 'train'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    folder = tmp_path / "train" / "checkpoint" / "hf"
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["ViTForImageClassification"]
    out = run_cli("model=hf", f"model.pretrained={folder}", "launcher=inline",
                  f"hydra.run.dir={tmp_path / 'again'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    data = report_of(tmp_path / "again")
    assert data["model_class"] == "ViTForImageClassification" and data["run"]["ok"]
