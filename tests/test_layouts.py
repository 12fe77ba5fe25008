"""What the FQNs are for: pipeline x FSDP2 x tensor parallel by FQN, each compared with the unsplit
model on the same global batch, and checkpoints that move between layouts."""

import itertools
import json
import os

import pytest
import torch

import ppsplit

from ppsplit import PpsplitError
from ppsplit.app.cli import run
from conftest import run_cli
from helpers import compose_cfg, model_and_batch

pytestmark = pytest.mark.slow


def run_report(folder, *overrides):
    cfg = compose_cfg(*overrides)
    code = run(cfg, str(folder))
    return code, json.loads((folder / "report.json").read_text())


def assert_matches_unsplit(run_section, steps=3, tie_atol=1e-6):
    """``tie_atol``: how far a tied tensor may be from the unsplit model's after the steps (an
    adaptive optimizer moves noise-gradient entries by up to its learning rate: ppsplit.stages.tolerance)."""
    assert run_section["ok"], run_section.get("worst_grad")
    assert run_section["rank_fqn_problems"] == []  # every rank's stages keep the original FQNs
    assert len(run_section["losses"]) == steps == len(run_section["reference_losses"])
    assert run_section["max_loss_rel_diff"] <= 1e-5
    assert run_section["grad_max_abs_diff"] <= 1e-5, run_section["worst_grad"]  # full tensors, by FQN
    for tie in run_section["ties"]:
        assert tie["copies_bitwise_equal"] and tie["max_abs_diff_vs_reference"] <= tie_atol, tie


LAYOUTS = [
    ("gpt2", 2, 1, "sgd"), ("llama", 2, 1, "adamw"), ("bert", 2, 1, "sgd"), ("t5", 2, 1, "adamw"),
    ("llama", 1, 2, "sgd"), ("bert", 1, 2, "adamw"), ("t5", 1, 2, "sgd"),
]


@pytest.mark.parametrize("model,dp,tp,optimizer", LAYOUTS, ids=[f"{m}-pp2xdp{d}xtp{t}-{o}" for m, d, t, o in LAYOUTS])
def test_pp2_with_data_or_tensor_parallel_matches_unsplit(tmp_path, model, dp, tp, optimizer):
    code, data = run_report(tmp_path, f"model={model}", f"parallel.dp={dp}", f"parallel.tp={tp}",
                            f"optimizer={optimizer}", "timeout_s=300")
    assert code == 0
    run_section = data["run"]
    fsdp = {"fsdp_reshard": "step", "fsdp_unit_mib": None, "fsdp_param_dtype": "float32"} if dp > 1 else {}
    assert run_section["mesh"] == {"pp": 2, "dp": dp, "tp": tp, "fsdp": dp > 1, **fsdp}
    assert run_section["ranks"] == 2 * dp * tp
    coords = sorted((r["pp"], r["dp"], r["tp"]) for r in run_section["rank_layout"])
    assert coords == [(p, d, t) for p in range(2) for d in range(dp) for t in range(tp)]
    assert_matches_unsplit(run_section, tie_atol=1e-3 if optimizer == "adamw" else 1e-5)


TIED_TP = {  # a tie whose copies are laid out unlike (the embedding's gradient whole, the head's a shard)
    "llama-tied-pp2xtp2": ["model=llama", "+model.config.tie_word_embeddings=true", "parallel.tp=2"],
    "llama-tied-pp2xdp2xtp2-replicated": ["model=llama", "+model.config.tie_word_embeddings=true", "parallel.dp=2",
                                          "parallel.fsdp=false", "parallel.tp=2"],
    "t5-pp2xdp2xtp2": ["model=t5", "parallel.dp=2", "parallel.tp=2"],
}  # (FSDP2 x TP with a tied LLaMA: the README's 8-rank command)


@pytest.mark.parametrize("name", list(TIED_TP))
def test_ties_stay_tied_under_tensor_parallel_layouts(tmp_path, name):
    code, data = run_report(tmp_path, *TIED_TP[name], "optimizer=adamw", "timeout_s=300")
    assert code == 0
    assert_matches_unsplit(data["run"], tie_atol=1e-3)  # AdamW at lr 1e-3: see assert_matches_unsplit
    assert data["run"]["ties"] and data["run"]["tie_comm_groups"]


