"""How stage modules execute. Two things make a stage as fast as the model's own forward.

Generated code. ``torch.export.unflatten`` builds ``InterpreterModule``s that run their fx graph
node by node through ``torch.fx.Interpreter`` (about 7 us a node). Each also carries generated
Python code for the same graph; running that instead costs nothing per node and gives identical
numerics. torch exposes the choice only through the private per-instance flag
``_run_with_interpreter`` (the module-wide default is
``torch.export.unflatten.RUN_WITH_INTERPRETER``). This is the one place ppsplit touches it;
``tests/test_stage_code.py`` fails if torch renames or drops it.

Constants computed once. With static shapes, part of a traced graph reads no input: GPT2's
causal mask (38 ops of ``arange``/``index``/``le``/``and`` over the static sequence length, where
the eager model with SDPA builds none), T5's relative position buckets, BERT's token types.
``fold_constants`` moves such a region into one ``CachedConstants`` call, which runs it the
first time and hands back the same tensors afterwards, for as long as the buffers it reads and
the results it gave are unwritten and the global settings an op may follow (default dtype,
autocast) unchanged; otherwise it runs the region again. A region is only formed where running
it ahead of the rest of the graph, once, changes nothing: no write from outside can reach it
(``_constant_nodes``). At GPT2 4L x 64 with a 4x16 microbatch this takes stage 0 from 1.39x to
1.02-1.07x the eager forward (bench ``stage_overhead``).
"""

import operator

import torch
from torch import fx

from ppsplit.torch_private import UNSAFE_VIEW, OpOverload, any_autocast, tracing_or_mode_active

_FLAG = "_run_with_interpreter"
_METADATA_ASSERTS = tuple(op for op in (getattr(torch.ops.aten, "_assert_tensor_metadata", None),)
                          if op is not None)
_METADATA_ASSERTS = tuple(getattr(op, "default", op) for op in _METADATA_ASSERTS)


def use_generated_code(module: torch.nn.Module) -> torch.nn.Module:
    """Make every unflattened submodule of ``module`` run its generated code."""
    for sub in module.modules():
        if not hasattr(sub, _FLAG):
            continue
        graph = getattr(sub, "graph", None)
        for node in graph.nodes if graph is not None else ():
            if node.name == "self":
                # fx's codegen names a call of a submodule called ``self`` (BERT's
                # ``attention.self``) ``self``, shadowing the method's own ``self``.
                node._rename("self_module")
        if graph is not None:
            fold_constants(sub)
        if hasattr(sub, "finalize"):
            # unflatten redirects repeated calls (``dropout@1``) after it generated code;
            # generate it again from the final graph.
            sub.finalize()
        setattr(sub, _FLAG, False)
    return module


def drop_dtype_checks(module: torch.nn.Module) -> int:
    """Remove export's checks that a value has the traced dtype (``_assert_tensor_metadata``)
    from every graph of ``module``; returns how many. Under FSDP2 gathering bfloat16 parameters
    (``train.precision=bf16``) values are legitimately of another dtype; the casts stay."""
    removed = 0
    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        checks = [n for n in graph.nodes if n.op == "call_function" and n.target in _METADATA_ASSERTS
                  and not n.users]
        for node in checks:
            graph.erase_node(node)
        if checks and hasattr(sub, "finalize"):
            sub.finalize()
        removed += len(checks)
    return removed


_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "hpu", "mps")


def _run_state() -> tuple:
    """The global settings an op's result may depend on without reading them as inputs."""
    autocast = None
    if any_autocast():
        autocast = tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                         for d in _AUTOCAST_DEVICES)
    return torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(), autocast


def _stamp(tensors) -> list[tuple[int, int]]:
    # A write in place bumps _version; ``.data =`` and swap_tensors change the storage.
    return [(t._version, t.data_ptr()) for t in tensors]


class CachedConstants:
    """A graph region that reads no input, run once and reused while what it read is unchanged.

    Called with the tensors the region reads (buffers, lifted constants), it returns the
    region's outputs. A call finds them cached if it gets the very same tensors, unwritten
    since (version and storage), no output has been written to, and the default dtype, the
    deterministic-algorithms flag and autocast are as they were. Under a tracer or a mode (fake
    tensors, export, make_fx, a TorchFunctionMode), or when an input needs gradients or is an
    inference tensor, it just runs the region. Writes that bypass autograd's version counter
    (``t.data.add_()``) are not seen, as autograd does not see them either."""

    __name__ = "cached_constants"  # fx names the call after it

    def __init__(self, graph: fx.Graph):
        self.region = fx.GraphModule(torch.nn.Module(), graph)
        self._memo = None  # (inputs, their stamps, run state, outputs, their stamps)

    def __call__(self, *inputs):
        if tracing_or_mode_active() or any(t.requires_grad or t.is_inference() for t in inputs):
            return self.region(*inputs)
        state = _run_state()
        memo = self._memo
        if memo is not None:
            held, held_stamps, held_state, outputs, out_stamps = memo
            if (held_state == state and len(held) == len(inputs)
                    and all(a is b for a, b in zip(held, inputs))
                    and _stamp(inputs) == held_stamps and _stamp(outputs) == out_stamps):
                return outputs
        # Normal tensors, made in grad mode (views made under no_grad refuse later in-place
        # writes under autograd); no input needs gradients, so nothing is recorded.
        with torch.inference_mode(False), torch.enable_grad():
            outputs = tuple(self.region(*inputs))
        self._memo = (inputs, _stamp(inputs), state, outputs, _stamp(outputs))
        return outputs


