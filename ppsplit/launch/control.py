"""The channel between the driver and its ranks: one TCPStore that the driver hosts.

The ranks rendezvous on it (``init_process_group`` gets it as its store, under a prefix of
this run's own), so a port is never shared between runs: the driver binds the port itself and
holds it until it exits, and a ``MASTER_PORT`` in the environment is never read. Over the same
store each rank publishes, twice a second, a heartbeat (its phase, its step, the last loss,
where its main thread is and whether it is blocked on a peer), its own error when it fails
(no disk needed: a full disk cannot hide it), and that it is done. The rank watches the
channel in turn: when the driver is gone (its store stops answering) or asks the ranks to
stop, the rank ends itself at once, so no rank outlives its driver by more than
:data:`DRIVER_LOST_S` seconds, locally or on SLURM.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import threading
import traceback
from datetime import timedelta

BEAT_S = 0.5  # a rank publishes its heartbeat this often
DRIVER_LOST_S = 10.0  # a rank whose driver has not answered for this long ends itself
RANK_LOST_S = 5.0  # the driver declares a rank lost after this long without a heartbeat
EXIT_DRIVER_GONE = 75  # a rank's exit status when it ended because its driver was gone
EXIT_ABORTED = 76  # ... because the driver told it to stop
RECENT_LOSSES = 16  # a heartbeat carries the losses of this many last steps, and every one not yet recorded
MAX_UNRECORDED = 4096  # ... up to this many (a driver that far behind gets the rest with the results)


def _store(host: str, port: int, master_fd: int | None = None, timeout_s: float = DRIVER_LOST_S):
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=master_fd is not None, master_listen_fd=master_fd,
                         wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


class DriverChannel:
    """The driver's end: hosts the store on ``host``:``port`` (0: a free port chosen by the
    system), reads the ranks' heartbeats, errors and results."""

    def __init__(self, host: str, port: int | None, token: str):
        self.token = token
        try:
            self._socket = socket.create_server((host, port or 0))
        except OSError as err:
            from ppsplit.errors import PpsplitError

            raise PpsplitError(f"launcher.port={port}: cannot listen on {host}:{port} ({os.strerror(err.errno) if err.errno else err}); "
                               "allowed: a free port, or null to let ppsplit choose one") from None
        self.host, self.port = host, self._socket.getsockname()[1]
        self.store = _store(host, self.port, master_fd=self._socket.fileno())
        # Whatever reaches the port from outside is the store's business: it drops a malformed
        # message, and its warning (a stack of C++ frames) stays off the user's console.
        from ppsplit.torch_private import native_log_level

        self._warnings_were = native_log_level(ERROR_LEVEL)

    def _key(self, kind: str, rank: int | None = None) -> str:
        return f"{self.token}/ctl/{kind}" + ("" if rank is None else f"/{rank}")

    def _read(self, kind: str, rank: int):
        key = self._key(kind, rank)
        if not self.store.check([key]):
            return None
        return self.store.get(key).decode()

    def heartbeat(self, rank: int) -> dict | None:
        raw = self._read("beat", rank)
        return None if raw is None else json.loads(raw)

    def error(self, rank: int) -> dict | None:
        """A rank's own error: ``line`` (its last line) and ``traceback``."""
        raw = self._read("error", rank)
        return None if raw is None else json.loads(raw)

    def done(self, rank: int) -> bool:
        return self.store.check([self._key("done", rank)])

    def abort(self, reason: str) -> None:
        try:
            self.store.set(self._key("abort"), reason)
        except Exception:  # the store is ours; failing to write it only loses the courtesy
            pass

    def recorded(self, steps: int) -> None:
        """The driver has the metrics of the first ``steps`` steps: the ranks may forget them."""
        self.store.set(self._key("recorded"), str(steps))

    def request_stop(self) -> None:
        """Ask the ranks to save at their next step boundary and end (a stop signal under
        ``checkpoint.every``)."""
        self.store.set(self._key("stop"), "1")

    def close(self) -> None:
        try:
            self._socket.close()
        except OSError:
            pass
        self.store = None
        if self._warnings_were is not None:
            from ppsplit.torch_private import native_log_level

            native_log_level(self._warnings_were)
            self._warnings_were = None


ERROR_LEVEL = 2  # c10's log levels: 0 info, 1 warning, 2 error


