"""Nothing runs from a checkpoint, no secret is left readable, noise on the control port stays
off the console, and the monitor says what failed: a heartbeat thread's bug as that, a SLURM
client that stops answering as that, never as "pending" or "not cancelled"."""

import json
import os
import pickle
import shutil
import socket
import stat
import struct
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import ForkedCli, run_cli
from ppsplit.checkpoint.folder import MARKER, file_digest


class RunsACommand:
    """A pickle that runs a shell command when it is loaded."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trusted")
    proc = run_cli("launcher=inline", "steps=1", "optimizer=adamw", "checkpoint.save=true",
                   f"checkpoint.dir={folder / 'ck'}", f"hydra.run.dir={folder / 'run'}", cwd=folder)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return folder / "ck"


def test_a_poisoned_metadata_is_refused_before_anything_of_it_runs(tmp_path, checkpoint):
    poisoned = tmp_path / "ck"
    shutil.copytree(checkpoint, poisoned)
    marker = tmp_path / "ran"
    with open(poisoned / ".metadata", "wb") as f:
        pickle.dump(RunsACommand(marker), f)
    meta = json.loads((poisoned / MARKER).read_text())  # as an attacker would: the digest made to match
    meta["files"][".metadata"] = {"bytes": os.path.getsize(poisoned / ".metadata"),
                                  "sha256": file_digest(str(poisoned / ".metadata"))}
    (poisoned / MARKER).write_text(json.dumps(meta))
    proc = run_cli("steps=1", f"checkpoint.load={poisoned}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "its .metadata names posix.system, which a checkpoint's metadata never holds" in lines[0]
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_a_poisoned_entry_is_refused_by_the_weights_only_reader(tmp_path, checkpoint):
    """A non-tensor entry (as the optimizer's param_groups are stored) that would run a command."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ppsplit.checkpoint.reader import SafePlanner, SafeReader

    marker = tmp_path / "ran"
    dcp.save({"lr": 0.1, "w": torch.ones(2)}, checkpoint_id=str(tmp_path / "plain"))
    state = {"lr": None, "w": torch.zeros(2)}
    dcp.load(state, storage_reader=SafeReader(str(tmp_path / "plain")), planner=SafePlanner())
    assert state["lr"] == 0.1 and torch.equal(state["w"], torch.ones(2))  # plain values read as before
    dcp.save({"lr": RunsACommand(marker), "w": torch.ones(2)}, checkpoint_id=str(tmp_path / "bad"))
    with pytest.raises(BaseException, match="holds more than plain values"):  # DCP wraps it: a BaseException
        dcp.load({"lr": None, "w": torch.zeros(2)}, storage_reader=SafeReader(str(tmp_path / "bad")),
                 planner=SafePlanner())
    assert not marker.exists()


def test_nothing_reads_an_outside_file_with_pickle():
    """Pickle reads left in the package: the launch file the run wrote itself, and the fork
    server's messages over its own pipe."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = subprocess.run(["git", "grep", "-n", r"pickle\.load\|weights_only=False", "--", "ppsplit"],
                           cwd=root, capture_output=True, text=True).stdout.splitlines()
    places = sorted(line.split(":")[0] for line in found)
    assert places == ["ppsplit/launch/local.py", "ppsplit/launch/rank.py"], found


def test_the_runs_secret_is_private_and_noise_on_its_port_stays_off_the_console(tmp_path):
    proc = ForkedCli(["steps=200", "verify=1", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    try:
        launch = tmp_path / "run" / "ranks" / "launch.pkl"
        end = time.monotonic() + 120
        while not launch.exists():
            assert proc.poll() is None and time.monotonic() < end, proc.stderr()[-2000:]
            time.sleep(0.05)
        time.sleep(0.2)  # written whole
        assert stat.S_IMODE(os.stat(launch.parent).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(launch).st_mode) == 0o600
        with open(launch, "rb") as f:
            launched = pickle.load(f)
        assert len(launched["token"].rpartition("-")[2]) >= 32  # 128 bits or more, in hex
        port = launched["port"]
        # a well-formed header with an absurd key size, then bytes of no meaning
        for payload in (b"\x00" + struct.pack("<I", 0x3C85F7CE) + b"\x01" + struct.pack("<Q", 2 ** 40),
                        b"\x01" + struct.pack("<Q", 2 ** 62), os.urandom(4096)):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(payload)
                time.sleep(0.2)
        out, err = proc.communicate(300)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "PASSED" in out, err[-2000:]
    assert "frame #" not in err + out and "TCPStore" not in err + out


# A rank's channel whose heartbeat thread meets a bug of its own; the driver's end lives in the
# same process, and reads the error the rank sent just before it ends.
HEARTBEAT_BUG = textwrap.dedent("""
    import os, time
    from ppsplit.launch.control import DriverChannel, RankChannel
    driver = DriverChannel("127.0.0.1", 0, "ppsplit-test")
    rank = RankChannel("127.0.0.1", driver.port, "ppsplit-test", 0, 10.0)
    real_exit = os._exit
    def report(status):
        print("status", status, "error", driver.error(0)["line"], flush=True)
        real_exit(status)
    os._exit = report
    def broken():
        raise ValueError("a bug in where()")
    rank.where = broken
    time.sleep(30)
""")


def test_a_heartbeat_threads_bug_is_named_as_such(tmp_path):
    """The rank ends, and the driver reads that error, not "driver gone"."""
    script = tmp_path / "beat.py"
    script.write_text(HEARTBEAT_BUG)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "status 1 error RuntimeError: the heartbeat thread failed: ValueError: a bug in where()" in proc.stdout
    assert "driver is gone" not in proc.stderr


def _failing_sacct(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sacct").write_text("#!/bin/sh\necho 'sacct: error: Problem talking to the database' >&2\nexit 1\n")
    os.chmod(bin_dir / "sacct", 0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


def test_slurm_queries_that_fail_are_never_read_as_pending_or_not_cancelled(tmp_path, monkeypatch):
    from ppsplit.launch import slurm as slurm_ranks
    from ppsplit.errors import CheckFailed

    _failing_sacct(tmp_path, monkeypatch)
    monkeypatch.setattr(slurm_ranks.time, "sleep", lambda s: None)
    job = slurm_ranks.SlurmJob.__new__(slurm_ranks.SlurmJob)  # a submitted job's watcher, without the submission
    job.job = type("Job", (), {"job_id": "4242"})()
    job._state, job._state_at, job._failures, job.query_error = "SUBMITTED", 0.0, 0, None
    job.STATE_EVERY_S = 0.0
    states = [job.state() for _ in range(slurm_ranks.QUERY_TRIES)]
    assert states == ["UNKNOWN"] * (slurm_ranks.QUERY_TRIES - 1) + [slurm_ranks.UNANSWERED]
    assert "sacct exited with 1: sacct: error: Problem talking to the database" in job.query_error
    with pytest.raises(CheckFailed, match="cannot tell whether SLURM job 4242 was cancelled .* it is not requeued"):
        job.cancelled()


def test_a_requeued_run_that_uses_up_its_new_jobs_says_so(cfg_for, monkeypatch, tmp_path):
    """Each of launcher.max_requeue new jobs signalled in turn: the run goes on in each, then
    ends naming the limit it used up (and the checkpoint the last one saved)."""
    from ppsplit.app import job as job_mod
    from ppsplit.config.spec import from_config
    from ppsplit.errors import JobStopped

    given = ["launcher=slurm", "launcher.requeue=true", "launcher.max_requeue=2", "checkpoint.every=5",
             f"checkpoint.dir={tmp_path / 'ck'}"]
    spec = from_config(cfg_for(*given), overrides=given)
    starts = []

    def signalled(checked, output_dir, say, restarts):
        starts.append(checked.spec.checkpoint.load)
        err = JobStopped(5 * len(starts), f"SLURM job {len(starts)}")
        err.saved = str(tmp_path / "ck" / f"step-{5 * len(starts):06d}")
        raise err

    monkeypatch.setattr(job_mod, "_run_once", signalled)
    monkeypatch.setattr(job_mod, "validate", lambda s: type("Checked", (), {"spec": s})())
    said = []
    with pytest.raises(JobStopped) as caught:
        job_mod.run_job(spec, str(tmp_path), progress=said.append)
    assert len(starts) == 3 and sum("going on in a new job" in s for s in said) == 2
    assert str(caught.value) == (
        "SLURM job 3 was signalled by SLURM (its time limit, a preemption or a requeue); the ranks stopped "
        "at step 15; launcher.max_requeue=2 new jobs were all used (a larger launcher.max_requeue or "
        f"launcher.time_min goes further); checkpoint: {tmp_path / 'ck' / 'step-000015'} "
        "(checkpoint.load=auto goes on from it)")
