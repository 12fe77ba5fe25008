"""Dispatch one process per rank, locally or to SLURM through submitit, and wait for them with a
bound: a rank that raises, dies or hangs fails the whole run, naming the rank."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

from ppsplit.errors import CheckFailed, PpsplitError
from ppsplit.run_rank import SCHEDULES, rank_main


@dataclass
class RankPlan:
    ranks: int
    stages_per_rank: int
    placement: str  # "single", "loop" or "v"


def plan_ranks(schedule: str, stages: int, stages_per_rank: int | None, microbatches: int) -> RankPlan:
    """Map stages to ranks for ``schedule``, refusing combinations the schedule cannot run."""
    if schedule not in SCHEDULES:
        raise PpsplitError(f"schedule {schedule!r} is not known; allowed: {', '.join(SCHEDULES)}")
    placement = SCHEDULES[schedule][1]
    if placement == "single":
        if stages_per_rank not in (None, 1):
            raise PpsplitError(
                f"schedule={schedule} runs one stage per rank, not stages_per_rank={stages_per_rank}; "
                "use interleaved_1f1b, looped_bfs, interleaved_zb, zbv or dualpipev for more"
            )
        per_rank = 1
    else:
        per_rank = 2 if stages_per_rank is None else stages_per_rank
        if placement == "v" and per_rank != 2:
            raise PpsplitError(
                f"schedule={schedule} needs exactly 2 stages per rank (V placement), "
                f"not stages_per_rank={per_rank}"
            )
        if per_rank < 1:
            raise PpsplitError(f"schedule.stages_per_rank={per_rank}: must be >= 1")
        if stages % per_rank:
            raise PpsplitError(
                f"stages={stages} is not divisible by schedule.stages_per_rank={per_rank}; "
                f"allowed: a multiple of {per_rank}"
            )
    ranks = stages // per_rank
    if placement != "single" and microbatches < ranks:
        raise PpsplitError(
            f"microbatches={microbatches}: schedule={schedule} needs microbatches >= ranks ({ranks})"
        )
    return RankPlan(ranks, per_rank, placement)


def make_executor(launcher: dict, folder: str, ranks: int, timeout_s: float):
    import submitit

    name = launcher["name"]
    cluster = {"local": "local", "slurm": "slurm"}[name]
    executor = submitit.AutoExecutor(folder=folder, cluster=cluster)
    params = {
        "tasks_per_node": launcher.get("tasks_per_node") or ranks,
        "nodes": launcher.get("nodes", 1),
        "cpus_per_task": launcher.get("cpus_per_task", 1),
        "timeout_min": max(1, int(launcher.get("time_min") or (timeout_s // 60 + 2))),
        "name": "ppsplit",
    }
    if name == "slurm":
        params["slurm_partition"] = launcher.get("partition")
        if launcher.get("gpus_per_task"):
            params["slurm_gpus_per_task"] = launcher["gpus_per_task"]
        extra = dict(launcher.get("additional_parameters") or {})
        if extra:
            params["slurm_additional_parameters"] = extra
        params = {k: v for k, v in params.items() if v is not None}
    nodes, per_node = params["nodes"], params["tasks_per_node"]
    if nodes * per_node != ranks:
        raise PpsplitError(
            f"launcher nodes={nodes} x tasks_per_node={per_node} gives {nodes * per_node} ranks; "
            f"this pipeline needs {ranks}"
        )
    executor.update_parameters(**params)
    return executor


def submit(task: dict, launcher: dict, folder: str, ranks: int):
    """Start the ranks; returns the submitit job at once."""
    os.makedirs(folder, exist_ok=True)
    executor = make_executor(launcher, folder, ranks, task["timeout_s"])
    with _outside_any_job():
        return executor.submit(rank_main, task)


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


def cancel(job) -> None:
    """Cancel ``job``, once. submitit's local controller takes a SIGINT as the order to stop its
    tasks (SIGINT, then SIGKILL a second later); a second SIGINT arriving meanwhile interrupts
    it before the SIGKILL and leaves a hung rank running."""
    if getattr(job, "_ppsplit_cancelled", False):
        return
    job._ppsplit_cancelled = True
    job.cancel(check=False)


def wait(job, ranks: int, timeout_s: float, poll_s: float = 0.5) -> list[dict]:
    """Every rank's result, or :class:`CheckFailed` naming the first rank that failed.

    Bounded by ``timeout_s``: on a failure or the deadline the whole job is cancelled, so the
    other ranks (blocked in a collective with the dead one) are not left behind.
    """
    deadline = time.monotonic() + timeout_s
    tasks = [job.task(i) for i in range(ranks)]
    while True:
        failed = [i for i, task in enumerate(tasks) if task.done() and task.exception() is not None]
        if failed:
            raise CheckFailed(_root_cause(job, tasks, poll_s, min(30.0, max(3.0, deadline - time.monotonic()))))
        if all(task.done() for task in tasks):
            return [task.result() for task in tasks]
        if time.monotonic() > deadline:
            cancel(job)
            raise CheckFailed(
                f"ranks did not finish within timeout_s={timeout_s:g}; job {job.job_id} cancelled "
                f"(state: {safe_state(job)})"
            )
        time.sleep(poll_s)


LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Read error",
             "Socket Timeout", "remote worker")


def _cause_rank(message: str) -> int:
    """0: the rank's own error; 1: it died without a word; 2: it only lost a peer."""
    if any(s in message for s in LOST_PEER):
        return 2
    return 1 if "ended without a result" in message else 0


def _root_cause(job, tasks, poll_s: float, grace_s: float) -> str:
    """Name the rank that caused a failure, not a neighbour that merely lost it.

    A neighbour's 'connection closed' usually arrives first, a dead rank's missing result last;
    wait (bounded) for a rank with a cause of its own, then cancel the job."""
    end = time.monotonic() + grace_s
    while True:
        errors = {i: describe(t.exception(), job) for i, t in enumerate(tasks)
                  if t.done() and t.exception() is not None}
        ranked = sorted(errors, key=lambda i: (_cause_rank(errors[i]), i))
        best = ranked[0]
        if _cause_rank(errors[best]) == 0 or time.monotonic() > end or all(t.done() for t in tasks):
            cancel(job)
            return f"rank {best} failed: {errors[best]}"
        time.sleep(poll_s)


def safe_state(job) -> str:
    try:
        return str(job.state)
    except Exception:  # the scheduler may not answer; the timeout message still stands
        return "unknown"


def describe(err: BaseException, job) -> str:
    """One line: the rank's own error (its last traceback line), or the job's state."""
    text = str(err).strip()
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    errors = [l for l in lines if (":" in l and l.split(":")[0].replace(".", "").isidentifier()
                                   and (l.split(":")[0].endswith(("Error", "Exception", "Interrupt"))))]
    if errors:
        return errors[-1]
    state = safe_state(job)
    if "has not produced any output" in text:
        return f"the process ended without a result (job state: {state})"
    return lines[-1] if lines else f"{type(err).__name__} (job state: {state})"
