"""Trace a model with torch.export, cut its graph where stages begin, and unflatten each stage.

Each stage is its own small ExportedProgram handed to ``torch.export.unflatten``, so a stage's
modules, parameters and buffers keep the original model's FQNs (``transformer.h.3.mlp.c_fc.weight``
stays that), buffers keep their persistence, and names tied in the original name one tensor.

Values a later stage needs are relayed: every stage returns all values that any later stage
reads, so each stage talks only to its neighbour. torch's ``Pipe`` instead sends a value from
stage 0 straight to stage 3 (the causal mask, rotary cos/sin, T5's encoder output), which its
runtime refuses beyond two ranks. Relaying was chosen over recomputing such values where they are
used because it needs no knowledge of which values are parameter-free or cheap, keeps every
stage's numerics bit-identical to the traced graph, and the relayed tensors are small next to
the activations already sent.
"""

from __future__ import annotations

import bisect
import copy
import functools
import inspect
import warnings
import operator
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import fx
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)
from torch.utils import _pytree as pytree

from ppsplit.errors import PpsplitError, nearest
from ppsplit.stage_code import adopt_tensors, same_kind, use_generated_code


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

    def stage_io_meta(self, index: int, sizes: dict[str, int] | None = None
                      ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Meta tensors shaped like stage ``index``'s inputs and outputs, from the trace.

        Handed to ``PipelineStage`` so it need not run the stage on empty tensors to learn the
        shapes (garbage token ids in a relayed input would index out of range). After a dynamic
        trace, ``sizes`` (``{"batch": 4, "seq": 64}``) gives the sizes to shape them for; a size
        not given is the example's."""
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


def module_run_order(program: ExportedProgram) -> dict[str, int]:
    """Each module FQN that runs, mapped to the index of its first operation in the graph; a
    module that runs more than once also has ``FQN@K`` for its K-th later call (K from 1)."""
    first: dict[str, int] = {}
    for i, node in enumerate(program.graph.nodes):
        if node.op != "call_function":
            continue
        for key, (path, _) in node.meta.get("nn_module_stack", {}).items():
            first.setdefault(path, i)
            call = key.rpartition("@")[2] if "@" in key else ""
            if call.isdigit() and int(call) > 0:
                first.setdefault(f"{path}@{call}", i)
    return first


def _repeated_calls(run_order: dict[str, int]) -> list[str]:
    """The calls of the outermost modules that run more than once (ALBERT's shared layer), as
    blocks: ``FQN``, ``FQN@1``, ... in run order."""
    repeated = sorted({name.rpartition("@")[0] for name in run_order if "@" in name})
    outer = [m for m in repeated if m and not any(m.startswith(o + ".") for o in repeated if o)]
    calls = [name for name in run_order if name in outer or name.rpartition("@")[0] in outer]
    return sorted(calls, key=run_order.__getitem__)


BLOCK_LISTS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)


def find_blocks(model: torch.nn.Module, run_order: dict[str, int] | None = None) -> list[str]:
    """The model's repeated blocks, in the order they run (without ``run_order``: every block
    the structure holds, in definition order, an upper bound known before tracing).

    A block list is an ``nn.ModuleList``, ``nn.Sequential`` or ``nn.ModuleDict`` of two or more
    children of one class that sits inside no other block list: ``transformer.h``,
    ``model.layers``, ``bert.encoder.layer``, T5's ``encoder.block`` then ``decoder.block``, a
    torchtitan-style ``layers`` dict. A model with no block list may hold its blocks as named
    attributes: then two or more sibling modules of one class that have submodules of their own
    (``block0``, ``block1``, ...), the outermost such. Failing both, with ``run_order``, the calls
    of a module that runs several times (ALBERT's one shared layer) are the blocks.
    """
    found: list[str] = []

    def inside(name: str) -> bool:
        return any(name == b or name.startswith(b + ".") for b in found)

    def join(parent: str, child: str) -> str:
        return f"{parent}.{child}" if parent else child

    for name, mod in model.named_modules():
        kids = list(mod.named_children())
        if (isinstance(mod, BLOCK_LISTS) and len(kids) >= 2 and len({type(c) for _, c in kids}) == 1
                and not inside(name)):
            found += [join(name, k) for k, _ in kids]
    if not found:
        for name, mod in model.named_modules():
            if inside(name):
                continue
            by_class: dict[type, list[str]] = {}
            for k, child in mod.named_children():
                if next(child.children(), None) is not None and not isinstance(child, BLOCK_LISTS):
                    by_class.setdefault(type(child), []).append(join(name, k))
            for names in by_class.values():
                if len(names) >= 2:
                    found += names
    if run_order is None:
        return found
    blocks = [b for b in found if b in run_order]
    if not blocks:  # one module run several times: its calls are the blocks
        return _repeated_calls(run_order)
    return sorted(blocks, key=run_order.__getitem__)


