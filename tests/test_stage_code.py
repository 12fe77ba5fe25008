"""Stages run generated code, not torch.fx.Interpreter (this fails if torch changes the switch), and
compute the parts of their graphs that read no input once."""

import importlib
import operator

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree

import ppsplit
from conftest import MODELS
from helpers import model_and_batch
from ppsplit.stages import code as stage_code
from ppsplit.stages.code import _FLAG, CachedConstants, adopt_tensors

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


def _pair(build, root_of=torch.nn.Module):
    """The same graph twice, as (folded, unfolded) GraphModules, and how many ops were folded."""
    modules = []
    for fold in (True, False):
        root = root_of()
        module = fx.GraphModule(root, _graph(build))
        folded = stage_code.fold_constants(module) if fold else 0
        module.recompile()
        modules.append((module, folded))
    (folded, n), (plain, _) = modules
    return folded, plain, n


def _steps(g: fx.Graph) -> fx.Node:
    """arange(4) + 1, as float: a region of two ops."""
    aten = torch.ops.aten
    return g.call_function(aten.add.Tensor, (g.call_function(
        aten.arange.default, (4,), {"dtype": torch.float32}), 1))


def test_a_submodule_that_writes_a_buffer_is_not_overtaken():
    aten = torch.ops.aten
    writer = fx.Graph()
    writer.output((writer.call_function(aten.add_.Tensor, (writer.get_attr("count"), writer.placeholder("x"))),))

    def root_of():
        sub = torch.nn.Module()
        sub.register_buffer("count", torch.zeros(4))
        root = torch.nn.Module()
        root.sub = fx.GraphModule(sub, writer)
        return root

    def build(g):
        x = g.placeholder("x")
        steps = _steps(g)
        g.call_module("sub", (x,))
        read = g.call_function(aten.mul.Tensor, (g.get_attr("sub.count"), steps))  # after the write
        return (g.call_function(aten.clone.default, (read,)),)

    folded, plain, n = _pair(build, root_of)
    assert n == 2
    for _ in range(3):
        assert torch.equal(folded(torch.ones(4))[0], plain(torch.ones(4))[0])


def test_a_write_into_a_region_value_from_outside_folds_nothing():
    aten = torch.ops.aten
    sub = fx.Graph()
    given, x = sub.placeholder("given"), sub.placeholder("x")
    alias = sub.call_function(aten._unsafe_view.default, (given, [4]))  # storage, not version
    sub.output((sub.call_function(aten.clone.default, (sub.call_function(aten.add_.Tensor, (alias, x)),)),))

    def root_of():
        root = torch.nn.Module()
        root.sub = fx.GraphModule(torch.nn.Module(), sub)
        return root

    def build(g):
        x = g.placeholder("x")
        return (g.call_function(operator.getitem, (g.call_module("sub", (_steps(g), x)), 0)),)

    folded, plain, n = _pair(build, root_of)
    assert n == 0
    assert [folded(torch.ones(4))[0].tolist() for _ in range(2)] == [[2.0, 3.0, 4.0, 5.0]] * 2


def test_cached_constants_see_global_settings_and_replaced_storage():
    aten = torch.ops.aten

    def root_of():
        root = torch.nn.Module()
        root.register_buffer("base", torch.zeros(4))
        return root

    def build(g):
        x = g.placeholder("x")
        scaled = g.call_function(aten.mul.Tensor, (g.call_function(aten.add.Tensor, (g.get_attr("base"), 1)),
                                                   g.call_function(aten.full.default, ([4], 2.0))))
        square = g.call_function(aten.mm.default, (g.call_function(aten.view.default, (scaled, [4, 1])),
                                                   g.call_function(aten.view.default, (scaled, [1, 4]))))
        return (g.call_function(aten.add.Tensor, (scaled, x)), square)

    folded, plain, n = _pair(build, root_of)
    assert n == 6
    x = torch.zeros(4)

    def same():
        for a, b in zip(folded(x), plain(x), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)

    same()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # aten.full without a dtype follows it
    try:
        same()
    finally:
        torch.set_default_dtype(default)
    with torch.autocast("cpu", torch.bfloat16):
        same()
    same()
    for module in (folded, plain):
        module.base.data = torch.full((4,), 10.0)  # new storage, same version
    same()
    for module in (folded, plain):
        torch.utils.swap_tensors(module.base, torch.full((4,), 20.0))
    same()
    with torch.inference_mode():
        frozen = torch.full((4,), 30.0)
    for module in (folded, plain):
        module.base = frozen  # an inference tensor keeps no version: never cached
    with torch.inference_mode():
        same()


def test_views_cached_under_no_grad_take_in_place_writes_under_autograd():
    aten = torch.ops.aten
    cached = CachedConstants(_graph(lambda g: (g.call_function(aten.slice.Tensor, (_steps(g), 0, 0, 4)),)))
    with torch.no_grad():
        cached()
    view, = cached()
    x = torch.ones(4, requires_grad=True)
    (view.add_(x) * 2).sum().backward()  # a view made under no_grad would refuse this
    assert torch.equal(x.grad, torch.full((4,), 2.0))
