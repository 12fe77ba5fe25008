"""A rank's stages from a model without weights: storage for exactly what the rank holds,
filled one block at a time.

A rank traces the model without weights (:func:`trace_device`), keeps its stages, lays them out
(tensor parallel, FSDP2) while they are still on meta, and only then gives them storage: each
tensor gets its local part alone, a shard where the layout shards it. The values are those of
the unsplit model. For each of the stage's blocks in turn (then the rest of the stage), the
block's tensors are made real in the meta model, the model's own initialisation runs over them,
seeded per FQN (:func:`ppsplit.models.init.initialize`), or they are read from the local checkpoint
(only the slices this rank holds), their local parts are copied into the stage, and the block
goes back to meta. The most a rank holds at once is its own share plus one whole block.
"""

from __future__ import annotations

import torch

from ppsplit.models import weights
from ppsplit.models.adapters import base_key, init_adapters, is_adapted
from ppsplit.models.init import initialize
from ppsplit.stages.code import retarget_devices, same_kind

INIT_DEVICE = torch.device("cpu")  # random fills draw on the CPU, as the unsplit model's do


def trace_device(device) -> torch.device:
    """Where a rank traces its model without weights. Models branch on their tensors' device
    (transformers' MoE routers count tokens per expert with ``histc`` in float32 on the CPU,
    in int32 elsewhere), so the trace must see the device the stages will run on: on the CPU
    the tensors are CPU tensors whose pages are never touched (their memory is reserved, not
    resident); elsewhere the meta device, which takes the accelerator's branches (an
    accelerator's memory cannot be reserved without being held)."""
    return torch.device("cpu") if torch.device(device).type == "cpu" else torch.device("meta")


def stand_ins(model: torch.nn.Module, device) -> None:
    """The meta model's tensors as uninitialised tensors on ``device`` (for the trace only:
    nothing reads or writes them; :func:`to_meta` puts them back)."""
    if torch.device(device).type != "meta":
        move_tensors(model, _named_tensors_dict(model), device)


def to_meta(*modules: torch.nn.Module) -> None:
    """Every tensor of ``modules`` that is not on meta replaced by a meta twin, one twin per
    tensor across all of them (a stage and the model it came from keep sharing)."""
    twins: dict[int, torch.Tensor] = {}
    for module in modules:
        _replace(module, {id(t) for _, t in _named_tensors(module) if not t.is_meta}, "meta", twins)


def materialize_stages(model, split, indices, seed: int, pretrained: str | None, device,
                       stages: dict | None = None) -> dict[int, torch.nn.Module]:
    """Give stages ``indices`` of a split traced on meta real tensors on ``device``, and only them.

    ``stages`` (index -> module) are those stages as laid out on this rank, still on meta
    (default: the split's own). ``model`` is the meta model the split was traced from; its
    tensors are made real one block at a time and are on meta again at the end."""
    stages = {i: (stages or {}).get(i, split.stages[i]) for i in indices}
    for stage in stages.values():
        _allocate(stage, device)
    by_fqn: dict[str, list[torch.Tensor]] = {}
    for stage in stages.values():
        for fqn, tensor in _named_tensors(stage):
            if not any(t is tensor for t in by_fqn.setdefault(fqn, [])):
                by_fqn[fqn].append(tensor)
    known = _named_tensors_dict(model)
    unknown = sorted(set(by_fqn) - set(known))
    if unknown:
        raise RuntimeError(f"no value for {', '.join(unknown[:5])}: not a tensor of the model")
    weight_map = weights.checkpoint_weight_map(pretrained) if pretrained else None  # read once
    rename = base_key if is_adapted(model) else None  # the adapters are not in it; the base is, by its own names
    for fqns in _groups(by_fqn, split.blocks):
        _fill(model, fqns, by_fqn, seed, pretrained, split.tie_groups, weight_map, rename)
    for stage in stages.values():
        retarget_devices(stage, device)
    return stages


