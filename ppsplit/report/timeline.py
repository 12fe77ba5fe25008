"""What the pipeline did, read on the driver from what each rank recorded
(:class:`ppsplit.train.recorder.Recorder`: every schedule action, timed).

The driver writes ``timeline.json`` in the run folder, Chrome's trace event format (Perfetto
and ``chrome://tracing`` open it): one process per rank, one track per stage, a track of the
steps and one of the send/receive waits; and ``timeline.png``, the median step as a Gantt chart
(:mod:`ppsplit.report.plot`). The bubble of a rank in a step is the share of the step its
stages were not computing (waiting on a peer, or idle); the report carries each rank's at the
median step, their mean, the share spent waiting on sends and receives, the per-stage forward
and backward times, and the bubble the schedule's own action lists imply
(:mod:`ppsplit.train.bubble`).
"""

from __future__ import annotations

import json
import os
import statistics

from ppsplit.train import bubble as schedule_bubble

WAIT_TID = 1000  # the trace's track of send/receive waits (after the stages' tracks)


def median_step(timelines: list[dict]) -> int | None:
    """The step whose slowest rank's duration is the median over the recorded steps."""
    by_step: dict[int, float] = {}
    for t in timelines:
        for step, start, end, _ in t["steps"]:
            by_step[step] = max(by_step.get(step, 0.0), end - start)
    if not by_step:
        return None
    middle = statistics.median_low(sorted(by_step.values()))
    return min(s for s, d in by_step.items() if d == middle)


def step_span(timelines: list[dict], step: int) -> tuple[float, float] | None:
    """The step from its first rank's start to the last rank's optimizer step (the pipeline part)."""
    spans = [(s, o or e) for t in timelines for k, s, e, o in t["steps"] if k == step]
    return (min(s for s, _ in spans), max(e for _, e in spans)) if spans else None


def shares(timelines: list[dict], step: int) -> tuple[dict[int, float], dict[int, float]]:
    """Each rank's idle share of ``step`` (1 - time in its stages' actions / the step's span) and
    the share of it spent waiting on sends and receives."""
    span = step_span(timelines, step)
    if span is None or span[1] <= span[0]:
        return {}, {}
    length = span[1] - span[0]
    idle, waiting = {}, {}
    for t in timelines:
        busy = sum(b - a for _, _, _, k, a, b in t["events"] if k == step)
        idle[t["rank"]] = max(0.0, 1.0 - busy / length)
        waiting[t["rank"]] = min(1.0, sum(b - a for _, k, a, b in t.get("waits", ()) if k == step) / length)
    return idle, waiting


def bubbles(timelines: list[dict], step: int) -> dict[int, float]:
    return shares(timelines, step)[0]


ACTIONS = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}


def stage_times(timelines: list[dict]) -> dict[int, dict[str, float]]:
    """Each stage's median duration (s) of each of its actions over the recorded steps (the first
    left out when there are more), pooled over the ranks that hold the stage; and under
    ``"compute"`` all its action time over its forwards: its compute per microbatch (DualPipeV
    runs some backwards whole and some in parts)."""
    steps = {k for t in timelines for k, *_ in t["steps"]}
    first = min(steps) if len(steps) > 1 else None
    pooled: dict[int, dict[str, list[float]]] = {}
    for t in timelines:
        for action, stage, _, step, start, end in t["events"]:
            if step != first:
                pooled.setdefault(stage, {}).setdefault(action, []).append(end - start)
    out = {}
    for stage, acts in sorted(pooled.items()):
        out[stage] = {a: statistics.median(v) for a, v in acts.items()}
        out[stage]["compute"] = sum(map(sum, acts.values())) / max(1, len(acts.get("forward", ())))
    return out


def stage_rows(timelines: list[dict], times: dict[int, dict[str, float]]) -> list[dict]:
    """The report's per-stage rows: action times in ms per microbatch, compute (all its actions
    for one microbatch), the activation bytes of one microbatch."""
    saved: dict[int, int] = {}
    holder: dict[int, int] = {}
    for t in timelines:
        for stage, n in (t.get("activation_bytes") or {}).items():
            saved.setdefault(int(stage), n)
        for _, stage, *_ in t["events"]:
            holder.setdefault(stage, t["rank"])
    rows = []
    for stage, acts in times.items():
        def ms(action):
            return None if action not in acts else acts[action] * 1e3
        rows.append({"stage": stage, "rank": holder.get(stage), "forward_ms": ms("forward"),
                     "backward_ms": ms("backward"), "backward_input_ms": ms("backward_input"),
                     "backward_weight_ms": ms("backward_weight"), "compute_ms": acts["compute"] * 1e3,
                     "activation_bytes": saved.get(stage)})
    return rows


def step_compute(timelines: list[dict], step: int) -> tuple[float, float]:
    """The median step's duration (its first start to its last end, optimizer included) and the
    time the ranks spent in actions in it, summed over the ranks (seconds)."""
    spans = [(s, e) for t in timelines for k, s, e, _ in t["steps"] if k == step]
    busy = sum(b - a for t in timelines for _, _, _, k, a, b in t["events"] if k == step)
    return max(e for _, e in spans) - min(s for s, _ in spans), busy


