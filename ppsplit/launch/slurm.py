"""Ranks on SLURM through submitit: one task per rank, the controller and partitions checked
before anything is submitted, and the address the ranks reach their driver on."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time

from ppsplit.errors import CheckFailed, PpsplitError
from ppsplit.config.spec import JobSpec

UNANSWERED = "UNANSWERED"  # the job's state once QUERY_TRIES queries in a row have failed
QUERY_TRIES = 6  # state queries in a row that may fail (one each STATE_EVERY_S) before the run fails


class QueryFailed(Exception):
    """A SLURM client command that did not answer (not found, timed out, or failed)."""


class SlurmJob:
    """One SLURM task per rank through submitit."""

    STATE_EVERY_S = 5.0

    def __init__(self, launch_file: str, spec: JobSpec, folder: str, world: int):
        import submitit

        from ppsplit.launch.rank import rank_entry

        launcher = spec.launcher
        per_node = launcher.tasks_per_node or -(-world // launcher.nodes)
        params = {
            "tasks_per_node": per_node,
            "nodes": launcher.nodes,
            "cpus_per_task": launcher.cpus_per_task,
            "timeout_min": launcher.time_min or max(1, int(spec.timeout_s // 60) + 2),
            "name": "ppsplit",
            "slurm_partition": launcher.partition,
            "slurm_signal_delay_s": launcher.signal_delay_s,
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
        # Known only from an answer: a failed query is never read as "pending" or "not cancelled".
        self._state, self._state_at = "SUBMITTED", 0.0
        self._failures, self.query_error = 0, None
        self._cancelled = False

    def exit_status(self, rank: int) -> int | None:
        return None  # SLURM does not tell a task's status while the job runs: heartbeats do

    def state(self) -> str:
        """The job's state from SLURM's accounting (asked at most every STATE_EVERY_S): PENDING
        until it is recorded there; UNKNOWN after a query that failed, and UNANSWERED (with
        ``query_error``) once QUERY_TRIES in a row have."""
        now = time.monotonic()
        if now - self._state_at > self.STATE_EVERY_S:
            self._state_at = now
            try:
                self._state = self._accounted() or "PENDING"  # submitted, not yet in the accounting
                self._failures = 0
            except QueryFailed as err:
                self._failures += 1
                self.query_error = f"{err} ({self._failures} queries in a row)"
                self._state = UNANSWERED if self._failures >= QUERY_TRIES else "UNKNOWN"
        return self._state

    def cancelled(self) -> bool:
        """Whether the job was cancelled (``scancel``), asked of the accounting now, not cached;
        a few tries, then :class:`~ppsplit.errors.CheckFailed` (a job whose end cannot be told is
        never requeued)."""
        for attempt in range(3):
            try:
                return "CANCELLED" in self._accounted()
            except QueryFailed as err:
                failed = err
                time.sleep(1.0 * (attempt + 1))
        raise CheckFailed(f"cannot tell whether SLURM job {self.job.job_id} was cancelled ({failed}); "
                          "it is not requeued")

    def _accounted(self) -> str:
        """The job's state line in ``sacct`` (empty before the accounting has it)."""
        return _query("sacct", "-j", str(self.job.job_id), "-X", "-n", "-P", "-o", "State").strip()

    def describe(self) -> str:
        return f"SLURM job {self.job.job_id}; logs in {self.folder}"

    def cancel(self) -> None:
        if not self._cancelled:
            self._cancelled = True
            with contextlib.suppress(Exception):
                self.job.cancel(check=False)

    def kill(self) -> None:
        self.cancel()

    def finished(self) -> None:
        pass


def _query(*command: str, timeout_s: float = 10.0) -> str:
    """A SLURM client command's output, or :class:`QueryFailed` saying why there is none."""
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise QueryFailed(f"{command[0]}: {type(err).__name__}: {err}") from None
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        raise QueryFailed(f"{command[0]} exited with {proc.returncode}" + (f": {said[-1][:200]}" if said else ""))
    return proc.stdout


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
