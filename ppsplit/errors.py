"""Errors that ppsplit reports to the user as one line: bad input (exit status 2), a check that
did not pass (1), and a run stopped by a signal or by SLURM."""

import difflib
import signal


class PpsplitError(ValueError):
    """Bad input: the message names the bad value and what is allowed."""


class CheckFailed(RuntimeError):
    """A check (FQN partition, numerics, a rank's run) did not pass: exit status 1."""


def nearest(name: str, candidates, n: int = 3) -> str:
    """A ' (did you mean ...?)' suffix naming the closest candidates, or ''."""
    close = difflib.get_close_matches(name, list(candidates), n=n, cutoff=0.5)
    return f" (did you mean {', '.join(close)}?)" if close else ""


class Interrupted(BaseException):
    """The driver got a signal asking it to stop (SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2);
    ``saved``: the checkpoint the ranks wrote on the way out (``checkpoint.every``)."""

    def __init__(self, signum: int, saved: str | None = None):
        super().__init__(signum)
        self.signum, self.saved = signum, saved

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class JobStopped(CheckFailed):
    """SLURM signalled the ranks' job (its time limit is near, or it is preempted): they saved
    at step ``step`` and ended. ``saved``: that checkpoint, once sealed."""

    def __init__(self, step: int, job: str, cancelled: bool = False):
        self.step, self.job, self.saved, self.cancelled = step, job, None, cancelled
        self.used_up = 0  # launcher.max_requeue, when every new job it allows was started
        why = "was cancelled (scancel)" if cancelled else \
            "was signalled by SLURM (its time limit, a preemption or a requeue)"
        super().__init__(f"{job} {why}; the ranks stopped at step {step}")

    def __str__(self) -> str:
        base = super().__str__()
        if self.used_up:
            base += (f"; launcher.max_requeue={self.used_up} new jobs were all used (a larger "
                     f"launcher.max_requeue or launcher.time_min goes further)")
        return f"{base}; checkpoint: {self.saved} (checkpoint.load=auto goes on from it)" if self.saved else base
