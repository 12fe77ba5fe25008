"""Lay stages out over data- and tensor-parallel ranks by FQN: FSDP2 on each block, tensor
parallelism from the model's own plan.

A rank's stages keep the original FQNs, so the plans that are keyed by them apply unchanged:

- **Tensor parallelism** (``tp > 1``) takes transformers' ``tp_plan`` (``model.layers.*.self_attn.q_proj:
  colwise``), or one given in the model config. Each planned leaf of the stage (an unflattened
  ``InterpreterModule`` running one ``aten.linear``) is replaced by a fresh module of the
  original's class holding the stage's own parameters, and torch's style is applied to it. The
  trace baked the global head counts into the graph (``expand(x, [2, 2, 2, 32, 16])``); which
  dimensions hold heads is found by following the sharded dimension from each column-wise
  output through the graph (views, transposes, broadcasts, attention), and those sizes are
  divided by ``tp`` (:mod:`ppsplit.stages.shard_flow`). No model is special-cased; an op the flow cannot
  follow is refused with its name and module.
- **FSDP2** (``fully_shard``) over the "dp" mesh on each block of the stage (the split's blocks,
  by FQN), or on smaller units carved by size (:func:`fsdp_units`), then on the stage root;
  ``fsdp=False`` keeps plain replicas whose gradients are averaged after each step. CPU ranks
  reduce-scatter gradients piece by piece (:class:`PieceByPieceReduceScatter`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ppsplit.errors import PpsplitError
from ppsplit.stages.shard_flow import StageFlow, apply_rewrites, tp_flows


# --- the plan --------------------------------------------------------------------------------

def torch_style(style: str):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if style == "colwise_gather_output":
        return ColwiseParallel(output_layouts=Replicate())
    if style == "embedding_rowwise":
        return RowwiseParallel(input_layouts=Replicate())
    raise PpsplitError(f"tensor-parallel style {style!r} is not supported; allowed: colwise, rowwise, "
                       "colwise_gather_output, embedding_rowwise, replicate")


def _fresh_leaf(original: torch.nn.Module, unflattened: torch.nn.Module) -> torch.nn.Module:
    """A new module of the original leaf's class and settings, holding the unflattened leaf's
    (the stage's) parameters: parallelizing it leaves the caller's model untouched."""
    leaf = type(original).__new__(type(original))
    torch.nn.Module.__init__(leaf)
    for key, value in vars(original).items():
        if not key.startswith("_") and key != "training":
            setattr(leaf, key, value)
    leaf._parameters = {n: unflattened._parameters.get(n, p) for n, p in original._parameters.items()}
    leaf._buffers = {n: unflattened._buffers.get(n, b) for n, b in original._buffers.items()}
    leaf.train(unflattened.training)
    return leaf


def apply_tensor_parallel(stage: torch.nn.Module, model: torch.nn.Module, flow: StageFlow, tp_mesh) -> None:
    """Swap the stage's planned leaves for the original modules' kind and apply their styles,
    then divide the head counts the trace baked in."""
    from torch.distributed.tensor.parallel import parallelize_module

    holders: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for prefix, module in stage.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((module, name))
    replaced: dict[int, torch.nn.Parameter] = {}
    for fqn, style in flow.leaves.items():
        unflattened = stage.get_submodule(fqn)
        original = model.get_submodule(fqn)
        if not isinstance(original, (torch.nn.Linear, torch.nn.Embedding)):
            raise PpsplitError(f"tensor-parallel plan: {fqn} is a {type(original).__name__}; "
                               "allowed: nn.Linear and nn.Embedding leaves")
        leaf = _fresh_leaf(original, unflattened)
        before = {name: p for name, p in leaf._parameters.items() if p is not None}
        parallelize_module(leaf, tp_mesh, torch_style(style))
        for name, p in before.items():
            replaced[id(p)] = leaf._parameters[name]
        parent_name, _, child = fqn.rpartition(".")
        parent = stage.get_submodule(parent_name) if parent_name else stage
        setattr(parent, child, leaf)
    # A tensor held under several names in this stage stays one tensor.
    for pid, new in replaced.items():
        for module, name in holders.get(pid, []):
            current = module._parameters.get(name)
            if current is not None and id(current) == pid:
                module._parameters[name] = new
    apply_rewrites(stage, flow.rewrites, tp_mesh)


def apply_fsdp(stage: torch.nn.Module, blocks: list[str], dp_mesh, bf16: bool = False,
               unit_bytes: int | None = None) -> None:
    """``fully_shard`` each of the stage's blocks, then the stage root, over ``dp_mesh``; with
    ``bf16``, parameters are gathered in bfloat16 and gradients reduced in float32. With
    ``unit_bytes``, blocks and the root are carved into smaller units first (:func:`fsdp_units`)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ppsplit.stages.code import drop_dtype_checks

    policy = MixedPrecisionPolicy()
    if bf16:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        drop_dtype_checks(stage)  # the trace saw float32 where bfloat16 parameters now give bfloat16
    names = {n for n, _ in stage.named_modules()}
    units = [b for b in blocks if b in names]
    if unit_bytes is not None:
        units = fsdp_units(stage, units, unit_bytes)
    for unit in units:
        fully_shard(stage.get_submodule(unit), mesh=dp_mesh, mp_policy=policy)
    fully_shard(stage, mesh=dp_mesh, mp_policy=policy)
    if dp_mesh.device_type == "cpu":
        scatter = PieceByPieceReduceScatter()
        for unit in units + [""]:
            stage.get_submodule(unit).set_custom_reduce_scatter(scatter)


PIECE_BYTES = 1 << 20


class PieceByPieceReduceScatter:
    """FSDP2's gradient reduce-scatter on CPU ranks (gloo), in pieces of at most ``piece_bytes``.

    gloo reduce-scatters through a copy of the whole tensor, so a unit's
    reduce-scatter held its gradients three times at once (autograd's, FSDP's flat input, gloo's
    copy); here gloo's copy is one piece. Once the pieces are reduced, FSDP's flat input is given
    back: FSDP keeps it until the next unit's reduce-scatter in case a GPU stream still reads it,
    which a CPU rank's finished, synchronous reduce-scatter cannot."""

    def __init__(self, piece_bytes: int = PIECE_BYTES):
        self.piece_bytes = piece_bytes

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False) -> None:
        import torch.distributed as dist

        rows = input_tensor.view(group.size(), -1)  # row r: what rank r keeps, of every gradient
        for cols in _pieces(rows, self.piece_bytes):
            dist.reduce_scatter_single(output_tensor[cols], rows[:, cols].contiguous().view(-1), op=op, group=group)
        input_tensor.untyped_storage().resize_(0)


