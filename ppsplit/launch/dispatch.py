"""Dispatch one process per rank, locally or to SLURM through submitit, and watch them.

The driver hosts the ranks' rendezvous and control channel (:mod:`ppsplit.launch.control`). A monitor
thread reads it four times a second and ends the run at the first failure, naming the rank
that caused it:

- a rank's own error, sent over the channel as it fails (a neighbour that only lost its peer
  is not named when the rank that caused it is known);
- a rank that died without a word: locally its exit status (killed by a signal, or exited),
  on SLURM its heartbeat going silent for :data:`~ppsplit.launch.control.RANK_LOST_S` seconds;
- ranks that made no progress (no phase or step changed) for ``timeout_s``: the message names
  the rank(s) not blocked on a peer, where they are and at which step.

The monitor never raises into the driver's main thread: it records the failure and stops the
ranks, and the main thread finds it where it checks (:meth:`Ranks.check`, :meth:`Ranks.wait`).
What the driver writes for the ranks' steps and checkpoints (the metrics log, sealing and pruning
step folders, which hash every file) runs on a thread of its own, so that a slow disk never
blinds the monitor.

On a failure, an interrupt (Ctrl-C, SIGTERM, SIGHUP) or any error in the driver the ranks are
stopped: locally each rank's process group gets SIGTERM and, two seconds later, SIGKILL; on
SLURM the channel tells them to stop and the job is cancelled. A rank whose driver dies (even
by SIGKILL) ends itself (see :mod:`ppsplit.launch.control`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ppsplit.launch.control import EXIT_ABORTED, EXIT_DRIVER_GONE, RANK_LOST_S, DriverChannel, new_token
from ppsplit.errors import CheckFailed
from ppsplit.config.spec import JobSpec
from ppsplit.launch.local import LocalProcesses
from ppsplit.launch.slurm import UNANSWERED, SlurmJob, driver_address
from ppsplit.launch.signals import ACTIVE

POLL_S = 0.25
ROOT_CAUSE_GRACE_S = RANK_LOST_S + 1.0  # after a lost-peer error, wait this long for its cause
SILENT_AFTER_LOSS_S = 1.5  # once a peer reported losing a rank, this much silence names it
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Read error",
             "Socket Timeout", "remote worker", "Connection refused", "ECONNRESET", "EPIPE",
             "Timed out waiting")


# --- the ranks of one run ------------------------------------------------------------------

class Ranks:
    """The ranks of one run: started by :meth:`start`, watched by a monitor thread, stopped on
    leaving the ``with`` block unless they finished."""

    def __init__(self, spec: JobSpec, run_dir: str, progress=None, on_step=None, on_saved=None):
        """``on_step(k, loss, lr, grad_norm, time_s, val_loss)``: called from the monitor for each
        step the ranks finish, in order, with what their heartbeats carried (the metrics log).
        ``on_saved(step)``: for each periodic checkpoint the ranks have written whole."""
        self.spec = spec
        self.on_step = on_step
        self.on_saved = on_saved
        self._saved: set[int] = set()
        self.stop_signal: int | None = None  # a stop signal the ranks save for before they end
        self.world = spec.world_size
        self.folder = os.path.join(run_dir, "ranks")
        from ppsplit.output import Progress

        self.progress = progress or Progress(enabled=False)
        self.channel: DriverChannel | None = None
        self.backend = None
        self.failure: str | None = None
        self.results: list[dict] | None = None
        self._done = threading.Event()
        self._io = ThreadPoolExecutor(1, thread_name_prefix="ppsplit-io")  # the driver's writes, in order
        self._io_error: str | None = None
        self._thread: threading.Thread | None = None
        self._beats: dict[int, dict] = {}
        self._reported_step = 0
        self._placed = False

    # lifecycle
    def start(self, payload: dict) -> "Ranks":
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        os.chmod(self.folder, 0o700)  # the launch file holds the run's secret; results and logs too
        launcher = self.spec.launcher
        host = "127.0.0.1" if launcher.name == "local" else driver_address(launcher.driver_host)
        token = new_token()
        self.channel = DriverChannel(host, launcher.port, token)
        launch_file = os.path.join(self.folder, "launch.pkl")
        fd = os.open(launch_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # an earlier attempt's file too
        with os.fdopen(fd, "wb") as f:
            pickle.dump({**payload, "spec": self.spec, "host": host, "port": self.channel.port,
                         "token": token, "folder": self.folder}, f)
        if launcher.name == "local":
            self.backend = LocalProcesses(launch_file, self.world, self.folder, launcher.cpus_per_task)
        else:
            self.backend = SlurmJob(launch_file, self.spec, os.path.join(os.path.dirname(self.folder), "submitit"),
                                    self.world)
        self._thread = threading.Thread(target=self._watch, name="ppsplit-monitor", daemon=True)
        self._thread.start()
        ACTIVE.add(self)
        return self

    def say_started(self) -> None:
        """One line naming the ranks' processes (or job) and where their logs are."""
        self.progress(f"ranks: {self.world} started ({self.backend.describe()})")

    def __enter__(self) -> "Ranks":
        return self

    def kill_now(self) -> None:
        """Stop the ranks without waiting for anything (the stop watchdog's last resort)."""
        if self.channel is not None:
            self.channel.abort("the driver was stopped")
        if self.backend is not None:
            self.backend.kill()

    def __exit__(self, exc_type, exc, tb) -> bool:
        ACTIVE.discard(self)
        if self.backend is not None and self.results is None:
            self.cancel(f"the driver stopped ({exc_type.__name__ if exc_type else 'done'})")
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._io.shutdown(wait=True)
        if self.backend is not None:
            self.backend.finished()
        if self.channel is not None:
            self.channel.close()
        return False

    def can_save_on_stop(self) -> bool:
        """Whether a stop signal now ends the ranks at their next step boundary, with a
        checkpoint (``checkpoint.every``, the ranks started and not finished)."""
        return self.on_saved is not None and self.channel is not None and self.results is None \
            and not self._done.is_set()

    def request_stop(self, signum: int) -> None:
        self.stop_signal = signum
        self.progress(f"{signal.Signals(signum).name}: the ranks save at their next step boundary, then end")
        self.channel.request_stop()

    def stopped_at(self) -> int | None:
        """The step the ranks stopped at, asked to by a signal (None: they ran to the end)."""
        return next((r.get("stopped_at") for r in self.results or () if r["rank"] == 0), None)

    def cancel(self, reason: str) -> None:
        self._done.set()
        if self.channel is not None:
            self.channel.abort(reason)
        if self.backend is not None:
            self.backend.cancel()

    def check(self) -> None:
        """:class:`CheckFailed` naming the rank that failed, if one has (the main thread asks at
        the points where it goes on to other work)."""
        if self.failure:
            raise CheckFailed(self.failure)

    def wait(self) -> list[dict]:
        """Every rank's result, or :class:`CheckFailed` naming the rank that failed."""
        while not self._done.wait(0.5):
            pass
        self.check()
        return self.results

    # the monitor
    def _watch(self) -> None:
        try:
            self._watch_loop()
        except Exception as err:  # never leave ranks running on a bug of the monitor
            self._fail(f"the rank monitor failed: {type(err).__name__}: {err}")

    def _watch_loop(self) -> None:
        seen = _Seen(time.monotonic())
        while not self._done.is_set():
            now = time.monotonic()
            self._read_channel(seen, now)
            failure = self._failed_rank(seen, now)
            if failure:
                return self._fail(*failure)
            if all(self.channel.done(r) for r in range(self.world)):
                return self._finish()
            self._report_placement()
            self._report_steps()
            self._report_saves((self._beats.get(0) or {}).get("saved") or ())
            ended = self._job_ended()
            if ended:  # every rank is gone now: the one that caused it is named, as it would have been
                self._read_channel(seen, time.monotonic())  # an error sent just before the end
                return self._fail(*(self._failed_rank(seen, time.monotonic(), job_over=True) or (ended,)))
            failure = self._io_error or self._stalled(seen, now)
            if failure:
                return self._fail(failure)
            time.sleep(POLL_S)

    def _read_channel(self, seen: "_Seen", now: float) -> None:
        """Each rank's latest heartbeat (when it last changed) and its error, if it sent one."""
        for rank in range(self.world):
            beat = self.channel.heartbeat(rank)
            if beat is not None:
                old = self._beats.get(rank)
                beat["seen"] = now if old is None or old["beat"] != beat["beat"] else old["seen"]
                self._beats[rank] = beat
            if rank not in seen.errors:
                error = self.channel.error(rank)
                if error is not None:
                    seen.errors[rank] = error
                    seen.first_error_at = seen.first_error_at or now

    def _failed_rank(self, seen: "_Seen", now: float, job_over: bool = False) -> tuple[str, dict | None] | None:
        """The failure to report, naming the rank that caused it: a rank's own error first, then
        a rank that died, then (after a grace) a rank that only lost its peer. ``job_over``: the
        ranks' SLURM job has ended, so no grace is left: once a rank has said it lost its peer,
        a rank that neither failed nor finished is the one that went away, whichever the driver
        noticed first."""
        errors = seen.errors
        own = {r: e for r, e in errors.items() if not _lost_peer(e["line"])}
        if own:
            rank = min(own)
            return f"rank {rank} failed: {own[rank]['line']}", own[rank]
        silent_s = SILENT_AFTER_LOSS_S if errors else RANK_LOST_S
        deaths = self._deaths(errors, now, 0.0 if job_over and errors else silent_s)
        if deaths:
            rank = min(deaths)
            return f"rank {rank} {deaths[rank]}", None
        if errors and (job_over or now - seen.first_error_at > ROOT_CAUSE_GRACE_S):
            rank = min(errors)
            return f"rank {rank} failed: {errors[rank]['line']}", errors[rank]
        return None

    def _finish(self) -> None:
        self.results = self._load_results()
        self._report_saves(next((r.get("saved_steps") or () for r in self.results if r["rank"] == 0), ()))
        self._io.submit(lambda: None).result()  # what the steps and saves wrote, all of it
        if self._io_error:
            return self._fail(self._io_error)
        done = max((len(r["step_times_s"]) for r in self.results), default=0)
        if done > self._reported_step:
            spec, last = self.spec, done - 1
            time_s = max(r["step_times_s"][-1] for r in self.results)
            tokens = spec.batch_size * spec.seq_len_at(last) * spec.train.grad_accumulation
            self.progress.step(done, spec.steps, loss=_mean_last_loss(self.results), lr=self.results[0]["lrs"][-1],
                               tokens_per_s=tokens / time_s if time_s else None)
        self._done.set()

    def _stalled(self, seen: "_Seen", now: float) -> str | None:
        """A message once no rank has made progress for ``timeout_s`` (a queued job waits)."""
        progress = tuple(self._beats.get(r, {}).get("progress") for r in range(self.world))
        pending = isinstance(self.backend, SlurmJob) and self.backend.state() == "PENDING"
        if progress != seen.progress or pending:
            seen.progress, seen.changed_at = progress, now
        elif now - seen.changed_at > self.spec.timeout_s:
            return self._stall_message()
        return None

    def _job_ended(self) -> str | None:
        if not isinstance(self.backend, SlurmJob):
            return None
        state = self.backend.state()
        if state == UNANSWERED:
            return f"SLURM does not answer about {self.backend.describe().split(';')[0]}: {self.backend.query_error}"
        if state in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                     "BOOT_FAIL", "DEADLINE") or state.startswith("CANCELLED"):
            return f"the SLURM job ended ({state}) before every rank finished"
        return None

    def _deaths(self, errors, now, silent_s: float) -> dict[int, str]:
        """Ranks that ended without reporting an error or a result; on SLURM, a rank silent for
        ``silent_s`` counts as ended."""
        dead = {}
        for rank in range(self.world):
            if rank in errors or self.channel.done(rank):
                continue
            status = self.backend.exit_status(rank)
            if status is not None:
                if self.channel.error(rank) is not None:
                    continue  # its error arrived meanwhile; the next round names it
                dead[rank] = _describe_exit(status) + _last_words(self.backend, rank, status)
                continue
            beat = self._beats.get(rank)
            if beat is not None and now - beat["seen"] > silent_s and not isinstance(self.backend, LocalProcesses):
                dead[rank] = (f"stopped answering: no heartbeat for {now - beat['seen']:.0f} s (the process "
                              f"was killed, or its node {beat.get('host', '?')} went away)")
        return dead

    def _report_placement(self) -> None:
        """Once every rank has reported, a line naming each node and its ranks (when they span
        more than one)."""
        if self._placed or len(self._beats) < self.world:
            return
        self._placed = True
        nodes: dict[str, list[int]] = {}
        for rank in range(self.world):
            nodes.setdefault(self._beats[rank].get("host", "?"), []).append(rank)
        if len(nodes) > 1:
            self.progress(f"ranks on {len(nodes)} nodes: " + "; ".join(
                f"{host}: rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}" for host, rs in nodes.items()))

    def _report_steps(self) -> None:
        """A line each time every rank has finished one more step, with the last stage's loss."""
        if len(self._beats) < self.world:
            return
        completed = min(b.get("completed") or 0 for b in self._beats.values())
        if completed > self._reported_step:
            for k in range(self._reported_step, completed):
                measured = self.step_metrics(k)
                if self.on_step is not None and "time_s" in measured:
                    self._off_path(f"recording step {k + 1}", self.on_step, k, **measured)
            self._reported_step = completed
            with contextlib.suppress(Exception):  # only lets the ranks forget those rows
                self.channel.recorded(completed)
            spec = self.spec
            tokens = spec.batch_size * spec.seq_len_at(completed - 1) * spec.train.grad_accumulation
            measured = self.step_metrics(completed - 1)
            self.progress.step(completed, spec.steps, tokens_per_s=tokens / measured["time_s"]
                               if measured.get("time_s") else None, **measured)

    def _report_saves(self, steps) -> None:
        """Each periodic checkpoint rank 0 says the ranks finished, once."""
        for step in steps:
            if step not in self._saved:
                self._saved.add(step)
                if self.on_saved is not None:
                    self._off_path(f"sealing the checkpoint of step {step}", self.on_saved, step)

    def _off_path(self, what: str, work, *args, **kwargs) -> None:
        """``work`` on the driver's writing thread; its failure fails the run, named."""
        def run():
            try:
                work(*args, **kwargs)
            except Exception as err:
                if self._io_error is None:
                    self._io_error = f"the driver failed {what}: {type(err).__name__}: {err}"

        self._io.submit(run)

    def step_metrics(self, step: int) -> dict:
        """What the ranks measured at ``step`` (0-based), as far as their heartbeats still carry
        it: the global batch's loss (the mean over the ranks of the last stage), the learning
        rate, the gradient norm, the slowest rank's seconds, and the validation loss if taken."""
        seen = [b["recent"][str(step)] for b in self._beats.values() if str(step) in (b.get("recent") or {})]
        if not seen:
            return {"loss": None}
        losses = [s["loss"] for s in seen if s.get("loss") is not None]
        vals = [s["val_loss"] for s in seen if s.get("val_loss") is not None]
        peaks = [self._beats.get(r, {}).get("peak") for r in range(self.world)]
        return {"loss": sum(losses) / len(losses) if losses else None, "lr": seen[0].get("lr"),
                "peak_flops": sum(peaks) if all(peaks) else None,
                "grad_norm": seen[0].get("grad_norm"), "time_s": max(s.get("time_s") or 0.0 for s in seen),
                "val_loss": sum(vals) / len(vals) if vals else None}

    def _stall_message(self) -> str:
        t = self.spec.timeout_s
        missing = [r for r in range(self.world) if r not in self._beats]
        if missing:
            return (f"ranks did not start within timeout_s={t:g}: rank(s) {', '.join(map(str, missing))} "
                    f"never reported ({self.backend.describe()})")
        stuck = [r for r in range(self.world) if not self._beats[r].get("waiting")]
        waiting = [r for r in range(self.world) if r not in stuck]

        def at(r):
            b = self._beats[r]
            doing = (f"in step {b['step'] + 1}/{self.spec.steps}" if b.get("step") is not None
                     else f"while {b['phase']}")
            return f"rank {r} {doing} at {b['where']}"

        if stuck:
            text = f"no progress for timeout_s={t:g}: " + "; ".join(at(r) for r in stuck) + " stopped"
            if waiting:
                text += f"; rank(s) {', '.join(map(str, waiting))} wait on it"
        else:
            text = (f"no progress for timeout_s={t:g}: every rank waits on a peer (a deadlock?): "
                    + "; ".join(at(r) for r in waiting))
        return text

    def _fail(self, message: str, error: dict | None = None) -> None:
        if error and error.get("traceback"):
            with contextlib.suppress(OSError):
                with open(os.path.join(self.folder, "error.txt"), "w") as f:
                    f.write(error["traceback"])
        self.failure = message
        self.cancel(message)

    def _load_results(self) -> list[dict]:
        import torch

        out = []
        for rank in range(self.world):
            path = os.path.join(self.folder, f"rank{rank}.result.pt")
            out.append(torch.load(path, weights_only=True))  # plain values and tensors, nothing to run
            os.unlink(path)  # its figures go into the report; its gradients can be large
        return out


