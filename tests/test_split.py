"""The core property: stage FQNs partition the original state_dict, and the chained stages are
the original model (forward, loss and every gradient)."""

import copy
import json

import pytest
import torch

import ppsplit
from ppsplit.app.cli import run
from helpers import compose_cfg, model_and_batch

BLOCKS = {"gpt2": 4, "llama": 4, "bert": 4, "t5": 8, "qwen2_moe": 4, "bart": 4, "vit": 4, "albert": 4}
CASES = [(m, s) for m in BLOCKS for s in (2, 4, "per_block")]


def stage_count(model, stages):
    return BLOCKS[model] if stages == "per_block" else stages


@pytest.mark.parametrize("model,stages", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_fqns_partition_state_dict_and_numerics_match(model, stages):
    net, mbs, loss_fn = model_and_batch(model)
    n = stage_count(model, stages)
    split = ppsplit.split(net, mbs[0].args, mbs[0].kwargs, stages=n)
    assert len(split.stages) == n

    original = net.state_dict()
    stage_keys = [set(stage.state_dict()) for stage in split.stages]
    assert set().union(*stage_keys) == set(original)
    tied = {k for g in split.tie_groups for k in g}
    for key in original:
        holders = [i for i, keys in enumerate(stage_keys) if key in keys]
        assert len(holders) == 1 or key in tied, (key, holders)
    for stage in split.stages:
        for key, tensor in stage.state_dict().items():
            assert torch.equal(tensor, original[key]), key

    report = ppsplit.verify_fqns(net, split)
    assert report.ok, report.problems()
    assert report.declared_ties_not_found == []  # the ties found agree with transformers'
    numerics = ppsplit.verify_numerics(net, split, mbs, loss_fn)
    assert numerics.forward_max_abs_diff <= 1e-5
    assert numerics.loss_abs_diff <= 1e-5
    assert numerics.grad_max_abs_diff <= 1e-5, numerics.worst_grad


@pytest.mark.parametrize("model", list(BLOCKS))
def test_main_job_writes_report(tmp_path, model):
    cfg = compose_cfg(f"model={model}", "stages=2", "launcher=inline")
    assert run(cfg, str(tmp_path)) == 0
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["model"] == model and data["stages"] == 2 and len(data["split_points"]) == 1
    check = data["fqn_check"]
    assert check["ok"] and not check["missing"] and not check["unexpected"] and not check["duplicated"]
    placements = sum(r["state_dict_keys"] for r in data["stage_info"])
    assert placements >= check["original_keys"]
    if not check["tied"]:  # untied keys sit in exactly one stage
        assert placements == check["original_keys"]
    assert [r["index"] for r in data["stage_info"]] == [0, 1]
    for key in ("forward_max_abs_diff", "loss_abs_diff", "grad_max_abs_diff"):
        assert data["numerics"][key] <= 1e-5
    assert data["run"]["launcher"] == "inline" and data["run"]["max_loss_rel_diff"] <= 1e-5


def test_layer_numbering_is_kept():
    net, mbs, _ = model_and_batch("gpt2")
    split = ppsplit.split(net, mbs[0].args, mbs[0].kwargs, stages=2)
    keys1 = set(split.stages[1].state_dict())
    assert "transformer.h.3.mlp.c_fc.weight" in keys1 and "transformer.h.2.attn.c_attn.weight" in keys1
    assert not any(k.startswith(("transformer.h.0.", "transformer.h.1.")) for k in keys1)
    assert split.points == ["transformer.h.2"]
    assert isinstance(split.stages[1].get_submodule("transformer.h.3.mlp.c_fc"), torch.nn.Module)


def test_non_persistent_buffers_stay_non_persistent():
    net, mbs, _ = model_and_batch("llama")
    split = ppsplit.split(net, mbs[0].args, mbs[0].kwargs, stages=2)
    stage0 = split.stages[0]
    assert "model.rotary_emb.inv_freq" in dict(stage0.named_buffers())
    assert "model.rotary_emb.inv_freq" not in stage0.state_dict()
    assert not any("lifted_tensor" in k for s in split.stages for k in s.state_dict())

    net, mbs, _ = model_and_batch("bert")
    split = ppsplit.split(net, mbs[0].args, mbs[0].kwargs, stages=2)
    keys = set().union(*(s.state_dict() for s in split.stages))
    assert "bert.embeddings.position_ids" not in keys and "bert.embeddings.token_type_ids" not in keys


def test_tied_weights_one_tensor_per_stage_and_no_stale_copy():
    net, mbs, _ = model_and_batch("gpt2")
    one = ppsplit.split(net, mbs[0].args, mbs[0].kwargs, stages=1)
    assert one.stages[0].get_parameter("lm_head.weight") is one.stages[0].get_parameter("transformer.wte.weight")
    two = ppsplit.split(net, mbs[0].args, mbs[0].kwargs, stages=2)
    assert "lm_head.weight" not in two.stages[0].state_dict()  # no stale head copy in stage 0
    assert "transformer.wte.weight" not in two.stages[1].state_dict()
    total = sum(p.numel() for s in two.stages for p in s.parameters())
    original = sum(p.numel() for p in net.parameters())
    assert total == original + net.transformer.wte.weight.numel()  # one legitimate copy
    # no weight memory: the stages hold the caller's tensors
    assert two.stages[1].get_parameter("lm_head.weight") is net.lm_head.weight

    net, mbs, _ = model_and_batch("t5")
    split = ppsplit.split(net, mbs[0].args, mbs[0].kwargs, stages=2)
    s0 = split.stages[0]
    # the decoder's embedding runs before decoder.block.0, so in stage 0 with the encoder's
    names = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
    assert len({id(s0.get_parameter(n)) for n in names}) == 1
    assert set(split.stages[-1].state_dict()) & set(names) == set()
    assert "lm_head.weight" in split.stages[-1].state_dict()

    net, mbs, _ = model_and_batch("bert")
    split = ppsplit.split(net, mbs[0].args, mbs[0].kwargs, stages=2)
    last = split.stages[-1]
    assert last.get_parameter("cls.predictions.bias") is last.get_parameter("cls.predictions.decoder.bias")


def test_caller_model_is_not_changed():
    net, mbs, _ = model_and_batch("gpt2")
    before = {k: v.clone() for k, v in net.state_dict().items()}
    forward = type(net).forward
    ppsplit.split(net, mbs[0].args, mbs[0].kwargs, points=["transformer.h.1"])
    assert "forward" not in vars(net) and type(net).forward is forward
    assert not any("forward" in vars(m) for m in net.modules())
    after = net.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_manual_points_and_tied_gradient_sum():
    net, mbs, loss_fn = model_and_batch("gpt2")
    reference = copy.deepcopy(net)
    split = ppsplit.split(net, mbs[0].args, mbs[0].kwargs, points=["transformer.h.1", "transformer.h.3"])
    assert len(split.stages) == 3
    loss_fn(split(*mbs[0].args, **mbs[0].kwargs), mbs[0].labels).backward()
    loss_fn(reference(*mbs[0].args, **mbs[0].kwargs), mbs[0].labels).backward()
    # the stages share the caller's tensors: one tensor, the full tied gradient
    wte = split.stages[0].get_parameter("transformer.wte.weight")
    assert wte is split.stages[2].get_parameter("lm_head.weight") is net.transformer.wte.weight
    assert torch.allclose(wte.grad, reference.transformer.wte.weight.grad, atol=1e-6)
    for stage in split.stages:
        for key, p in stage.named_parameters():
            assert torch.allclose(p.grad, reference.get_parameter(key).grad, atol=1e-6), key


DYNAMIC = [m for m in BLOCKS if m != "vit"]  # images have no sequence length


@pytest.mark.parametrize("model", DYNAMIC)
def test_one_dynamic_split_serves_several_batch_and_sequence_sizes(model):
    """Traced once with a dynamic batch and sequence dimension, the stages run every shape in
    the bounds, as the unsplit model does; no size travels between stages (each stage reads the
    sizes it needs off the tensors it receives, as a pipeline stage must)."""
    from ppsplit.data.batch import make_batch
    from ppsplit.config.spec import from_config

    net, _, loss_fn = model_and_batch(model)
    s = from_config(compose_cfg(f"model={model}")).model
    kind, call_kwargs = s.inputs, s.call_kwargs

    def microbatches(batch, seq, seed):
        return make_batch(kind, net, batch * 2, seq, seed, call_kwargs=call_kwargs).microbatches(2)

    example = microbatches(2, 32, 0)[0]
    split = ppsplit.split(net, example.args, example.kwargs, stages=2,
                          dynamic={"batch": (1, 8), "seq": (8, 64)})
    assert ppsplit.verify_fqns(net, split).ok
    assert set(split.size_symbols()) == {"batch", "seq"}
    for batch, seq in ((2, 32), (3, 16), (2, 48), (4, 8)):
        mbs = microbatches(batch, seq, batch + seq)
        # What stage 0 sends at this shape is what stage 1 is told to expect, and only tensors.
        ins, _ = split.stage_io_meta(1, {"batch": batch, "seq": seq})
        with torch.no_grad():
            sent = split.stages[0](*split.flat_inputs(mbs[0].args, mbs[0].kwargs))
        sent = sent if isinstance(sent, tuple) else (sent,)
        assert all(isinstance(t, torch.Tensor) for t in sent)
        assert [tuple(t.shape) for t in sent] == [tuple(t.shape) for t in ins]
        numerics = ppsplit.verify_numerics(net, split, mbs, loss_fn)
        assert numerics.forward_max_abs_diff <= 1e-5, (batch, seq)
        assert numerics.loss_abs_diff <= 1e-5, (batch, seq)
        assert numerics.grad_max_abs_diff <= 1e-5, (batch, seq, numerics.worst_grad)


def test_a_dynamic_split_keeps_the_keyword_constants_it_was_traced_with():
    net, mbs, _ = model_and_batch("gpt2")
    split = ppsplit.split(net, mbs[0].args, mbs[0].kwargs, stages=2, dynamic={"seq": (8, 64)})
    assert mbs[0].kwargs.get("return_dict") is False
    out = split(*mbs[0].args, **mbs[0].kwargs)  # given as traced
    assert torch.equal(out[0], net(*mbs[0].args, **mbs[0].kwargs)[0])
    assert torch.equal(split(*mbs[0].args)[0], out[0])  # or left out: they were bound at the trace
    with pytest.raises(ppsplit.PpsplitError, match="traced with return_dict=False; allowed: that value"):
        split(*mbs[0].args, return_dict=True)


@pytest.mark.parametrize("launcher", ["inline"])  # local ranks: the README's seq_lens command
def test_steps_of_different_sequence_lengths_match_the_unsplit_model(tmp_path, launcher):
    model = "gpt2" if launcher == "inline" else "llama"
    cfg = compose_cfg(f"model={model}", "stages=2", f"launcher={launcher}", "seq_lens=[16,32,48]", "steps=4")
    assert run(cfg, str(tmp_path)) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    r = report["run"]
    assert r["ok"] and r["seq_lens"] == [16, 32, 48, 16]
    assert r["losses"] == pytest.approx(r["reference_losses"], rel=1e-5)
    assert r["grad_max_abs_diff"] <= 1e-5
