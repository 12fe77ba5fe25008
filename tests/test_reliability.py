"""Nothing lost, nothing orphaned, every failure named within its bound: real subprocesses, real
signals, real ranks (local here; the SLURM twins are in test_slurm.py)."""

import glob
import json
import os
import signal
import socket
import subprocess
import time

import pytest

from conftest import ForkedCli, run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" not in f.read()
    except OSError:
        return False


def rank_pids(run_dir) -> list[int]:
    return [int(open(f).read().split()[0]) for f in glob.glob(os.path.join(run_dir, "ranks", "rank*.pid"))]


def start_driver(run_dir, *overrides, env=None):
    """A driver that trains for a long time, in its own session (as a terminal would run it)."""
    return ForkedCli(["steps=100000", f"hydra.run.dir={run_dir}", *overrides], cwd=os.path.dirname(run_dir),
                     env=env)


def wait_training(run_dir, ranks=2, timeout=120):
    """Until every rank has written its pid and the ranks have taken a few steps."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if len(rank_pids(run_dir)) == ranks:
            time.sleep(6)  # past the rendezvous, into the steps
            return rank_pids(run_dir)
        time.sleep(0.2)
    pytest.fail("the ranks did not start")


def seconds_until_gone(pids, start, limit=30.0) -> float:
    while any(alive(p) for p in pids):
        if time.monotonic() - start > limit:
            pytest.fail(f"ranks {[p for p in pids if alive(p)]} still alive {limit} s later")
        time.sleep(0.02)
    return time.monotonic() - start


def stop(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait()


# --- data loss ------------------------------------------------------------------------------------

@pytest.mark.parametrize("late", [False, True], ids=["refused-before-the-folder", "refused-after-tracing"])
def test_bad_input_leaves_an_existing_folder_as_it_was(tmp_path, late):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep me")
    (user / "results").mkdir()
    bad = "split.points=[transformer.h.9]" if late else "stages=-1"
    proc = run_cli(*(["split=manual"] if late else []), bad, f"hydra.run.dir={user}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert sorted(p.name for p in user.iterdir()) == ["notes.txt", "results"]
    assert (user / "notes.txt").read_text() == "keep me"


def test_bad_input_in_the_current_folder_removes_nothing_but_its_own(tmp_path):
    (tmp_path / "data.txt").write_text("x")
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "mine.yaml").write_text("a: 1")
    proc = run_cli("split=manual", "split.points=[transformer.h.9]", "hydra.run.dir=.", cwd=tmp_path)
    assert proc.returncode == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hydra", "data.txt"]
    assert [p.name for p in (tmp_path / ".hydra").iterdir()] == ["mine.yaml"]


def test_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path):
    from ppsplit.app.cli import RunFolder

    target = tmp_path / "outputs" / "2026-12-03" / "10-00-00"
    first, second = RunFolder(str(target), "ppsplit"), RunFolder(str(target), "ppsplit")
    assert first.claim_unique() == str(target)
    assert second.claim_unique() == f"{target}-1"
    (target / "report.json").write_text("{}")  # the good run's output
    second.clean()  # the bad run cleans up its own folder only
    assert (target / "report.json").exists() and not os.path.exists(f"{target}-1")
    (target / "notes.txt").write_text("the user's")
    first.clean()  # a run removes its own files, never a folder holding what it did not write
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt"]


def test_a_good_and_a_bad_run_side_by_side_in_the_default_folder(tmp_path):
    good = ForkedCli(["launcher=inline", "steps=1"], cwd=tmp_path)
    bad = ForkedCli(["split=manual", "split.points=[transformer.h.9]"], cwd=tmp_path)
    assert bad.wait(timeout=300) == 2 and good.wait(timeout=300) == 0, good.stderr()
    reports = glob.glob(str(tmp_path / "outputs" / "*" / "*" / "report.json"))
    assert len(reports) == 1 and json.loads(open(reports[0]).read())["ok"]


def checkpoint_files(folder):
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)


def test_a_non_empty_checkpoint_folder_is_refused_before_any_rank(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "__0_0.distcp").write_text("an earlier checkpoint")
    run_dir = tmp_path / "run"
    proc = run_cli("checkpoint.save=true", f"checkpoint.dir={ckpt}", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("ppsplit: error: checkpoint.dir=") and "not empty" in line and "overwrite" in line
    assert checkpoint_files(ckpt) == ["__0_0.distcp"] and not run_dir.exists()


@pytest.mark.parametrize("kind", ["file", "read-only"])
def test_a_checkpoint_dir_that_cannot_be_written_is_refused(tmp_path, kind):
    if kind == "file":
        target = tmp_path / "ckpt"
        target.write_text("not a folder")
        expect = "is a file"
    else:
        target = "/sys/ppsplit-checkpoint"  # a read-only file system, even for root
        expect = "is not writable"
    proc = run_cli("checkpoint.save=true", f"checkpoint.dir={target}", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert proc.returncode == 2
    assert expect in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_overwrite_replaces_an_earlier_checkpoint_whole_and_only_when_the_new_one_stands(tmp_path):
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "ckpt"
    first = run_cli("launcher=inline", "checkpoint.save=true", f"checkpoint.dir={ckpt}", "optimizer=adamw",
                    f"hydra.run.dir={tmp_path}/a", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    before = checkpoint_files(ckpt)
    # A failing run with overwrite=true leaves the earlier checkpoint as it was, and no partial one.
    failing = run_cli("checkpoint.save=true", f"checkpoint.dir={ckpt}", "checkpoint.overwrite=true",
                      "debug.crash_rank=1", "debug.crash_step=1", f"hydra.run.dir={tmp_path}/b", cwd=tmp_path)
    assert failing.returncode == 1
    assert checkpoint_files(ckpt) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "ckpt"]
    # A passing one with SGD replaces it whole: no AdamW state left beside the new files.
    second = run_cli("checkpoint.save=true", f"checkpoint.dir={ckpt}", "checkpoint.overwrite=true",
                     f"hydra.run.dir={tmp_path}/c", cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    keys = set(dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    assert not any(k.endswith(".exp_avg") for k in keys)
    assert json.loads((ckpt / "ppsplit.json").read_text())["optimizer"]["name"] == "sgd"
    assert not glob.glob(str(tmp_path / ".ckpt.partial-*"))


def test_overwrite_never_replaces_a_folder_that_is_not_a_checkpoint(tmp_path):
    folder = tmp_path / "thesis"
    folder.mkdir()
    (folder / "chapter1.tex").write_text("...")
    proc = run_cli("checkpoint.save=true", f"checkpoint.dir={folder}", "checkpoint.overwrite=true",
                   f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert proc.returncode == 2 and "not a ppsplit checkpoint" in proc.stderr
    assert checkpoint_files(folder) == ["chapter1.tex"]


@pytest.mark.parametrize("launcher", ["inline", "local"])
def test_a_diverged_run_fails_naming_the_step_and_writes_strict_json(tmp_path, launcher):
    run_dir = tmp_path / "run"
    proc = run_cli("model=llama", "optimizer.lr=1e6", f"launcher={launcher}", f"hydra.run.dir={run_dir}",
                   cwd=tmp_path)
    assert proc.returncode == 1
    assert "training diverged in step 3/3: the loss is nan" in proc.stdout
    assert "PASSED" not in proc.stdout and "ties" not in proc.stdout.split("training diverged")[1]

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    data = json.loads((run_dir / "report.json").read_text(), parse_constant=refuse)
    assert not data["ok"] and not data["run"]["ok"] and data["run"]["diverged"]["step"] == 2
    assert os.stat(run_dir / "report.json").st_mode & 0o777 == 0o644


# --- processes left behind, failures reported late -------------------------------------------------

@pytest.mark.slow
def test_ranks_end_themselves_when_the_driver_is_killed(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_driver(run_dir)
    try:
        pids = wait_training(run_dir)
        start = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        gone = seconds_until_gone(pids, start)
    finally:
        stop(proc)
    assert gone < 5
    print(f"local SIGKILL of driver -> no rank left: {gone:.2f} s")


@pytest.mark.slow
def test_a_rank_killed_from_outside_is_reported_within_seconds(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_driver(run_dir, "timeout_s=60")
    try:
        pids = wait_training(run_dir)
        victim = int(open(run_dir / "ranks" / "rank1.pid").read().split()[0])
        start = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - start
    finally:
        stop(proc)
    assert proc.returncode == 1
    assert err.strip().splitlines()[-1] == ("ppsplit: check failed: rank 1 was killed by SIGKILL "
                                            "(e.g. the OOM killer, or kill -9)")
    assert took < 10 and not any(alive(p) for p in pids)
    print(f"local rank killed -> reported: {took:.2f} s")


@pytest.mark.slow
def test_a_failing_rank_is_reported_at_once_not_at_the_timeout(tmp_path):
    start = time.monotonic()
    proc = run_cli("debug.crash_rank=0", "debug.crash_step=1", "timeout_s=300", f"hydra.run.dir={tmp_path}/run",
                   cwd=tmp_path)
    took = time.monotonic() - start
    assert proc.returncode == 1  # one line, no traceback, at once: not after timeout_s
    assert proc.stderr.strip().splitlines() == [
        "ppsplit: check failed: rank 0 failed: RuntimeError: injected crash on rank 0 at step 1"]
    assert took < 100  # the whole run, start-up included; the timeout is 300 s


@pytest.mark.slow
def test_a_rank_that_aborts_natively_is_named_with_what_its_log_says(tmp_path):
    # gloo's errors end a process through std::terminate (SIGABRT) after a line on stderr; the
    # driver names the rank and that line, not only the signal
    proc = run_cli("debug.crash_rank=1", "debug.crash_step=0", "debug.crash_mode=abort", "timeout_s=300",
                   f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "ppsplit: check failed: rank 1 was killed by SIGABRT; its log ends: injected native abort on rank 1 at step 0"]


@pytest.mark.slow
def test_an_error_on_a_full_disk_still_reaches_the_user(tmp_path):
    disk = tmp_path / "small"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        proc = run_cli("checkpoint.save=true", f"checkpoint.dir={disk}/ckpt", f"hydra.run.dir={tmp_path}/run",
                       cwd=tmp_path)
        left = sorted(os.listdir(disk))
    finally:
        subprocess.run(["umount", str(disk)])
    assert proc.returncode == 1
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("ppsplit: check failed: rank ") and "No space left on device" in line, line
    assert left == []  # nothing half-written


@pytest.mark.slow
def test_concurrent_runs_and_a_master_port_never_share_a_store(tmp_path):
    env = {"MASTER_PORT": "29500", "MASTER_ADDR": "127.0.0.1"}
    runs = [ForkedCli([f"seed={seed}", f"hydra.run.dir={tmp_path}/{seed}"], cwd=tmp_path, env=env)
            for seed in (0, 1)]
    for proc in runs:
        assert proc.wait(timeout=300) == 0, proc.stderr()
    a, b = (json.loads((tmp_path / str(seed) / "report.json").read_text())["run"] for seed in (0, 1))
    assert a["ok"] and b["ok"] and a["losses"] != b["losses"]  # each compared with its own reference


def test_a_port_that_is_taken_is_refused_naming_it(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        proc = run_cli(f"launcher.port={port}", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"ppsplit: error: launcher.port={port}: cannot listen on 127.0.0.1:{port} (Address already in use); "
        "allowed: a free port, or null to let ppsplit choose one"]
    assert not (tmp_path / "run").exists()


# --- refuse early ---------------------------------------------------------------------------------

BAD = [
    (["seq_len=200"], "seq_len=200 is beyond the model's max_position_embeddings=128"),
    (["model.config.n_head=5"], "model.config: GPT2LMHeadModel refuses it"),
    (["schedule=interleaved_1f1b", "schedule.stages_per_rank=abc"], "schedule.stages_per_rank='abc'"),
    (["timeout_s=0"], "timeout_s=0: allowed: a number > 0"),
    (["tolerance=-1"], "tolerance=-1: allowed: a number >= 0"),
    (["timeout_s=abc"], "timeout_s='abc': allowed: a finite number > 0"),
    (["launcher.cpus_per_task=0"], "launcher.cpus_per_task=0: allowed: an integer >= 1"),
    (["split=layers", "split.first_stage_less=3"], "split.first_stage_less=3: the even share is 2"),
    (["model=llama", "model.config.num_hidden_layers=8", "stages=8"],
     "microbatches=4: schedule=1f1b needs microbatches >= stages (8)"),
    (["schedule=dualpipev", "stages=4", "microbatches=1", "batch_size=8"],
     "microbatches=1: schedule=dualpipev needs microbatches >= ranks (2)"),
    (["schedule=dualpipev", "stages=4", "microbatches=3", "batch_size=6"],
     "microbatches=3: schedule=dualpipev needs microbatches >= stages (4)"),
    (["split=manual", "split.points=[transformer.wte]"], "stage 0 (before the first split point) holds no parameter"),
    (["debug.crash_rank=7"], "debug.crash_rank=7: allowed: 0 to 1"),
    (["parallel.dp=2", "launcher=inline"], "parallel.dp=2 parallel.tp=1 needs ranks"),
    (["batch_size=4", "parallel.dp=2"], "batch_size=4 is not divisible by microbatches=4 x parallel.dp=2"),
    (["seq_lens=[16,200]"], "seq_lens=[16, 200] is beyond the model's max_position_embeddings=128; allowed: 2 to 128"),
    (["seq_lens=[1,32]"], "seq_lens=[1, 32]: allowed: integers >= 2"),
    (["seq_lens=abc"], "seq_lens='abc': allowed: a list of sequence lengths"),
    (["model=vit", "seq_lens=[16,32]"], "seq_lens=[16, 32]: ViTForImageClassification takes images"),
    (["model=llama", "parallel.tp=2", "seq_lens=[16,32]"], "seq_lens=[16, 32] with parallel.tp=2"),
    (["parallel.fsdp_reshard=block"], "parallel.fsdp_reshard='block' is not known; allowed: step, microbatch"),
    (["parallel.fsdp_unit_mib=0"], "parallel.fsdp_unit_mib=0: allowed: a number > 0"),
    (["parallel.fsdp_param_dtype=bfloat16"], "parallel.fsdp_param_dtype=bfloat16 with train.precision=fp32: "
     "allowed: train.precision=bf16, or parallel.fsdp_param_dtype=float32"),
    (["parallel.fsdp_param_dtype=fp16"], "parallel.fsdp_param_dtype='fp16' is not known; allowed: float32, bfloat16"),
]


@pytest.mark.parametrize("overrides,expect", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_values_are_one_line_exit_2_and_leave_nothing(tmp_path, overrides, expect):
    run_dir = tmp_path / "run"
    proc = run_cli(*overrides, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ppsplit: error: ") and expect in lines[0], lines
    assert not run_dir.exists() and not (tmp_path / "outputs").exists()


def test_a_corrupt_pretrained_config_is_refused(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{ not json")
    (folder / "model.safetensors").write_bytes(b"")
    proc = run_cli(f"model.pretrained={folder}", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert proc.returncode == 2
    assert "its config.json cannot be read" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_slurm_without_a_controller_is_refused_naming_up_sh(tmp_path):
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=nowhere\nSlurmctldHost=localhost\nSlurmctldPort=9\nMessageTimeout=2\n"
                    "NodeName=localhost CPUs=1 State=UNKNOWN\nPartitionName=debug Nodes=localhost Default=YES\n")
    proc = run_cli("launcher=slurm", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path,
                   env={"SLURM_CONF": str(conf)}, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "launcher=slurm" in lines[0] and "launchers/slurm/up.sh" in lines[0]
    assert not (tmp_path / "run").exists()
