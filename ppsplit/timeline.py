"""What the pipeline did, as it ran: every schedule action each rank took, timed.

On each rank the :class:`Recorder` wraps the ``PipelineStage`` objects' own entry points (the
schedules of ``torch.distributed.pipelining`` call ``forward_one_chunk``, ``backward_one_chunk``
and ``backward_weight_one_chunk`` on them), so forward, full backward, backward-input and
backward-weight are timed per stage and microbatch without touching torch's code. The schedules
wait on their sends and receives through one module function, ``_wait_batch_p2p``, and post them
through ``_batch_p2p``: a wrapper around each (delegating to torch's) times the waits and tells
sends from receives. The training loop marks each step's start and end, and the optimizer step.
Wall-clock times (``time.time``), so that the ranks' events line up in one picture. The first
forward of each stage also counts the bytes autograd saves for its backward (its activations
for one microbatch, the parameters left out).

The driver writes ``timeline.json`` in the run folder, Chrome's trace event format (Perfetto
and ``chrome://tracing`` open it): one process per rank, one track per stage, a track of the
steps and one of the send/receive waits; and ``timeline.png``, the median step as a Gantt chart
(:mod:`ppsplit.timeline_plot`). The bubble of a rank in a step is the share of the step its
stages were not computing (waiting on a peer, or idle); the report carries each rank's at the
median step, their mean, the share spent waiting on sends and receives, the per-stage forward
and backward times, and the bubble the schedule's own action lists imply
(:mod:`ppsplit.schedule_bubble`).
"""

from __future__ import annotations

import json
import os
import statistics
import time

from ppsplit import schedule_bubble

MAX_STEPS = 64  # the steps recorded (the first ones): enough for a median, bounded for long runs
WAIT_TID = 1000  # the trace's track of send/receive waits (after the stages' tracks)
_ACTIVE: list = [None]  # the recorder the wrapped p2p functions report to (one per rank process)


class Recorder:
    def __init__(self, rank: int, pp_rank: int = 0, first_replica: bool = True):
        self.rank, self.pp_rank, self.first_replica = rank, pp_rank, first_replica
        self.events: list[tuple] = []  # (action, stage, microbatch, step, start, end)
        self.waits: list[tuple] = []  # (what: "recv" / "send" / "send+recv", step, start, end)
        self.steps: list[tuple] = []  # (step, start, end, optimizer start)
        self.activation_bytes: dict[int, int] = {}  # stage -> bytes saved for backward, one microbatch
        self.order: dict | None = None  # the schedule's action lists (kept on rank 0, when complete)
        self.step: int | None = None
        self._started = 0.0
        self._optimizer = None
        self._work_kinds: dict[int, str] = {}
        _ACTIVE[0] = self
        _time_p2p_waits()

    @property
    def recording(self) -> bool:
        return self.step is not None and len(self.steps) < MAX_STEPS

    def wrap(self, pipe_stage, index: int) -> None:
        """Time this ``PipelineStage``'s actions (an instance attribute over the class's method)."""
        def timed(name, method, action):
            def run(chunk, *args, **kwargs):
                if not self.recording:
                    return method(chunk, *args, **kwargs)
                counting = name == "forward_one_chunk" and index not in self.activation_bytes
                start = time.time()
                try:
                    if counting:
                        with _SavedBytes() as saved:
                            return method(chunk, *args, **kwargs)
                    return method(chunk, *args, **kwargs)
                finally:
                    end = time.time()
                    if counting:
                        self.activation_bytes[index] = saved.total
                    label = action(kwargs) if callable(action) else action
                    self.events.append((label, index, int(chunk), self.step, start, end))
            setattr(pipe_stage, name, run)

        timed("forward_one_chunk", pipe_stage.forward_one_chunk, "forward")
        timed("backward_one_chunk", pipe_stage.backward_one_chunk,
              lambda kw: "backward" if kw.get("full_backward", True) else "backward_input")
        timed("backward_weight_one_chunk", pipe_stage.backward_weight_one_chunk, "backward_weight")

    def keep_order(self, schedule, stages: int, microbatches: int) -> None:
        """Keep the schedule's action lists (every pipeline rank's) for the theoretical bubble,
        when they are complete."""
        order = schedule_bubble.action_lists(schedule)
        if schedule_bubble.complete(order, stages, microbatches):
            self.order = {str(r): [list(a) for a in actions] for r, actions in order.items()}

    def step_begin(self, step: int) -> None:
        self.step, self._started, self._optimizer = step, time.time(), None

    def optimizer_begin(self) -> None:
        self._optimizer = time.time()

    def step_end(self) -> None:
        if self.recording:
            self.steps.append((self.step, self._started, time.time(), self._optimizer))
        self.step = None
        self._work_kinds.clear()

    def as_dict(self) -> dict:
        return {"rank": self.rank, "pp_rank": self.pp_rank, "first_replica": self.first_replica, "events": self.events, "waits": self.waits, "steps": self.steps,
                "activation_bytes": {str(k): v for k, v in self.activation_bytes.items()}, "order": self.order}


class _SavedBytes:
    """The bytes autograd saves for backward while in this context, each storage once, leaving
    out parameters (and views of them: a linear layer saves its weight, transposed)."""

    def __init__(self):
        import torch

        self.total, self._seen = 0, set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        try:
            base = t._base if t._base is not None else t
            if not (base.is_leaf and base.requires_grad):
                local = getattr(t, "_local_tensor", t)  # a DTensor's own shard
                storage = local.untyped_storage()
                if storage.data_ptr() not in self._seen:
                    self._seen.add(storage.data_ptr())
                    self.total += storage.nbytes()
        except (RuntimeError, AttributeError, NotImplementedError):
            pass  # a tensor without a storage of its own (a subclass): not counted
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


def _time_p2p_waits() -> None:
    """Wrap the schedules' ``_batch_p2p`` (tag each work as a send or a receive) and
    ``_wait_batch_p2p`` (time the wait), once per process; both delegate to torch's own."""
    import importlib

    from ppsplit.torch_private import P2P_FUNCTIONS

    module, post_name, wait_name = P2P_FUNCTIONS
    schedules = importlib.import_module(module)
    if getattr(getattr(schedules, wait_name), "ppsplit_timed", False):
        return
    post, wait = getattr(schedules, post_name), getattr(schedules, wait_name)

    def tagged(p2p_ops, *args, **kwargs):
        works = post(p2p_ops, *args, **kwargs)
        rec = _ACTIVE[0]
        if rec is not None and rec.recording:
            names = {getattr(op.op, "__name__", "") for op in p2p_ops}
            kind = "send" if names == {"isend"} else "recv" if names == {"irecv"} else "send+recv"
            for w in works:
                rec._work_kinds[id(w)] = kind
        return works

    def timed(works):
        rec = _ACTIVE[0]
        if rec is None or not rec.recording or not works:
            return wait(works)
        start = time.time()
        try:
            return wait(works)
        finally:
            kinds = {rec._work_kinds.pop(id(w), "send+recv") for w in works}
            kind = kinds.pop() if len(kinds) == 1 else "send+recv"
            rec.waits.append((kind, rec.step, start, time.time()))

    timed.ppsplit_timed, timed.original = True, wait
    setattr(schedules, post_name, tagged)
    setattr(schedules, wait_name, timed)


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
        from ppsplit import timeline_plot

        length, busy = step_compute(timelines, step)
        out["step_ms"], out["compute_ms"] = length * 1e3, busy * 1e3
        picture = os.path.join(run_dir, "timeline.png")
        _write_whole(picture, lambda p: timeline_plot.gantt(timelines, step, p, out))
        out["picture"] = picture
    return out