def _deterministic_op(target) -> bool:
    if target is operator.getitem:
        return True
    return (isinstance(target, OpOverload)
            and torch.Tag.nondeterministic_seeded not in target.tags)


def _written_args(node: fx.Node) -> list[fx.Node]:
    """The input nodes that ``node`` may write into: those its op's schema marks written
    (``add_``'s ``self``...), or every input of a call whose effects are unknown."""
    target = node.target
    if target is operator.getitem or isinstance(target, CachedConstants):
        return []
    if not isinstance(target, OpOverload):
        return list(node.all_input_nodes)
    written = []
    for i, arg in enumerate(target._schema.arguments):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if arg.alias_info is not None and arg.alias_info.is_write:
            fx.node.map_arg(value, written.append)
    return written


def _may_alias(node: fx.Node) -> bool:
    """Whether ``node``'s value may share storage with one of its inputs."""
    target = node.target
    if isinstance(target, CachedConstants):
        return False
    if isinstance(target, OpOverload):
        return (target is UNSAFE_VIEW  # shares storage, not version
                or any(r.alias_info is not None for r in target._schema.returns))
    return True  # getitem, submodules, anything else


def _returns_tensor(node: fx.Node) -> bool:
    if "val" in node.meta:
        return isinstance(node.meta["val"], torch.Tensor)
    returns = getattr(node.target, "_schema", None) and node.target._schema.returns
    return bool(returns) and len(returns) == 1 and isinstance(returns[0].type, torch.TensorType)


class _Storage:
    """Which nodes of a graph may hold storage of the tensors it was given, of its own state
    (buffers, constants) or of a region, following views and anything else that may alias."""

    def __init__(self, **roots: set[fx.Node]):
        self.sets = {name: set(nodes) for name, nodes in roots.items()}

    def follow(self, node: fx.Node) -> None:
        if _may_alias(node):
            for nodes in self.sets.values():
                if any(n in nodes for n in node.all_input_nodes):
                    nodes.add(node)

    def hit(self, name: str, nodes) -> bool:
        return any(n in self.sets[name] for n in nodes)


def _writes(module: torch.nn.Module, seen: dict) -> tuple[bool, bool]:
    """(may write into a tensor it is given, may write into state) for a submodule's graph,
    through its own submodules; an unflattened module called several times
    (``InterpreterModuleDispatcher``) counts every call's graph."""
    if id(module) in seen:
        return seen[id(module)]
    seen[id(module)] = (True, True)  # until known (and for recursion)
    graphs = [getattr(m, "graph", None) for m in getattr(module, "_call_modules", [module])]
    if not all(isinstance(g, fx.Graph) for g in graphs):
        return seen[id(module)]
    given = state = False
    for graph in graphs:
        storage = _Storage(given=set(graph.find_nodes(op="placeholder")),
                           state=set(graph.find_nodes(op="get_attr")))
        for node in graph.nodes:
            if node.op == "call_module":
                sub_given, sub_state = _writes(module.get_submodule(node.target), seen)
                state |= sub_state or (sub_given and storage.hit("state", node.all_input_nodes))
                given |= sub_given and storage.hit("given", node.all_input_nodes)
            elif node.op == "call_function":
                written = _written_args(node)
                given |= storage.hit("given", written)
                state |= storage.hit("state", written)
            if node.op in ("call_module", "call_function"):
                storage.follow(node)
    seen[id(module)] = (given, state)
    return given, state