def _pieces(rows: torch.Tensor, piece_bytes: int):
    width = max(1, piece_bytes // (rows.shape[0] * rows.element_size()))
    return [slice(start, min(start + width, rows.shape[1])) for start in range(0, rows.shape[1], width)]


def fsdp_units(stage: torch.nn.Module, blocks: list[str], unit_bytes: int) -> list[str]:
    """The stage's FSDP units, innermost first, when none should hold more than ``unit_bytes`` of
    parameters: each block (and the root, what the blocks leave) gives its largest submodules
    units of their own, recursively, until what stays in it fits. A leaf larger than the limit is
    one unit. FSDP gathers a unit's parameters only around the unit's own forward and backward, so
    a submodule stays in its parent's unit when any of its parameters is also held, or read by
    a graph, outside it (a tie, a weight read by the parent's code), or when no graph calls it
    (a container such as T5's ``layer`` list, whose items the block calls directly)."""
    blocks = list(blocks)
    size = {name: 0 for name, _ in stage.named_modules()}  # bytes under a module in no block below it
    seen: set[int] = set()
    for fqn, param in stage.named_parameters():  # each tensor once
        if id(param) in seen:
            continue
        seen.add(id(param))
        local = param.to_local() if hasattr(param, "to_local") else param  # a tensor-parallel shard
        parts = fqn.split(".")[:-1]
        for depth in range(len(parts), -1, -1):
            holder = ".".join(parts[:depth])
            size[holder] += local.numel() * local.element_size()
            if holder in blocks:
                break
    shared = _shared_prefixes(stage)
    called = _called_modules(stage)
    units = list(blocks)

    def carve(name: str, module: torch.nn.Module) -> int:
        """Carve units out of ``name``; the bytes it still holds itself."""
        left = size[name]
        children = sorted(((_join(name, c), m) for c, m in module.named_children()), key=lambda x: -size[x[0]])
        for child, sub in children:
            if left <= unit_bytes:
                break
            if child in units or not size[child]:
                continue
            kept = carve(child, sub)
            left -= size[child] - kept  # what its own units took
            if kept and child not in shared and child in called:
                units.append(child)
                left -= kept
        return left

    for block in blocks:
        carve(block, stage.get_submodule(block))
    carve("", stage)
    return sorted(units, key=lambda n: -n.count("."))  # a unit before any unit that holds it


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _graph_nodes(stage: torch.nn.Module):
    """``(module name, node)`` for every node of the stage's unflattened graphs."""
    for name, module in stage.named_modules(remove_duplicate=False):
        graph = getattr(module, "graph", None)
        for node in graph.nodes if isinstance(graph, torch.fx.Graph) else ():
            yield name, node


def _called_modules(stage: torch.nn.Module) -> set[str]:
    """The modules an unflattened graph of the stage calls (``call_module``)."""
    return {_join(name, node.target) for name, node in _graph_nodes(stage) if node.op == "call_module"}


def _shared_prefixes(stage: torch.nn.Module) -> set[str]:
    """Modules that cannot be FSDP units of their own: those on the way from a parameter's
    holders and readers (an unflattened graph's ``get_attr``) up to, not including, their common
    ancestor, for every parameter with more than one."""
    users: dict[int, set[str]] = {}
    for name, module in stage.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            users.setdefault(id(param), set()).add(name)
    for name, node in _graph_nodes(stage):
        if node.op == "get_attr":
            try:
                param = stage.get_parameter(_join(name, node.target))
            except AttributeError:
                continue  # a buffer, a constant
            users.setdefault(id(param), set()).add(name)
    shared: set[str] = set()
    for holders in users.values():
        if len(holders) < 2:
            continue
        common = _common_prefix(holders)
        depth = len(common.split(".")) if common else 0
        for holder in holders:
            parts = holder.split(".") if holder else []
            shared.update(".".join(parts[:i]) for i in range(depth + 1, len(parts) + 1))
    return shared


def _common_prefix(names: set[str]) -> str:
    split = [n.split(".") if n else [] for n in names]
    out = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        out.append(parts[0])
    return ".".join(out)


def reshard_every_microbatch(pipe_stage) -> None:
    """FSDP2 under a pipeline schedule with the memory of a shard: each microbatch's backward
    reduce-scatters its gradients block by block and reshards, as FSDP does outside a pipeline.

    torch's ``PipelineStage`` keeps an FSDP stage's parameters gathered and its gradients whole
    from the first microbatch's backward to the last, then reduce-scatters once: the least
    communication, but for the length of the backward a rank holds its whole stage twice over
    (parameters and gradients), whatever ``dp``. Here every microbatch's backward runs with
    FSDP's own settings for a last backward, and the stage's end-of-backward (the same call the
    schedule makes after the last one) follows it; the sharded gradients accumulate over the
    microbatches (each microbatch's loss is weighted already: the schedule scales nothing after). Only a full backward
    is changed (FSDP is refused under the zero-bubble schedules, which split it)."""
    from torch.distributed.fsdp import FSDPModule
    from ppsplit.torch_private import stage_backward

    module = pipe_stage.submod
    if not isinstance(module, FSDPModule):
        return
    plain = pipe_stage.backward_maybe_with_nosync

    def backward(backward_type, bwd_kwargs, last_backward=False):
        if backward_type != "full":
            return plain(backward_type, bwd_kwargs, last_backward)
        module.set_is_last_backward(True)
        module.set_reshard_after_backward(True)
        module.set_requires_gradient_sync(True)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        pipe_stage.perform_reduce_grad(1)  # the groups autograd did not reach, and FSDP's end of backward
        return grads, None

    pipe_stage.backward_maybe_with_nosync = backward


@dataclass
class Layout:
    """How one rank's stages are laid out."""
    pp: int
    dp: int
    tp: int
    fsdp: bool = True

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) of a global rank: "pp" outermost, "tp" innermost."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp


