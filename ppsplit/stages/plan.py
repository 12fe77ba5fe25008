"""Choose where stages begin: by block counts, or balanced by parameters or FLOPs.

The candidate cut points are the starts of the model's repeated blocks and, for ``params`` and
``flops``, the first module after the last block (``stages.points.unit_starts``). The graph between
two cut points is one *unit*; the first unit also carries what runs before the first block
(embeddings, masks, rotary tables) and the last is the final norm, the head and the loss (or,
for ``even`` and ``layers``, the last block with them). A strategy's stages are contiguous
runs of units, and ``params``/``flops`` pick the runs that minimise the largest stage's cost: an
exact linear-partition dynamic programme, not a greedy fill.
"""

from __future__ import annotations

import bisect
import math
import operator
from functools import reduce
from typing import Sequence

import torch
from torch.export.graph_signature import InputKind

from ppsplit.errors import PpsplitError

STRATEGIES = ("even", "manual", "layers", "params", "flops")
# Cross-entropy over the logits is not a graph op (the loss runs outside the stages); count it
# as a few FLOPs per logit (max, exp, sum, log forward; softmax minus one-hot backward).
LOSS_FLOPS_PER_LOGIT = 6
# Backward of a matmul computes two products of the forward's size (input and weight grads).
BACKWARD_FACTOR = 2


def _int(size) -> int:
    """A size as an int; of a size that varies (a dynamic trace's), its traced value. (``int()``
    of it would instead specialise the trace to that value.)"""
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


def _numel(shape) -> int:
    return int(reduce(operator.mul, [_int(s) for s in shape], 1))


def _val(x):
    return x.meta.get("val") if isinstance(x, torch.fx.Node) else x


def node_forward_flops(node: torch.fx.Node) -> int:
    """Forward FLOPs of one graph op: matmul-class ops counted exactly from their shapes; other
    ops (elementwise, norms, gathers) are memory-bound and count as zero. After a dynamic trace
    the sizes are the example's."""
    if node.op != "call_function":
        return 0
    name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    args = [_val(a) for a in node.args]
    out = node.meta.get("val")
    try:
        if name in ("linear", "matmul", "mm", "bmm") and isinstance(out, torch.Tensor):
            return 2 * _numel(out.shape) * _int(args[0].shape[-1])
        if name in ("addmm", "baddbmm") and isinstance(out, torch.Tensor):
            return 2 * _numel(out.shape) * _int(args[1].shape[-1])
        if name == "scaled_dot_product_attention":
            q, k, v = args[:3]
            lq, lk = _int(q.shape[-2]), _int(k.shape[-2])
            batch_heads = _numel(q.shape[:-2])
            return 2 * batch_heads * lq * lk * (_int(q.shape[-1]) + _int(v.shape[-1]))
    except (AttributeError, IndexError, TypeError):
        return 0
    return 0


def _flops_from(program, starts: Sequence[int], microbatches: int) -> list[float]:
    """Forward+backward FLOPs of the graph's ranges that begin at node indices ``starts``
    (the first at 0), times ``microbatches``; the loss counts in the last range."""
    flops = [0.0] * len(starts)
    for i, node in enumerate(program.graph.nodes):
        if node.op == "call_function":
            flops[bisect.bisect_right(starts, i) - 1] += node_forward_flops(node) * (1 + BACKWARD_FACTOR)
    flops[-1] += LOSS_FLOPS_PER_LOGIT * _logits_numel(program)
    return [f * microbatches for f in flops]


def unit_costs(model, program, blocks: Sequence[str], run_order: dict[str, int],
               microbatches: int = 1) -> dict[str, list[float]]:
    """Per unit (one per cut point in ``blocks``, the first also taking what runs before it):
    ``params`` (distinct parameters its ops read; a tied tensor counts in every unit that reads
    it) and ``flops`` (forward + backward at the traced microbatch, times ``microbatches``; the
    loss counted in the last unit)."""
    starts = [0] + [run_order[b] for b in blocks[1:]]
    named = dict(model.named_parameters(remove_duplicate=False))
    target = {s.arg.name: s.target for s in program.graph_signature.input_specs
              if s.kind == InputKind.PARAMETER}
    params: list[dict[int, int]] = [{} for _ in starts]
    for i, node in enumerate(program.graph.nodes):
        if node.op != "call_function":
            continue
        unit = bisect.bisect_right(starts, i) - 1
        for arg in node.all_input_nodes:
            fqn = target.get(arg.name)
            if fqn is not None and fqn in named:
                params[unit][id(named[fqn])] = named[fqn].numel()
    return {"params": [float(sum(p.values())) for p in params],
            "flops": _flops_from(program, starts, microbatches)}


