"""Every private torch API ppsplit relies on (ppsplit/torch_private.py) is still where ppsplit
reaches for it; a torch upgrade that moves or removes one fails here, by name."""

import importlib

import pytest
import torch

from ppsplit import torch_private


def test_the_private_modules_and_functions_are_there():
    missing = []
    for module, name in (("torch.utils._pytree", "tree_flatten"), ("torch.utils._pytree", "tree_leaves"),
                         ("torch._ops", "OpOverload"), ("torch.fx._symbolic_trace", "is_fx_symbolic_tracing"),
                         ("torch.utils._python_dispatch", "_get_current_dispatch_mode"),
                         ("torch.distributed.pipelining._backward", "stage_backward"),
                         ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"),
                         ("torch.distributed.checkpoint._traverse", "set_element"),
                         ("torch.distributed.fsdp._fully_shard._fsdp_param", "FSDPParam"),
                         (torch_private.P2P_FUNCTIONS[0], torch_private.P2P_FUNCTIONS[1]),
                         (torch_private.P2P_FUNCTIONS[0], torch_private.P2P_FUNCTIONS[2])):
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as err:
            missing.append(f"{module}.{name}: {type(err).__name__}")
    for name in ("_is_any_autocast_enabled", "_is_torch_function_mode_enabled", "_get_dispatch_mode",
                 "_TorchDispatchModeKey"):
        if not hasattr(torch._C, name):
            missing.append(f"torch._C.{name}")
    assert not missing, "torch moved or removed: " + "; ".join(missing)


def test_they_answer_as_ppsplit_reads_them():
    assert torch_private.UNSAFE_VIEW.name() == "aten::_unsafe_view"
    assert isinstance(torch.ops.aten.add.Tensor, torch_private.OpOverload)
    assert hasattr(torch.ops.aten.add_.Tensor, "_schema") and hasattr(torch.ones(1), "_version")
    assert torch_private.any_autocast() is False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch_private.any_autocast() is True
    assert torch_private.tracing_or_mode_active() is False
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert torch_private.tracing_or_mode_active() is True
    assert torch_private.fsdp_params(torch.nn.Linear(2, 2)) == []
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    assert callable(FSDPParam.reset_sharded_param)  # what reset_fsdp_shards calls on each record
    torch_private.reset_fsdp_shards(torch.nn.Linear(2, 2))  # a module FSDP2 never wrapped: nothing to do
    nested = {"a": {}}
    torch_private.set_nested(nested, ("a", "b"), 3)
    assert nested == {"a": {"b": 3}}


def test_the_native_log_level_can_be_set_and_restored():
    previous = torch_private.native_log_level(2)
    if previous is None:
        pytest.skip("this torch build does not export c10's log level flag")
    assert torch_private.native_log_level(previous) == 2
