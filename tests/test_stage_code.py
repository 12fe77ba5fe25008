"""Stages run generated code, not torch.fx.Interpreter (this fails if torch changes the switch), and
compute the parts of their graphs that read no input once."""

import importlib

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree

import ppsplit
from conftest import MODELS
from helpers import model_and_batch
from ppsplit import stage_code
from ppsplit.stage_code import _FLAG, CachedConstants, adopt_tensors

unflatten = importlib.import_module("torch.export.unflatten")  # the module, not the function


def test_torch_still_has_the_switch():
    assert hasattr(unflatten, "RUN_WITH_INTERPRETER")
    module = unflatten.InterpreterModule(torch.fx.Graph())
    assert hasattr(module, _FLAG)


def test_stages_never_enter_the_interpreter(monkeypatch):
    net, mbs, _ = model_and_batch("bert")  # BERT has a submodule named `self`
    split = ppsplit.split(net, mbs[0].args, mbs[0].kwargs, stages=2)
    interpreted = [m for s in split.stages for m in s.modules() if getattr(m, _FLAG, False)]
    assert not interpreted

    def refuse(*args, **kwargs):
        raise AssertionError("a stage ran through torch.fx.Interpreter")

    monkeypatch.setattr(torch.fx.Interpreter, "run", refuse)
    out = split(*mbs[0].args, **mbs[0].kwargs)
    ref = net(*mbs[0].args, **mbs[0].kwargs)
    assert torch.equal(out[0], ref[0])


def _regions(stage: torch.nn.Module) -> list[CachedConstants]:
    found = []
    for sub in stage.modules():
        graph = getattr(sub, "graph", None)
        if isinstance(graph, fx.Graph):
            found += [n.target for n in graph.nodes if isinstance(n.target, CachedConstants)]
    return found


def _leaves(out) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("model", MODELS)
def test_constant_regions_run_once_and_change_nothing(model, monkeypatch):
    net, mbs, _ = model_and_batch(model)
    args, kwargs = mbs[0].args, mbs[0].kwargs
    split = ppsplit.split(net, args, kwargs, stages=2)
    with monkeypatch.context() as patch:
        patch.setattr(stage_code, "fold_constants", lambda module: 0)
        plain = ppsplit.split(net, args, kwargs, stages=2)
    assert not [r for s in plain.stages for r in _regions(s)]
    regions = [r for s in split.stages for r in _regions(s)]
    # Every model builds a mask or position indices from the static shapes alone.
    assert regions
    runs = []
    for r in regions:
        monkeypatch.setattr(r, "region",
                            lambda *a, _r=r, _run=r.region: runs.append(_r) or _run(*a))
    expected = _leaves(plain(*args, **kwargs))
    for _ in range(3):
        got = _leaves(split(*args, **kwargs))
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert sorted(map(id, runs)) == sorted(map(id, regions))  # each ran once, on the first call


def test_cached_constants_follow_the_buffers_they_read():
    net, mbs, _ = model_and_batch("llama")  # the rotary frequencies are a (non-persistent) buffer
    args, kwargs = mbs[0].args, mbs[0].kwargs
    split = ppsplit.split(net, args, kwargs, stages=2)
    assert any(r.region.graph.find_nodes(op="placeholder") for r in _regions(split.stages[0]))
    before = split(*args, **kwargs)[0]
    with torch.no_grad():
        net.model.rotary_emb.inv_freq.mul_(0.5)  # the stages hold the caller's tensors
    written = split(*args, **kwargs)[0]
    assert not torch.equal(written, before)
    assert torch.equal(written, net(*args, **kwargs)[0])
    replacement = net.model.rotary_emb.inv_freq * 3
    net.model.rotary_emb.inv_freq = replacement
    for stage in split.stages:
        adopt_tensors(stage, {"model.rotary_emb.inv_freq": replacement}, only_known=True)
    assert torch.equal(split(*args, **kwargs)[0], net(*args, **kwargs)[0])


def _graph(build) -> fx.Graph:
    graph = fx.Graph()
    graph.output(build(graph))
    return graph


def test_cached_constants_run_again_after_a_write_into_them():
    aten = torch.ops.aten
    cached = CachedConstants(_graph(lambda g: (g.call_function(
        aten.add.Tensor, (g.call_function(aten.arange.default, (4,)), 1)),)))
    first, = cached()
    assert cached()[0] is first
    first.add_(10)
    again, = cached()
    assert torch.equal(again, torch.arange(4) + 1)


def test_cached_constants_under_inference_mode_and_fake_tensors():
    aten = torch.ops.aten
    cached = CachedConstants(_graph(lambda g: (g.call_function(aten.mul.Tensor, (
        g.call_function(aten.arange.default, (4,), {"dtype": torch.float32}), 2)),)))
    with torch.inference_mode():
        first, = cached()
    assert not first.is_inference()  # a later training step may save it for backward
    weight = torch.ones(4, requires_grad=True)
    (weight * cached()[0]).sum().backward()
    assert torch.equal(weight.grad, torch.arange(4.0) * 2)
    with FakeTensorMode():
        fake, = cached()
    assert isinstance(fake, FakeTensor)
    assert cached()[0] is first


def test_random_ops_and_parameters_are_not_folded():
    aten = torch.ops.aten

    def build(g):
        noise = g.call_function(aten.rand.default, ([4],))
        steps = g.call_function(aten.add.Tensor, (g.call_function(aten.arange.default, (4,)), 1))
        return (g.call_function(aten.add.Tensor, (steps, noise)),
                g.call_function(aten.mul.Tensor, (g.get_attr("weight"), 2)))

    root = torch.nn.Module()
    root.weight = torch.nn.Parameter(torch.ones(4))
    module = fx.GraphModule(root, _graph(build))
    assert stage_code.fold_constants(module) == 2  # arange and its add, nothing else
    module.recompile()
    (a, scaled), (b, _) = module(), module()
    assert not torch.equal(a, b)  # the noise is drawn on every call
    assert scaled.requires_grad


def test_writes_keep_their_order():
    aten = torch.ops.aten
    root = torch.nn.Module()
    root.register_buffer("count", torch.zeros(4))
    graph = fx.Graph()
    x = graph.placeholder("x")
    steps = graph.call_function(aten.add.Tensor, (graph.call_function(
        aten.arange.default, (4,), {"dtype": torch.float32}), 1))
    graph.call_function(aten.add_.Tensor, (graph.get_attr("count"), steps))  # state: every call
    written = graph.call_function(aten.add_.Tensor, (steps, x))  # a write from outside
    after = graph.call_function(aten.mul.Tensor, (steps, 2))  # must see that write
    graph.output((written, after))
    module = fx.GraphModule(root, graph)
    assert stage_code.fold_constants(module) == 2  # arange and add; not the writes, not the mul
    module.recompile()
    for call in range(1, 4):
        x = torch.full((4,), float(call))
        written, after = module(x)
        assert torch.equal(written, torch.arange(4.0) + 1 + x)
        assert torch.equal(after, 2 * (torch.arange(4.0) + 1 + x))
        assert torch.equal(root.count, (torch.arange(4.0) + 1) * call)