def _logits_numel(program) -> int:
    out = list(program.graph.nodes)[-1].args[0]
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    val = _val(first)
    return _numel(val.shape) if isinstance(val, torch.Tensor) else 0


def linear_partition(costs: Sequence[float], parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous non-empty groups of ``costs`` minimising the largest sum.

    Exact dynamic programme, O(parts * n^2). Among the partitions that reach that minimum, the
    one with the smallest sum of squared stage costs is taken (the most even), earlier stages
    taking the larger share on a tie."""
    n = len(costs)
    if not 1 <= parts <= n:
        raise PpsplitError(f"stages={parts}: must be between 1 and the {n} blocks")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def solve(score, limit):
        best = [[math.inf] * (n + 1) for _ in range(parts + 1)]
        cut = [[0] * (n + 1) for _ in range(parts + 1)]
        best[0][0] = 0.0
        for k in range(1, parts + 1):
            for j in range(k, n - (parts - k) + 1):
                for i in range(k - 1, j):
                    part = prefix[j] - prefix[i]
                    if part > limit or best[k - 1][i] == math.inf:
                        continue
                    value = score(best[k - 1][i], part)
                    if value <= best[k][j] + 1e-12 * max(1.0, abs(value)):
                        best[k][j], cut[k][j] = value, i
        return best[parts][n], cut

    largest, _ = solve(max, math.inf)
    _, cut = solve(lambda acc, part: acc + part * part, largest * (1 + 1e-12) + 1e-12)
    sizes, j = [], n
    for k in range(parts, 0, -1):
        i = cut[k][j]
        sizes.append(j - i)
        j = i
    return sizes[::-1]


def points_from_sizes(blocks: Sequence[str], sizes: Sequence[int]) -> list[str]:
    starts = [sum(sizes[:i]) for i in range(1, len(sizes))]
    return [blocks[i] for i in starts]


def layer_sizes(n_blocks: int, stages: int | None, layers: Sequence[int] | None,
                first_stage_less: int = 0, last_stage_less: int = 0) -> list[int]:
    """Blocks per stage: explicit ``layers``, or an even split in which the first and last
    stages take ``first_stage_less`` / ``last_stage_less`` fewer blocks (they also run the
    embedding and the head)."""
    if layers:
        sizes = [int(x) for x in layers]
        if any(s < 1 for s in sizes) or sum(sizes) != n_blocks:
            raise PpsplitError(
                f"split.layers={list(sizes)}: needs positive counts that add up to the model's "
                f"{n_blocks} blocks"
            )
        return sizes
    if stages is None or stages < 1:
        raise PpsplitError(f"stages={stages}: must be at least 1")
    if first_stage_less < 0 or last_stage_less < 0:
        raise PpsplitError("split.first_stage_less and split.last_stage_less must be >= 0")
    if stages > n_blocks:
        raise PpsplitError(f"stages={stages}: more stages than the model's {n_blocks} blocks")
    # The ends weigh as (1 + less) blocks each, as torchtitan counts the embedding and the head
    # as layers; the balanced partition of those weights gives the block counts.
    weights = [1.0] * n_blocks
    weights[0] += first_stage_less
    weights[-1] += last_stage_less
    return linear_partition(weights, stages)


def stage_costs(split, microbatches: int = 1) -> dict[str, list[float]]:
    """Each stage's parameters (distinct tensors it holds) and forward+backward FLOPs."""
    return {"params": [float(sum(p.numel() for p in stage.parameters())) for stage in split.stages],
            "flops": _flops_from(split.program, [0, *split.positions], microbatches)}


def balance(costs: Sequence[float]) -> float:
    """max/mean: 1.0 is perfectly balanced; the pipeline runs at the pace of the max."""
    mean = sum(costs) / len(costs) if costs else 0.0
    return max(costs) / mean if mean else 1.0
