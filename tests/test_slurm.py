"""The real SLURM cluster (launchers/slurm/up.sh): jobs submitted through submitit, sweeps as
concurrent jobs, failures and time-outs reported."""

import json
import os
import signal
import subprocess
import time

import pytest

from ppsplit import CheckFailed
from ppsplit.app.cli import run
from conftest import ForkedCli
from helpers import compose_cfg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture(scope="session", autouse=True)
def slurm_cluster():
    """Bring the cluster up (idempotent: quick when it already runs)."""
    proc = subprocess.run(["bash", os.path.join(ROOT, "launchers", "slurm", "up.sh")],
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        pytest.fail(f"launchers/slurm/up.sh failed:\n{proc.stdout}\n{proc.stderr}")


def report_of(folder):
    return json.loads((folder / "report.json").read_text())


@pytest.mark.parametrize("launcher", ["slurm"])
@pytest.mark.parametrize("model", ["t5"])  # gpt2 on SLURM: the README's command
def test_slurm_run_equals_local_run(tmp_path, model, launcher):
    assert run(compose_cfg(f"model={model}", "launcher=slurm"), str(tmp_path / "slurm")) == 0
    assert run(compose_cfg(f"model={model}", "launcher=local"), str(tmp_path / "local")) == 0
    slurm, local = report_of(tmp_path / "slurm")["run"], report_of(tmp_path / "local")["run"]
    assert slurm["launcher"] == "slurm" and slurm["ok"]
    assert slurm["losses"] == pytest.approx(local["losses"], rel=1e-7)
    assert slurm["final_state_digests"] == local["final_state_digests"]
    # The SLURM job's ranks timed their actions too: the same trace, picture and figures.
    timeline = slurm["timeline"]
    trace = json.loads((tmp_path / "slurm" / "timeline.json").read_text())["traceEvents"]
    assert {e["pid"] for e in trace if e["ph"] == "X" and e["cat"] == "forward"} == {0, 1}
    assert (tmp_path / "slurm" / "timeline.png").stat().st_size > 10_000
    assert timeline["bubble_theory"] == pytest.approx(local["timeline"]["bubble_theory"])
    assert [s["stage"] for s in timeline["stages"]] == [0, 1]


@pytest.mark.parametrize("launcher", ["slurm"])
def test_slurm_rank_crash_is_named(tmp_path, launcher):
    cfg = compose_cfg("model=gpt2", "launcher=slurm", "debug.crash_rank=1", "debug.crash_step=1")
    start = time.monotonic()
    with pytest.raises(CheckFailed, match="rank 1 failed: RuntimeError: injected crash on rank 1"):
        run(cfg, str(tmp_path))
    assert time.monotonic() - start < 120


@pytest.mark.parametrize("launcher", ["slurm"])
def test_slurm_hung_rank_is_named_and_the_job_cancelled(tmp_path, launcher):
    cfg = compose_cfg("model=gpt2", "launcher=slurm", "debug.crash_rank=0", "debug.crash_step=0",
                      "debug.crash_mode=hang", "timeout_s=12")
    with pytest.raises(CheckFailed, match=r"no progress for timeout_s=12: rank 0 in step 1/3 at ppsplit/faults.py:\d+ in inject_crash"):
        run(cfg, str(tmp_path))
    job_id = [l for l in os.listdir(tmp_path / "submitit") if l.endswith("_submission.sh")]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the cancelled job leaves the queue
        out = subprocess.run(["squeue", "-h", "-n", "ppsplit", "-o", "%i %T"], capture_output=True,
                             text=True).stdout
        if not any(j.split("_")[0] in out for j in job_id):
            break
        time.sleep(1)
    else:
        pytest.fail(f"job still queued: {out}")


def start_driver(run_dir, *overrides):
    return ForkedCli(["launcher=slurm", "steps=100000", f"hydra.run.dir={run_dir}", *overrides],
                     cwd=os.path.dirname(run_dir))


@pytest.mark.parametrize("launcher", ["slurm"])
@pytest.mark.parametrize("what", ["SIGTERM", "SIGKILL", "rank"])
def test_slurm_ranks_never_outlive_their_driver_and_a_killed_rank_is_named(tmp_path, launcher, what):
    from test_reliability import alive, seconds_until_gone, stop, wait_training

    run_dir = tmp_path / "run"
    proc = start_driver(run_dir)
    try:
        pids = wait_training(run_dir)
        start = time.monotonic()
        if what == "rank":
            os.kill(int(open(run_dir / "ranks" / "rank1.pid").read().split()[0]), signal.SIGKILL)
        else:
            os.kill(proc.pid, getattr(signal, what))
        if what == "SIGKILL":
            gone = seconds_until_gone(pids, start)
        else:
            _, err = proc.communicate(timeout=60)
            gone = seconds_until_gone(pids, start)
    finally:
        stop(proc)
    if what == "SIGTERM":
        assert proc.returncode == 143
        assert err.strip().splitlines() == ["ppsplit: interrupted by SIGTERM; no rank is left running"]
    if what == "rank":
        assert proc.returncode == 1
        assert err.strip().splitlines()[-1].startswith("ppsplit: check failed: rank 1 stopped answering")
    assert gone < 15  # control.DRIVER_LOST_S bounds a rank whose driver vanished
    print(f"slurm {what} -> {'reported and ' if what == 'rank' else ''}no rank left: {gone:.2f} s")
    assert not any(alive(p) for p in pids)


@pytest.mark.parametrize("launcher", ["slurm"])
def test_scontrol_requeue_of_the_running_job_goes_on_in_a_new_one(tmp_path, launcher):
    """The ranks' job requeued by hand mid-run: they save within KillWait, the run goes on in a
    new job from there, and the requeued copy is cancelled (it would start again later)."""
    ck, run_dir, steps = tmp_path / "ck", tmp_path / "run", 300
    proc = ForkedCli(["launcher=slurm", f"steps={steps}", "checkpoint.every=100000", f"checkpoint.dir={ck}",
                      "launcher.requeue=true", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    try:
        end = time.monotonic() + 240
        while not (run_dir / "metrics.csv").exists() or len((run_dir / "metrics.csv").read_text().splitlines()) < 5:
            assert proc.poll() is None and time.monotonic() < end, proc.stderr()[-2000:]
            time.sleep(0.1)
        job = next(w for line in proc.stdout().splitlines() if "ranks: 2 started (SLURM job" in line
                   for w in [line.split("SLURM job ")[1].split(";")[0]])
        subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True, timeout=30)
        assert proc.wait(300) == 0, proc.stderr()[-2000:]
    finally:
        proc.kill()
    (restart,) = report_of(run_dir)["run"]["restarts"]
    assert restart["job"] == f"SLURM job {job}" and restart["stopped_at"] >= 4
    assert os.readlink(ck / "latest") == f"step-{steps:06d}"
    time.sleep(1)
    states = subprocess.run(["sacct", "-j", job, "-X", "-n", "-o", "State"], capture_output=True, text=True).stdout
    assert "PENDING" not in states and "RUNNING" not in states, states  # the requeued copy is gone