class RankChannel:
    """A rank's end. ``beat`` thread: publishes the heartbeat, watches for the driver."""

    def __init__(self, host: str, port: int, token: str, rank: int, timeout_s: float,
                 driver_pid: int | None = None):
        self.token, self.rank, self.driver_pid = token, rank, driver_pid
        self.phase, self.step, self.progress, self.completed = "starting", None, 0, 0
        self.recent: dict[str, dict] = {}  # step (as a JSON key) -> its loss and metrics, the last few
        self.saved: list[int] = []  # the periodic checkpoints written whole, by step
        self.stop_requested = threading.Event()  # the driver asks for a checkpoint and the end
        self.recorded = 0  # the steps whose metrics the driver has (see DriverChannel.recorded)
        self.peak_flops: float | None = None  # this rank's matmul FLOP/s on its device, once measured
        self._main = threading.main_thread()
        self._stop = threading.Event()
        self.store = _store(host, port, timeout_s=timeout_s)  # the main thread's: rendezvous, errors, done
        self._beat_store = _store(host, port)  # its own connection, for the heartbeat thread
        self._beats = 0
        self._publish()
        self._thread = threading.Thread(target=self._run, name="ppsplit-heartbeat", daemon=True)
        self._thread.start()

    def _key(self, kind: str, rank: int | None = None) -> str:
        return f"{self.token}/ctl/{kind}" + ("" if rank is None else f"/{rank}")

    def process_group_store(self):
        """A store of this run's own for ``init_process_group``."""
        import torch.distributed as dist

        return dist.PrefixStore(f"{self.token}/pg", self.store)

    def report(self, phase: str, step: int | None = None) -> None:
        """What the main thread is doing now (each change counts as progress)."""
        self.phase, self.step = phase, step
        self.progress += 1

    def step_done(self, step: int, loss: float | None, metrics: dict | None = None) -> None:
        """Step ``step`` (0-based) finished; ``loss``: its loss, on a rank of the last stage;
        ``metrics``: what else the step measured (lr, grad norm, seconds). The last few steps
        are kept, so the driver can average the data-parallel ranks at one step."""
        self.completed = step + 1
        self.recent[str(step)] = {"loss": loss, **(metrics or {})}
        keep_from = min(self.recorded, self.completed - RECENT_LOSSES)  # never a row the driver lacks
        for old in list(self.recent):
            if int(old) < keep_from or len(self.recent) > MAX_UNRECORDED:
                del self.recent[old]
        self.progress += 1

    def checkpoint_saved(self, step: int) -> None:
        """Every rank has written the periodic checkpoint of ``step`` (said by rank 0 once
        torch.distributed.checkpoint's save, which ends with the metadata, returned)."""
        self.saved = [*self.saved, step]
        self.progress += 1

    def where(self) -> tuple[str, bool]:
        """The main thread's innermost frame, and whether it waits on a peer (a collective or a
        pipeline send/receive in torch.distributed)."""
        frame = sys._current_frames().get(self._main.ident)
        if frame is None:
            return "", False
        waiting = os.sep + os.path.join("torch", "distributed") + os.sep in frame.f_code.co_filename
        own = frame
        while own is not None and os.sep + "ppsplit" + os.sep not in own.f_code.co_filename:
            own = own.f_back
        shown = own or frame
        path = shown.f_code.co_filename
        short = path[path.rfind(os.sep + "ppsplit" + os.sep) + 1:] if own else os.path.basename(path)
        return f"{short}:{shown.f_lineno} in {shown.f_code.co_name}", waiting

    def _beat(self) -> str:
        where, waiting = self.where()
        self._beats += 1
        return json.dumps({"beat": self._beats, "progress": self.progress, "phase": self.phase, "step": self.step,
                           "completed": self.completed, "recent": dict(self.recent), "saved": self.saved,
                           "where": where, "waiting": waiting, "pid": os.getpid(), "host": socket.gethostname(),
                           "peak": self.peak_flops})

    def _publish(self) -> None:
        self._beat_store.set(self._key("beat", self.rank), self._beat())

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                beat = self._beat()
            except Exception as err:  # a bug of this thread: said as one, never as a lost driver
                self._exit_failed(err)
            try:
                self._beat_store.set(self._key("beat", self.rank), beat)
                aborted = self._beat_store.check([self._key("abort")])
                stop = not self.stop_requested.is_set() and self._beat_store.check([self._key("stop")])
                recorded = (self._beat_store.get(self._key("recorded"))
                            if self._beat_store.check([self._key("recorded")]) else None)
            except (RuntimeError, OSError):  # the store's errors: the driver is gone, or silent for DRIVER_LOST_S
                self._exit(EXIT_DRIVER_GONE, "its driver is gone (the control store stopped answering)")
            if stop:
                self.stop_requested.set()
            if recorded is not None:
                self.recorded = int(recorded)
            if aborted:
                self._exit(EXIT_ABORTED, "the driver stopped the run")
            if self.driver_pid and not _alive(self.driver_pid):
                self._exit(EXIT_DRIVER_GONE, f"its driver (pid {self.driver_pid}) is gone")

    def _exit_failed(self, err: BaseException) -> None:
        """The heartbeat thread itself failed: the driver is told so (this rank's error), then the
        rank ends."""
        wrapped = RuntimeError(f"the heartbeat thread failed: {one_line(err)}")
        wrapped.__traceback__ = err.__traceback__
        try:
            self.fail(wrapped, self._beat_store)
        finally:
            self._exit(1, str(wrapped))

    def _exit(self, status: int, why: str) -> None:
        try:
            sys.stderr.write(f"ppsplit rank {self.rank}: ending: {why}\n")
            sys.stderr.flush()
        finally:
            os._exit(status)

    def fail(self, err: BaseException, store=None) -> None:
        """Send this rank's own error to the driver: its last line first, then the traceback
        (``store``: the connection to send it on, the main thread's by default)."""
        text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        line = one_line(err)
        try:
            (store or self.store).set(self._key("error", self.rank), json.dumps({"line": line, "traceback": text}))
        except Exception:
            pass

    def finish(self) -> None:
        self.store.set(self._key("done", self.rank), "1")

    def stop(self) -> None:
        self._stop.set()


def one_line(err: BaseException) -> str:
    """``Type: first line`` of an error, with the error inside a wrapper that hides it (torch's
    ``CheckpointException`` carries each rank's own error in ``failures``)."""
    text = str(err).strip()
    line = f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
    if err.__cause__ is not None:  # a wrapper ("[Stage 0] failed to run forward:"): say what it wraps
        line = f"{line.rstrip(':')}: {one_line(err.__cause__)}"
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = next(iter(failures.items()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            line = f"{type(err).__name__} (rank {rank}: {one_line(inner)})"
    return line


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def new_token() -> str:
    """The run's secret: the prefix of every key in its store (256 bits from ``secrets``)."""
    return f"ppsplit-{secrets.token_hex(32)}"
