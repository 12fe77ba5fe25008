"""A rank's process: rendezvous on the driver's store, run :func:`ppsplit.train.rank.train_rank`,
and send the result, or the rank's own error, to the driver.

Locally each rank is forked by :mod:`ppsplit.launch.local` (:func:`forked`); on SLURM submitit
runs :func:`rank_entry` in every task. Both report over the driver's channel (:mod:`ppsplit.launch.control`).
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from ppsplit.launch.control import RankChannel
from ppsplit.config.spec import JobSpec


# --- the process ------------------------------------------------------------------------------

def rank_entry(launch_file: str, rank: int | None = None, world: int | None = None) -> None:
    """Every rank process runs this: rendezvous, train, write the result, say done. Any error,
    an ``Exception`` or not, is sent to the driver before the process ends."""
    with open(launch_file, "rb") as f:
        launch = pickle.load(f)
    local_rank = rank
    on_slurm = rank is None
    if on_slurm:  # a SLURM task, started by submitit
        import submitit

        env = submitit.JobEnvironment()
        rank, world, local_rank = env.global_rank, env.num_tasks, env.local_rank
    spec: JobSpec = launch["spec"]
    driver_pid = int(os.environ["PPSPLIT_DRIVER_PID"]) if "PPSPLIT_DRIVER_PID" in os.environ else None
    channel = RankChannel(launch["host"], launch["port"], launch["token"], rank, spec.timeout_s, driver_pid)
    try:
        with open(os.path.join(launch["folder"], f"rank{rank}.pid"), "w") as f:
            f.write(f"{os.getpid()} {os.uname().nodename}\n")
    except OSError:  # a full disk: the channel still carries everything that matters
        pass
    if launch.get("series") and on_slurm:
        _save_on_slurm_signal(channel)
    try:
        result = run(spec, launch, rank, world, local_rank, channel)
        path = os.path.join(launch["folder"], f"rank{rank}.result.pt")
        torch.save(result, path + ".partial")
        os.replace(path + ".partial", path)
        channel.report("done")
        channel.finish()
    except BaseException as err:
        channel.fail(err)
        traceback.print_exc()
        sys.stderr.flush()
        raise
    finally:
        channel.stop()


def _save_on_slurm_signal(channel) -> None:
    """SLURM's signal before the time limit (or on preemption), SIGUSR2 as submitit asks for it:
    the ranks save at their next step boundary and end (submitit's own handler would end rank 0
    at once)."""
    import signal

    def stop(signum, frame):
        channel.stop_requested.set()

    signal.signal(signal.SIGUSR2, stop)
    signal.signal(signal.SIGTERM, stop)  # scontrol requeue, scancel: KillWait (10 s here) before SIGKILL


def run(spec: JobSpec, launch: dict, rank: int, world: int, local_rank: int, channel) -> dict:
    torch.set_num_threads(spec.launcher.cpus_per_task)
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    from ppsplit.train.metrics import matmul_peak

    channel.report("measuring the device")
    channel.peak_flops = matmul_peak(spec.launcher.cpus_per_task, device=device, precision=spec.train.precision)
    channel.report("rendezvous")
    # The driver names a stalled rank after timeout_s; the collectives' own timeout is only the
    # backstop, so it is longer.
    dist.init_process_group("nccl" if cuda else "gloo", store=channel.process_group_store(), rank=rank,
                            world_size=world, timeout=timedelta(seconds=2 * spec.timeout_s + 30))
    try:
        from ppsplit.train.rank import train_rank

        result = train_rank(spec, launch, rank, world, device, channel)
        # No rank closes its connections while a peer may still be finishing a collective with
        # it: gloo aborts the process (SIGABRT) when a peer goes away under a pending operation.
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()


def forked(argv: list[str]) -> None:
    """A local rank (``LAUNCH RANK WORLD``), forked by :mod:`ppsplit.launch.local`."""
    import gc

    # The interpreter's own thresholds, whatever the driver it was forked from set for its start
    # (app.cli.DRIVER_GC_THRESHOLDS): a rank's garbage goes as soon as it always has.
    gc.set_threshold(700, 10, 10)
    launch_file, rank, world = argv[0], int(argv[1]), int(argv[2])
    try:
        rank_entry(launch_file, rank, world)
    except BaseException:
        sys.exit(1)
