"""What the pipeline did, as it ran: every schedule action each rank took, timed.

On each rank the :class:`Recorder` wraps the ``PipelineStage`` objects' own entry points (the
schedules of ``torch.distributed.pipelining`` call ``forward_one_chunk``, ``backward_one_chunk``
and ``backward_weight_one_chunk`` on them), so forward, full backward, backward-input and
backward-weight are timed per stage and microbatch without touching torch's code; the training
loop marks each step's start and end, and the optimizer step. Wall-clock times
(``time.time``), so that the ranks' events line up in one picture.

The driver writes ``timeline.json`` in the run folder, Chrome's trace event format (Perfetto
and ``chrome://tracing`` open it): one process per rank, one track per stage, plus a track of
the steps. The bubble of a rank in a step is the share of the step its stages were not
computing (waiting on a peer, or idle); the report carries each rank's at the median step and
their mean.
"""

from __future__ import annotations

import json
import os
import statistics
import time

MAX_STEPS = 64  # the steps recorded (the first ones): enough for a median, bounded for long runs


class Recorder:
    def __init__(self, rank: int):
        self.rank = rank
        self.events: list[tuple] = []  # (action, stage, microbatch, step, start, end)
        self.steps: list[tuple] = []  # (step, start, end, optimizer start)
        self.step: int | None = None
        self._started = 0.0
        self._optimizer = None

    @property
    def recording(self) -> bool:
        return self.step is not None and len(self.steps) < MAX_STEPS

    def wrap(self, pipe_stage, index: int) -> None:
        """Time this ``PipelineStage``'s actions (an instance attribute over the class's method)."""
        def timed(name, method, action):
            def run(chunk, *args, **kwargs):
                if not self.recording:
                    return method(chunk, *args, **kwargs)
                start = time.time()
                try:
                    return method(chunk, *args, **kwargs)
                finally:
                    label = action(kwargs) if callable(action) else action
                    self.events.append((label, index, int(chunk), self.step, start, time.time()))
            setattr(pipe_stage, name, run)

        timed("forward_one_chunk", pipe_stage.forward_one_chunk, "forward")
        timed("backward_one_chunk", pipe_stage.backward_one_chunk,
              lambda kw: "backward" if kw.get("full_backward", True) else "backward_input")
        timed("backward_weight_one_chunk", pipe_stage.backward_weight_one_chunk, "backward_weight")

    def step_begin(self, step: int) -> None:
        self.step, self._started, self._optimizer = step, time.time(), None

    def optimizer_begin(self) -> None:
        self._optimizer = time.time()

    def step_end(self) -> None:
        if self.recording:
            self.steps.append((self.step, self._started, time.time(), self._optimizer))
        self.step = None

    def as_dict(self) -> dict:
        return {"rank": self.rank, "events": self.events, "steps": self.steps}


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


def bubbles(timelines: list[dict], step: int) -> dict[int, float]:
    """Each rank's idle share of ``step``: 1 - (time in its stages' actions) / (the step's time,
    from its start to the optimizer step on the slowest rank)."""
    spans = {t["rank"]: next(((s, o or e) for k, s, e, o in t["steps"] if k == step), None) for t in timelines}
    starts = [s for s in spans.values() if s]
    if not starts:
        return {}
    begin, end = min(s for s, _ in starts), max(e for _, e in starts)
    out = {}
    for t in timelines:
        busy = sum(b - a for _, _, _, k, a, b in t["events"] if k == step)
        out[t["rank"]] = max(0.0, 1.0 - busy / (end - begin)) if end > begin else 0.0
    return out


def chrome_trace(timelines: list[dict]) -> dict:
    """Chrome trace events (``ph: X``, microseconds): a process per rank, a thread per stage
    (and thread 0 for the steps and optimizer)."""
    events = []
    for t in timelines:
        rank = t["rank"]
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": "steps"}})
        for stage in sorted({e[1] for e in t["events"]}):
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": stage + 1,
                           "args": {"name": f"stage {stage}"}})
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
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write(run_dir: str, results: list[dict]) -> dict | None:
    """``timeline.json`` from the ranks' recordings; the report's ``run.timeline``."""
    timelines = [r["timeline"] for r in results if r.get("timeline")]
    if not timelines or not any(t["steps"] for t in timelines):
        return None
    path = os.path.join(run_dir, "timeline.json")
    with open(path + ".partial", "w") as f:
        json.dump(chrome_trace(timelines), f)
    os.replace(path + ".partial", path)
    step = median_step(timelines)
    shares = bubbles(timelines, step) if step is not None else {}
    return {"file": path, "steps_recorded": max(len(t["steps"]) for t in timelines),
            "median_step": None if step is None else step + 1,
            "bubble": {str(r): v for r, v in sorted(shares.items())},
            "bubble_mean": sum(shares.values()) / len(shares) if shares else None}
