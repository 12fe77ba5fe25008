"""How stage modules execute.

``torch.export.unflatten`` builds ``InterpreterModule``s that run their fx graph node by node
through ``torch.fx.Interpreter`` (about 7 us a node). Each also carries generated Python code for
the same graph; running that instead costs nothing per node and gives identical numerics. torch
exposes the choice only through the private per-instance flag ``_run_with_interpreter`` (the
module-wide default is ``torch.export.unflatten.RUN_WITH_INTERPRETER``). This is the one place
ppsplit touches it; ``tests/test_stage_code.py`` fails if torch renames or drops it.
"""

import torch

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
        if hasattr(sub, "finalize"):
            # unflatten redirects repeated calls (``dropout@1``) after it generated code;
            # generate it again from the final graph.
            sub.finalize()
        setattr(sub, _FLAG, False)
    return module


def retarget_devices(module: torch.nn.Module, device) -> torch.nn.Module:
    """Rewrite every device baked into the stage's graphs (a trace on meta records
    ``device=meta`` in ``arange``/``full``/``to``...) to ``device``, whether the op took it as a
    keyword or positionally (LLaMA's rotary ``aten.to.device(inv_freq, meta, ...)``)."""
    device = torch.device(device)

    def swap(value):
        return device if isinstance(value, torch.device) and value.type == "meta" else value

    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        changed = False
        for node in graph.nodes:
            args = torch.fx.node.map_aggregate(node.args, swap)
            kwargs = torch.fx.node.map_aggregate(node.kwargs, swap)
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs, changed = args, kwargs, True
        if changed and hasattr(sub, "finalize"):
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
