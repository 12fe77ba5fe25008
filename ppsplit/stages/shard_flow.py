"""Follow the tensor-parallel shard through a stage's graphs.

The trace baked the global head counts into the graph (``expand(x, [2, 2, 2, 32, 16])``). Which
dimensions hold heads is found by following the sharded dimension from each column-wise output
through the graph (views, transposes, broadcasts, attention), and those sizes are divided by
``tp``; a whole tensor that meets a sharded one is cut to this rank's part. No model is
special-cased; an op the flow cannot follow is refused with its name and module.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field

import torch
from torch import fx

from ppsplit.errors import PpsplitError
from ppsplit.stages.code import _METADATA_ASSERTS
from ppsplit.torch_private import OpOverload

aten = torch.ops.aten


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
        shards = {a: env.get(a) for a in node.all_input_nodes}
        if target is operator.getitem:
            src = shards.get(node.args[0])
            return src[node.args[1]] if isinstance(src, (tuple, list)) else src
        if all(_flat_none(s) for s in shards.values()):
            return None  # nothing sharded flows in: nothing to follow
        if not isinstance(target, OpOverload):
            self._refuse(where, node, "an unknown call")
        first = node.args[0] if isinstance(node.args[0], fx.Node) else None
        op = _Op(where, node, shards.get(first) if first is not None else None,
                 _shape(first) if first is not None else None, _shape(node), shards)
        if target in _METADATA_ASSERTS and _args_of(node, 1, "size") is None and _args_of(node, 2, "stride") is None:
            return None  # a check of dtype and device only: a shard passes it as the whole did
        for targets, handler in _HANDLERS:
            if target in targets:
                return handler(self, op)
        if target in _ELEMENTWISE or torch.Tag.pointwise in target.tags:
            return self._broadcast(where, node, shards, op.out_shape)
        self._refuse(where, node, "an op ppsplit does not know how to shard")

    # One handler per kind of op: where the sharded dim ``op.d`` of the first input lands.
    def _on_view(self, op):
        return self._view(op.where, op.node, op.d, op.in_shape, op.out_shape)

    def _on_expand(self, op):
        j = op.d + len(op.out_shape) - len(op.in_shape)
        self._divide(op.where, op.node, 1, j, op.out_shape[j])
        return j

    def _on_transpose(self, op):
        a, b = (x % len(op.in_shape) for x in op.node.args[1:3])
        return b if op.d == a else a if op.d == b else op.d

    def _on_permute(self, op):
        return [x % len(op.in_shape) for x in op.node.args[1]].index(op.d)

    def _on_t(self, op):
        return 1 - op.d

    def _on_unsqueeze(self, op):
        dim = op.node.args[1] % len(op.out_shape)
        return op.d + 1 if dim <= op.d else op.d

    def _on_squeeze(self, op):
        dim = op.node.args[1] % len(op.in_shape)
        if dim == op.d:
            self._refuse(op.where, op.node, "it squeezes the sharded dim")
        return op.d - 1 if dim < op.d else op.d

    def _on_along(self, op):
        """Ops that work along one dim (slices, splits, softmax): never the sharded one."""
        node, d = op.node, op.d
        dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % len(op.in_shape)
        if dim == d:
            self._refuse(op.where, node, "it works along the sharded dim")
        if node.target in (aten.select.int, aten.unbind.int):
            d = d - 1 if dim < d else d
        if node.target in _SPLITS:
            return tuple(d for _ in node.meta.get("val", ()))
        return d

    def _on_cat(self, op):
        dims = {op.shards.get(p) for p in op.node.args[0]}
        dim = (op.node.args[1] if len(op.node.args) > 1 else 0) % len(op.out_shape)
        if len(dims) != 1 or dim in dims:
            self._refuse(op.where, op.node, "it joins sharded and whole tensors, or along the sharded dim")
        return dims.pop()

    def _on_batched(self, op):
        return self._batched(op.where, op.node, op.shards, op.out_shape)

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


@dataclass
class _Op:
    where: str  # the module whose graph holds the node
    node: fx.Node
    d: int | None  # the sharded dim of its first input
    in_shape: tuple | None
    out_shape: tuple | None
    shards: dict


_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default)
_HANDLERS = (
    (_VIEWS, ShardFlow._on_view),
    ((aten.expand.default,), ShardFlow._on_expand),
    ((aten.transpose.int,), ShardFlow._on_transpose),
    ((aten.permute.default,), ShardFlow._on_permute),
    ((aten.t.default,), ShardFlow._on_t),
    ((aten.unsqueeze.default,), ShardFlow._on_unsqueeze),
    ((aten.squeeze.dim,), ShardFlow._on_squeeze),
    ((aten.slice.Tensor, aten.select.int, aten.narrow.default, *_SPLITS, aten._softmax.default,
      aten.softmax.int, aten._log_softmax.default), ShardFlow._on_along),
    ((aten.cat.default,), ShardFlow._on_cat),
    ((aten.scaled_dot_product_attention.default, aten.matmul.default, aten.bmm.default), ShardFlow._on_batched),
)


def _args_of(node, index: int, name: str):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


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
    if not any(f.leaves for f in flows):
        raise TensorParallelRefused(f"parallel.tp={tp}: the plan names no module of the model (e.g. "
                                    f"{next(iter(plan), '(empty)')}); allowed: FQN patterns of its nn.Linear and "
                                    "nn.Embedding layers")
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


def apply_rewrites(stage: torch.nn.Module, rewrites: list[Rewrite], tp_mesh) -> None:
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


def tp_plan_of(model: torch.nn.Module, override: dict | None = None) -> dict[str, str]:
    """The tensor-parallel plan of ``model`` keyed by full FQN patterns: ``override`` (from the
    model config) or transformers' own (``model.tp_plan``); for a peft-adapted model, laid out
    over its adapters too (:func:`adapter_plan`)."""
    plan = dict(override) if override else dict(getattr(model, "tp_plan", None) or {})
    from ppsplit.models.adapters import is_adapted

    return adapter_plan(model, plan) if plan and is_adapted(model) else plan


def local_shape(meta: torch.Tensor, shard: int | None, tp: int) -> torch.Tensor:
    if shard is None:
        return meta
    shape = list(meta.shape)
    shape[shard] //= tp
    return torch.empty(shape, dtype=meta.dtype, device="meta").requires_grad_(meta.requires_grad)


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


def tp_flows(split, model: torch.nn.Module | None, plan: dict | None, tp: int) -> list[StageFlow]:
    """The split's tensor-parallel flows at ``tp``, computed once (before any stage is laid out:
    the flows follow the stages' unflattened graphs) and kept on the split."""
    cached = split._tp_flows
    if cached is not None and cached[0] == tp and (plan is None or dict(plan) == cached[1]):
        return cached[2]
    if model is None:
        raise PpsplitError(f"tp={tp}: the split has no tensor-parallel layout at tp={tp} yet; "
                           "allowed: pass model= (its plan, or plan=) or call ppsplit.parallelize first")
    flows = check_tensor_parallel(split, model, plan, tp)
    split._tp_flows = (tp, dict(plan) if plan else None, flows)
    return flows


