"""The command line as a user meets it: the main job, and one-line errors for bad input."""

import json
import os

import pytest
import torch

from ppsplit import PpsplitError
from ppsplit.app.cli import run
from conftest import run_cli
from helpers import compose_cfg


BAD = [
    (["split=manual", "split.points=[transformer.h.9]"], "transformer.h.9", "did you mean"),
    (["split=manual", "split.points=[transformer.h.3,transformer.h.1]"], "out of order", None),
    (["split=manual", "split.points=[transformer.h.2,transformer.h.2]"], "repeated", None),
    (["split=manual", "split.points=[transformer.h.2,transformer.h.2.ln_1]"], "empty", None),
    (["split=manual"], "split.points", None),
    (["stages=0"], "stages=0", None),
    (["stages=5"], "stages=5", "1 to 4"),
    (["batch_size=6", "microbatches=4"], "batch_size=6", "microbatches=4"),
    (["model.pretrained=/nonexistent/dir"], "/nonexistent/dir", None),
]


@pytest.mark.parametrize("overrides,names,allowed", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_is_refused(tmp_path, overrides, names, allowed):
    cfg = compose_cfg("model=gpt2", *overrides)
    with pytest.raises(PpsplitError) as info:
        run(cfg, str(tmp_path))
    message = str(info.value)
    assert names in message and "\n" not in message
    if allowed:
        assert allowed in message
    assert not (tmp_path / "report.json").exists()


def test_pretrained_folder_without_model(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    cfg = compose_cfg("model=gpt2", f"model.pretrained={empty}")
    with pytest.raises(PpsplitError, match="holds no model"):
        run(cfg, str(tmp_path))


@pytest.mark.parametrize("overrides,expect", [
    (["split=manual", "split.points=[transformer.h.9]"], "transformer.h.9"),
    (["batch_size=6", "microbatches=4"], "batch_size=6"),
    (["model.pretrained=/nonexistent/dir"], "/nonexistent/dir"),
])
def test_bad_input_exits_2_with_one_line_and_no_run_folder(tmp_path, overrides, expect):
    run_dir = tmp_path / "run"
    proc = run_cli(*overrides, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("ppsplit: error:") and expect in lines[0]
    assert not run_dir.exists()


MISTAKES = [
    (["stagess=2"], "stagess=2: no such key (did you mean stages"),
    (["parallel.dpp=2"], "parallel.dpp=2: no such key (did you mean parallel.dp"),
    (["schedule=nosuch"], "schedule=nosuch is not known; allowed: 1f1b, dualpipev, gpipe"),
    (["launcher=mpi"], "launcher=mpi is not known; allowed: inline, local, slurm"),
    (["model=gpt3"], "model=gpt3 is not known; allowed: albert, bart, bert, gpt2, hf, llama"),
    (["-m", "model=gpt2,gpt3"], "model=gpt3 is not known"),
    (["model.config.newkey=3"], "model.config has no key 'newkey'"),
    (["model.config.newkey=3"], "a new key needs +: +model.config.newkey=3"),
    (["+stages=3"], "+stages=3: stages exists already; allowed: stages=3"),
    (["checkpoint.dir=/tmp/my", "dir"], "a value with a space needs quotes: 'checkpoint.dir=/tmp/my dir'"),
    (["stages=[1"], "'stages=[1' does not parse"),
]


@pytest.mark.parametrize("argv,expect", MISTAKES, ids=[" ".join(m[0]) for m in MISTAKES])
def test_every_mistake_on_the_command_line_is_one_line(argv, expect):
    from ppsplit.app.cli import CONF_DIR
    from ppsplit.config.overrides import check_command_line

    with pytest.raises(PpsplitError) as info:
        check_command_line(argv, CONF_DIR)
    assert expect in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("argv", [["stagess=2"], ["-m", "schedule=nosuch"], ["checkpoint.dir=/tmp/my", "dir"]])
def test_a_mistake_hydra_would_report_exits_2_with_one_line_and_no_folder(tmp_path, argv):
    proc = run_cli(*argv, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ppsplit: error: "), lines
    assert os.listdir(tmp_path) == []


def test_a_good_command_line_passes_the_check():
    from ppsplit.app.cli import CONF_DIR
    from ppsplit.config.overrides import check_command_line

    check_command_line(["-m", "model=gpt2,llama", "stages=2,4", "+model.config.new=1", "split=manual",
                        "split.points=[transformer.h.1]", "hydra.run.dir=/tmp/x y"], CONF_DIR)


def test_pretrained_local_folder_loads_real_weights(tmp_path):
    from ppsplit.models import build
    from ppsplit.config.spec import from_config

    s = from_config(compose_cfg("model=gpt2")).model
    saved = build.build_model(s.class_name, s.config, seed=123)
    saved.save_pretrained(tmp_path / "gpt2")
    cfg = compose_cfg("model=gpt2", f"model.pretrained={tmp_path / 'gpt2'}")
    assert run(cfg, str(tmp_path)) == 0
    loaded = build.build_model(s.class_name, pretrained=str(tmp_path / "gpt2"))
    ref = saved.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in loaded.state_dict().items())


def test_pretrained_takes_its_config_and_the_overrides_given_on_the_command_line(tmp_path):
    from ppsplit.models import build
    from ppsplit.config.spec import from_config

    s = from_config(compose_cfg("model=gpt2")).model
    saved = build.build_model(s.class_name, dict(s.config, n_layer=2), seed=5)
    saved.save_pretrained(tmp_path / "gpt2")
    given = ["model=gpt2", f"model.pretrained={tmp_path / 'gpt2'}", "+model.config.layer_norm_epsilon=0.001"]
    spec = from_config(compose_cfg(*given), overrides=given)
    assert spec.model.config == {"layer_norm_epsilon": 0.001}  # not the model file's n_layer: 4
    loaded = build.build_model(spec.model.class_name, spec.model.config, spec.model.pretrained)
    assert loaded.config.n_layer == 2 and loaded.config.layer_norm_epsilon == 0.001
    proc = run_cli(*given[1:], "launcher=inline", "steps=1", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "model.config over" in proc.stdout and "layer_norm_epsilon=0.001" in proc.stdout
    assert json.loads((tmp_path / "run" / "report.json").read_text())["stages"] == 2