def unit_starts(program: ExportedProgram, run_order: dict[str, int], blocks: Sequence[str]) -> list[str]:
    """Where a balanced strategy may begin a stage: each block, and the first module that runs
    after the last block (GPT2's ``transformer.ln_f``, LLaMA's ``model.norm``), so that the final
    norm and the head, which at a large vocabulary cost several blocks, can be a stage of their
    own. Of modules that begin at the same op, the outermost is named."""
    if not blocks:
        return []
    end = _module_end(program, blocks[-1]) - 1
    after = sorted((i, len(name), name) for name, i in run_order.items() if name and "@" not in name and i > end)
    return list(blocks) + [after[0][2]] if after else list(blocks)


def even_points(blocks: Sequence[str], stages: int) -> list[str]:
    """Split points giving each stage an equal share of the blocks (earlier stages take the
    remainder, since the last stage also carries the head and the loss)."""
    if stages < 1:
        raise PpsplitError(f"stages={stages}: must be at least 1")
    if not blocks and stages > 1:
        raise PpsplitError(
            f"stages={stages}: the model shows no repeated blocks to split between (no ModuleList, "
            "Sequential or ModuleDict of two or more modules of one class, nor sibling modules of one "
            "class); allowed: split points by module FQN (split=manual split.points=[...], or points=)"
        )
    if stages > len(blocks):
        raise PpsplitError(
            f"stages={stages}: more stages than the model's {len(blocks)} blocks; "
            f"allowed: 1 to {len(blocks)}"
        )
    base, extra = divmod(len(blocks), stages)
    sizes = [base + (1 if i < extra else 0) for i in range(stages)]
    starts = [sum(sizes[:i]) for i in range(1, stages)]
    return [blocks[i] for i in starts]