def test_fsdp_halves_what_each_rank_holds(tmp_path):
    _, one = run_report(tmp_path / "dp1", "model=llama", "optimizer=adamw")
    _, two = run_report(tmp_path / "dp2", "model=llama", "optimizer=adamw", "parallel.dp=2")
    _, rep = run_report(tmp_path / "rep", "model=llama", "optimizer=adamw", "parallel.dp=2", "parallel.fsdp=false")
    assert_matches_unsplit(two["run"])
    assert_matches_unsplit(rep["run"])

    def held(data, pp):
        return [r["param_bytes"] + r["optimizer_bytes"] for r in data["run"]["rank_layout"] if r["pp"] == pp]

    for pp in (0, 1):
        whole = held(one, pp)[0]
        assert all(0.45 * whole <= b <= 0.6 * whole for b in held(two, pp)), (held(two, pp), whole)
        assert held(rep, pp) == [whole, whole]  # plain replicas hold it all


@pytest.mark.parametrize("schedule,fsdp", [("interleaved_1f1b", "true"), ("zbv", "false")])
def test_multi_stage_schedules_with_data_parallel(tmp_path, schedule, fsdp):
    code, data = run_report(tmp_path, "model=gpt2", "stages=4", f"schedule={schedule}", "parallel.dp=2",
                            f"parallel.fsdp={fsdp}", "timeout_s=300")
    assert code == 0 and data["run"]["ranks"] == 4 and data["run"]["stages_per_rank"] == 2
    assert_matches_unsplit(data["run"])


@pytest.mark.parametrize("overrides,expect", [
    (["model=gpt2", "parallel.tp=2"], "GPT2LMHeadModel has no tensor-parallel plan"),
    (["model=llama", "parallel.tp=4"], "parallel.tp=4 does not divide the model's num_key_value_heads=2"),
    (["model=llama", "parallel.tp=2", "model.tp_plan={model.nosuch:colwise}"], "the plan names no module of the model"),
    (["model=gpt2", "parallel.dp=2", "launcher=slurm", "launcher.nodes=1", "launcher.tasks_per_node=2"],
     "gives 2 ranks; this run needs 4"),
    (["model=gpt2", "stages=4", "schedule=zbv", "parallel.dp=2"], "allowed: parallel.fsdp=false"),
])
def test_layouts_that_cannot_run_are_refused_before_any_rank(tmp_path, overrides, expect):
    with pytest.raises(PpsplitError, match=expect):
        run(compose_cfg(*overrides), str(tmp_path))
    assert not (tmp_path / "ranks").exists()


def checkpoint_step(overrides, folder, load=None, save=None, steps=2):
    args = [*overrides, f"steps={steps}", "optimizer=adamw", "timeout_s=300"]
    if load:
        args.append(f"checkpoint.load={load}")
    if save:
        args += ["checkpoint.save=true", f"checkpoint.dir={save}"]
    code, data = run_report(folder, *args)
    assert code == 0, data["run"]
    return data


@pytest.mark.parametrize("model,chain", [
    # (the README's chain shows GPT2 through pp2, pp4 x dp2 and one stage; here the losses are checked)
    ("llama", [["stages=2", "parallel.tp=2"], ["stages=4"], ["stages=2", "parallel.dp=2", "parallel.tp=2"],
               ["launcher=inline", "stages=1"]]),
])
def test_a_checkpoint_moves_between_layouts_and_training_goes_on_as_if_uninterrupted(tmp_path, model, chain):
    import transformers

    from ppsplit.parallel.stage_state import tensor_digest

    steps = 2
    whole = checkpoint_step([f"model={model}", "launcher=inline"], tmp_path / "whole", steps=steps * len(chain))
    losses, previous = [], None
    for i, layout in enumerate(chain):
        save = tmp_path / f"ckpt{i}"
        data = checkpoint_step([f"model={model}", *layout, "checkpoint.hf=true"],
                               tmp_path / f"run{i}", load=previous, save=save, steps=steps)
        resumed = data["run"]["resumed_from"]
        assert (resumed and {k: resumed[k] for k in ("checkpoint", "step")}) == (
            None if previous is None else {"checkpoint": str(previous), "step": steps * i})
        assert_matches_unsplit(data["run"], steps=steps, tie_atol=1e-3)  # resumed on both sides
        losses += data["run"]["losses"]
        previous = save
        # Each layout's HF folder is an ordinary transformers model: the trained tensors, tied as before.
        cls = getattr(transformers, data["model_class"])
        loaded = cls.from_pretrained(save / "hf")
        assert {k: tensor_digest(v) for k, v in loaded.state_dict().items()} == data["run"]["final_state_digests"]
    assert losses == pytest.approx(whole["run"]["losses"], rel=1e-5)
    assert json.loads((previous / "ppsplit.json").read_text())["step"] == steps * len(chain)
    # The HF folder again, as model.pretrained at pp2 x dp2 x tp2: each rank reads only its slices
    # of the safetensors (rows and columns for TP, FSDP's strided shards whole and cut) and the
    # run equals the driver's unsplit from_pretrained model.
    code, data = run_report(tmp_path / "pretrained", f"model={model}", f"model.pretrained={previous / 'hf'}",
                            "stages=2", "parallel.dp=2", "parallel.tp=2", "steps=1", "timeout_s=300")
    assert code == 0
    assert_matches_unsplit(data["run"], steps=1)


