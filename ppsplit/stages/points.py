"""Where stages begin: the model's repeated blocks in the order they run, and split points.

A point is a module FQN (a stage begins at its first operation), ``MODULE:end`` (right after
its last), the K-th call of a module that runs several times (``FQN@K``), or the K-th
``torch.distributed.pipelining.pipe_split()`` call in forward (``pipe_split:K``). Positions are
indices into the traced graph's nodes.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.export import ExportedProgram

from ppsplit.errors import PpsplitError, nearest


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
    end = module_end(program, blocks[-1]) - 1
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


MARKER = "pipe_split"  # points "pipe_split:K": the K-th pipe_split() call in forward
END = ":end"  # a point "MODULE:end" begins a stage right after MODULE (torch's SplitPoint.END)


def markers(program: ExportedProgram) -> list[int]:
    """Graph positions of the ``torch.distributed.pipelining.pipe_split()`` calls in forward."""
    target = getattr(getattr(getattr(torch.ops, "pippy", None), "_pipe_split", None), "default", None)
    return [i for i, node in enumerate(program.graph.nodes)
            if node.op == "call_function" and target is not None and node.target is target]


def module_end(program: ExportedProgram, module: str) -> int:
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


def point_positions(
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
        positions.append(module_end(program, module) if module != point else run_order[module])
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