def tie_groups(model: torch.nn.Module) -> list[list[str]]:
    """Groups of state_dict keys that name one tensor in ``model``."""
    by_id: dict[int, list[str]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        by_id.setdefault(id(tensor), []).append(key)
    return [keys for keys in by_id.values() if len(keys) > 1]


MARKER = "pipe_split"  # points "pipe_split:K": the K-th pipe_split() call in forward
END = ":end"  # a point "MODULE:end" begins a stage right after MODULE (torch's SplitPoint.END)


def markers(program: ExportedProgram) -> list[int]:
    """Graph positions of the ``torch.distributed.pipelining.pipe_split()`` calls in forward."""
    target = getattr(getattr(getattr(torch.ops, "pippy", None), "_pipe_split", None), "default", None)
    return [i for i, node in enumerate(program.graph.nodes)
            if node.op == "call_function" and target is not None and node.target is target]


def _module_end(program: ExportedProgram, module: str) -> int:
    """The graph position just after the last operation of ``module``, or of one call of it
    (``FQN@K``: the ops that carry that call's own stack key)."""
    path_of, _, call = module.partition("@")

    def inside(key: str, path: str) -> bool:
        if call:
            return path == path_of and key.rpartition("@")[2] == call
        return path == module or path.startswith(module + ".")

    return 1 + max(
        i for i, node in enumerate(program.graph.nodes)
        if node.op == "call_function"
        and any(inside(key, path) for key, (path, _) in node.meta.get("nn_module_stack", {}).items())
    )


def _point_positions(
    model: torch.nn.Module, points: Sequence[str], run_order: dict[str, int],
    program: ExportedProgram,
) -> list[int]:
    """Where each point begins a stage: a module FQN (at its first operation), ``MODULE:end``
    (after its last), or ``pipe_split:K`` (at the K-th marker)."""
    modules = dict(model.named_modules())
    marks = markers(program)
    positions = []
    for point in points:
        if isinstance(point, str) and point.startswith(MARKER + ":"):
            k = point[len(MARKER) + 1:]
            if not (k.isdigit() and int(k) < len(marks)):
                raise PpsplitError(
                    f"split point {point!r}: forward calls pipe_split() {len(marks)} time(s); "
                    f"allowed: {', '.join(f'{MARKER}:{i}' for i in range(len(marks))) or 'no marker points'}")
            positions.append(marks[int(k)])
            continue
        module = point[:-len(END)] if isinstance(point, str) and point.endswith(END) else point
        base = module.partition("@")[0] if isinstance(module, str) else module
        if module != point and f"{base}@1" in run_order:  # the end of which call is ambiguous
            raise PpsplitError(f"split point {point!r}: {base!r} runs more than once; "
                               f"allowed: one of its calls, where a stage begins ({base}@1, ...)")
        if isinstance(module, str) and module in run_order and "@" in module:
            positions.append(run_order[module])  # the K-th call of a module that runs several times
            continue
        if not isinstance(module, str) or module not in modules or module == "":
            raise PpsplitError(
                f"split point {point!r} is not a module of {type(model).__name__}"
                f"{nearest(str(module), [m for m in modules if m])} (a module FQN, "
                f"MODULE{END} to begin after it, or {MARKER}:K)"
            )
        if module not in run_order:
            raise PpsplitError(
                f"split point {point!r} never runs in forward; "
                f"allowed: modules that run{nearest(module, run_order)}"
            )
        positions.append(_module_end(program, module) if module != point else run_order[module])
    for i, (a, b) in enumerate(zip(points, points[1:])):
        if a == b:
            raise PpsplitError(f"split point {a!r} is repeated; each stage begins once")
        if positions[i + 1] < positions[i]:
            raise PpsplitError(
                f"split points out of order: {b!r} runs before {a!r}; list them in run order"
            )
        if positions[i + 1] == positions[i]:
            raise PpsplitError(
                f"split points {a!r} and {b!r} begin at the same operation, "
                f"which leaves stage {i + 1} empty"
            )
    return positions


def _stage_of_nodes(nodes: list[fx.Node], positions: list[int]) -> dict[fx.Node, int]:
    stage_of: dict[fx.Node, int] = {}
    for i, node in enumerate(nodes):
        if node.op != "call_function":
            continue
        src = node.args[0] if node.args else None
        if node.target is operator.getitem and isinstance(src, fx.Node) and src in stage_of:
            # A multi-output op and its getitems stay together: only tensors cross stages.
            stage_of[node] = stage_of[src]
        else:
            stage_of[node] = bisect.bisect_right(positions, i)
    return stage_of


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
    from ppsplit import plan

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
    positions = _point_positions(model, points, run_order, program)
    result = _build_split(model, program, points, positions, blocks)
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


def _build_split(model, program, points, positions, blocks) -> Split:
    graph = program.graph
    nodes = list(graph.nodes)
    sig = program.graph_signature
    n_stages = len(points) + 1
    stage_of = _stage_of_nodes(nodes, positions)
    first_op = next(i for i, n in enumerate(nodes) if n.op == "call_function")
    if positions and positions[0] == first_op:
        raise PpsplitError(
            f"split point {points[0]!r} is the model's first operation, which leaves stage 0 empty"
        )

    spec_of = {spec.arg.name: spec for spec in sig.input_specs}
    user_inputs = [
        n for n in nodes
        if n.op == "placeholder" and spec_of[n.name].kind == InputKind.USER_INPUT
        and isinstance(spec_of[n.name].arg, TensorArgument)
    ]
    output_node = nodes[-1]
    if any(spec.kind != OutputKind.USER_OUTPUT for spec in sig.output_specs):
        kinds = sorted({spec.kind.name for spec in sig.output_specs} - {"USER_OUTPUT"})
        raise PpsplitError(
            f"{type(model).__name__}.forward mutates its inputs or buffers ({', '.join(kinds)}); "
            "allowed: models whose forward only returns values"
        )
    out_leaves_nodes = list(output_node.args[0])
    out_spec = program.call_spec.out_spec
    last = n_stages - 1

    # Which stage defines each value, and the last stage that reads it.
    def_stage = {n: 0 for n in user_inputs}
    def_stage.update(stage_of)
    last_use: dict[fx.Node, int] = {}
    for node, s in stage_of.items():
        for arg in node.all_input_nodes:
            if arg in def_stage:
                last_use[arg] = max(last_use.get(arg, 0), s)
    for leaf in out_leaves_nodes:
        if isinstance(leaf, fx.Node):
            last_use[leaf] = last
    index = {n: i for i, n in enumerate(nodes)}
    # A symbolic size (a dynamic trace's batch or sequence length) is not sent between stages:
    # each stage that needs one reads it off the tensors it receives (see _stage_module).
    live = [
        sorted((v for v in def_stage if def_stage[v] <= b < last_use.get(v, -1) and not _is_size(v)),
               key=index.get)
        for b in range(n_stages - 1)
    ]
    stage_in = [user_inputs] + live
    stage_out = live + [[leaf for leaf in out_leaves_nodes if isinstance(leaf, fx.Node)]]

    # State tensors each stage reads, and the modules each stage runs.
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    used_state: list[dict[int, list[fx.Node]]] = [dict() for _ in range(n_stages)]
    carried: list[set[str]] = [set() for _ in range(n_stages)]
    for node, s in stage_of.items():
        for path, _ in node.meta.get("nn_module_stack", {}).values():
            carried[s].add(path)
        for arg in node.all_input_nodes:
            spec = spec_of.get(arg.name) if arg.op == "placeholder" else None
            if spec is not None and spec.kind != InputKind.USER_INPUT:
                key = id(named[spec.target]) if spec.target in named else id(arg)
                phs = used_state[s].setdefault(key, [])
                if arg not in phs:
                    phs.append(arg)

    stage_keys = _assign_keys(model, named, used_state, carried, n_stages)
    stages = [
        _stage_module(program, nodes, stage_of, s, stage_in[s], stage_out[s],
                      used_state[s], stage_keys[s], named, carried[s])
        for s in range(n_stages)
    ]
    out_pos = {leaf: i for i, leaf in enumerate(stage_out[last])}
    return Split(
        stages=stages,
        points=list(points),
        stage_keys=stage_keys,
        tie_groups=_shared_keys(model, stage_keys),
        stage_inputs=[[n.name for n in ins] for ins in stage_in],
        stage_outputs=[[n.name for n in outs] for outs in stage_out],
        program=program,
        blocks=blocks,
        positions=list(positions),
        stage_modules=carried,
        _in_spec=program.call_spec.in_spec,
        _input_leaves=_tensor_input_leaves(sig),
        _out_spec=out_spec,
        _out_leaves=[
            ("value", out_pos[leaf]) if isinstance(leaf, fx.Node) else ("const", leaf)
            for leaf in out_leaves_nodes
        ],
        _signature=_forward_signature(model),
    )


def _forward_signature(model: torch.nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None


def _renumber_calls(graph: fx.Graph) -> None:
    """Number each module's calls from this stage's first (``nn_module_stack`` keys ``PATH@K``):
    a stage that begins at the third call of a shared layer runs it as its own first call, so
    unflatten gives the stage the module under its original FQN, not a copy named ``...@2``."""
    seen: dict[str, list[str]] = {}
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if not stack or node.op != "call_function":  # a stage input keeps its producer's
            continue
        renamed = {}
        for key, value in stack.items():
            base, at, call = key.rpartition("@")
            if not (at and call.isdigit()):
                base, call = key, "0"
            calls = seen.setdefault(base, [])
            if call not in calls:
                calls.append(call)
            k = calls.index(call)
            renamed[f"{base}@{k}" if k else base] = value
        node.meta["nn_module_stack"] = renamed  # a new dict: the traced program's stays as it was


def _shared_keys(model: torch.nn.Module, stage_keys: list[list[str]]) -> list[list[str]]:
    """The tie groups, and each key that several stages hold under its own name (a layer that
    runs in several stages, as ALBERT's): its copies are kept in step like a tie's."""
    groups = tie_groups(model)
    grouped = {k for g in groups for k in g}
    held = [set(keys) for keys in stage_keys]
    return groups + [[k] for k in model.state_dict() if k not in grouped and sum(k in h for h in held) > 1]


def _tensor_input_leaves(sig: ExportGraphSignature) -> list[int]:
    user = [s for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    return [i for i, s in enumerate(user) if isinstance(s.arg, TensorArgument)]


def _assign_keys(model, named, used_state, carried, n_stages) -> list[list[str]]:
    """Which stage holds each original state_dict key.

    A key goes to the stages that read its tensor and run its module. A tied key whose module
    never runs (T5's ``shared``) goes to the first stage that reads its tensor; a key nobody
    reads goes to the first stage that runs its module or the nearest module above it.
    """
    keys: list[list[str]] = [[] for _ in range(n_stages)]
    for key in model.state_dict(keep_vars=True):
        tensor_id = id(named[key])
        module = key.rpartition(".")[0]
        readers = [s for s in range(n_stages) if tensor_id in used_state[s]]
        holders = [s for s in readers if module in carried[s]] or readers[:1]
        if not holders:
            holders = [_first_runner(module, carried)]
        for s in holders:
            keys[s].append(key)
    return keys


def _first_runner(module: str, carried: list[set[str]]) -> int:
    while True:
        for s, paths in enumerate(carried):
            if module in paths:
                return s
        if not module:
            return 0
        module = module.rpartition(".")[0]


def _is_size(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.SymInt)


def _read_size(graph: fx.Graph, node: fx.Node, user: fx.Node, inputs: list[tuple[fx.Node, fx.Node]],
               s: int) -> fx.Node:
    """A symbolic size that an earlier stage computed (``s1``, or ``2*s0*s1``), computed again
    from this stage's tensor inputs: each symbol read off an input that has it as a dimension
    (``aten.sym_size.int``), then the sums and products between them."""
    import sympy

    stack = dict(user.meta.get("nn_module_stack", {}))  # computed where it is used
    reads: dict[Any, fx.Node] = {}

    def emit(target, args, val):
        out = graph.call_function(target, args)
        out.meta["val"], out.meta["nn_module_stack"] = val, dict(stack)
        return out

    def symbol(sym):
        if sym not in reads:
            for original, placeholder in inputs:
                shape = getattr(original.meta.get("val"), "shape", ())
                hit = next((d for d, size in enumerate(shape)
                            if isinstance(size, torch.SymInt) and size.node.expr == sym), None)
                if hit is not None:
                    reads[sym] = emit(torch.ops.aten.sym_size.int, (placeholder, hit), shape[hit])
                    break
            else:
                raise PpsplitError(
                    f"stage {s} uses the size {want} (varying between calls), and none of the tensors it "
                    f"receives has {sym} as a dimension; allowed: fixed shapes (no dynamic sizes) for this split")
        return reads[sym]

    def build(expr):
        if expr.is_Integer:
            return int(expr)
        if expr.is_Symbol:
            return symbol(expr)
        if isinstance(expr, (sympy.Add, sympy.Mul)):
            join = operator.add if isinstance(expr, sympy.Add) else operator.mul
            parts = [build(a) for a in expr.args]
            out = parts[0]
            for part in parts[1:]:
                vals = [p.meta["val"] if isinstance(p, fx.Node) else p for p in (out, part)]
                out = emit(join, (out, part), join(*vals))
            return out
        raise PpsplitError(f"stage {s} uses the size {want} (varying between calls), which ppsplit cannot "
                           "compute from the tensors the stage receives; allowed: fixed shapes for this split")

    want = node.meta["val"].node.expr
    out = build(want)
    if not isinstance(out, fx.Node):  # a constant after all
        return out
    out.meta["val"] = node.meta["val"]
    return out


def _stage_module(program, nodes, stage_of, s, inputs, outputs, used, keys, named, carried):
    """Build stage ``s`` as its own ExportedProgram and unflatten it."""
    sig = program.graph_signature
    spec_of = {spec.arg.name: spec for spec in sig.input_specs}
    keys_by_id: dict[int, list[str]] = {}
    for key in keys:
        keys_by_id.setdefault(id(named[key]), []).append(key)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    input_specs: list[InputSpec] = []
    # unflatten copies every tensor it is given; give it free meta stand-ins and hand the stage
    # the caller's own tensors afterwards (adopt_tensors), so a split costs no weight memory.
    stand_in: dict[int, torch.Tensor] = {}

    def meta_of(tensor):
        if id(tensor) not in stand_in:
            stand_in[id(tensor)] = same_kind(tensor, torch.empty_like(tensor, device="meta"))
        return stand_in[id(tensor)]

    state_dict: dict[str, torch.Tensor] = {key: meta_of(named[key]) for key in keys}
    constants: dict[str, Any] = {}
    state_phs = {ph for phs in used.values() for ph in phs}

    for node in nodes:  # state placeholders in the original's order (params, buffers, constants)
        if node not in state_phs:
            continue
        spec = spec_of[node.name]
        target = spec.target
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER) and target not in state_dict:
            if spec.kind == InputKind.PARAMETER or spec.persistent:
                # A tied tensor read under a name this stage does not carry: read it under one
                # of the names the stage holds, so no stale or extra name appears.
                target = keys_by_id[id(named[target])][0]
            else:
                constants[target] = meta_of(named[target]) if target in named else program.constants[target]
        elif spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER):
            constants[target] = program.constants[target]
        # fx may rename a placeholder (a name like ``input`` shadows a builtin): the specs name
        # the placeholder as created
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
        input_specs.append(
            InputSpec(kind=spec.kind, arg=TensorArgument(env[node].name), target=target,
                      persistent=spec.persistent)
        )
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
        input_specs.append(InputSpec(kind=InputKind.USER_INPUT, arg=TensorArgument(env[node].name),
                                     target=None))
    copying: list[fx.Node] = []
    sizes: dict[tuple, fx.Node] = {}

    def value(node):
        if node in env or not _is_size(node):
            return env[node]
        # Read once in each module call that uses it: a read shared between two calls of one
        # layer (ALBERT's) would make their graphs differ, and unflatten would then copy the
        # layer under a name of its own.
        user = copying[-1]
        where = (node, tuple(user.meta.get("nn_module_stack", {})))
        if where not in sizes:
            sizes[where] = _read_size(graph, node, user, [(n, env[n]) for n in inputs], s)
        return sizes[where]

    for node in nodes:
        if stage_of.get(node) == s:
            copying.append(node)
            env[node] = graph.node_copy(node, value)
    _renumber_calls(graph)
    out_vals = [env[v] for v in outputs]
    graph.output(tuple(out_vals))
    output_specs = [
        OutputSpec(kind=OutputKind.USER_OUTPUT, arg=TensorArgument(v.name), target=None)
        for v in out_vals
    ]
    in_spec = pytree.tree_flatten((tuple(range(len(inputs))), {}))[1]
    out_spec = pytree.tree_flatten(out_vals[0] if len(out_vals) == 1 else tuple(out_vals))[1]
    call_graph = [
        ModuleCallEntry(
            "",
            ModuleCallSignature(
                inputs=[TensorArgument(env[n].name) for n in inputs],
                outputs=[TensorArgument(v.name) for v in out_vals],
                in_spec=in_spec,
                out_spec=out_spec,
            ),
        )
    ] + [
        entry for entry in program.module_call_graph
        if entry.fqn and entry.signature is None and entry.fqn.split("@")[0] in carried
    ]
    stage_program = ExportedProgram(
        root=torch.nn.Module(),
        graph=graph,
        graph_signature=ExportGraphSignature(input_specs=input_specs, output_specs=output_specs),
        state_dict=state_dict,
        range_constraints=program.range_constraints,
        module_call_graph=call_graph,
        constants=constants,
        verifiers=program.verifiers,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)  # torch's own LeafSpec notice
        module = torch.export.unflatten(stage_program)
    adopt_tensors(module, named, only_known=True)
    use_generated_code(module)
    return module
