"""Dispatch one process per rank, locally or to SLURM through submitit, and watch them.

The driver hosts the ranks' rendezvous and control channel (:mod:`ppsplit.control`). A monitor
thread reads it four times a second and ends the run at the first failure, naming the rank
that caused it:

- a rank's own error, sent over the channel as it fails (a neighbour that only lost its peer
  is not named when the rank that caused it is known);
- a rank that died without a word: locally its exit status (killed by a signal, or exited),
  on SLURM its heartbeat going silent for :data:`~ppsplit.control.RANK_LOST_S` seconds;
- ranks that made no progress (no phase or step changed) for ``timeout_s``: the message names
  the rank(s) not blocked on a peer, where they are and at which step.

On a failure, an interrupt (Ctrl-C, SIGTERM, SIGHUP) or any error in the driver the ranks are
stopped: locally each rank's process group gets SIGTERM and, two seconds later, SIGKILL; on
SLURM the channel tells them to stop and the job is cancelled. A rank whose driver dies (even
by SIGKILL) ends itself (see :mod:`ppsplit.control`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time

from ppsplit.control import EXIT_ABORTED, EXIT_DRIVER_GONE, RANK_LOST_S, DriverChannel, new_token
from ppsplit.errors import CheckFailed, PpsplitError
from ppsplit.job_spec import JobSpec

POLL_S = 0.25
ROOT_CAUSE_GRACE_S = RANK_LOST_S + 1.0  # after a lost-peer error, wait this long for its cause
SILENT_AFTER_LOSS_S = 1.5  # once a peer reported losing a rank, this much silence names it
KILL_AFTER_S = 2.0  # local ranks: SIGKILL this long after SIGTERM
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Read error",
             "Socket Timeout", "remote worker", "Connection refused", "ECONNRESET", "EPIPE",
             "Timed out waiting")


class RanksFailed(BaseException):
    """Raised in the driver's main thread by the monitor when the ranks fail meanwhile."""


class Interrupted(BaseException):
    """The driver got a signal asking it to stop (SIGINT, SIGTERM, SIGHUP)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


# --- backends --------------------------------------------------------------------------------

class LocalProcesses:
    """One process per rank on this machine, each in its own session (a Ctrl-C in the terminal
    reaches only the driver, which stops them) and killed by the kernel if the driver dies."""

    def __init__(self, launch_file: str, world: int, folder: str, threads: int):
        self.folder = folder
        self.processes: list[subprocess.Popen] = []
        env = dict(os.environ)
        for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(key, None)  # the ranks rendezvous on the driver's store, never on these
        env.update(OMP_NUM_THREADS=str(threads), PPSPLIT_DRIVER_PID=str(os.getpid()))
        try:
            for rank in range(world):
                with open(self.log(rank), "wb") as log:
                    self.processes.append(subprocess.Popen(
                        [sys.executable, "-u", "-m", "ppsplit.run_rank", launch_file, str(rank), str(world)],
                        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                        env=env, start_new_session=True, close_fds=True,
                    ))
        except BaseException:
            self.cancel()
            raise

    def log(self, rank: int) -> str:
        return os.path.join(self.folder, f"rank{rank}.log")

    def exit_status(self, rank: int) -> int | None:
        return self.processes[rank].poll()

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def describe(self) -> str:
        return f"local processes {', '.join(map(str, self.pids()))}; logs in {self.folder}"

    def cancel(self) -> None:
        """SIGTERM to every rank's process group, SIGKILL to what is left after KILL_AFTER_S."""
        for sig, wait in ((signal.SIGTERM, KILL_AFTER_S), (signal.SIGKILL, 5.0)):
            for p in self.processes:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(p.pid, sig)
            end = time.monotonic() + wait
            while time.monotonic() < end and any(p.poll() is None for p in self.processes):
                time.sleep(0.05)

    def finished(self) -> None:
        for p in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        self.cancel()  # nothing is left, whatever a rank did


