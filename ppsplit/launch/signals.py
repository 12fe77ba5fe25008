"""Stop signals in the driver. SIGINT, SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 end a run within a
bound: at once (the ranks stopped, :class:`Interrupted` raised in the main thread) or, while
ranks train under ``checkpoint.every``, once they have saved at their next step boundary. A
watchdog armed by the first signal ends the process whatever its main thread does."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

from ppsplit.errors import Interrupted


STOP_GRACE_S = 1.5  # after a stop signal the driver ends this long later, whatever it is doing
STOP_SAVE_S = 120.0  # ... or this long, when the ranks save a checkpoint first (checkpoint.every)
ACTIVE: set = set()  # the Ranks of the runs under way in this process
_STOPPING = threading.Event()
_SAID = threading.Lock()
_said = False


def say_interrupted(signum: int, saved: str | None = None) -> None:
    """The one line a stopped driver prints (once, whoever gets there first); ``saved``: the
    checkpoint the ranks wrote on the way out."""
    global _said
    import sys

    with _SAID:
        if not _said:
            _said = True
            where = f"; checkpoint: {saved} (checkpoint.load=auto goes on from it)" if saved else ""
            print(f"ppsplit: interrupted by {signal.Signals(signum).name}{where}; no rank is left running",
                  file=sys.stderr, flush=True)


def install_signal_handlers() -> dict:
    """SIGINT, SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 raise :class:`Interrupted` in the main
    thread; returns the previous handlers. The first stop signal
    also arms a watchdog: if the driver has not ended :data:`STOP_GRACE_S` later (a long native
    call that keeps the handler from running, a slow exit), it kills the ranks and ends the
    process itself. Later stop signals change nothing."""
    def interrupted(signum, frame):
        if _STOPPING.is_set():
            return
        _STOPPING.set()
        saving = [r for r in list(ACTIVE) if r.can_save_on_stop()]
        for ranks in saving:
            ranks.request_stop(signum)
        threading.Thread(target=_watchdog, args=(signum, STOP_SAVE_S if saving else STOP_GRACE_S),
                         name="ppsplit-stop", daemon=True).start()
        if not saving:
            raise Interrupted(signum)

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        previous[sig] = signal.signal(sig, interrupted)
    return previous


def _watchdog(signum: int, grace_s: float) -> None:
    time.sleep(grace_s)
    for ranks in list(ACTIVE):
        with contextlib.suppress(Exception):
            ranks.kill_now()
    say_interrupted(signum)
    os._exit(128 + signum)


def restore_signal_handlers(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
