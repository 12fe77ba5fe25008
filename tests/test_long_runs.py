"""Long runs survive: a step folder every ``checkpoint.every`` steps, the newest ``keep`` kept, a
``latest`` link, and ``checkpoint.load=auto`` going on from the newest after the driver was
killed, with the whole loss curve equal to an uninterrupted run's, bit for bit. Bad input is
refused in one line before any rank starts, with nothing removed."""

import csv
import fcntl
import json
import os
import shutil
import signal
import time

import pytest

from conftest import ForkedCli, run_cli
from test_reliability import alive, rank_pids

from ppsplit.checkpoint.folder import MARKER, foreign_entry
from ppsplit.checkpoint.series import LOCK

SERIES = ("steps=6", "checkpoint.every=2", "checkpoint.keep=2")


def losses(folder) -> list[str]:
    """metrics.csv's loss column as written (repr of the float: equal text is equal bits)."""
    with open(os.path.join(folder, "metrics.csv"), newline="") as f:
        return [(row["step"], row["loss"]) for row in csv.DictReader(f)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Two local ranks, 6 steps, a step folder every 2, the newest 2 kept."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    proc = run_cli(*SERIES, f"checkpoint.dir={folder / 'ck'}", f"hydra.run.dir={folder / 'run'}", cwd=folder)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return folder


def test_every_n_steps_a_step_folder_the_newest_kept_and_latest_linked(uninterrupted):
    ck = uninterrupted / "ck"
    assert sorted(os.listdir(ck)) == [LOCK, "latest", "step-000004", "step-000006"]
    assert os.readlink(ck / "latest") == "step-000006"
    for step in (4, 6):
        folder = ck / f"step-{step:06d}"
        meta = json.loads((folder / MARKER).read_text())
        assert meta["step"] == step and meta["data"]["next_step"] == step
        assert foreign_entry(str(folder)) is None  # the manifest lists all it holds, metrics.csv too
        assert [s for s, _ in losses(folder)] == [str(k) for k in range(1, step + 1)]
    assert losses(ck / "step-000006") == losses(uninterrupted / "run")
    report = json.loads((uninterrupted / "run" / "report.json").read_text())
    assert [os.path.basename(p) for p in report["run"]["checkpoints"]] == \
        ["step-000002", "step-000004", "step-000006"]  # written in turn; the oldest then removed
    assert report["run"]["checkpoint"] == str(ck / "step-000006")


@pytest.mark.slow
def test_killed_driver_then_auto_resume_gives_the_uninterrupted_curve(tmp_path, uninterrupted):
    ck = tmp_path / "ck"
    # Rank 1 hangs at step 5: the driver is killed -9 once step 4's checkpoint stands.
    proc = ForkedCli([*SERIES, f"checkpoint.dir={ck}", f"hydra.run.dir={tmp_path / 'a'}", "debug.crash_rank=1",
                      "debug.crash_step=4", "debug.crash_mode=hang"], cwd=tmp_path)
    try:
        end = time.monotonic() + 240
        while not (os.path.islink(ck / "latest") and os.readlink(ck / "latest") == "step-000004"):
            assert proc.poll() is None and time.monotonic() < end, f"no step-4 checkpoint: {proc.stderr()[-2000:]}"
            time.sleep(0.05)
        ranks = rank_pids(tmp_path / "a")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    end = time.monotonic() + 30
    while any(alive(p) for p in ranks) and time.monotonic() < end:
        time.sleep(0.1)
    assert not any(alive(p) for p in ranks), "ranks outlived the killed driver"
    assert os.readlink(ck / "latest") == "step-000004"
    (ck / "notes.txt").write_text("mine")  # the user's, beside the step folders: never touched
    (ck / "step-000001").mkdir()  # a step-like folder that ppsplit did not write

    # Every step now, the newest kept: step 4, which this run loaded (and its unsplit reference
    # reads again at the end), outlives step 5 until the final step stands.
    again = run_cli(*SERIES, "checkpoint.every=1", "checkpoint.keep=1", f"checkpoint.dir={ck}", "checkpoint.load=auto",
                    f"hydra.run.dir={tmp_path / 'b'}", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "PASSED" in again.stdout
    assert f"checkpoint.load=auto: going on from {ck / 'step-000004'} (step 4 of steps=6)" in again.stdout
    assert losses(tmp_path / "b") == losses(uninterrupted / "run")  # all 6 rows, bit for bit
    report = json.loads((tmp_path / "b" / "report.json").read_text())
    assert report["run"]["resumed_from"]["step"] == 4 and report["run"]["steps"] == 2
    assert [os.path.basename(p) for p in report["run"]["checkpoints"]] == ["step-000005", "step-000006"]
    assert report["run"]["checkpoint"] == str(ck / "step-000006") and os.readlink(ck / "latest") == "step-000006"
    assert sorted(os.listdir(ck)) == [LOCK, "latest", "notes.txt", "step-000001", "step-000006"]
    assert not any(n.startswith(".") and n != LOCK for n in os.listdir(ck))  # the killed run's staging is gone

    done = run_cli(*SERIES, "checkpoint.keep=1", f"checkpoint.dir={ck}", "checkpoint.load=auto",
                   f"hydra.run.dir={tmp_path / 'c'}", cwd=tmp_path)
    assert done.returncode == 0 and "nothing left to train" in done.stdout, done.stderr[-2000:]
    assert json.loads((tmp_path / "c" / "report.json").read_text())["nothing_left"]["step"] == 6


def test_inline_auto_starts_fresh_then_saves_every_step(tmp_path):
    ck = tmp_path / "new" / "ck"
    proc = run_cli("launcher=inline", "steps=3", "checkpoint.every=1", "checkpoint.keep=1", f"checkpoint.dir={ck}",
                   "checkpoint.load=auto", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no checkpoint in" in proc.stdout and "starting at step 0" in proc.stdout
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert [os.path.basename(p) for p in report["run"]["checkpoints"]] == [f"step-00000{k}" for k in (1, 2, 3)]
    assert sorted(os.listdir(ck)) == [LOCK, "latest", "step-000003"]
    assert losses(ck / "step-000003") == losses(tmp_path / "run")


def _user_folder(tmp_path, uninterrupted, kind):
    ck = tmp_path / "ck"
    if kind == "files":
        ck.mkdir()
        (ck / "data.bin").write_text("mine")
    elif kind in ("series", "series-auto"):
        shutil.copytree(uninterrupted / "ck", ck, symlinks=True)
    return ck


BAD = {  # case -> (overrides, the folder's contents, what the one line says)
    "every=0": (["checkpoint.every=0"], None, "checkpoint.every=0: allowed: a whole number of steps >= 1"),
    "keep=0": (["checkpoint.every=2", "checkpoint.keep=0"], None, "checkpoint.keep=0: allowed: a whole number >= 1"),
    "keep-alone": (["checkpoint.keep=2"], None, "checkpoint.keep=2 without checkpoint.every"),
    "auto-alone": (["checkpoint.load=auto"], None, "checkpoint.load=auto resumes from the step folders"),
    "overwrite": (["checkpoint.every=2", "checkpoint.overwrite=true"], None, "step folders are never replaced"),
    "user-files": (["checkpoint.every=2"], "files", "is not empty (data.bin is not a ppsplit checkpoint)"),
    "earlier-run": (["checkpoint.every=2"], "series", "holds the checkpoints of an earlier run (newest: step-000006)"),
    "other-seed": (["checkpoint.every=2", "checkpoint.load=auto", "seed=1"], "series-auto",
                   "was made with seed=0 (here 1)"),
    "other-model": (["checkpoint.every=2", "checkpoint.load=auto", "model.config.n_layer=2"], "series-auto",
                    "holds another model"),
    "locked": (["checkpoint.every=2"], "locked", "is in use by another run (pid 4242)"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_before_any_rank_with_nothing_removed(tmp_path, uninterrupted, case):
    overrides, kind, says = BAD[case]
    ck = _user_folder(tmp_path, uninterrupted, kind)
    held = None
    if kind == "locked":  # another run holds the folder
        ck.mkdir()
        held = open(ck / LOCK, "w")
        held.write("4242 cafe\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    try:
        proc = run_cli("steps=6", *overrides, f"checkpoint.dir={ck}", f"hydra.run.dir={tmp_path / 'run'}",
                       cwd=tmp_path)
    finally:
        if held:
            held.close()
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], proc.stderr[-2000:]
    assert lines[0].startswith("ppsplit: error: ") and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "ranks").exists()  # refused before any rank started
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if "run" not in p.parts)
    assert after == [p for p in before if "run" not in p.parts]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=lambda s: s.name)
def test_a_stop_signal_saves_where_training_stands_then_auto_goes_on(tmp_path, sig):
    ck, run = tmp_path / "ck", tmp_path / "a"
    proc = ForkedCli(["steps=100000", "checkpoint.every=100000", f"checkpoint.dir={ck}", f"hydra.run.dir={run}"],
                     cwd=tmp_path)
    try:
        end = time.monotonic() + 240
        while not (run / "metrics.csv").exists() or len((run / "metrics.csv").read_text().splitlines()) < 4:
            assert proc.poll() is None and time.monotonic() < end, proc.stderr()[-2000:]
            time.sleep(0.05)
        ranks = rank_pids(run)
        proc.send_signal(sig)
        assert proc.wait(60) == 128 + sig
    finally:
        proc.kill()
    (line,) = proc.stderr().strip().splitlines()
    step = int(os.readlink(ck / "latest").split("-")[1])
    assert line == (f"ppsplit: interrupted by {sig.name}; checkpoint: {ck / f'step-{step:06d}'} "
                    "(checkpoint.load=auto goes on from it); no rank is left running")
    assert not any(alive(p) for p in ranks)
    saved = losses(ck / f"step-{step:06d}")
    assert [s for s, _ in saved] == [str(k) for k in range(1, step + 1)] and saved == losses(run)
    again = run_cli(f"steps={step + 1}", "checkpoint.every=100000", f"checkpoint.dir={ck}", "checkpoint.load=auto",
                    f"hydra.run.dir={tmp_path / 'b'}", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert losses(tmp_path / "b")[:step] == saved and len(losses(tmp_path / "b")) == step + 1
