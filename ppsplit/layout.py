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
  divided by ``tp`` (:class:`ShardFlow`). No model is special-cased; an op the flow cannot
  follow is refused with its name and module.
- **FSDP2** (``fully_shard``) over the "dp" mesh on each block of the stage (the split's blocks,
  by FQN), then on the stage root; ``fsdp=False`` keeps plain replicas whose gradients are
  averaged after each step.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field

import torch
from torch import fx

from ppsplit.errors import PpsplitError

aten = torch.ops.aten


# --- the plan --------------------------------------------------------------------------------

def tp_plan_of(model: torch.nn.Module, override: dict | None = None) -> dict[str, str]:
    """The tensor-parallel plan of ``model`` keyed by full FQN patterns: ``override`` (from the
    model config) or transformers' own (``model.tp_plan``)."""
    if override:
        return dict(override)
    plan = getattr(model, "tp_plan", None)
    return dict(plan or {})


def _pattern(fqn_pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(fqn_pattern).replace(r"\*", r"[^.]+") + "$")


def planned_leaves(stage: torch.nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """The stage's modules the plan names, with their styles (``replicate`` ones left out)."""
    patterns = [(_pattern(p), style) for p, style in plan.items()]
    out = {}
    for name, _ in stage.named_modules():
        for pattern, style in patterns:
            if name and pattern.match(name) and style != "replicate":
                out[name] = style
                break
    return out


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


# --- following the sharded dimension -----------------------------------------------------------

# What each style does to a module call: (required input shard, output shard); "last" = last dim.
_STYLE_IO = {
    "colwise": (None, "last"),
    "rowwise": ("last", None),
    "colwise_gather_output": (None, None),
    "embedding_rowwise": (None, None),
}
# Elementwise ops the "pointwise" tag misses, and ops that keep their input's layout.
_ELEMENTWISE = {aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
                aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.type_as.default,
                aten.dropout.default, aten.lift_fresh_copy.default, aten.where.ScalarOther,
                aten.where.ScalarSelf, aten.where.Scalar, aten.masked_fill.Tensor, aten.zeros_like.default,
                aten.ones_like.default, aten.full_like.default, aten.empty_like.default}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


class TensorParallelRefused(PpsplitError):
    pass


def _shape(node) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(int(s) for s in val.shape) if isinstance(val, torch.Tensor) else None


@dataclass
class Rewrite:
    """A size argument of one graph node to divide by the tensor-parallel degree or, with
    ``narrow``, a whole input of the node to cut to this rank's part along dim ``index``."""
    module: str  # the stage submodule whose graph holds the node
    node: str
    arg: int  # which argument is the size list
    index: int  # which entry of it (narrow: which dim)
    narrow: str | None = None  # the whole input's node name


@dataclass
class StageFlow:
    inputs: list  # shard dim of each stage input (None: whole)
    outputs: list
    rewrites: list[Rewrite] = field(default_factory=list)
    leaves: dict[str, str] = field(default_factory=dict)  # planned leaf FQN -> style


class ShardFlow:
    """Follow the tensor-parallel shard through a stage's graphs (see the module docstring)."""

    def __init__(self, tp: int, leaves: dict[str, str]):
        self.tp, self.leaves = tp, leaves
        self.rewrites: list[Rewrite] = []

    def run(self, stage: torch.nn.Module, inputs: list) -> list:
        return self._graph(stage, "", inputs)

    def _refuse(self, where: str, node, why: str):
        raise TensorParallelRefused(
            f"parallel.tp={self.tp}: cannot follow the tensor-parallel shard through {node.target} "
            f"in {where or 'the stage'} ({why}); allowed: a model whose heads split evenly, or tp=1")

    def _graph(self, module: torch.nn.Module, prefix: str, inputs: list) -> list:
        graph = getattr(module, "graph", None)
        if not isinstance(graph, fx.Graph):
            if any(s is not None for s in _flat(inputs)):
                raise TensorParallelRefused(f"parallel.tp={self.tp}: {prefix or 'the stage'} is not traced "
                                            "code, and a tensor-parallel shard reaches it")
            return [None]
        env: dict = {}
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        for node, shard in zip(placeholders, list(inputs) + [None] * len(placeholders)):
            env[node] = shard
        out = []
        for node in graph.nodes:
            if node.op in ("placeholder",):
                continue
            if node.op == "get_attr":
                env[node] = None
            elif node.op == "call_module":
                env[node] = self._module_call(module, prefix, node, env)
            elif node.op == "call_function":
                env[node] = self._function(prefix, node, env)
            elif node.op == "output":
                out = fx.node.map_aggregate(node.args[0], lambda a: env.get(a) if isinstance(a, fx.Node) else None)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def _module_call(self, module, prefix, node, env):
        name = f"{prefix}.{node.target}" if prefix else node.target
        args = [env.get(a) if isinstance(a, fx.Node) else None for a in node.args]
        if name in self.leaves:
            need, gives = _STYLE_IO[self.leaves[name]]
            given = args[0] if args else None
            ndim_in = len(_shape(node.args[0]) or ())
            expect = None if need is None else ndim_in - 1
            if given != expect:
                self._refuse(prefix, node, f"{self.leaves[name]} {name} expects its input "
                                           f"{'whole' if expect is None else 'sharded on its last dim'}")
            return None if gives is None else len(_shape(node)) - 1
        sub = module.get_submodule(node.target)
        if any(a is not None for a in args) or any(leaf.startswith(name + ".") for leaf in self.leaves):
            if type(sub).__name__ == "InterpreterModuleDispatcher":
                self._refuse(prefix, node, "a module called several times")
            result = self._graph(sub, name, args)
            return result[0] if len(result) == 1 and not isinstance(node.meta.get("val"), (tuple, list)) else tuple(result)
        return None

    def _function(self, where, node, env):
        target = node.target
        tensors = [a for a in node.all_input_nodes]
        shards = {a: env.get(a) for a in tensors}
        if target is operator.getitem:
            src = shards.get(node.args[0])
            return src[node.args[1]] if isinstance(src, (tuple, list)) else src
        if all(_flat_none(s) for s in shards.values()):
            return None  # nothing sharded flows in: nothing to follow
        if not isinstance(target, torch._ops.OpOverload):
            self._refuse(where, node, "an unknown call")
        d = shards.get(node.args[0]) if isinstance(node.args[0], fx.Node) else None
        in_shape = _shape(node.args[0]) if isinstance(node.args[0], fx.Node) else None
        out_shape = _shape(node)
        if target in _VIEWS:
            return self._view(where, node, d, in_shape, out_shape)
        if target is aten.expand.default:
            j = d + len(out_shape) - len(in_shape)
            self._divide(where, node, 1, j, out_shape[j])
            return j
        if target is aten.transpose.int:
            a, b = (x % len(in_shape) for x in node.args[1:3])
            return b if d == a else a if d == b else d
        if target is aten.permute.default:
            return [x % len(in_shape) for x in node.args[1]].index(d)
        if target is aten.t.default:
            return 1 - d
        if target is aten.unsqueeze.default:
            dim = node.args[1] % len(out_shape)
            return d + 1 if dim <= d else d
        if target in (aten.squeeze.dim,):
            dim = node.args[1] % len(in_shape)
            if dim == d:
                self._refuse(where, node, "it squeezes the sharded dim")
            return d - 1 if dim < d else d
        if target in (aten.slice.Tensor, aten.select.int, aten.narrow.default, aten.split.Tensor,
                      aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default,
                      aten._softmax.default, aten.softmax.int, aten._log_softmax.default):
            dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % len(in_shape)
            if dim == d:
                self._refuse(where, node, "it works along the sharded dim")
            if target in (aten.select.int, aten.unbind.int):
                d = d - 1 if dim < d else d
            if target in (aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default):
                return tuple(d for _ in node.meta.get("val", ()))
            return d
        if target is aten.cat.default:
            parts = node.args[0]
            dims = {shards.get(p) for p in parts}
            dim = (node.args[1] if len(node.args) > 1 else 0) % len(out_shape)
            if len(dims) != 1 or dim in dims:
                self._refuse(where, node, "it joins sharded and whole tensors, or along the sharded dim")
            return dims.pop()
        if target in (aten.scaled_dot_product_attention.default, aten.matmul.default, aten.bmm.default):
            return self._batched(where, node, shards, out_shape)
        if target in _ELEMENTWISE or torch.Tag.pointwise in target.tags:
            return self._broadcast(where, node, shards, out_shape)
        self._refuse(where, node, "an op ppsplit does not know how to shard")

    def _view(self, where, node, d, in_shape, out_shape):
        before = math.prod(in_shape[:d])
        j, acc = 0, 1
        while j < len(out_shape) and acc < before:
            acc *= out_shape[j]
            j += 1
        while j < len(out_shape) - 1 and out_shape[j] == 1 and in_shape[d] != 1:
            j += 1
        ok = (acc == before and j < len(out_shape)
              and (in_shape[d] % out_shape[j] == 0 or out_shape[j] % in_shape[d] == 0))
        if not ok:
            self._refuse(where, node, f"a view from {list(in_shape)} to {list(out_shape)} mixes the sharded dim")
        self._divide(where, node, 1, j, out_shape[j])
        return j

    def _divide(self, where, node, arg, index, size):
        if size % self.tp:
            self._refuse(where, node, f"its size {size} does not divide by {self.tp}")
        sizes = node.args[arg]
        if sizes[index] != -1:
            self.rewrites.append(Rewrite(where, node.name, arg, index))

    def _broadcast(self, where, node, shards, out_shape):
        dims = set()
        for a, s in shards.items():
            shape = _shape(a)
            if shape is None:
                continue
            offset = len(out_shape) - len(shape)
            if s is not None:
                dims.add(s + offset)
        if len(dims) != 1:
            self._refuse(where, node, "its inputs are sharded on different dims")
        j = dims.pop()
        for a, s in shards.items():
            shape = _shape(a)
            if s is None and shape is not None:
                k = j - (len(out_shape) - len(shape))
                if 0 <= k < len(shape) and shape[k] != 1:
                    self._narrow(where, node, a, k, shape[k], out_shape[j])
        return j

    def _narrow(self, where, node, whole, dim, size, sharded_size):
        """A whole tensor meets a sharded one: this rank uses its own part of it (an attention
        bias built for every head, say)."""
        if size != sharded_size or size % self.tp:
            self._refuse(where, node, f"a whole tensor of size {size} meets one sharded from {sharded_size}")
        self.rewrites.append(Rewrite(where, node.name, 0, dim, narrow=whole.name))

    def _batched(self, where, node, shards, out_shape):
        """Attention and batched matmuls: the shard must be a batch dim (not the last two)."""
        dims = {s for s in shards.values() if s is not None}
        if len(dims) != 1:
            self._refuse(where, node, "its inputs are sharded on different dims")
        j = dims.pop()
        for a in node.all_input_nodes:
            shape = _shape(a)
            if shape and j >= len(shape) - 2:
                self._refuse(where, node, "it contracts over the sharded dim")
            if shards.get(a) is None and shape and len(shape) > j and shape[j] != 1:
                self._narrow(where, node, a, j, shape[j], out_shape[j])
        return j


def _flat(values):
    out = []
    for v in values:
        out.extend(_flat(v) if isinstance(v, (tuple, list)) else [v])
    return out


def _flat_none(value) -> bool:
    return all(v is None for v in _flat([value]))


def plan_stage_flows(split, plan: dict[str, str], tp: int, model: torch.nn.Module | None = None) -> list[StageFlow]:
    """Follow the shard through every stage in order (a value may cross a stage boundary
    sharded: it then travels as each tensor-parallel rank's shard). With ``model``, refuse a plan
    that names other than ``nn.Linear`` and ``nn.Embedding`` leaves."""
    flows, carried = [], None
    for index, stage in enumerate(split.stages):
        leaves = planned_leaves(stage, plan)
        for fqn in leaves if model is not None else ():
            kind = type(model.get_submodule(fqn))
            if not issubclass(kind, (torch.nn.Linear, torch.nn.Embedding)):
                raise TensorParallelRefused(f"parallel.tp={tp}: the plan names {fqn}, a {kind.__name__}; "
                                            "allowed: nn.Linear and nn.Embedding leaves")
        flow = ShardFlow(tp, leaves)
        inputs = [None] * len(split.stage_inputs[index]) if carried is None else carried
        outputs = flow.run(stage, inputs)
        flows.append(StageFlow(inputs, outputs, flow.rewrites, leaves))
        carried = outputs
    if any(s is not None for s in _flat(flows[-1].outputs)):
        raise TensorParallelRefused(f"parallel.tp={tp}: the model's outputs would stay sharded; "
                                    "allowed: a plan whose last layers gather their output")
    return flows


# --- applying it -------------------------------------------------------------------------------

class _NarrowFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, rank, tp, group):
        ctx.dim, ctx.tp, ctx.group = dim, tp, group
        size = x.shape[dim] // tp
        return x.narrow(dim, rank * size, size).contiguous()

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        parts = [torch.empty_like(grad) for _ in range(ctx.tp)]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=ctx.dim), None, None, None, None


