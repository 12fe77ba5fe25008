"""What the pipeline did, as it ran, recorded on each rank: every schedule action timed.

The :class:`Recorder` wraps the ``PipelineStage`` objects' own entry points (the schedules of
``torch.distributed.pipelining`` call ``forward_one_chunk``, ``backward_one_chunk`` and
``backward_weight_one_chunk`` on them), so forward, full backward, backward-input and
backward-weight are timed per stage and microbatch without touching torch's code. The schedules
wait on their sends and receives through one module function, ``_wait_batch_p2p``, and post them
through ``_batch_p2p``: a wrapper around each (delegating to torch's) times the waits and tells
sends from receives. The training loop marks each step's start and end, and the optimizer step.
Wall-clock times (``time.time``), so that the ranks' events line up in one picture. The first
forward of each stage also counts the bytes autograd saves for its backward (its activations
for one microbatch, the parameters left out). The driver reads what it recorded
(:mod:`ppsplit.report.timeline`)."""

from __future__ import annotations

import time

from ppsplit.train import bubble as schedule_bubble


MAX_STEPS = 64  # the steps recorded (the first ones): enough for a median, bounded for long runs


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
