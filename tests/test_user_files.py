"""Nothing of the user's is ever lost or overwritten: a checkpoint folder is replaced only when
all it holds is what ppsplit wrote (its manifest says so), and a run never changes another run's
files. User files are compared by checksum before and after."""

import hashlib
import json
import os
import shutil

import pytest

from conftest import run_cli
from ppsplit import PpsplitError
from ppsplit.checkpoint.folder import MARKER, Target, foreign_entry, manifest_of, remove_checkpoint


def checksums(folder) -> dict[str, str]:
    """Every entry under ``folder``: a file's SHA-256, a folder as 'dir', a link as its target."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if os.path.islink(path):
                out[rel] = "link:" + os.readlink(path)
            elif os.path.isdir(path):
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


def one_error_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("ppsplit: error: "), lines
    return lines[0]


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    """A real ppsplit checkpoint (one inline step), written once for this file's tests."""
    folder = tmp_path_factory.mktemp("saved")
    proc = run_cli("launcher=inline", "steps=1", "checkpoint.save=true", f"checkpoint.dir={folder / 'ckpt'}",
                   "checkpoint.hf=true", f"hydra.run.dir={folder / 'run'}", cwd=folder)
    assert proc.returncode == 0, proc.stderr
    return folder / "ckpt"


def test_the_manifest_lists_every_file_the_checkpoint_holds(saved_checkpoint):
    meta = json.loads((saved_checkpoint / MARKER).read_text())
    assert meta["files"] == manifest_of(str(saved_checkpoint))
    assert ".metadata" in meta["files"] and "hf/config.json" in meta["files"]
    assert foreign_entry(str(saved_checkpoint)) is None


def test_overwrite_refuses_a_checkpoint_folder_holding_the_users_files(tmp_path, saved_checkpoint):
    d3 = tmp_path / "D3"
    shutil.copytree(saved_checkpoint, d3)
    (d3 / "notes.txt").write_text("my notes")
    (d3 / "mydata").mkdir()
    (d3 / "mydata" / "table.csv").write_text("a,b\n1,2\n")
    before = checksums(d3)
    proc = run_cli("optimizer=adamw", "steps=2", "checkpoint.save=true", "checkpoint.overwrite=true",
                   f"checkpoint.dir={d3}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    line = one_error_line(proc)
    assert "mydata/ is not part of the ppsplit checkpoint there" in line and "checkpoint.dir=" in line
    assert checksums(d3) == before
    assert not (tmp_path / "run").exists() and sorted(os.listdir(tmp_path)) == ["D3"]


@pytest.mark.parametrize("case", ["marker-names-only", "changed-file", "link", "no-manifest"])
def test_no_rule_on_file_names_decides_a_deletion(tmp_path, saved_checkpoint, case):
    folder = tmp_path / "ckpt"
    if case == "marker-names-only":  # the two names a checkpoint has, as empty files, beside the user's
        folder.mkdir()
        (folder / MARKER).write_text("")
        (folder / ".metadata").write_text("")
        (folder / "thesis.tex").write_text("...")
        named = MARKER
    else:
        shutil.copytree(saved_checkpoint, folder)
        if case == "changed-file":
            with open(folder / "hf" / "config.json", "a") as f:
                f.write(" ")
            named = "hf/config.json (changed since ppsplit wrote it)"
        elif case == "link":
            (folder / "elsewhere").symlink_to(tmp_path)
            named = "elsewhere"
        else:  # a checkpoint written before ppsplit kept a manifest
            meta = json.loads((folder / MARKER).read_text())
            del meta["files"]
            (folder / MARKER).write_text(json.dumps(meta))
            named = "no manifest of its files"
    before = checksums(folder)
    with pytest.raises(PpsplitError, match="is not part of the ppsplit checkpoint there") as info:
        Target(str(folder), overwrite=True)
    assert named in str(info.value)
    assert checksums(folder) == before


def test_removing_a_checkpoint_removes_only_what_its_manifest_lists(tmp_path, saved_checkpoint):
    folder = tmp_path / "ckpt"
    shutil.copytree(saved_checkpoint, folder)
    (folder / "hf" / "late.txt").write_text("appeared after the check")
    left = remove_checkpoint(str(folder))
    late = hashlib.sha256(b"appeared after the check").hexdigest()
    assert left == ["hf"] and checksums(folder) == {"hf": "dir", "hf/late.txt": late}


def test_overwrite_replaces_a_clean_checkpoint_and_leaves_nothing_of_the_old_one(tmp_path, saved_checkpoint):
    folder = tmp_path / "ckpt"
    shutil.copytree(saved_checkpoint, folder)
    proc = run_cli("launcher=inline", "steps=1", "optimizer=adamw", "checkpoint.save=true",
                   "checkpoint.overwrite=true", f"checkpoint.dir={folder}", f"hydra.run.dir={tmp_path / 'run'}",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((folder / MARKER).read_text())
    assert meta["optimizer"]["name"] == "adamw" and "hf/config.json" not in meta["files"]
    assert foreign_entry(str(folder)) is None  # the old hf/ went with the old checkpoint
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "run"]  # no staging or old folder left


def test_bad_input_found_late_leaves_an_earlier_run_as_it_was(tmp_path):
    prev = tmp_path / "PREV"
    proc = run_cli("launcher=inline", "steps=1", f"hydra.run.dir={prev}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    before = checksums(prev)
    proc = run_cli("split=manual", "split.points=[nope]", f"hydra.run.dir={prev}", cwd=tmp_path)
    line = one_error_line(proc)
    assert f"hydra.run.dir={prev} holds an earlier run (.hydra/config.yaml)" in line
    assert checksums(prev) == before


def test_a_sweep_folder_holding_an_earlier_sweep_is_refused(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli("-m", "launcher=inline", "steps=0", "seed=0", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    before = checksums(sweep)
    proc = run_cli("-m", "launcher=inline", "steps=0", "seed=1", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert "holds an earlier sweep (multirun.yaml)" in one_error_line(proc)
    assert checksums(sweep) == before


@pytest.mark.parametrize("change,expect", [
    ("model.config.n_layer=2", "it has transformer.h.2."),
    ("model.config.n_embd=32", "is [1000, 64] there, [1000, 32] here"),
])
def test_a_checkpoint_of_another_model_is_refused_before_any_rank(tmp_path, saved_checkpoint, change, expect):
    proc = run_cli("optimizer=sgd", change, f"checkpoint.load={saved_checkpoint}",
                   f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    line = one_error_line(proc)
    assert "holds another model" in line and expect in line and "saved with" in line, line
    assert not (tmp_path / "run").exists()
