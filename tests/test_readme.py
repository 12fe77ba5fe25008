"""The README is executable: every command and code block runs as written, and the sample output
is what the command it shows prints."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def blocks() -> list[tuple[str, str, int]]:
    """(info string, body, line) of every fenced block."""
    out, info, body, start = [], None, [], 0
    for number, line in enumerate(open(README).read().splitlines(), 1):
        if line.startswith("```"):
            if info is None:
                info, body, start = line[3:].strip(), [], number
            else:
                out.append((info, "\n".join(body), start))
                info = None
        elif info is not None:
            body.append(line)
    return out


def commands(body: str) -> list[str]:
    """The block's command lines; the set-up lines' installs are what .ci/run runs, so of a
    ``pip install ... && X`` line only X runs here."""
    out = []
    for line in body.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split("&&")]
        parts = [p for p in parts if not p.startswith("pip install")]
        if parts and parts != ["python -m pytest"]:  # the suite itself is this run
            out.append(" && ".join(parts))
    return out


SHELL = [(body, line) for info, body, line in blocks() if info in ("", "sh", "bash") and commands(body)]
PYTHON = [(body, line) for info, body, line in blocks() if info == "python"]


def needs(body: str) -> list:
    marks = [pytest.mark.slow]
    if "launcher=slurm" in body:
        marks.append(pytest.mark.slurm)
    if "launcher.nodes=2" in body:
        marks.append(pytest.mark.slurm_nodes)
    return marks


@pytest.mark.parametrize("body", [pytest.param(b, marks=needs(b), id=f"line{n}") for b, n in SHELL])
def test_shell_block_runs_as_written(tmp_path, body):
    if "launcher=slurm" in body:
        nodes = ["--nodes", "2"] if "launcher.nodes=2" in body else []
        subprocess.run(["bash", os.path.join(ROOT, "launchers", "slurm", "up.sh"), *nodes], check=True,
                       capture_output=True, stdin=subprocess.DEVNULL, timeout=600)
    for command in commands(body):  # in one folder: a later line may read what an earlier wrote
        proc = subprocess.run(command, shell=True, cwd=tmp_path, capture_output=True, text=True,
                              timeout=900, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"


@pytest.mark.parametrize("body", [pytest.param(b, id=f"line{n}") for b, n in PYTHON])
def test_python_block_runs_as_written(tmp_path, body):
    proc = subprocess.run([sys.executable, "-c", body], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def normalise(text: str) -> list[str]:
    """What may differ between two runs of one command: seconds, times, process ids, paths."""
    out = []
    for line in text.strip().splitlines():
        line = re.sub(r"^\[\s*[\d.]+s\]", "[T]", line)
        line = re.sub(r"\([\d.]+ s\)", "(S)", line)
        line = re.sub(r"local processes [\d, ]+;", "local processes P;", line)
        line = re.sub(r"\S*outputs/\S+", "PATH", line)
        line = re.sub(r"step time \(median after the first\): [\d.]+ ms", "step time M", line)
        line = re.sub(r"(max loss rel diff |first-step grad diff )[\d.]+e-\d+", r"\1E", line)
        line = re.sub(r"[\d.]+e-\d\d from the unsplit", "E from the unsplit", line)
        out.append(line)
    return out


@pytest.mark.slow
def test_the_sample_output_is_what_the_command_prints(tmp_path):
    text = open(README).read()
    section = text[text.index("## What a run prints"):]
    command = re.search(r"`(python -m ppsplit [^`]+)` prints", section).group(1)
    sample = next(body for info, body, _ in blocks() if info == "text" and body.startswith("[") and
                  "PASSED" in body)
    proc = subprocess.run(command, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    # A step line prints every 2 s and at the end: how many come before the last depends on
    # the machine's speed, so only the last is compared.
    def settled(lines):
        return [l for l in lines if not re.match(r"\[T\] step (\d+)/(?!\1 )\d+ done", l)]

    got, shown = settled(normalise(proc.stdout)), settled(normalise(sample))
    # The driver checks the split while the ranks train, so the ranks' step lines may come
    # before or after its check line: the same lines, and in the same order apart from that.
    assert sorted(got) == sorted(shown)
    steps = re.compile(r"\[T\] (step \d+/\d+ done|ranks finished)")
    assert [l for l in got if not steps.match(l)] == [l for l in shown if not steps.match(l)]
    assert [l for l in got if steps.match(l)] == [l for l in shown if steps.match(l)]
