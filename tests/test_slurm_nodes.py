"""The two-node SLURM cluster (launchers/slurm/up.sh --nodes 2): each node its own network
namespace and hostname on a private bridge, so the ranks' rendezvous, gloo traffic and the
driver's channel cross a (virtual) network between nodes, not 127.0.0.1."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from ppsplit.app.cli import run
from conftest import run_cli
from helpers import compose_cfg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATE = os.environ.get("PPSPLIT_SLURM_NODES_DIR", "/tmp/ppsplit-slurm-nodes")
SLURM_CONF = os.path.join(STATE, "etc", "slurm.conf")
ACROSS = ("launcher=slurm", "launcher.nodes=2")  # the cluster's default partition, "nodes"
pytestmark = [pytest.mark.slurm, pytest.mark.slurm_nodes, pytest.mark.slow]


def up():
    proc = subprocess.run(["bash", os.path.join(ROOT, "launchers", "slurm", "up.sh"), "--nodes", "2"],
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        pytest.fail(f"launchers/slurm/up.sh --nodes 2 failed:\n{proc.stdout}\n{proc.stderr}")


@pytest.fixture(scope="session", autouse=True)
def two_node_cluster():
    """Bring the cluster up (idempotent: quick when it already runs)."""
    up()


@pytest.fixture(autouse=True)
def its_client_config(monkeypatch):
    """The SLURM client commands (and so submitit) talk to the two-node cluster."""
    monkeypatch.setenv("SLURM_CONF", SLURM_CONF)


def report_of(folder):
    return json.loads((folder / "report.json").read_text())["run"]


def node_pids(node: str) -> set[int]:
    out = subprocess.run(["ip", "netns", "pids", f"ppsplit-{node}"], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def daemon_pid(name: str) -> int:
    with open(os.path.join(STATE, "pids", f"{name}.pid")) as f:
        return int(f.read())


def leftovers() -> dict[str, set[int]]:
    """Processes in the nodes other than their slurmd."""
    out = {}
    for node in ("node1", "node2"):
        extra = node_pids(node) - {daemon_pid(f"slurmd-{node}")}
        if extra:
            out[node] = extra
    return out


def wait_no_leftovers(within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while leftovers() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not leftovers(), f"processes left on the nodes: {leftovers()}"


@pytest.mark.parametrize("launcher", ["slurm"])
def test_two_stages_across_two_nodes_equal_a_local_run(tmp_path, launcher):
    assert run(compose_cfg("model=gpt2", "stages=2", *ACROSS), str(tmp_path / "nodes")) == 0
    assert run(compose_cfg("model=gpt2", "stages=2", "launcher=local"), str(tmp_path / "local")) == 0
    nodes, local = report_of(tmp_path / "nodes"), report_of(tmp_path / "local")
    assert nodes["ok"] and nodes["nodes"] == {"node1": [0], "node2": [1]}
    assert [r["host"] for r in nodes["rank_layout"]] == ["node1", "node2"]
    assert nodes["losses"] == pytest.approx(local["losses"], rel=1e-7)
    assert nodes["final_state_digests"] == local["final_state_digests"]  # the tie crossed the nodes


@pytest.mark.parametrize("launcher", ["slurm"])
def test_four_stages_two_ranks_per_node_match_the_unsplit_model(tmp_path, launcher):
    assert run(compose_cfg("model=llama", "stages=4", *ACROSS), str(tmp_path)) == 0
    r = report_of(tmp_path)
    assert r["ok"] and r["nodes"] == {"node1": [0, 1], "node2": [2, 3]}
    assert r["losses"] == pytest.approx(r["reference_losses"], rel=1e-5)
    assert r["grad_max_abs_diff"] < 1e-5


@pytest.mark.parametrize("launcher", ["slurm"])
def test_a_rank_dying_on_node2_is_named_with_its_node(tmp_path, launcher):
    proc = run_cli("model=gpt2", "stages=2", *ACROSS, "debug.crash_rank=1", "debug.crash_mode=exit",
                   "debug.crash_step=1", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path,
                   env={"SLURM_CONF": SLURM_CONF})
    console = proc.stdout + proc.stderr
    assert proc.returncode == 1, console[-2000:]
    assert "ranks on 2 nodes: node1: rank 0; node2: rank 1" in console
    assert "rank 1 stopped answering" in console and "its node node2 went away" in console, console[-2000:]
    assert "Traceback" not in console
    wait_no_leftovers(30)


@pytest.mark.parametrize("launcher", ["slurm"])
def test_a_node_that_goes_away_fails_the_run_and_names_it(tmp_path, launcher):
    timeout_s = 60
    log = tmp_path / "console.txt"
    env = {**os.environ, "SLURM_CONF": SLURM_CONF}
    with open(log, "w") as out:
        driver = subprocess.Popen(
            [sys.executable, "-m", "ppsplit", "model=gpt2", "stages=2", *ACROSS, "steps=5000",
             f"timeout_s={timeout_s}", f"hydra.run.dir={tmp_path / 'run'}"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not re.search(r"step \d+/5000 done", log.read_text()):  # the ranks train
            assert driver.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        # node2 goes away: its slurmd and everything running on it, at once.
        gone = node_pids("node2")
        assert daemon_pid("slurmd-node2") in gone and len(gone) > 1, "no rank was running on node2"
        for pid in gone:
            os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        rc = driver.wait(timeout=timeout_s + 30)
        took = time.monotonic() - killed_at
        text = log.read_text()
        assert rc == 1, text
        assert "rank 1 stopped answering" in text and "node node2 went away" in text, text
        assert took < timeout_s, f"the run took {took:.0f} s to fail"
        wait_no_leftovers(60)
    finally:
        if driver.poll() is None:
            driver.kill()
        up()  # node2 comes back (its lost job is cleared first)


@pytest.mark.parametrize("launcher", ["slurm"])
def test_sweep_points_land_on_different_nodes(tmp_path, launcher):
    sweep = tmp_path / "sweep"
    proc = run_cli("-m", "model=gpt2", "stages=2", *ACROSS, "seed=0,1", f"hydra.sweep.dir={sweep}",
                   cwd=tmp_path, timeout=600, env={"SLURM_CONF": SLURM_CONF})
    assert proc.returncode == 0, proc.stderr[-2000:]
    reports = [report_of(sweep / str(i)) for i in (0, 1)]
    assert all(r["ok"] and r["nodes"] == {"node1": [0], "node2": [1]} for r in reports)
    # Each point's driver ran as a job of its own, on its own node, and its ranks reached it there.
    assert sorted(r["driver_host"] for r in reports) == ["node1", "node2"]


@pytest.mark.parametrize("launcher", ["slurm"])
def test_the_driver_listens_on_its_address_towards_the_controller(monkeypatch, launcher):
    from ppsplit.launch.slurm import driver_address

    assert driver_address() == "10.77.0.1"  # the bridge: what the nodes reach
    assert driver_address("login7") == "login7"  # a name given is taken as it is
    monkeypatch.setenv("SLURM_CONF", "/nonexistent/slurm.conf")
    assert driver_address() == __import__("socket").gethostname()  # no controller to route to


@pytest.mark.parametrize("launcher", ["slurm"])
@pytest.mark.parametrize("override, message", [
    ("launcher.nodes=3", "ppsplit: error: launcher.nodes=3: partition nodes has 2 nodes; allowed: 1 to 2"),
    ("launcher.partition=gpu", "ppsplit: error: launcher.partition=gpu: no such partition; allowed: nodes (2 nodes)"),
])
def test_more_nodes_than_the_partition_has_is_refused_before_anything_runs(tmp_path, launcher, override, message):
    # A job asking for more nodes than its partition has would wait in the queue for ever.
    proc = run_cli("model=gpt2", "stages=3", "launcher=slurm", override, f"hydra.run.dir={tmp_path / 'run'}",
                   cwd=tmp_path, env={"SLURM_CONF": SLURM_CONF})
    assert proc.returncode == 2 and proc.stderr.strip() == message, proc.stderr
    assert not (tmp_path / "run").exists()