class TpNarrow:
    """A whole tensor cut to this tensor-parallel rank's part of dim ``dim``. Its gradient is the
    parts of every rank put together, so what the whole tensor came from (T5's relative position
    bias, say) gets its whole gradient on every rank, as without tensor parallelism."""

    __name__ = "tp_narrow"

    def __init__(self, dim: int, rank: int, tp: int, group):
        self.dim, self.rank, self.tp, self.group = dim, rank, tp, group

    def __call__(self, x):
        return _NarrowFn.apply(x, self.dim, self.rank, self.tp, self.group)


def _apply_rewrites(stage: torch.nn.Module, rewrites: list[Rewrite], tp_mesh) -> None:
    tp, tp_rank, group = tp_mesh.size(), tp_mesh.get_local_rank(), tp_mesh.get_group()
    changed = {}
    for rw in rewrites:
        module = stage.get_submodule(rw.module) if rw.module else stage
        node = next(n for n in module.graph.nodes if n.name == rw.node)
        changed[id(module)] = module
        if rw.narrow is not None:
            whole = next(n for n in module.graph.nodes if n.name == rw.narrow)
            with module.graph.inserting_before(node):
                part = module.graph.call_function(TpNarrow(rw.index, tp_rank, tp, group), (whole,))
            node.replace_input_with(whole, part)
            continue
        sizes = list(node.args[rw.arg])
        sizes[rw.index] = sizes[rw.index] // tp
        args = list(node.args)
        args[rw.arg] = sizes
        node.args = tuple(args)
    for module in changed.values():
        if hasattr(module, "finalize"):
            module.finalize()


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
    _apply_rewrites(stage, flow.rewrites, tp_mesh)


