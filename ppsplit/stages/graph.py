"""Cut the traced graph into stages and build each stage's module under the original FQNs.

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
import inspect
import operator
import warnings
from typing import Any

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
from ppsplit.torch_private import pytree

from ppsplit.errors import PpsplitError
from ppsplit.stages.code import adopt_tensors, same_kind, use_generated_code


def tie_groups(model: torch.nn.Module) -> list[list[str]]:
    """Groups of state_dict keys that name one tensor in ``model``."""
    by_id: dict[int, list[str]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        by_id.setdefault(id(tensor), []).append(key)
    return [keys for keys in by_id.values() if len(keys) > 1]


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


def build_stages(model, program, points, positions, blocks) -> dict[str, Any]:
    """The fields of a :class:`~ppsplit.stages.trace.Split`: its stages, their keys, inputs and outputs."""
    nodes = list(program.graph.nodes)
    sig = program.graph_signature
    n_stages = len(points) + 1
    stage_of = _stage_of_nodes(nodes, positions)
    _check_first_stage_not_empty(nodes, points, positions)
    spec_of = _input_spec_by_name(sig)
    user_inputs = _user_tensor_inputs(nodes, spec_of)
    _check_only_returns(model, sig)
    out_leaves_nodes = list(nodes[-1].args[0])
    out_spec = program.call_spec.out_spec
    stage_in, stage_out = _stage_boundaries(nodes, stage_of, user_inputs, out_leaves_nodes, n_stages)
    named = _named_tensors(model)
    used_state, carried = _stage_state(stage_of, spec_of, named, n_stages)
    stage_keys = _assign_keys(model, named, used_state, carried, n_stages)
    stages = [
        _stage_module(program, nodes, stage_of, s, stage_in[s], stage_out[s],
                      used_state[s], stage_keys[s], named, carried[s])
        for s in range(n_stages)
    ]
    return dict(
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
        _out_leaves=_output_leaves(out_leaves_nodes, stage_out[n_stages - 1]),
        _signature=_forward_signature(model),
    )


def _check_first_stage_not_empty(nodes: list[fx.Node], points, positions: list[int]) -> None:
    """Refuse a split whose first point is the model's first operation: stage 0 would run nothing."""
    first_op = next(i for i, n in enumerate(nodes) if n.op == "call_function")
    if positions and positions[0] == first_op:
        raise PpsplitError(
            f"split point {points[0]!r} is the model's first operation, which leaves stage 0 empty"
        )


def _input_spec_by_name(sig: ExportGraphSignature) -> dict[str, InputSpec]:
    """Each input spec under the name of the placeholder it describes."""
    return {spec.arg.name: spec for spec in sig.input_specs}


def _user_tensor_inputs(nodes: list[fx.Node], spec_of: dict[str, InputSpec]) -> list[fx.Node]:
    """The placeholders of the caller's tensor arguments (not state, not non-tensor arguments):
    stage 0's inputs."""
    return [
        n for n in nodes
        if n.op == "placeholder" and spec_of[n.name].kind == InputKind.USER_INPUT
        and isinstance(spec_of[n.name].arg, TensorArgument)
    ]


def _check_only_returns(model: torch.nn.Module, sig: ExportGraphSignature) -> None:
    """Refuse a forward that mutates its inputs or buffers: a stage only hands values on."""
    if any(spec.kind != OutputKind.USER_OUTPUT for spec in sig.output_specs):
        kinds = sorted({spec.kind.name for spec in sig.output_specs} - {"USER_OUTPUT"})
        raise PpsplitError(
            f"{type(model).__name__}.forward mutates its inputs or buffers ({', '.join(kinds)}); "
            "allowed: models whose forward only returns values"
        )


def _value_lifetimes(stage_of, user_inputs, out_leaves, last: int):
    """Which stage defines each value, and the last stage that reads it (``last`` for the
    model's outputs): a value is relayed through every boundary in between."""
    def_stage = {n: 0 for n in user_inputs}
    def_stage.update(stage_of)
    last_use: dict[fx.Node, int] = {}
    for node, s in stage_of.items():
        for arg in node.all_input_nodes:
            if arg in def_stage:
                last_use[arg] = max(last_use.get(arg, 0), s)
    for leaf in out_leaves:
        if isinstance(leaf, fx.Node):
            last_use[leaf] = last
    return def_stage, last_use


def _stage_boundaries(nodes, stage_of, user_inputs, out_leaves, n_stages):
    """Each stage's input values and output values: stage 0 takes the caller's tensors, the last
    returns the model's output leaves, and each boundary carries every live value in graph order."""
    def_stage, last_use = _value_lifetimes(stage_of, user_inputs, out_leaves, n_stages - 1)
    index = {n: i for i, n in enumerate(nodes)}
    # A symbolic size (a dynamic trace's batch or sequence length) is not sent between stages:
    # each stage that needs one reads it off the tensors it receives (see _copy_stage_nodes).
    live = [
        sorted((v for v in def_stage if def_stage[v] <= b < last_use.get(v, -1) and not _is_size(v)),
               key=index.get)
        for b in range(n_stages - 1)
    ]
    stage_in = [user_inputs] + live
    stage_out = live + [[leaf for leaf in out_leaves if isinstance(leaf, fx.Node)]]
    return stage_in, stage_out


def _named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer under each of its names, tied names included."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    return named


