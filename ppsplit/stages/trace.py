"""Trace a model with torch.export and split it: :func:`split` and the :class:`Split` it returns.

The journey: :func:`export` traces the model once (without changing it); :mod:`ppsplit.stages.points`
finds its blocks and where each stage begins; :mod:`ppsplit.stages.graph` cuts the graph there and
unflattens each stage under the original FQNs.
"""

from __future__ import annotations

import bisect
import copy
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.export import ExportedProgram
from ppsplit.torch_private import pytree

from ppsplit.errors import PpsplitError
from ppsplit.stages.points import (MARKER, even_points, find_blocks, markers, module_run_order, point_positions,
                                  unit_starts)
from ppsplit.stages.graph import build_stages
from ppsplit.stages.shard_flow import local_shape, tp_flows

__all__ = ["Split", "export", "find_blocks", "split"]


@dataclass
class Split:
    """A model cut into pipeline stages that keep the original FQNs.

    Calling it runs the stages in order in this process, with autograd through all of them.
    """

    stages: list[torch.nn.Module]
    points: list[str]
    stage_keys: list[list[str]]  # state_dict keys held by each stage
    tie_groups: list[list[str]]  # original FQNs that name one tensor
    stage_inputs: list[list[str]]  # graph values each stage receives, in order
    stage_outputs: list[list[str]]
    program: ExportedProgram = field(repr=False)
    blocks: list[str] = field(default_factory=list)  # the model's repeated blocks, in run order
    positions: list[int] = field(default_factory=list)  # graph node index where each stage > 0 begins
    strategy: str = "manual"
    stage_modules: list[set[str]] = field(repr=False, default_factory=list)  # modules each runs
    _in_spec: pytree.TreeSpec = field(repr=False, default=None)
    _input_leaves: list[int] = field(repr=False, default_factory=list)
    _out_spec: pytree.TreeSpec = field(repr=False, default=None)
    _out_leaves: list[tuple[str, Any]] = field(repr=False, default_factory=list)
    _signature: inspect.Signature | None = field(repr=False, default=None)  # the model's forward's
    _bound: dict = field(repr=False, default_factory=dict)  # keyword constants bound at a dynamic trace
    _tp_flows: tuple | None = field(repr=False, default=None)  # (tp, plan, flows) of the last tensor-parallel layout

    def __len__(self) -> int:
        return len(self.stages)

    def flat_inputs(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, ...]:
        """The tensors stage 0 takes, from the model's own (args, kwargs). Arguments passed
        otherwise than traced (by position instead of by name, or the reverse) are bound by the
        model's ``forward`` signature."""
        kwargs = dict(kwargs)
        for key, value in self._bound.items():  # traced as part of the call: given, or implied
            if key in kwargs and kwargs.pop(key) != value:
                raise PpsplitError(f"{key}: this split was traced with {key}={value!r}; allowed: that value")
        order = self._in_spec.children()[1].context
        if set(kwargs) != set(order) or len(args) != self._in_spec.children()[0].num_children:
            args, kwargs = self._rearrange(tuple(args), dict(kwargs))
        leaves, spec = pytree.tree_flatten((tuple(args), {k: kwargs[k] for k in order}))
        if spec != self._in_spec:
            raise PpsplitError("inputs do not have the structure of the traced example inputs")
        return tuple(leaves[i] for i in self._input_leaves)

    def _rearrange(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``args``/``kwargs`` arranged as the trace took them: the first n parameters of
        ``forward`` by position, the traced keywords by name."""
        order = list(self._in_spec.children()[1].context)
        n = self._in_spec.children()[0].num_children
        traced = f"{n} positional argument(s) and keywords {order}"
        if self._signature is None:
            raise PpsplitError(f"arguments {len(args)} positional and keywords {sorted(kwargs)} "
                               f"differ from the traced {traced}")
        try:
            bound = self._signature.bind(*args, **kwargs).arguments
        except TypeError as err:
            raise PpsplitError(f"the arguments do not fit the model's forward: {err}") from None
        var_kw = next((p.name for p in self._signature.parameters.values()
                       if p.kind == inspect.Parameter.VAR_KEYWORD), None)
        given = {k: v for k, v in bound.items() if k != var_kw}
        given.update(bound.get(var_kw, {}) if var_kw else {})
        positional = [p.name for p in self._signature.parameters.values()
                      if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                    inspect.Parameter.POSITIONAL_OR_KEYWORD)][:n]
        wanted = positional + order
        missing = [k for k in wanted if k not in given]
        extra = sorted(set(given) - set(wanted))
        if len(positional) < n or missing or extra:
            raise PpsplitError(f"arguments {sorted(given)} differ from the traced {traced}"
                               + (f": missing {missing}" if missing else "")
                               + (f": not traced {extra}" if extra else ""))
        return tuple(given[k] for k in positional), {k: given[k] for k in order}

    def model_outputs(self, values: Sequence[torch.Tensor]):
        """The last stage's outputs rebuilt into the structure the model returns."""
        leaves = [values[v] if kind == "value" else v for kind, v in self._out_leaves]
        return pytree.tree_unflatten(leaves, self._out_spec)

    def stage_io_meta(self, index: int, sizes: dict[str, int] | None = None, *, tp: int = 1,
                      model: torch.nn.Module | None = None, plan: dict | None = None
                      ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Meta tensors shaped like stage ``index``'s inputs and outputs, from the trace.

        Handed to ``PipelineStage`` so it need not run the stage on empty tensors to learn the
        shapes (garbage token ids in a relayed input would index out of range). After a dynamic
        trace, ``sizes`` (``{"batch": 4, "seq": 64}``) gives the sizes to shape them for; a size
        not given is the example's. With ``tp`` > 1, the shapes one tensor-parallel rank sends
        and receives (a value that crosses stages sharded travels as the rank's shard), by the
        plan (``plan``, or ``model``'s own; either may be left out once
        :func:`ppsplit.parallelize` has laid the split out at this ``tp``)."""
        ins, outs = self._io_meta(index, sizes)
        if tp == 1:
            return ins, outs
        flow = tp_flows(self, model, plan, tp)[index]
        return (tuple(local_shape(t, f, tp) for t, f in zip(ins, flow.inputs)),
                tuple(local_shape(t, f, tp) for t, f in zip(outs, flow.outputs)))

    def _io_meta(self, index: int, sizes: dict[str, int] | None):
        vals = {n.name: n.meta.get("val") for n in self.program.graph.nodes}
        symbols = self.size_symbols()
        given = {symbols[k]: v for k, v in (sizes or {}).items() if k in symbols}

        def dim(size):
            if not isinstance(size, torch.SymInt):
                return int(size)
            expr = size.node.expr.xreplace(given)
            return int(expr) if isinstance(expr, int) or expr.is_number else int(size.node.hint)

        def meta(name, grad):
            v = vals[name]
            t = torch.empty([dim(d) for d in v.shape], dtype=v.dtype, device="meta")
            return t.requires_grad_(grad and t.is_floating_point())

        ins = tuple(meta(n, index > 0) for n in self.stage_inputs[index])
        outs = tuple(meta(n, True) for n in self.stage_outputs[index])
        return ins, outs

    def size_symbols(self) -> dict[str, Any]:
        """After a dynamic trace, the symbol of each dynamic size (``batch``, ``seq``), read off
        the first tensor input that has it; empty for a trace at fixed shapes."""
        out = {}
        for node in self.program.graph.nodes:
            if node.op != "placeholder" or node.name not in self.stage_inputs[0]:
                continue
            shape = getattr(node.meta.get("val"), "shape", ())
            for name, d in DYNAMIC_DIMS.items():
                if name not in out and d < len(shape) and isinstance(shape[d], torch.SymInt) \
                        and shape[d].node.expr.is_symbol:
                    out[name] = shape[d].node.expr
        return out

    def stage_blocks(self) -> list[list[str]]:
        """The blocks each stage runs (a shared layer's calls as ``FQN@K``)."""
        order = module_run_order(self.program)
        return [[b for b in self.blocks if bisect.bisect_right(self.positions, order[b]) == s]
                for s in range(len(self.stages))]

    def __call__(self, *args, **kwargs):
        values = self.flat_inputs(args, kwargs)
        for stage in self.stages:
            values = as_tuple(stage(*values))
        return self.model_outputs(values)


def as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


DYNAMIC_DIMS = {"batch": 0, "seq": 1}  # the tensor dimension each dynamic size names


def export(model: torch.nn.Module, args: tuple, kwargs: dict | None = None,
           dynamic: dict[str, tuple[int, int]] | None = None) -> ExportedProgram:
    """Trace ``model`` without changing it (no patched ``forward``).

    ``dynamic`` maps ``"batch"`` and/or ``"seq"`` to the (min, max) sizes the trace must serve:
    dimension 0 of every tensor input is the batch, dimension 1 of every 2-D or 3-D tensor input
    (token ids, masks, embeddings) the sequence. Keyword inputs that are not tensors
    (``return_dict=False``) are then bound to the call, as torch 2.13 cannot give dynamic shapes
    to a ``forward`` that takes them through ``**kwargs``."""
    kwargs = dict(kwargs or {})
    target, dynamic_shapes = model, None
    if dynamic:
        constants = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
        kwargs = {k: v for k, v in kwargs.items() if k not in constants}
        if constants:
            # A view of the model (the same submodules, parameters and buffers, so the same
            # FQNs) whose forward has the constants bound; the model itself is untouched.
            target = copy.copy(model)
            target.forward = functools.partial(model.forward, **constants)
        dynamic_shapes = _dynamic_shapes(target, args, kwargs, dynamic)
    try:
        return torch.export.export(target, tuple(args), kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as err:
        if "Cache" in str(err) and getattr(getattr(model, "config", None), "use_cache", False) \
                and kwargs.get("use_cache") is not False:
            # transformers returns a DynamicCache, which torch.export cannot carry out of a graph.
            raise PpsplitError(
                f"{type(model).__name__} has use_cache=True, and torch.export cannot trace the cache it "
                "returns; allowed: the model built with use_cache=False, or kwargs={'use_cache': False}"
            ) from None
        if dynamic and type(err).__name__ in ("UserError", "ConstraintViolationError", "GuardOnDataDependentSymNode"):
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise PpsplitError(f"{type(model).__name__} cannot be traced for varying sizes {dynamic}: {first}") from None
        raise


def _dynamic_shapes(model, args, kwargs, dynamic) -> Any:
    from torch.export import Dim, ShapesCollection

    unknown = sorted(set(dynamic) - set(DYNAMIC_DIMS))
    if unknown:
        raise PpsplitError(f"dynamic sizes {unknown}: allowed: {', '.join(DYNAMIC_DIMS)}")
    dims = {name: Dim(name, min=lo, max=hi) for name, (lo, hi) in dynamic.items()}
    shapes = ShapesCollection()
    for leaf in pytree.tree_leaves((tuple(args), kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            marks = {d: dims[name] for name, d in DYNAMIC_DIMS.items()
                     if name in dims and d < leaf.dim() and (d == 0 or leaf.dim() <= 3)}
            if marks:
                shapes[leaf] = marks
    return shapes.dynamic_shapes(model, tuple(args), kwargs)


def split(
    model: torch.nn.Module,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    stages: int | None = None,
    points: Sequence[str] | None = None,
    strategy: str = "even",
    layers: Sequence[int] | None = None,
    first_stage_less: int = 0,
    last_stage_less: int = 0,
    microbatches: int = 1,
    program: ExportedProgram | None = None,
    dynamic: dict[str, tuple[int, int]] | None = None,
) -> Split:
    """Cut ``model`` into pipeline stages whose FQNs are the original's.

    Give ``points`` (module FQNs where a stage begins; ``MODULE:end`` begins one right after a
    module, ``pipe_split:K`` at the K-th ``pipe_split()`` call in forward; with neither points nor
    stages, every ``pipe_split()`` call is a point), or ``stages`` and a ``strategy`` over the
    model's repeated blocks: ``even`` (equal block counts), ``layers`` (``layers=[3, 4, 4, 3]``,
    or ``first_stage_less``/``last_stage_less``), ``params`` or ``flops`` (minimise the largest
    stage's parameters or forward+backward FLOPs at the traced shapes times ``microbatches``;
    these may also begin the last stage at the final norm, see ``unit_starts``).
    ``args``/``kwargs`` are example inputs (one microbatch); the stages are traced at their
    shapes, or, with ``dynamic={"batch": (lo, hi), "seq": (lo, hi)}``, for every batch and
    sequence size in those bounds (see :func:`export`). ``model`` is not modified.
    """
    from ppsplit.stages import plan

    if points is not None and (stages is not None or layers):
        raise PpsplitError("give either points= (module FQNs) or stages=/layers=, not both")
    allowed = [name for name in plan.STRATEGIES if name != "manual"]  # manual: give points=
    if points is None and strategy not in allowed:
        raise PpsplitError(
            f"split strategy {strategy!r} is not known; allowed: {', '.join(allowed)} "
            "(or points= for a manual split)"
        )
    program = program if program is not None else export(model, args, kwargs, dynamic)
    run_order = module_run_order(program)
    blocks = find_blocks(model, run_order)
    chosen = "manual"
    if points is None and stages is None and not layers:  # the pipe_split() calls in forward
        points = [f"{MARKER}:{k}" for k in range(len(markers(program)))]
        if not points:
            raise PpsplitError("give stages= (with a strategy) or points= (module FQNs where stages "
                               "begin), or call torch.distributed.pipelining.pipe_split() in forward")
        chosen = "markers"
    elif points is None:
        if strategy == "layers":
            sizes = plan.layer_sizes(len(blocks), stages, layers, first_stage_less, last_stage_less)
            points = plan.points_from_sizes(blocks, sizes)
        elif strategy == "even":
            points = even_points(blocks, stages)
        else:
            even_points(blocks, stages)  # the same limits on the stage count
            units = unit_starts(program, run_order, blocks)
            costs = plan.unit_costs(model, program, units, run_order, microbatches)[strategy]
            points = plan.points_from_sizes(units, plan.linear_partition(costs, stages))
        chosen = strategy
    points = list(points)
    positions = point_positions(model, points, run_order, program)
    result = Split(**build_stages(model, program, points, positions, blocks))
    result.strategy = chosen
    if dynamic:
        result._bound = {k: v for k, v in (kwargs or {}).items() if not isinstance(v, torch.Tensor)}
    for index, (stage, runs) in enumerate(zip(result.stages, result.stage_blocks())):
        if not any(True for _ in stage.parameters()) and not runs:
            where = "before the first split point" if index == 0 else f"from {points[index - 1]!r}"
            raise PpsplitError(
                f"split points {points}: stage {index} ({where}) holds no parameter and no block; "
                "allowed: points that give every stage some of the model's work"
            )
    return result


