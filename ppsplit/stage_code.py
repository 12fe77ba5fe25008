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
