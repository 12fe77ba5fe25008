"""What the ``debug.*`` keys inject, so that tests can prove how ppsplit fails: a rank that
crashes, dies or hangs at a step, a rank with a defect the comparison must catch, and a driver
that pauses in a phase (to be signalled there).

The one seam: a rank asks its :class:`Faults` at fixed points (its stages built, a batch drawn,
gradients about to be synchronised, a step begun); the driver calls :func:`pause` at each phase.
With no ``debug.*`` key set, each answer is "as it was", and nothing else in the run branches
on them."""

from __future__ import annotations

import os
import sys
import time

DRIVER_PHASES = ("build", "trace", "check", "train", "save", "report", "summary")
PAUSE_MODES = ("sleep", "stuck")
# Defects a rank can be made to have, to prove that the comparison with the unsplit model fails:
# a tied copy's gradient never summed, the last stage's gradients dropped, microbatch 1 replaced
# by microbatch 0 (one processed twice), one weight changed by 1e-3 after the split, each
# microbatch's loss its own mean (a mean of means, not the whole batch's: ppsplit.train.objective).
DEFECTS = ("unsynced_tie", "dropped_stage_grad", "repeated_microbatch", "perturbed_weight", "mean_of_means")


class InjectedBaseException(BaseException):
    """``debug.crash_mode=base``: an error that is not an ``Exception`` (as torch's
    ``CheckpointException`` is not)."""


def inject_crash(mode: str, rank: int, step: int) -> None:
    if mode == "exit":
        os._exit(3)  # a rank that dies without a word
    if mode == "abort":  # a native failure: says why on stderr, then SIGABRT (as std::terminate does)
        print(f"injected native abort on rank {rank} at step {step}", file=sys.stderr, flush=True)
        os.abort()
    if mode == "hang":
        time.sleep(24 * 3600)  # a rank that never answers
    if mode == "base":
        raise InjectedBaseException(f"injected BaseException on rank {rank} at step {step}")
    raise RuntimeError(f"injected crash on rank {rank} at step {step}")


def pause(phase: str, at: str | None, mode: str = "sleep") -> None:
    """``debug.pause_at=PHASE``: the driver says so and waits in that phase. ``sleep`` waits as
    Python code does (a signal's handler runs at once); ``stuck`` also swallows what the handler
    raises, as a long call into native code would keep it from running: only the driver's
    watchdog then ends the process."""
    if at != phase:
        return
    print(f"debug: pausing at {phase}", file=sys.stderr, flush=True)
    end = time.monotonic() + 3600
    while time.monotonic() < end:
        try:
            time.sleep(end - time.monotonic())
        except BaseException:
            if mode != "stuck":
                raise


def repeat_first_microbatch(batch, microbatches: int):
    """The batch with its second microbatch replaced by its first."""
    import torch

    def repeat(t):
        if not isinstance(t, torch.Tensor) or microbatches < 2:
            return t
        parts = list(torch.tensor_split(t, microbatches))
        parts[1] = parts[0]
        return torch.cat(parts)

    return type(batch)(tuple(repeat(a) for a in batch.args), {k: repeat(v) for k, v in batch.kwargs.items()},
                 repeat(batch.labels))


def perturb_one_weight(stage, tied: set[str]) -> str:
    """Add 1e-3 to one entry of the stage's first matrix that is not tied; returns its FQN."""
    import torch

    for name, p in stage.named_parameters():
        if p.dim() == 2 and name not in tied:
            with torch.no_grad():
                local = p.to_local() if hasattr(p, "to_local") else p
                local.view(-1)[0] += 1e-3
            return name
    raise RuntimeError("no untied matrix to perturb in this stage")


class Faults:
    """What a rank injects, from ``debug.*`` (a ``DebugSpec``): every answer is "unchanged" when
    no key is set."""

    def __init__(self, debug, rank: int, microbatches: int, pieces: int):
        self.debug, self.rank, self.microbatches, self._pieces = debug, rank, microbatches, pieces

    def loss_pieces(self) -> int | None:
        """``mean_of_means``: each microbatch's own mean, over this many pieces (else None)."""
        return self._pieces if self.debug.defect == "mean_of_means" else None

    def stages_built(self, modules: dict, tied: set[str]) -> None:
        if self.debug.defect == "perturbed_weight" and 0 in modules:
            perturb_one_weight(modules[0], tied)

    def batch(self, batch):
        if self.debug.defect == "repeated_microbatch":
            return repeat_first_microbatch(batch, self.microbatches)
        return batch

    def synchronise_ties(self, modules: dict, last_stage: int, sum_grads) -> None:
        """Sum the ties' gradients (``sum_grads``), unless a defect drops them or the last
        stage's."""
        if self.debug.defect == "dropped_stage_grad" and last_stage in modules:
            modules[last_stage].zero_grad(set_to_none=False)
        if self.debug.defect != "unsynced_tie":
            sum_grads()

    def step_begins(self, step: int) -> None:
        if self.debug.crash_rank == self.rank and self.debug.crash_step == step:
            inject_crash(self.debug.crash_mode, self.rank, step)
