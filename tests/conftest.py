import gc
import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from ppsplit.app.cli import CONF_DIR, DRIVER_GC_THRESHOLDS

MODELS = ("gpt2", "llama", "bert", "t5")
MORE_MODELS = ("qwen2_moe", "bart", "vit", "albert")  # more families, configured like the four
LAUNCHERS = ("inline", "local", "slurm")

# Most tests run the driver in this process (build, trace, check, the unsplit reference), which
# makes objects by the million and keeps few: at the default thresholds 16% of tests/test_split.py
# went to full collections of the session's heap. The command line's own setting keeps them young.
gc.set_threshold(*DRIVER_GC_THRESHOLDS)


def pytest_addoption(parser):
    parser.addoption("--model", choices=MODELS + MORE_MODELS + ("hf",), default=None,
                     help="run only the model-parametrized tests of this model (the CI matrix)")
    parser.addoption("--launcher", choices=LAUNCHERS, default=None,
                     help="run only the launcher-parametrized tests of this launcher")


def pytest_collection_modifyitems(config, items):
    chosen = {k: config.getoption(f"--{k}") for k in ("model", "launcher")}
    if not any(chosen.values()):
        return
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        unwanted = any(
            want and params.get(k) is not None and params.get(k) != want
            for k, want in chosen.items()
        )
        (drop if unwanted else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(autouse=True)
def reports_follow_the_schema(tmp_path):
    """Every report.json a test leaves under its tmp_path is valid against ppsplit's schema."""
    yield
    import glob
    import json

    import jsonschema

    from ppsplit.report.text import schema

    validator = jsonschema.Draft202012Validator(schema())
    for path in glob.glob(os.path.join(str(tmp_path), "**", "report.json"), recursive=True):
        with open(path) as f:
            errors = sorted(validator.iter_errors(json.load(f)), key=str)
        assert not errors, f"{path}: {errors[0].json_path}: {errors[0].message}"


@pytest.fixture
def cfg_for():
    """Compose the real configs with overrides, as the command line does."""
    def _compose(*overrides):
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides))
    return _compose


from forked_cli import ForkedCli, run_cli  # noqa: E402,F401  (the command line, forked: see forked_cli)


def run_real_cli(*args, cwd, timeout=300, env=None):
    """Run ``python -m ppsplit`` as its own interpreter, as a user would."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "ppsplit", *args], cwd=cwd, capture_output=True, text=True,
        timeout=timeout, env=full_env,
    )