def device_mesh(layout: Layout, device_type: str):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=("pp", "dp", "tp"))


def parallelize(split, index: int, model: torch.nn.Module, mesh, plan: dict | None = None,
                fsdp: bool = True, flows: list[StageFlow] | None = None, bf16: bool = False,
                fsdp_unit_bytes: int | None = None) -> torch.nn.Module:
    """Apply a layout to stage ``index`` of ``split`` on this rank: tensor parallelism over
    ``mesh["tp"]`` with ``plan`` (default: the model's own), then FSDP2 over ``mesh["dp"]``, one
    unit per block, or units of at most ``fsdp_unit_bytes`` of parameters (:func:`fsdp_units`).
    The stage keeps its FQNs. Every rank of the mesh calls this for its stages."""
    stage = split.stages[index]
    tp = mesh["tp"].size()
    if tp > 1:
        flows = flows or tp_flows(split, model, plan, tp)
        apply_tensor_parallel(stage, model, flows[index], mesh["tp"])
    if mesh["dp"].size() > 1 and fsdp:
        blocks = dict.fromkeys(b.partition("@")[0] for b in split.stage_blocks()[index])  # a shared layer once
        apply_fsdp(stage, list(blocks), mesh["dp"], bf16, fsdp_unit_bytes)
    return stage


BUCKET_BYTES = 25 << 20  # replicas' gradients are averaged this many bytes at a time (DDP's default)


@torch.no_grad()
def average_grads(modules: dict, group, size: int, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Replicated data parallelism (``parallel.fsdp=false``): each gradient becomes the mean over
    the data-parallel ranks, in buckets of up to ``bucket_bytes`` (the gradients of one dtype
    and device copied into one flat tensor, all-reduced once, copied back), as DDP does: a few
    all-reduces a step however many tensors the stages hold."""
    for bucket in _buckets([p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                            for module in modules.values() for p in module.parameters() if p.grad is not None],
                           bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def _buckets(grads: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of gradients of one dtype and device, each up to ``bucket_bytes`` (a
    larger gradient alone)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if not out or (g.dtype, g.device) != (out[-1][0].dtype, out[-1][0].device) or size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(g)
        size += nbytes
    return out