class _Seen:
    """What the monitor has seen of the ranks so far."""

    def __init__(self, now: float):
        self.errors: dict[int, dict] = {}
        self.first_error_at: float | None = None
        self.progress: tuple | None = None
        self.changed_at = now


def _mean_last_loss(results: list[dict]) -> float | None:
    """The last step's loss of the global batch: the mean over the ranks that hold the last stage."""
    last = [r["losses"][-1] for r in results if r["losses"]]
    return sum(last) / len(last) if last else None


def _lost_peer(line: str) -> bool:
    return any(s in line for s in LOST_PEER)


# A process that ends itself on a native failure says why in its log: C++'s std::terminate
# (gloo's errors reach it) prints the exception's what(), Python's fatal errors name themselves.
_NATIVE_DEATHS = {signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL}
_WHY_WORDS = ("what():", "terminate called", "Fatal Python error", "Error", "error")


def _last_words(backend, rank: int, status: int) -> str:
    """What a rank that died of a native failure (an abort, a segmentation fault) last said about
    it in its log, or nothing (a rank killed from outside has nothing to say)."""
    log = getattr(backend, "log", None)
    if status >= 0 or log is None or -status not in _NATIVE_DEATHS:
        return ""
    try:
        with open(log(rank), "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 8192))
            lines = [line.strip() for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    for word in _WHY_WORDS:
        said = next((line for line in reversed(lines) if word in line), None)
        if said is not None:
            return f"; its log says: {said[:300]}"
    return f"; its log ends: {lines[-1][:300]}" if lines else ""


def _describe_exit(status: int) -> str:
    if status < 0:
        name = signal.Signals(-status).name if -status in signal.Signals._value2member_map_ else str(-status)
        hint = " (e.g. the OOM killer, or kill -9)" if name == "SIGKILL" else ""
        return f"was killed by {name}{hint}"
    if status == EXIT_DRIVER_GONE:
        return "ended: it lost its driver"
    if status == EXIT_ABORTED:
        return "was stopped by the driver"
    if status == 0:
        return "ended without a result"
    return f"exited with status {status} without reporting an error"