@pytest.mark.parametrize("model", ["t5"])
def test_fsdp_resharding_after_every_microbatch_matches_unsplit(tmp_path, model):
    # each microbatch's backward reduce-scatters and reshards (a shard's memory), the sharded
    # gradients accumulate over the microbatches: the same training as the unsplit model's; the
    # blocks carved into units of at most 80 KiB (attention, feed-forward, single layers; T5's
    # layer lists, which the blocks never call, left in the block)
    code, data = run_report(tmp_path, f"model={model}", "parallel.dp=2", "parallel.fsdp_reshard=microbatch",
                            "parallel.fsdp_unit_mib=0.08", "optimizer=adamw", "timeout_s=300")
    assert code == 0
    assert data["run"]["mesh"] == {"pp": 2, "dp": 2, "tp": 1, "fsdp": True, "fsdp_reshard": "microbatch",
                                   "fsdp_unit_mib": 0.08, "fsdp_param_dtype": "float32"}
    assert_matches_unsplit(data["run"], tie_atol=1e-3)


@pytest.mark.parametrize("model,param_dtype", [("bert", "float32"), ("t5", "float32"), ("llama", "bfloat16")])
def test_fsdp_under_bf16_matches_the_unsplit_bf16_model(tmp_path, model, param_dtype):
    # float32 gathered, autocast casting op by op as in the unsplit model: T5 (its wo kept in
    # float32) and BERT (an embedding summed over every token) matched it only this way
    code, data = run_report(tmp_path, f"model={model}", "train.precision=bf16", "parallel.dp=2",
                            f"parallel.fsdp_param_dtype={param_dtype}", "timeout_s=300")
    assert code == 0 and data["run"]["ok"], data["run"].get("mismatch")
    assert data["run"]["mesh"]["fsdp_param_dtype"] == param_dtype and data["run"]["train"]["precision"] == "bf16"


def _unit_bytes(stage, unit, units, skip=()):
    """The parameter bytes a unit holds itself: those in no unit below it (and not in ``skip``)."""
    inner = [u for u in units if u != unit and (not unit or u.startswith(unit + "."))]
    return sum(p.numel() * p.element_size() for fqn, p in stage.named_parameters()
               if (not unit or fqn.startswith(unit + ".")) and not any(fqn.startswith(u + ".") for u in inner)
               and id(p) not in skip)


@pytest.mark.parametrize("model", ["llama", "gpt2", "t5"])
def test_fsdp_units_hold_at_most_the_limit(model):
    from ppsplit.parallel.layout import fsdp_units

    whole, mbs, _ = model_and_batch(model)
    split = ppsplit.split(whole, mbs[0].args, mbs[0].kwargs, stages=2)
    for (index, stage), share in itertools.product(enumerate(split.stages), (3, 5, 8, 20)):
        blocks = list(dict.fromkeys(b.partition("@")[0] for b in split.stage_blocks()[index]))
        block_bytes = min(_unit_bytes(stage, b, []) for b in blocks)
        limit = block_bytes // share
        units = fsdp_units(stage, blocks, limit)
        called = {f"{n}.{node.target}".lstrip(".") for n, m in stage.named_modules()
                  for node in getattr(getattr(m, "graph", None), "nodes", ()) if node.op == "call_module"}
        assert set(units) <= called, set(units) - called  # FSDP's hooks run only for a module called
        assert set(blocks) <= set(units) and len(units) > len(blocks)
        for i, unit in enumerate(units):  # FSDP wraps a module before any module that holds it
            assert not any(u.startswith(unit + ".") for u in units[i + 1:]), (unit, units)
        leaves = {n for n, m in stage.named_modules() if not any(True for _ in m.children())}
        names: dict[int, int] = {}  # a tied tensor (T5's shared embedding) stays where all its holders are
        for _, p in stage.named_parameters(remove_duplicate=False):
            names[id(p)] = names.get(id(p), 0) + 1
        tied = {k for k, n in names.items() if n > 1}
        for unit in units + [""]:
            held = _unit_bytes(stage, unit, units, skip=tied)
            assert held <= limit or unit in leaves, (model, index, unit, held, limit)
        assert fsdp_units(stage, blocks, 10 * block_bytes * len(blocks)) == blocks  # all fits: one per block


