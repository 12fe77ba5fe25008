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
first time and hands back the same tensors afterwards for as long as the buffers it reads are
the same tensors at the same version and nobody has written into its results
(``Tensor._version``); otherwise it runs the region again. At GPT2 4L x 64 with a 4x16
microbatch this takes stage 0 from 1.39x to 1.02-1.07x the eager forward (bench
``stage_overhead``).
"""

import operator

import torch
from torch import fx

_FLAG = "_run_with_interpreter"


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


# Fake tensors, functionalization, make_fx's proxies: a tracer that must see the region's ops.
_INFRA_MODES = tuple(torch._C._TorchDispatchModeKey.__members__.values())


class CachedConstants:
    """A graph region that reads no input, run once and reused while what it read is unchanged.

    Called with the tensors the region reads (buffers, lifted constants), it returns the
    region's outputs; a call finds them cached if it gets the very same tensors at the same
    versions and no output has been written to since. Under a tracer or a dispatch mode (fake
    tensors, export, make_fx), or when an input needs gradients, it just runs the region."""

    __name__ = "cached_constants"  # fx names the call after it

    def __init__(self, graph: fx.Graph):
        self.region = fx.GraphModule(torch.nn.Module(), graph)
        self._memo = None  # (inputs, their versions, outputs, their versions)

    def clear(self) -> None:
        self._memo = None

    def __call__(self, *inputs):
        if (fx._symbolic_trace.is_fx_symbolic_tracing()
                or any(torch._C._get_dispatch_mode(key) is not None for key in _INFRA_MODES)
                or torch.utils._python_dispatch._get_current_dispatch_mode() is not None
                or any(t.requires_grad for t in inputs)):
            return self.region(*inputs)
        memo = self._memo
        if memo is not None:
            held, versions, outputs, out_versions = memo
            if (all(a is b for a, b in zip(held, inputs))
                    and [t._version for t in inputs] == versions
                    and [t._version for t in outputs] == out_versions):
                return outputs
        # Normal tensors even under inference_mode, so that a later training step can use them.
        with torch.inference_mode(False), torch.no_grad():
            outputs = tuple(self.region(*inputs))
        self._memo = (inputs, [t._version for t in inputs], outputs, [t._version for t in outputs])
        return outputs


def _deterministic_op(target) -> bool:
    if target is operator.getitem:
        return True
    return (isinstance(target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded not in target.tags)


def _written_args(node: fx.Node) -> list[fx.Node]:
    """The input nodes that ``node``'s op writes into (``add_``'s ``self``...)."""
    written = []
    for i, arg in enumerate(node.target._schema.arguments):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if arg.alias_info is not None and arg.alias_info.is_write:
            fx.node.map_arg(value, written.append)
    return written


def _returns_tensor(node: fx.Node) -> bool:
    if "val" in node.meta:
        return isinstance(node.meta["val"], torch.Tensor)
    returns = getattr(node.target, "_schema", None) and node.target._schema.returns
    return bool(returns) and len(returns) == 1 and isinstance(returns[0].type, torch.TensorType)


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, todo = set(), [node]
    while todo:
        for n in todo.pop().all_input_nodes:
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def _graph_may_write_inputs(module: torch.nn.Module) -> bool:
    """Whether a submodule's graphs hold any op that could write into a tensor it was given."""
    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        for node in graph.nodes if isinstance(graph, fx.Graph) else ():
            if node.op == "call_function" and _may_write(node):
                return True
    return False


def _may_write(node: fx.Node) -> bool:
    target = node.target
    if target is operator.getitem or isinstance(target, CachedConstants):
        return False
    return not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable


def _constant_nodes(module: torch.nn.Module, graph: fx.Graph) -> list[fx.Node]:
    """The nodes, in graph order, whose values depend on no input and no parameter, and that can
    all run ahead of the rest of the graph.

    An op that writes into its input (T5's ``relative_buckets += ...``) joins them only if what
    it writes derives from no buffer (the region would write into it once instead of on every
    call) and no value of the region has been read outside it yet (that read must see the value
    from before the write). Once a node outside the region may write into a value derived from
    it (an in-place op, or a submodule whose graph holds one), nothing later joins: it would see
    the value from before that write."""
    constant: dict[fx.Node, None] = {}
    derived: set[fx.Node] = set()  # outside the region, computed from its values
    read_outside = False
    for node in graph.nodes:
        ok = False
        if node.op == "get_attr":
            value = module
            for part in node.target.split("."):
                value = getattr(value, part, None)
            ok = isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)
        elif (node.op == "call_function" and _deterministic_op(node.target)
              and all(n in constant for n in node.all_input_nodes)):
            ok = not _may_write(node) or (not read_outside and not any(
                a.op == "get_attr" for w in _written_args(node) for a in _ancestors(w) | {w}))
        if ok:
            constant[node] = None
            continue
        touched = [n for n in node.all_input_nodes if n in constant or n in derived]
        if not touched:
            continue
        read_outside = True
        derived.add(node)
        if node.op == "call_module":
            writes = _graph_may_write_inputs(module.get_submodule(node.target))
        elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            writes = any(w in constant or w in derived for w in _written_args(node))
        else:
            writes = node.op != "output" and _may_write(node)
        if writes:
            break
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
                node.target.clear()
                if retarget(node.target.region.graph):
                    node.target.region.recompile()
        return changed

    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        if isinstance(graph, fx.Graph) and retarget(graph) and hasattr(sub, "finalize"):
            sub.finalize()
    return module


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