def action_lists(timelines: list[dict]) -> tuple[dict | None, str | None]:
    """The schedule's action lists per pipeline rank, and where they come from: the schedule's
    own ``pipeline_order``, or (where that is incomplete) the order the ranks took in the first
    recorded step."""
    order = next((t["order"] for t in timelines if t.get("order")), None)
    if order:
        return {int(r): [tuple(a) for a in actions] for r, actions in order.items()}, "pipeline_order"
    first = min((k for t in timelines for k, *_ in t["steps"]), default=None)
    lists = {}
    for t in timelines:
        if t.get("first_replica", True):
            ran = sorted((e for e in t["events"] if e[3] == first), key=lambda e: e[4])
            lists[t.get("pp_rank", t["rank"])] = [(stage, ACTIONS[a], mb) for a, stage, mb, *_ in ran]
    return (lists, "as run") if any(lists.values()) else (None, None)


def theory(timelines: list[dict], times: dict[int, dict[str, float]]) -> tuple[dict | None, dict | None, str | None]:
    """The schedule's bubble from its action lists: with unit costs, and with this run's stage
    times; and the lists' source."""
    lists, source = action_lists(timelines)
    if not lists:
        return None, None, None
    unit = schedule_bubble.simulate(lists)
    letters = {v: k for k, v in ACTIONS.items()}

    def measured(stage: int, kind: str) -> float:
        acts = times.get(stage, {})
        if kind == "B" and "backward" not in acts and "backward_input" in acts:
            return acts["backward_input"] + acts.get("backward_weight", 0.0)
        if letters[kind] in acts:
            return acts[letters[kind]]
        return schedule_bubble.UNIT_COSTS[kind] * acts.get("forward", 0.0)

    return unit, schedule_bubble.simulate(lists, measured) if times else None, source


def chrome_trace(timelines: list[dict]) -> dict:
    """Chrome trace events (``ph: X``, microseconds): a process per rank, a thread per stage,
    thread 0 for the steps and optimizer, thread 1000 for the send/receive waits."""
    events = []
    for t in timelines:
        rank = t["rank"]
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": "steps"}})
        for stage in sorted({e[1] for e in t["events"]}):
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": stage + 1,
                           "args": {"name": f"stage {stage}"}})
        if t.get("waits"):
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": WAIT_TID,
                           "args": {"name": "send/recv waits"}})
        for step, start, end, optimizer in t["steps"]:
            events.append({"name": f"step {step + 1}", "ph": "X", "pid": rank, "tid": 0, "ts": start * 1e6,
                           "dur": (end - start) * 1e6, "cat": "step"})
            if optimizer:
                events.append({"name": "optimizer", "ph": "X", "pid": rank, "tid": 0, "ts": optimizer * 1e6,
                               "dur": (end - optimizer) * 1e6, "cat": "optimizer"})
        for action, stage, mb, step, start, end in t["events"]:
            events.append({"name": f"{action} {mb}", "ph": "X", "pid": rank, "tid": stage + 1, "ts": start * 1e6,
                           "dur": (end - start) * 1e6, "cat": action,
                           "args": {"stage": stage, "microbatch": mb, "step": step + 1}})
        for kind, step, start, end in t.get("waits", ()):
            events.append({"name": f"wait {kind}", "ph": "X", "pid": rank, "tid": WAIT_TID, "ts": start * 1e6,
                           "dur": (end - start) * 1e6, "cat": "wait", "args": {"step": step + 1}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _write_whole(path: str, write) -> None:
    write(path + ".partial")
    os.replace(path + ".partial", path)


def write(run_dir: str, results: list[dict]) -> dict | None:
    """``timeline.json`` and ``timeline.png`` from the ranks' recordings; the report's ``run.timeline``."""
    timelines = [r["timeline"] for r in results if r.get("timeline")]
    if not timelines or not any(t["steps"] for t in timelines):
        return None

    def trace(path):
        with open(path, "w") as f:
            json.dump(chrome_trace(timelines), f)

    path = os.path.join(run_dir, "timeline.json")
    _write_whole(path, trace)
    step = median_step(timelines)
    idle, waiting = shares(timelines, step) if step is not None else ({}, {})
    times = stage_times(timelines)
    rows = stage_rows(timelines, times)
    unit, expected, source = theory(timelines, times)
    compute = [r["compute_ms"] for r in rows]
    out = {"file": path, "picture": None, "steps_recorded": max(len(t["steps"]) for t in timelines),
           "median_step": None if step is None else step + 1,
           "bubble": {str(r): v for r, v in sorted(idle.items())},
           "bubble_mean": sum(idle.values()) / len(idle) if idle else None,
           "wait": {str(r): v for r, v in sorted(waiting.items())},
           "wait_mean": sum(waiting.values()) / len(waiting) if waiting else None,
           "bubble_theory": unit["bubble_mean"] if unit else None,
           "bubble_theory_by_pp_rank": {str(r): v for r, v in sorted(unit["bubble"].items())} if unit else {},
           "bubble_theory_from": source,
           "bubble_expected": expected["bubble_mean"] if expected else None,
           "stages": rows,
           "step_ms": None, "compute_ms": None,
           "imbalance": max(compute) / (sum(compute) / len(compute)) if compute and sum(compute) > 0 else None}
    if step is not None:
        from ppsplit.report import plot as timeline_plot

        length, busy = step_compute(timelines, step)
        out["step_ms"], out["compute_ms"] = length * 1e3, busy * 1e3
        picture = os.path.join(run_dir, "timeline.png")
        _write_whole(picture, lambda p: timeline_plot.gantt(timelines, step, p, out))
        out["picture"] = picture
    return out