def test_fsdp_units_keep_a_tie_in_one_unit():
    from ppsplit.parallel.layout import fsdp_units

    whole, mbs, _ = model_and_batch("gpt2")  # wte is lm_head: one stage holds both
    split = ppsplit.split(whole, mbs[0].args, mbs[0].kwargs, stages=1)
    stage = split.stages[0]
    assert stage.get_parameter("transformer.wte.weight") is stage.get_parameter("lm_head.weight")
    units = fsdp_units(stage, list(dict.fromkeys(b.partition("@")[0] for b in split.stage_blocks()[0])), 1)
    assert not {"transformer.wte", "lm_head", "transformer"} & set(units)
    assert "transformer.h.0.mlp.c_fc" in units  # a leaf of a block: its own unit


def _reduce_scatter_rank(rank, port, out):
    import torch.distributed as dist

    from ppsplit.parallel.layout import PieceByPieceReduceScatter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    grads = torch.arange(2 * 1001, dtype=torch.float32) * (rank + 1)
    expected = torch.empty(1001)
    dist.reduce_scatter_single(expected, grads.clone(), group=dist.group.WORLD)
    comm = PieceByPieceReduceScatter(piece_bytes=40)  # 5 columns a piece, the last one 1 wide
    got = comm.allocate((1001,), dtype=torch.float32, device=torch.device("cpu"))
    comm(got, grads, dist.group.WORLD, dist.ReduceOp.SUM)
    torch.save({"equal": torch.equal(got, expected), "input_bytes": grads.untyped_storage().nbytes()},
               f"{out}.{rank}")
    dist.destroy_process_group()


def test_reduce_scatter_in_pieces_equals_gloos(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_reduce_scatter_rank, args=(port, str(tmp_path / "out")), nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"out.{rank}")
        assert got == {"equal": True, "input_bytes": 0}  # FSDP's flat input given back at once


# --- the Python API, without Hydra -------------------------------------------------------------------