def apply_fsdp(stage: torch.nn.Module, blocks: list[str], dp_mesh) -> None:
    """``fully_shard`` each of the stage's blocks, then the stage root, over ``dp_mesh``."""
    from torch.distributed.fsdp import fully_shard

    names = {n for n, _ in stage.named_modules()}
    for block in blocks:
        if block in names:
            fully_shard(stage.get_submodule(block), mesh=dp_mesh)
    fully_shard(stage, mesh=dp_mesh)


def local_shape(meta: torch.Tensor, shard: int | None, tp: int) -> torch.Tensor:
    if shard is None:
        return meta
    shape = list(meta.shape)
    shape[shard] //= tp
    return torch.empty(shape, dtype=meta.dtype, device="meta").requires_grad_(meta.requires_grad)


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


def check_tensor_parallel(split, model: torch.nn.Module, plan: dict | None, tp: int) -> list[StageFlow]:
    """The flows of a tensor-parallel layout, or :class:`TensorParallelRefused` before any rank
    starts: a model without a plan, a plan naming what cannot be sharded, an op the shard cannot
    follow."""
    plan = tp_plan_of(model, plan)
    if not plan:
        raise TensorParallelRefused(
            f"parallel.tp={tp}: {type(model).__name__} has no tensor-parallel plan (transformers ships "
            "none for it); give one as model.tp_plan (FQN pattern: colwise|rowwise|colwise_gather_output|"
            "embedding_rowwise), or use tp=1")
    return plan_stage_flows(split, plan, tp, model)


def parallelize(split, index: int, model: torch.nn.Module, mesh, plan: dict | None = None,
                fsdp: bool = True, flows: list[StageFlow] | None = None) -> torch.nn.Module:
    """Apply a layout to stage ``index`` of ``split`` on this rank: tensor parallelism over
    ``mesh["tp"]`` with ``plan`` (default: the model's own), then FSDP2 over ``mesh["dp"]``.
    The stage keeps its FQNs. Every rank of the mesh calls this for its stages."""
    stage = split.stages[index]
    tp = mesh["tp"].size()
    if tp > 1:
        flows = flows or check_tensor_parallel(split, model, plan, tp)
        apply_tensor_parallel(stage, model, flows[index], mesh["tp"])
    if mesh["dp"].size() > 1 and fsdp:
        blocks = dict.fromkeys(b.partition("@")[0] for b in split.stage_blocks()[index])  # a shared layer once
        apply_fsdp(stage, list(blocks), mesh["dp"])
    return stage