@torch.no_grad()
def _fill(model, fqns, by_fqn, seed, pretrained, tie_groups, weight_map, rename=None) -> None:
    """One block: real in ``model``, initialised (or read), copied into the stages' local
    parts, and on meta again; nothing of it outlives the call."""
    move_tensors(model, fqns, INIT_DEVICE)
    initialize(model, seed)
    if is_adapted(model):  # the model's own pass reached its adapters too: peft's start, per FQN
        init_adapters(model, seed)
    whole = _named_tensors_dict(model)
    read = _checkpoint_parts(pretrained, fqns, by_fqn, tie_groups, weight_map, rename) if pretrained else {}
    for fqn in fqns:
        for tensor in by_fqn[fqn]:
            part = read.get((fqn, id(tensor)))
            _local(tensor).copy_(part if part is not None else local_part(tensor, whole[fqn]))
    del whole, read
    move_tensors(model, fqns, "meta")  # the block's storage freed


def _named_tensors(module: torch.nn.Module):
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def _named_tensors_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(_named_tensors(module))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def move_tensors(module: torch.nn.Module, fqns, device) -> None:
    """Give the named parameters and buffers of ``module`` new (uninitialised) storage on
    ``device`` (``"meta"``: none); names of one tensor keep naming one tensor."""
    named = _named_tensors_dict(module)
    _replace(module, {id(named[f]) for f in fqns if f in named}, device)


def _replace(module: torch.nn.Module, targets: set[int], device, new: dict | None = None) -> None:
    new = {} if new is None else new
    for sub in module.modules():
        for store in (sub._parameters, sub._buffers):
            for name, tensor in list(store.items()):
                if tensor is None or id(tensor) not in targets:
                    continue
                if id(tensor) not in new:
                    new[id(tensor)] = same_kind(tensor, torch.empty_like(tensor, device=device))
                store[name] = new[id(tensor)]


def _allocate(stage: torch.nn.Module, device) -> None:
    """Storage on ``device`` for every tensor of ``stage`` still on meta: its local part only
    (a DTensor keeps its placements), one new tensor per tensor however many names it has. FSDP2
    then takes the new parameters as its shards."""
    _replace(stage, {id(t) for _, t in _named_tensors(stage) if t.is_meta}, device)
    from ppsplit.torch_private import reset_fsdp_shards

    reset_fsdp_shards(stage)  # FSDP2's padded shard storage follows the new parameters


def _groups(by_fqn: dict, blocks: list[str]) -> list[list[str]]:
    """The FQNs one block at a time (a block's tensors are initialised together), then the rest."""
    order = sorted(dict.fromkeys(b.partition("@")[0] for b in blocks), key=len, reverse=True)
    groups: dict[str, list[str]] = {}
    for fqn in by_fqn:
        block = next((b for b in order if fqn.startswith(b + ".")), "")
        groups.setdefault(block, []).append(fqn)
    return [groups[k] for k in sorted(groups, key=lambda k: k == "")]  # the rest last


def local_part(tensor: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """The part of ``whole`` that ``tensor`` holds on this rank: all of it, or its shard of a
    DTensor (cut locally, no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(tensor, DTensor):
        return whole
    index = shard_slices(tensor)
    if index is not None:
        return whole[index]  # a view: nothing copied before the copy into the shard
    return distribute_tensor(whole, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()


def shard_slices(tensor: torch.Tensor) -> tuple[slice, ...] | None:
    """The index of this rank's part of a DTensor in the whole tensor, when it is one block
    (placements Shard or Replicate only); None for a plain tensor (all of it) or a strided shard."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from ppsplit.torch_private import local_shape_and_offset

    if not isinstance(tensor, DTensor):
        return None
    if not all(type(p) in (Shard, Replicate) for p in tensor.placements):
        return None
    shape, offset = local_shape_and_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _checkpoint_parts(folder: str, fqns, by_fqn, tie_groups, weight_map, rename=None
                      ) -> dict[tuple[str, int], torch.Tensor]:
    """This rank's parts of the named tensors that the checkpoint holds, by (FQN, id of the
    stage tensor): a shard's rows or columns read alone, a strided shard read whole and cut."""
    wanted = [(fqn, tensor, shard_slices(tensor)) for fqn in fqns for tensor in by_fqn[fqn]]
    got = weights.read_checkpoint_parts(folder, [(fqn, index) for fqn, _, index in wanted], tie_groups, weight_map,
                                        rename)
    return {(fqn, id(tensor)): value if index is not None else local_part(tensor, value)
            for (fqn, tensor, index), value in zip(wanted, got) if value is not None}