def _api_rank(rank, world, port, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import ppsplit
    from helpers import model_and_batch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model, mbs, loss_fn = model_and_batch("llama")
    split = ppsplit.split(model, mbs[0].args, mbs[0].kwargs, stages=2)
    mesh = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    for index in range(2):
        ppsplit.parallelize(split, index, model, mesh)  # tensor parallel over both ranks
    keys = [sorted(stage.state_dict()) for stage in split.stages]
    for mb in mbs:
        loss_fn(split(*mb.args, **mb.kwargs), mb.labels).backward()
    grads = {k: getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for st in split.stages
             for k, p in st.named_parameters()}
    if rank == 0:
        torch.save({"keys": keys, "grads": grads}, out)
    dist.destroy_process_group()


def test_parallelize_from_python(tmp_path):
    import socket

    import torch.multiprocessing as mp

    import ppsplit
    from helpers import model_and_batch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "grads.pt"
    mp.spawn(_api_rank, args=(2, port, str(out)), nprocs=2)
    got = torch.load(out)
    model, mbs, loss_fn = model_and_batch("llama")
    split = ppsplit.split(model, mbs[0].args, mbs[0].kwargs, stages=2)
    assert got["keys"] == [sorted(stage.state_dict()) for stage in split.stages]  # FQNs unchanged
    for mb in mbs:
        loss_fn(model(*mb.args, **mb.kwargs), mb.labels).backward()
    for key, grad in got["grads"].items():
        assert torch.allclose(grad, model.get_parameter(key).grad, atol=1e-6), key


def _api_train_rank(rank, world, port, out):
    """pp2 x dp2 (FSDP2) training of tied GPT2 with the public API and torch's own pipelining."""
    import torch.distributed as dist
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh

    import ppsplit
    from helpers import model_and_batch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, mbs, loss_fn = model_and_batch("gpt2")  # 4 microbatches: 2 for each dp rank
    split = ppsplit.split(model, mbs[0].args, mbs[0].kwargs, stages=2)
    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "dp", "tp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    stage = ppsplit.parallelize(split, pp, model, mesh, fsdp_unit_bytes=4096)  # FSDP2 over dp, units of <= 4 KB
    ins, outs = split.stage_io_meta(pp)
    pipe = pipelining.PipelineStage(stage, pp, 2, torch.device("cpu"), input_args=ins,
                                    output_args=outs[0] if len(outs) == 1 else outs, group=mesh["pp"].get_group())
    schedule = pipelining.Schedule1F1B(pipe, n_microbatches=2, loss_fn=loss_fn)
    ties = ppsplit.TiedWeights(split, {pp: stage}, mesh=mesh)  # wte (stage 0) = lm_head (stage 1)
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.5)
    mine = mbs[2 * dp:2 * dp + 2]
    inputs = [torch.cat(ts) for ts in zip(*(split.flat_inputs(mb.args, mb.kwargs) for mb in mine))]
    for _ in range(3):
        if pp == 0:
            schedule.step(*inputs)
        else:
            schedule.step(target=torch.cat([mb.labels for mb in mine]))
        ties.sync_grads()
        optimizer.step()
        optimizer.zero_grad()
    ties.check()
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in stage.state_dict().items()}
    if dp == 0:
        torch.save({"state": state, "groups": ties.groups}, os.path.join(out, f"stage{pp}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_plain_multiprocessing_script_trains_tied_pp2_x_dp2_with_the_public_api(tmp_path):
    import socket

    import torch.multiprocessing as mp

    from helpers import model_and_batch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_api_train_rank, args=(4, port, str(tmp_path)), nprocs=4)
    got = [torch.load(tmp_path / f"stage{i}.pt") for i in range(2)]
    model, mbs, loss_fn = model_and_batch("gpt2")  # the unsplit model, the same 4 microbatches a step
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        (sum(loss_fn(model(*mb.args, **mb.kwargs), mb.labels) for mb in mbs) / len(mbs)).backward()
        optimizer.step()
        optimizer.zero_grad()
    want = model.state_dict()
    assert set(got[0]["state"]) | set(got[1]["state"]) == set(want)  # every FQN, as the model names it
    for part in got:
        for key, value in part["state"].items():
            assert torch.allclose(value, want[key], rtol=1e-4, atol=1e-6), key
    # The tie crossed the pipeline ranks and stayed one tensor: both copies equal the unsplit weight.
    assert torch.equal(got[0]["state"]["transformer.wte.weight"], got[1]["state"]["lm_head.weight"])
    assert got[0]["groups"] == [{"keys": ["transformer.wte.weight", "lm_head.weight"], "ranks": [0, 1]}]


def test_tied_weights_in_one_process_sum_the_copies_and_refuse_a_wrong_placement():
    import ppsplit
    from helpers import model_and_batch

    model, mbs, loss_fn = model_and_batch("gpt2")
    split = ppsplit.split(model, mbs[0].args, mbs[0].kwargs, stages=2)
    stages = dict(enumerate(split.stages))
    ties = ppsplit.TiedWeights(split, stages)  # no torch.distributed: both stages here
    loss_fn(split(*mbs[0].args, **mbs[0].kwargs), mbs[0].labels).backward()
    loss_fn(model(*mbs[0].args, **mbs[0].kwargs), mbs[0].labels).backward()
    ties.sync_grads()
    want = model.get_parameter("transformer.wte.weight").grad  # the unsplit model's: both uses summed
    for i, key in ((0, "transformer.wte.weight"), (1, "lm_head.weight")):
        assert torch.allclose(stages[i].get_parameter(key).grad, want, atol=1e-6), key
    ties.check()
    with pytest.raises(PpsplitError, match=r"stage_ranks=\[0\]: the split has 2 stages"):
        ppsplit.TiedWeights(split, stages, stage_ranks=[0])
    with pytest.raises(PpsplitError, match=r"stages \[5\]: the split has stages 0..1"):
        ppsplit.TiedWeights(split, {5: split.stages[0]})
    with pytest.raises(PpsplitError, match=r"stages \[0\] on pipeline rank 0; stage_ranks=\[0, 0\] puts \[0, 1\]"):
        ppsplit.TiedWeights(split, {0: split.stages[0]}, stage_ranks=[0, 0])