# How a LoRA layer's adapters are laid out beside a base layer of each tensor-parallel style:
# (A's style, B's style); None: whole on every rank.
_ADAPTER_STYLES = {"colwise": (None, "colwise"), "colwise_gather_output": (None, "colwise_gather_output"),
                   "rowwise": ("rowwise", None)}


def adapter_plan(model: torch.nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """The tensor-parallel plan of an adapted model, by its own FQNs. ``plan`` is keyed by the
    base model's FQN patterns (or already by peft's). A planned layer that peft wrapped is laid
    out as its base layer (``.base_layer``, in the plan's style) and its adapters to match: beside
    a column-wise base, B is column-wise and A whole on every rank (B's input gradient is summed
    over the ranks, so A's is whole); beside a row-wise base, A is row-wise (its input arrives
    sharded, its output is summed) and B whole. Unwrapped layers keep their style."""
    from peft.tuners.lora import LoraLayer

    from ppsplit.models.adapters import PREFIX

    modules = dict(model.named_modules())
    out: dict[str, str] = {}
    for pattern, style in plan.items():
        full = pattern if pattern.startswith(PREFIX) else PREFIX + pattern
        matched = [name for name in modules if _pattern(full).match(name)]
        if style == "replicate" or not any(isinstance(modules[n], LoraLayer) for n in matched):
            out[full] = style
            continue
        for name in matched:
            module = modules[name]
            if not isinstance(module, LoraLayer):
                out[name] = style
                continue
            if style not in _ADAPTER_STYLES or not isinstance(module.get_base_layer(), torch.nn.Linear):
                raise PpsplitError(f"peft.target_modules takes {name.removeprefix(PREFIX)}, which parallel.tp lays "
                                   f"out {style}; allowed: adapters on linear layers (colwise or rowwise), or "
                                   "parallel.tp=1")
            a_style, b_style = _ADAPTER_STYLES[style]
            out[f"{name}.base_layer"] = style
            for adapter in module.lora_A.keys():
                for part, part_style in (("lora_A", a_style), ("lora_B", b_style)):
                    if part_style:
                        out[f"{name}.{part}.{adapter}"] = part_style
    return out