def _constant_nodes(module: torch.nn.Module, graph: fx.Graph) -> list[fx.Node]:
    """The nodes, in graph order, whose values depend on no input and no parameter, and that
    can all run, once, ahead of the rest of the graph.

    - An op that writes into its input (T5's ``relative_buckets += ...``) joins only if what it
      writes holds no buffer (the region would write into it once, not on every call) and no
      region value has been read outside yet (that read must see the value from before).
    - Once a node outside may write into a buffer (in place, or a submodule into its own), no
      buffer joins any more, and if the region already reads one, nothing joins: it would read
      the buffer from before that write.
    - If a node outside may write into a region value (or a view of one), nothing is folded:
      later calls would get the written value back.
    """
    constant: dict[fx.Node, None] = {}
    storage = _Storage(region=set(), state=set())
    read_outside = buffers_may_change = False
    seen: dict = {}
    for node in graph.nodes:
        ok = False
        if node.op == "get_attr":
            value = module
            for part in node.target.split("."):
                value = getattr(value, part, None)
            storage.sets["state"].add(node)
            ok = (not buffers_may_change and isinstance(value, torch.Tensor)
                  and not isinstance(value, torch.nn.Parameter))
        elif (node.op == "call_function" and _deterministic_op(node.target)
              and all(n in constant for n in node.all_input_nodes)):
            written = _written_args(node)
            ok = not written or (not read_outside and not storage.hit("state", written))
        if ok:
            constant[node] = None
            if node.op != "get_attr":
                storage.sets["region"].add(node)
                storage.follow(node)
            continue
        if node.op in ("placeholder", "get_attr"):
            continue
        read_outside |= storage.hit("region", node.all_input_nodes)
        if node.op == "call_module":
            given, own = _writes(module.get_submodule(node.target), seen)
            into_region = given and storage.hit("region", node.all_input_nodes)
            into_state = own or (given and storage.hit("state", node.all_input_nodes))
        elif node.op == "call_function":
            written = _written_args(node)
            into_region = storage.hit("region", written)
            into_state = storage.hit("state", written)
        else:  # output
            into_region = into_state = False
        if into_region:
            return []
        if into_state:
            if any(n.op == "get_attr" for n in constant):
                break
            buffers_may_change = True
        if node.op != "output":
            storage.follow(node)
    return list(constant)


def fold_constants(module: torch.nn.Module) -> int:
    """Replace the region of ``module``'s graph that reads no input by one ``CachedConstants``
    call; returns the number of ops moved (0 if fewer than two would be, or if a value other
    than a tensor leaves the region)."""
    graph = module.graph
    nodes = _constant_nodes(module, graph)
    region = set(nodes)
    ops = [n for n in nodes if n.op == "call_function"]
    results = [n for n in ops if any(u not in region for u in n.users)]
    if len(ops) < 2 or not all(_returns_tensor(n) for n in results):
        return 0
    leaves = [n for n in nodes if n.op == "get_attr" and any(u in region for u in n.users)]
    sub = fx.Graph()
    env = {leaf: sub.placeholder(f"in_{i}") for i, leaf in enumerate(leaves)}
    for node in ops:
        env[node] = sub.node_copy(node, env.__getitem__)
    sub.output(tuple(env[n] for n in results))
    for leaf in leaves:  # a get_attr reads no value, so it can move up to where the call goes
        ops[0].prepend(leaf)
    with graph.inserting_before(ops[0]):
        call = graph.call_function(CachedConstants(sub), tuple(leaves), name="cached_constants")
        for i, node in enumerate(results):
            value = graph.call_function(operator.getitem, (call, i))
            value.meta = dict(node.meta)
            node.replace_all_uses_with(value)
    for node in reversed(ops):
        graph.erase_node(node)
    graph.lint()
    return len(ops)


def retarget_devices(module: torch.nn.Module, device) -> torch.nn.Module:
    """Rewrite every device baked into the stage's graphs (a trace on meta records
    ``device=meta`` in ``arange``/``full``/``to``...) to ``device``, whether the op took it as a
    keyword or positionally (LLaMA's rotary ``aten.to.device(inv_freq, meta, ...)``)."""
    device = torch.device(device)

    def swap(value):
        return device if isinstance(value, torch.device) and value.type == "meta" else value

    def retarget(graph: fx.Graph) -> bool:
        changed = False
        for node in graph.nodes:
            args = fx.node.map_aggregate(node.args, swap)
            kwargs = fx.node.map_aggregate(node.kwargs, swap)
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs, changed = args, kwargs, True
            if isinstance(node.target, CachedConstants):
                # A new region, not this one rewritten: a deepcopy of the stage shares it.
                copied = fx.Graph()
                copied.output(copied.graph_copy(node.target.region.graph, {}))
                if retarget(copied):
                    node.target, changed = CachedConstants(copied), True
        return changed

    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        if isinstance(graph, fx.Graph) and retarget(graph) and hasattr(sub, "finalize"):
            sub.finalize()
    return module


def same_kind(tensor: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """``data`` as what ``tensor`` is: a Parameter (with its ``requires_grad``) or a plain
    tensor (a buffer)."""
    return torch.nn.Parameter(data, tensor.requires_grad) if isinstance(tensor, torch.nn.Parameter) else data


def adopt_tensors(module: torch.nn.Module, tensors: dict[str, torch.Tensor], only_known: bool = False) -> list[str]:
    """Put ``tensors`` (by FQN) into ``module`` in place of its own, keeping one object per tied
    tensor; returns the FQNs that were not found in ``tensors`` (``only_known``: skip those
    silently, e.g. constants the trace lifted, which are not the model's)."""
    missing = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        prefix = f"{prefix}." if prefix else ""
        for store in (sub._parameters, sub._buffers):
            for name, tensor in list(store.items()):
                if tensor is None:
                    continue
                new = tensors.get(prefix + name)
                if new is None:
                    if not only_known:
                        missing.append(prefix + name)
                elif isinstance(tensor, torch.nn.Parameter) and not isinstance(new, torch.nn.Parameter):
                    raise TypeError(f"{prefix + name}: a parameter needs a Parameter")
                else:
                    store[name] = new
    return missing
