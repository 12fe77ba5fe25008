"""The private torch APIs ppsplit relies on, in one place. torch 2.13 offers no public way to
do these things; each entry says what ppsplit needs it for. ``tests/test_torch_private.py``
reaches every one, so a torch upgrade that moves or removes one is named there, not found deep
inside a run. Attributes of torch's own objects (``OpOverload._schema``, ``Tensor._version``)
are read where they are used, and listed in :data:`ATTRIBUTES` for the same test.
"""

from __future__ import annotations

import ctypes
import os

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree  # noqa: F401  (flatten inputs and outputs as torch.export does)

OpOverload = torch._ops.OpOverload  # an aten op's overload: how FX graphs name their targets
UNSAFE_VIEW = torch.ops.aten._unsafe_view.default  # the view export emits for reshape: shares storage

# Fake tensors, functionalization, make_fx's proxies: a tracer that must see a region's ops.
_INFRA_MODES = tuple(torch._C._TorchDispatchModeKey.__members__.values())

# Private attributes of torch's objects that ppsplit reads where it uses them: (what, attribute).
ATTRIBUTES = (("an OpOverload", "_schema"), ("a Tensor", "_version"))


def any_autocast() -> bool:
    """Whether autocast is on for any device (one call instead of one per device)."""
    return torch._C._is_any_autocast_enabled()


def tracing_or_mode_active() -> bool:
    """Whether ops now run under a tracer or a mode (FX's symbolic trace, a TorchFunctionMode, a
    dispatch mode: fake tensors, export, make_fx) rather than on real tensors."""
    return (fx._symbolic_trace.is_fx_symbolic_tracing()
            or torch._C._is_torch_function_mode_enabled()
            or any(torch._C._get_dispatch_mode(key) is not None for key in _INFRA_MODES)
            or torch.utils._python_dispatch._get_current_dispatch_mode() is not None)


def stage_backward(stage_output, output_grads, input_values):
    """The pipeline stage's own backward step (torch.distributed.pipelining), for FSDP
    resharding after every microbatch."""
    from torch.distributed.pipelining._backward import stage_backward as backward

    return backward(stage_output, output_grads, input_values)


def fsdp_params(module: torch.nn.Module) -> list:
    """FSDP2's parameter records of ``module`` (each keeps its padded shard storage)."""
    state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
    return [p for group in getattr(state, "_fsdp_param_groups", None) or () for p in group.fsdp_params]


def reset_fsdp_shards(module: torch.nn.Module) -> None:
    """After FSDP2's parameters of ``module`` and below got new storage (materialised from meta),
    point each one's padded shard storage at it again."""
    for sub in module.modules():
        for param in fsdp_params(sub):
            param.reset_sharded_param()


def local_shape_and_offset(shape, mesh, placements):
    """A DTensor's local shape and global offset on this rank."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(shape, mesh, placements)


def set_nested(root: dict, path, value) -> None:
    """Set a value in DCP's nested state dict at a flattened key's path."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(root, path, value)


# The pipeline schedules post their sends and receives through one module function and wait on
# them through another: the timeline wraps both (module, post, wait).
P2P_FUNCTIONS = ("torch.distributed.pipelining.schedules", "_batch_p2p", "_wait_batch_p2p")


def native_log_level(level: int) -> int | None:
    """Set the level below which torch's C++ code (c10's ``LOG``: 0 info, 1 warning, 2 error)
    stays silent in this process; returns the previous one (None where this build does not
    export the flag)."""
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        flag = ctypes.c_int.in_dll(lib, "FLAGS_caffe2_log_level")
    except (OSError, ValueError):
        return None
    previous, flag.value = flag.value, level
    return previous