def _stage_state(stage_of, spec_of, named, n_stages):
    """The state each stage reads (its placeholders, grouped by tensor so tied names count once)
    and the module paths each stage runs: together they decide which keys a stage holds."""
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
    return used_state, carried


def _output_leaves(out_leaves, last_outputs) -> list[tuple[str, Any]]:
    """Each leaf of the model's output: a position among the last stage's outputs, or a constant."""
    out_pos = {leaf: i for i, leaf in enumerate(last_outputs)}
    return [
        ("value", out_pos[leaf]) if isinstance(leaf, fx.Node) else ("const", leaf)
        for leaf in out_leaves
    ]


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
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    meta_of = _meta_stand_ins()
    state_dict: dict[str, torch.Tensor] = {key: meta_of(named[key]) for key in keys}
    input_specs, constants = _state_placeholders(graph, env, program, nodes, used, keys, named,
                                                 state_dict, meta_of)
    input_specs += _user_placeholders(graph, env, inputs)
    _copy_stage_nodes(graph, env, nodes, stage_of, s, inputs)
    _renumber_calls(graph)
    out_vals = [env[v] for v in outputs]
    graph.output(tuple(out_vals))
    output_specs = [
        OutputSpec(kind=OutputKind.USER_OUTPUT, arg=TensorArgument(v.name), target=None)
        for v in out_vals
    ]
    stage_program = ExportedProgram(
        root=torch.nn.Module(),
        graph=graph,
        graph_signature=ExportGraphSignature(input_specs=input_specs, output_specs=output_specs),
        state_dict=state_dict,
        range_constraints=program.range_constraints,
        module_call_graph=_stage_call_graph(program, [env[n] for n in inputs], out_vals, carried),
        constants=constants,
        verifiers=program.verifiers,
    )
    return _unflatten_stage(stage_program, named)


def _meta_stand_ins():
    """A function giving each tensor one free meta stand-in, the same one every time.

    unflatten copies every tensor it is given; give it these and hand the stage the caller's own
    tensors afterwards (adopt_tensors), so a split costs no weight memory.
    """
    stand_in: dict[int, torch.Tensor] = {}

    def meta_of(tensor):
        if id(tensor) not in stand_in:
            stand_in[id(tensor)] = same_kind(tensor, torch.empty_like(tensor, device="meta"))
        return stand_in[id(tensor)]

    return meta_of


def _placeholder_like(graph: fx.Graph, env: dict[fx.Node, fx.Node], node: fx.Node) -> fx.Node:
    """A placeholder in ``graph`` standing for ``node`` (same name asked for, a copy of its meta)."""
    env[node] = graph.placeholder(node.name)
    env[node].meta = dict(node.meta)
    return env[node]


def _state_placeholders(graph, env, program, nodes, used, keys, named, state_dict, meta_of):
    """The stage's state placeholders and their input specs, plus the constants they read.

    Placeholders come in the original's order (params, buffers, constants).
    """
    spec_of = _input_spec_by_name(program.graph_signature)
    keys_by_id: dict[int, list[str]] = {}
    for key in keys:
        keys_by_id.setdefault(id(named[key]), []).append(key)
    input_specs: list[InputSpec] = []
    constants: dict[str, Any] = {}
    state_phs = {ph for phs in used.values() for ph in phs}
    for node in nodes:
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
        ph = _placeholder_like(graph, env, node)
        input_specs.append(
            InputSpec(kind=spec.kind, arg=TensorArgument(ph.name), target=target,
                      persistent=spec.persistent)
        )
    return input_specs, constants


def _user_placeholders(graph, env, inputs) -> list[InputSpec]:
    """The stage's value inputs as placeholders (after the state ones), and their input specs."""
    input_specs: list[InputSpec] = []
    for node in inputs:
        ph = _placeholder_like(graph, env, node)
        input_specs.append(InputSpec(kind=InputKind.USER_INPUT, arg=TensorArgument(ph.name),
                                     target=None))
    return input_specs


def _copy_stage_nodes(graph, env, nodes, stage_of, s, inputs) -> None:
    """Copy stage ``s``'s operations into ``graph`` in their original order, recomputing each
    symbolic size they use from the stage's inputs (sizes are not sent between stages)."""
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


def _stage_call_graph(program, in_phs, out_vals, carried) -> list[ModuleCallEntry]:
    """The stage's module call graph: its own root signature, then the original's entries for
    the modules it runs, so unflatten rebuilds them under their FQNs."""
    in_spec = pytree.tree_flatten((tuple(range(len(in_phs))), {}))[1]
    out_spec = pytree.tree_flatten(out_vals[0] if len(out_vals) == 1 else tuple(out_vals))[1]
    return [
        ModuleCallEntry(
            "",
            ModuleCallSignature(
                inputs=[TensorArgument(ph.name) for ph in in_phs],
                outputs=[TensorArgument(v.name) for v in out_vals],
                in_spec=in_spec,
                out_spec=out_spec,
            ),
        )
    ] + [
        entry for entry in program.module_call_graph
        if entry.fqn and entry.signature is None and entry.fqn.split("@")[0] in carried
    ]


def _unflatten_stage(stage_program: ExportedProgram, named) -> torch.nn.Module:
    """The stage's module: unflattened, holding the caller's own tensors, running generated code."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)  # torch's own LeafSpec notice
        module = torch.export.unflatten(stage_program)
    adopt_tensors(module, named, only_known=True)
    use_generated_code(module)
    return module
