"""The bubble a pipeline schedule implies, from the schedule's own action lists.

Every schedule of ``torch.distributed.pipelining`` carries ``pipeline_order``: for each pipeline
rank, the compute actions it takes in order (forward ``F``, full backward ``B``, backward-input
``I``, backward-weight ``W``, and DualPipeV's overlapped pairs). :func:`simulate` plays those
lists out with the pipeline's dependencies (a forward after the previous stage's forward of the
same microbatch; a backward after this stage's forward and the next stage's backward), each
rank taking its actions in its order, communication free, and gives each rank's idle share of
the makespan. No formula per schedule: the same play-out covers all seven. Where a schedule's
plan is incomplete (:func:`complete`), the order its ranks actually took is played out instead.

With unit costs (``F = I = W = 1``, ``B = I + W = 2``) it is the schedule's theoretical bubble
for its stage and microbatch counts (1F1B on p ranks with m microbatches: (p-1)/(m+p-1)); with
this run's measured per-stage times it is the bubble to expect were sends and overheads free.
"""

from __future__ import annotations

from typing import Callable

UNIT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
COMPUTE = tuple(UNIT_COSTS)

Order = dict[int, list[tuple[int, str, int]]]  # pipeline rank -> (stage, kind, microbatch) in order


def action_lists(schedule) -> Order:
    """``schedule.pipeline_order`` as plain (stage, kind, microbatch) lists: idle slots,
    communication and gradient-reduction actions left out, overlapped pairs taken apart."""
    out: Order = {}
    for rank, actions in (getattr(schedule, "pipeline_order", None) or {}).items():
        flat: list[tuple[int, str, int]] = []
        for action in actions:
            for a in (action.sub_actions or (action,)) if action is not None else ():
                kind = getattr(a.computation_type, "value", str(a.computation_type))
                if kind in COMPUTE and a.microbatch_index is not None:
                    flat.append((int(a.stage_index), kind, int(a.microbatch_index)))
        out[int(rank)] = flat
    return out


def complete(order: Order, stages: int, microbatches: int) -> bool:
    """Whether every stage has each microbatch's forward and its backward (whole, or input and
    weight parts) exactly once. Torch 2.13's ``Schedule1F1B.pipeline_order`` is not: on the
    last rank it skips microbatch 0's forward (its runtime code runs it; the plan is off)."""
    seen: dict[tuple[int, int], list[str]] = {}
    for actions in order.values():
        for stage, kind, mb in actions:
            seen.setdefault((stage, mb), []).append(kind)
    want = {(s, mb) for s in range(stages) for mb in range(microbatches)}
    return set(seen) == want and all(sorted(k) in (["B", "F"], ["F", "I", "W"]) for k in seen.values())


def simulate(order: Order, cost: Callable[[int, str], float] | None = None) -> dict:
    """Play ``order`` out; ``cost(stage, kind)`` each action's duration (unit costs by default).

    Returns ``{"bubble": {rank: idle share}, "bubble_mean": ..., "makespan": ...}``; raises
    ValueError when the lists cannot all run (an action waiting on one that never comes)."""
    cost = cost or (lambda _stage, kind: UNIT_COSTS[kind])
    stages = {s for actions in order.values() for s, _, _ in actions}
    last = max(stages, default=0)
    done: dict[tuple[str, int, int], float] = {}
    clock = {r: 0.0 for r in order}
    busy = {r: 0.0 for r in order}
    at = {r: 0 for r in order}

    def ready(stage: int, kind: str, mb: int) -> float | None:
        """When the action's inputs exist; None while they do not yet."""
        needs: list[float | None] = []
        if kind == "F":
            if stage > 0:
                needs.append(done.get(("F", stage - 1, mb)))
        elif kind in ("B", "I"):
            needs.append(done.get(("F", stage, mb)))
            if stage < last:
                needs.append(done.get(("B", stage + 1, mb), done.get(("I", stage + 1, mb))))
        else:  # W
            needs.append(done.get(("I", stage, mb)))
        return None if any(n is None for n in needs) else max(needs, default=0.0)

    remaining = sum(len(a) for a in order.values())
    while remaining:
        moved = False
        for rank, actions in order.items():
            while at[rank] < len(actions):
                stage, kind, mb = actions[at[rank]]
                start = ready(stage, kind, mb)
                if start is None:
                    break
                took = cost(stage, kind)
                clock[rank] = max(clock[rank], start) + took
                busy[rank] += took
                done[(kind, stage, mb)] = clock[rank]
                at[rank] += 1
                remaining -= 1
                moved = True
        if not moved:
            stuck = {r: a[at[r]] for r, a in order.items() if at[r] < len(a)}
            raise ValueError(f"the schedule's action lists cannot all run: waiting at {stuck}")
    makespan = max(clock.values(), default=0.0)
    shares = {r: (1.0 - busy[r] / makespan) if makespan > 0 else 0.0 for r in order}
    return {"bubble": shares, "bubble_mean": sum(shares.values()) / len(shares) if shares else None,
            "makespan": makespan}