class SlurmJob:
    """One SLURM task per rank through submitit."""

    STATE_EVERY_S = 5.0

    def __init__(self, launch_file: str, spec: JobSpec, folder: str, world: int):
        import submitit

        from ppsplit.run_rank import rank_entry

        launcher = spec.launcher
        per_node = launcher.tasks_per_node or -(-world // launcher.nodes)
        params = {
            "tasks_per_node": per_node,
            "nodes": launcher.nodes,
            "cpus_per_task": launcher.cpus_per_task,
            "timeout_min": launcher.time_min or max(1, int(spec.timeout_s // 60) + 2),
            "name": "ppsplit",
            "slurm_partition": launcher.partition,
        }
        if launcher.gpus_per_task:
            params["slurm_gpus_per_task"] = launcher.gpus_per_task
        if launcher.additional_parameters:
            params["slurm_additional_parameters"] = dict(launcher.additional_parameters)
        executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
        executor.update_parameters(**{k: v for k, v in params.items() if v is not None})
        self.folder = folder
        with _outside_any_job():
            self.job = executor.submit(rank_entry, launch_file)
        self._state, self._state_at = "PENDING", 0.0
        self._cancelled = False

    def exit_status(self, rank: int) -> int | None:
        return None  # SLURM does not tell a task's status while the job runs: heartbeats do

    def state(self) -> str:
        now = time.monotonic()
        if now - self._state_at > self.STATE_EVERY_S:
            self._state_at = now
            with contextlib.suppress(Exception):  # the scheduler may not answer this time
                self._state = str(self.job.state)
        return self._state

    def describe(self) -> str:
        return f"SLURM job {self.job.job_id}; logs in {self.folder}"

    def cancel(self) -> None:
        if not self._cancelled:
            self._cancelled = True
            with contextlib.suppress(Exception):
                self.job.cancel(check=False)

    def finished(self) -> None:
        pass


@contextlib.contextmanager
def _outside_any_job():
    """Submit as if from a login shell. A sweep point's driver runs inside a SLURM job (and a
    submitit one); sbatch would hand that job's SLURM_* and SUBMITIT_* variables to the ranks,
    which then look for their work in the driver's job folder."""
    saved = {k: v for k, v in os.environ.items()
             if k.startswith(("SUBMITIT_", "SLURM_", "SBATCH_", "SRUN_")) and k != "SLURM_CONF"}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


def check_slurm_controller(partition: str | None = None, nodes: int = 1, timeout_s: float = 10.0) -> None:
    """Refuse ``launcher=slurm`` at once when no SLURM controller answers, when the partition
    does not exist, or when it has fewer nodes than ``launcher.nodes`` (such a job would wait
    in the queue for ever)."""
    hint = "start one with launchers/slurm/up.sh, or use launcher=local"

    def scontrol(*args: str) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=timeout_s,
                                  stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise PpsplitError(f"launcher=slurm: SLURM's client commands are not installed; {hint}") from None
        except subprocess.TimeoutExpired:
            raise PpsplitError(f"launcher=slurm: no SLURM controller answered within {timeout_s:g} s; {hint}") from None

    proc = scontrol("ping")
    if proc.returncode != 0 or " is UP" not in proc.stdout:
        said = (proc.stdout + proc.stderr).strip().splitlines()
        raise PpsplitError(f"launcher=slurm: no SLURM controller answers (scontrol ping: "
                           f"{said[-1] if said else 'no answer'}); {hint}")
    partitions = {}  # name: (total nodes, default)
    for line in scontrol("show", "partition", "-o").stdout.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "PartitionName" in fields:
            partitions[fields["PartitionName"]] = (int(fields.get("TotalNodes", "0") or 0),
                                                   fields.get("Default") == "YES")
    if not partitions:
        return  # the controller did not list them; sbatch will say what is wrong
    listed = ", ".join(f"{name} ({n} node{'s' if n != 1 else ''})" for name, (n, _) in partitions.items())
    if partition is None:
        partition = next((name for name, (_, default) in partitions.items() if default), None)
        if partition is None:
            raise PpsplitError(f"launcher.partition=null: the cluster has no default partition; allowed: {listed}")
    elif partition not in partitions:
        raise PpsplitError(f"launcher.partition={partition}: no such partition; allowed: {listed}")
    total = partitions[partition][0]
    if nodes > total:
        bigger = [f"launcher.partition={name}" for name, (n, _) in partitions.items() if n >= nodes]
        raise PpsplitError(f"launcher.nodes={nodes}: partition {partition} has {total} node{'s' if total != 1 else ''}; "
                           f"allowed: 1 to {total}" + (f", or {' or '.join(bigger)}" if bigger else ""))


# --- the ranks of one run ------------------------------------------------------------------

class Ranks:
    """The ranks of one run: started by :meth:`start`, watched by a monitor thread, stopped on
    leaving the ``with`` block unless they finished."""

    def __init__(self, spec: JobSpec, run_dir: str, progress=None):
        self.spec = spec
        self.world = spec.world_size
        self.folder = os.path.join(run_dir, "ranks")
        from ppsplit.report import Progress

        self.progress = progress or Progress(enabled=False)
        self.channel: DriverChannel | None = None
        self.backend = None
        self.failure: str | None = None
        self.results: list[dict] | None = None
        self._done = threading.Event()
        self._waiting = self._closing = False
        self._thread: threading.Thread | None = None
        self._beats: dict[int, dict] = {}
        self._reported_step = 0
        self._placed = False

    # lifecycle
    def start(self, payload: dict) -> "Ranks":
        os.makedirs(self.folder, exist_ok=True)
        launcher = self.spec.launcher
        host = "127.0.0.1" if launcher.name == "local" else driver_address(launcher.driver_host)
        token = new_token()
        self.channel = DriverChannel(host, launcher.port, token)
        launch_file = os.path.join(self.folder, "launch.pkl")
        with open(launch_file, "wb") as f:
            pickle.dump({**payload, "spec": self.spec, "host": host, "port": self.channel.port,
                         "token": token, "folder": self.folder}, f)
        if launcher.name == "local":
            self.backend = LocalProcesses(launch_file, self.world, self.folder, launcher.cpus_per_task)
        else:
            self.backend = SlurmJob(launch_file, self.spec, os.path.join(os.path.dirname(self.folder), "submitit"),
                                    self.world)
        self.progress(f"ranks: {self.world} started ({self.backend.describe()})")
        self._thread = threading.Thread(target=self._watch, name="ppsplit-monitor", daemon=True)
        self._thread.start()
        return self

    def __enter__(self) -> "Ranks":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._closing = True  # from here on the monitor never interrupts the main thread
        if self.backend is not None and self.results is None:
            self.cancel(f"the driver stopped ({exc_type.__name__ if exc_type else 'done'})")
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.backend is not None:
            self.backend.finished()
        if self.channel is not None:
            self.channel.close()
        if exc_type is RanksFailed and self.failure:
            raise CheckFailed(self.failure) from None
        return False

    def cancel(self, reason: str) -> None:
        self._done.set()
        if self.channel is not None:
            self.channel.abort(reason)
        if self.backend is not None:
            self.backend.cancel()

    def wait(self) -> list[dict]:
        """Every rank's result, or :class:`CheckFailed` naming the rank that failed."""
        self._waiting = True
        try:
            while not self._done.wait(0.5):
                pass
        except RanksFailed:
            pass
        if self.failure:
            raise CheckFailed(self.failure)
        return self.results

    # the monitor
    def _watch(self) -> None:
        try:
            self._watch_loop()
        except Exception as err:  # never leave ranks running on a bug of the monitor
            self._fail(f"the rank monitor failed: {type(err).__name__}: {err}")

    def _watch_loop(self) -> None:
        errors: dict[int, dict] = {}
        first_error_at = None
        last_progress, last_change = None, time.monotonic()
        while not self._done.is_set():
            now = time.monotonic()
            for rank in range(self.world):
                beat = self.channel.heartbeat(rank)
                if beat is not None:
                    old = self._beats.get(rank)
                    if old is None or old["beat"] != beat["beat"]:
                        beat["seen"] = now
                    else:
                        beat["seen"] = old["seen"]
                    self._beats[rank] = beat
                if rank not in errors:
                    error = self.channel.error(rank)
                    if error is not None:
                        errors[rank] = error
                        first_error_at = first_error_at or now
            deaths = self._deaths(errors, now, SILENT_AFTER_LOSS_S if errors else RANK_LOST_S)
            own = {r: e for r, e in errors.items() if not _lost_peer(e["line"])}
            if own:
                rank = min(own)
                return self._fail(f"rank {rank} failed: {own[rank]['line']}", errors[rank])
            if deaths:
                rank = min(deaths)
                return self._fail(f"rank {rank} {deaths[rank]}")
            if errors and now - first_error_at > ROOT_CAUSE_GRACE_S:
                rank = min(errors)
                return self._fail(f"rank {rank} failed: {errors[rank]['line']}", errors[rank])
            if all(self.channel.done(r) for r in range(self.world)):
                self.results = self._load_results()
                last = [r["losses"][-1] for r in self.results if r["losses"]]
                done = max((len(r["losses"]) for r in self.results), default=0)
                if done > self._reported_step:
                    self.progress.step(done, self.spec.steps, last[0] if last else None)
                self._done.set()
                return
            self._report_placement()
            self._report_steps()
            state = self.backend.state() if isinstance(self.backend, SlurmJob) else "RUNNING"
            progress = tuple(self._beats.get(r, {}).get("progress") for r in range(self.world))
            if progress != last_progress or state == "PENDING":
                last_progress, last_change = progress, now
            elif now - last_change > self.spec.timeout_s:
                return self._fail(self._stall_message())
            if state in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                         "BOOT_FAIL", "DEADLINE") or state.startswith("CANCELLED"):
                return self._fail(f"the SLURM job ended ({state}) before every rank finished")
            time.sleep(0.25)

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
                dead[rank] = _describe_exit(status)
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
            self._reported_step = completed
            losses = [b["loss"] for b in self._beats.values() if b.get("loss") is not None]
            self.progress.step(completed, self.spec.steps, losses[0] if losses else None)

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
        if not self._waiting and not self._closing:
            _interrupt_main()

    def _load_results(self) -> list[dict]:
        import torch

        out = []
        for rank in range(self.world):
            path = os.path.join(self.folder, f"rank{rank}.result.pt")
            out.append(torch.load(path, weights_only=False))
            os.unlink(path)  # its figures go into the report; its gradients can be large
        return out


def _interrupt_main() -> None:
    import _thread

    with contextlib.suppress(Exception):
        _thread.interrupt_main(signal.SIGUSR1)


def _lost_peer(line: str) -> bool:
    return any(s in line for s in LOST_PEER)


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


def driver_address(setting: str = "auto") -> str:
    """Where SLURM ranks reach the driver. ``auto``: this machine's own address on its route to
    the SLURM controller (127.0.0.1 for a controller on loopback; on a cluster, the address the
    login node has on the cluster's network), found without sending anything. Anything else is
    taken as given: a name or an address that every node resolves to this machine."""
    import socket

    if setting != "auto":
        return setting
    controller = _controller_address()
    if controller is None:
        return socket.gethostname()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(controller)  # UDP: picks the route and the source address, sends nothing
            return probe.getsockname()[0]
        except OSError:
            return socket.gethostname()


def _controller_address() -> tuple[str, int] | None:
    """The SLURM controller's address and port, from ``scontrol show config``."""
    import socket

    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=10,
                             stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    host = re.search(r"^SlurmctldHost\[0\]\s*=\s*([^\s(]+)(?:\(([^)]+)\))?", out, re.M)
    port = re.search(r"^SlurmctldPort\s*=\s*(\d+)", out, re.M)
    if host is None:
        return None
    address = host.group(2) or host.group(1)
    try:
        address = socket.gethostbyname(address)
    except OSError:
        return None
    return address, int(port.group(1)) if port else 6817


def install_signal_handlers() -> dict:
    """SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` in the main thread, and SIGUSR1
    (the monitor's) :class:`RanksFailed`; returns the previous handlers."""
    def interrupted(signum, frame):
        raise Interrupted(signum)

    def failed(signum, frame):
        raise RanksFailed()

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        previous[sig] = signal.signal(sig, interrupted)
    previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, failed)
    return previous


def restore_signal_handlers(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
