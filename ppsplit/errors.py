"""Errors that ppsplit reports to the user as one line (exit status 2 for bad input)."""

import difflib


class PpsplitError(ValueError):
    """Bad input: the message names the bad value and what is allowed."""


class CheckFailed(RuntimeError):
    """A check (FQN partition, numerics, a rank's run) did not pass: exit status 1."""


def nearest(name: str, candidates, n: int = 3) -> str:
    """A ' (did you mean ...?)' suffix naming the closest candidates, or ''."""
    close = difflib.get_close_matches(name, list(candidates), n=n, cutoff=0.5)
    return f" (did you mean {', '.join(close)}?)" if close else ""
