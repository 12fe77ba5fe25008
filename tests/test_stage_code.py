"""Stages run generated code, not torch.fx.Interpreter; this fails if torch changes the switch."""

import importlib

import torch
import ppsplit
from ppsplit.stage_code import _FLAG
from helpers import model_and_batch

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
