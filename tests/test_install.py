"""Installs like a well-kept tool: the built wheel, in a new virtual environment, runs from any
folder with its configs, Hydra's help and completion, and a user's own config folder."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


def outer_site_packages() -> list[str]:
    """The package folders of the environment that runs the tests: a virtual environment's (and
    the base interpreter's, where it sees them) or the machine's own."""
    return [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages") and os.path.isdir(p)]


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A new virtual environment with the built wheel. It sees the packages of the environment
    that runs the tests (torch, transformers: the pinned CPU build, no download), after its own,
    but not this checkout. ``--system-site-packages`` would give it the base interpreter's, which
    inside a virtual environment lack them; the outer folders go on its path as plain lines of a
    ``.pth`` file instead, so that their own ``.pth`` files (an editable install's, which points
    at the checkout) are never run."""
    base = tmp_path_factory.mktemp("install")
    dist = base / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(dist), ROOT], check=True, capture_output=True)
    (wheel,) = dist.glob("ppsplit-*.whl")
    env_dir = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True)
    python = str(env_dir / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(site, "outer_environment.pth"), "w") as f:
        f.write("".join(p + "\n" for p in outer_site_packages()))
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", str(wheel)], check=True,
                   capture_output=True)
    return env_dir


def ppsplit(venv, *args, cwd, env=None):
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    return subprocess.run([str(venv / "bin" / "ppsplit"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**clean, **(env or {})})


def test_the_installed_package_is_the_wheel_with_its_configs(venv, tmp_path):
    proc = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import ppsplit.app.cli; print(ppsplit.app.cli.__file__); print(ppsplit.app.cli.CONF_DIR)"],
                          cwd=tmp_path, capture_output=True, text=True, check=True,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    module, conf = proc.stdout.split()
    assert module.startswith(str(venv)) and conf.startswith(str(venv))
    seen = subprocess.run([str(venv / "bin" / "python"), "-c", "import sys, torch; print(torch.__file__); print(sys.path)"],
                          cwd=tmp_path, capture_output=True, text=True, check=True,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}).stdout
    assert "site-packages" in seen.splitlines()[0]  # the testing environment's torch, not a download
    assert f"'{ROOT}'" not in seen  # and never the checkout
    assert os.path.isfile(os.path.join(conf, "model", "llama.yaml"))


def test_runs_the_main_job_and_a_sweep_from_an_unrelated_folder(venv, tmp_path):
    proc = ppsplit(venv, cwd=tmp_path)  # the default: local ranks, started from the installed package
    assert proc.returncode == 0, proc.stderr[-2000:]
    (report,) = tmp_path.glob("outputs/*/*/report.json")
    assert json.loads(report.read_text())["ok"]
    assert "PASSED" in (report.parent / "ppsplit.log").read_text()  # the console, in the run folder
    sweep = ppsplit(venv, "-m", "launcher=inline", "steps=0", "stages=2,4", "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert sweep.returncode == 0, sweep.stderr[-2000:]
    assert (tmp_path / "sweep" / "summary.csv").read_text().count("\n") == 3


def test_help_config_and_completion(venv, tmp_path):
    helped = ppsplit(venv, "--help", cwd=tmp_path)
    assert helped.returncode == 0 and "Traceback" not in helped.stdout + helped.stderr
    models = sorted(f[:-5] for f in os.listdir(os.path.join(ROOT, "conf", "model")) if f.endswith(".yaml"))
    assert {"gpt2", "llama", "bert", "t5"} <= set(models)
    assert "ppsplit is powered by Hydra" in helped.stdout and f"model: {', '.join(models)}" in helped.stdout
    cfg = ppsplit(venv, "--cfg", "job", cwd=tmp_path)
    assert cfg.returncode == 0 and "model_class: GPT2LMHeadModel" in cfg.stdout
    info = ppsplit(venv, "--info", cwd=tmp_path)
    assert info.returncode == 0 and "Traceback" not in info.stdout + info.stderr
    completed = ppsplit(venv, "-sc", "query=bash", cwd=tmp_path, env={"COMP_LINE": "ppsplit model=", "COMP_POINT": "14"})
    assert completed.stdout.split() == [f"model={m}" for m in models]


def test_a_users_own_model_config_folder(venv, tmp_path):
    mine = tmp_path / "myconf" / "model"
    mine.mkdir(parents=True)
    text = open(os.path.join(ROOT, "conf", "model", "gpt2.yaml")).read()
    (mine / "gpt2_6l.yaml").write_text(text.replace("name: gpt2", "name: gpt2_6l").replace("n_layer: 4", "n_layer: 6"))
    proc = ppsplit(venv, "--config-dir", str(tmp_path / "myconf"), "model=gpt2_6l", "stages=3", "launcher=inline",
                   "steps=1", "hydra.run.dir=run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "run" / "report.json").read_text())
    assert data["model"] == "gpt2_6l" and [s["num_blocks"] for s in data["stage_info"]] == [2, 2, 2]
