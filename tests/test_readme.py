"""The README is executable: every command and code block runs as written, every run it starts
passes (each ``report.json`` it writes says ``ok``), the sample output is what its command
prints, and what the README claims of a command is checked on the reports that command wrote
(CLAIMS below). A feature that a README command shows is tested here, on that run, not again
elsewhere."""

import csv
import glob
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import run_cli

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


def sample_command() -> str:
    text = open(README).read()
    section = text[text.index("## What a run prints"):]
    return re.search(r"`(python -m ppsplit [^`]+)` prints", section).group(1)


def reports_under(folder) -> set[str]:
    return set(glob.glob(os.path.join(folder, "**", "report.json"), recursive=True))


def load(path) -> dict:
    return json.loads(open(path).read())


# --- what the README says of its commands, checked on the reports each one wrote --------------
# Each check gets the block's runs: (command, the reports it wrote) in order.

def sweep_rows_match_reports(runs, cwd):
    """The summary of a sweep has one row per point, and each row says what that point's report says."""
    for _, reports in runs:
        (sweep,) = {os.path.dirname(os.path.dirname(r)) for r in reports}
        rows = list(csv.DictReader(open(os.path.join(sweep, "summary.csv"))))
        assert len(rows) == len(reports)
        assert open(os.path.join(sweep, "summary.md")).read().count("\n") == len(rows) + 2
        assert os.path.getsize(os.path.join(sweep, "summary.png")) > 1000
        for row in rows:
            data = load(os.path.join(sweep, row["point"], "report.json"))
            assert row["check"] == "passed" and row["model"] == data["model"]
            assert int(row["stages"]) == data["stages"] and row["strategy"] == data["split_strategy"]
            assert row["split_points"] == " ".join(data["split_points"])
            assert float(row["balance_flops"]) == pytest.approx(data["balance"]["flops"], abs=1e-4)
            if data["run"]:
                assert float(row["step_time_s"]) == pytest.approx(data["run"]["step_time_s"], abs=1e-6)


def eight_ranks_with_a_tie(runs, cwd):
    ((_, (report,)),) = runs
    run = load(report)["run"]
    assert run["ranks"] == 8 and run["mesh"] == {"pp": 2, "dp": 2, "tp": 2, "fsdp": True,
                                                  "fsdp_reshard": "step", "fsdp_unit_mib": None,
                                                  "fsdp_param_dtype": "float32"}
    assert sorted((r["pp"], r["dp"], r["tp"]) for r in run["rank_layout"]) == \
        [(p, d, t) for p in range(2) for d in range(2) for t in range(2)]
    assert [t["keys"] for t in run["ties"]] == [["model.embed_tokens.weight", "lm_head.weight"]]
    assert all(t["copies_bitwise_equal"] for t in run["ties"]) and run["rank_fqn_problems"] == []


def lengths_vary(runs, cwd):
    ((_, (report,)),) = runs
    run = load(report)["run"]
    assert run["seq_lens"] == [16, 32, 48] and run["launcher"] == "local"
    assert run["losses"] == pytest.approx(run["reference_losses"], rel=1e-5)


def any_class(runs, cwd):
    ((_, (report,)),) = runs
    data = load(report)
    assert data["model_class"] == "Qwen2ForCausalLM" and data["run"]["ranks"] == 2


def chain_resumes(runs, cwd):
    data = [load(reports[0]) for _, reports in runs]
    assert [d["run"]["resumed_from"] and d["run"]["resumed_from"]["step"] for d in data] == [None, 2, 4]
    assert [(d["layout"]["pp"], d["layout"]["dp"]) for d in data] == [(2, 1), (2, 2), (1, 1)]
    hf = os.path.join(cwd, "ck", "c", "hf")
    assert os.path.isfile(os.path.join(hf, "config.json")) and glob.glob(os.path.join(hf, "*.safetensors"))


def slurm_points_run_side_by_side(runs, cwd):
    assert all(load(r)["run"]["launcher"] == "slurm" for _, reports in runs for r in reports)
    (sweep,) = [reports for command, reports in runs if "ppsplit -m " in command]
    (a0, a1), (b0, b1) = [(load(r)["started_at"], load(r)["finished_at"]) for r in sweep]
    assert a0 < b1 and b0 < a1, "the sweep points ran one after another"


def across_two_nodes(runs, cwd):
    ((_, (report,)),) = runs
    run = load(report)["run"]
    assert run["nodes"] == {"node1": [0, 1], "node2": [2, 3]} and run["mesh"]["dp"] == 2
    assert {x["pp"]: x["host"] for x in run["rank_layout"] if x["dp"] == 1} == {0: "node1", 1: "node2"}


def trains_below_the_unigram_entropy(runs, cwd):
    """The toy corpus run: the validation loss falls, ends well below the corpus' unigram
    entropy, and the metrics and the loss picture are there."""
    import numpy as np

    (_, (report,)), = [r for r in runs if r[1]]
    data = load(report)
    val = [v["loss"] for v in data["run"]["val_losses"]]
    from ppsplit.data.store import open_store

    counts = np.bincount(open_store(data["data"]["cache"])[0]["train"].ravel())
    p = counts[counts > 0] / counts.sum()
    entropy = float(-(p * np.log(p)).sum())
    assert val == sorted(val, reverse=True) and val[-1] < entropy - 0.5, (val, entropy)
    folder = os.path.dirname(report)
    assert len(open(os.path.join(folder, "metrics.csv")).read().splitlines()) == 301
    assert os.path.getsize(os.path.join(folder, "loss.png")) > 1000


def goes_on_from_the_newest(runs, cwd):
    """The second run resumes at step 6 and trains 4 more; two step folders are kept, latest
    names the newest, and metrics.csv holds the whole run's 10 rows."""
    (_, (first,)), (_, (second,)) = runs
    assert load(first)["run"]["resumed_from"] is None
    run = load(second)["run"]
    assert run["resumed_from"]["step"] == 6 and run["steps"] == 4
    ck = os.path.join(cwd, "ck", "long")
    assert sorted(n for n in os.listdir(ck) if n.startswith("step-")) == ["step-000008", "step-000010"]
    assert os.readlink(os.path.join(ck, "latest")) == "step-000010"
    rows = list(csv.DictReader(open(os.path.join(os.path.dirname(second), "metrics.csv"))))
    assert [int(r["step"]) for r in rows] == list(range(1, 11))


def requeued_to_the_last_step(runs, cwd):
    """Over one or more new jobs (how many depends on the machine's speed: one on a fast day),
    each going on from the step folder the one before saved when SLURM signalled it;
    metrics.csv has every step once, with the job it ran in."""
    ((command, (report,)),) = runs
    run, ck = load(report)["run"], os.path.join(cwd, "ck", "slurm")
    steps = int(re.search(r"\bsteps=(\d+)", command).group(1))
    restarts = run["restarts"]
    assert len(restarts) >= 1 and len({r["job"] for r in restarts}) == len(restarts), restarts
    stops = [r["stopped_at"] for r in restarts]
    assert stops == sorted(stops) and stops[-1] < steps
    assert [r["checkpoint"] for r in restarts] == [os.path.join(ck, f"step-{s:06d}") if s else None for s in stops]
    assert run["resumed_from"]["step"] == stops[-1] and run["steps"] == steps - stops[-1]
    assert os.readlink(os.path.join(ck, "latest")) == f"step-{steps:06d}"
    rows = [(int(r["step"]), int(r["restart"]))
            for r in csv.DictReader(open(os.path.join(os.path.dirname(report), "metrics.csv")))]
    assert [s for s, _ in rows] == list(range(1, steps + 1))
    assert [sum(s > stop for stop in stops) for s, _ in rows] == [r for _, r in rows]


def fine_tunes_adapters_over_the_pretrained_base(runs, cwd):
    """The LoRA run over the pretrained base: the adapters alone train, the held-out answer loss
    falls, and the adapter folder and the merged model are peft's and
    transformers' own (loaded and compared)."""
    import peft
    import torch
    import transformers

    (_, (pretrain,)), (_, (tune,)) = [r for r in runs if r[1]]
    assert load(pretrain)["ok"]
    data = load(tune)
    assert data["peft"]["trained_params"] < data["peft"]["params"] // 10
    assert data["data"]["sft"]["format"] == "conversational" and data["data"]["sft"]["packing"]
    val = [v["loss"] for v in data["run"]["val_losses"]]
    # it falls from the first evaluation and stays below it (5.88 -> 5.77 -> 5.73 -> 5.70 here); not
    # asserted strictly falling at every evaluation: near the end the steps are small and another
    # machine's float kernels can leave two evaluations level
    assert len(val) == 4 and max(val[1:]) < val[0] and val[-1] < val[0] - 0.1, val
    base = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(cwd, "base", "hf"))
    adapted = peft.PeftModel.from_pretrained(base, os.path.join(cwd, "lora", "hf"))
    merged = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(cwd, "lora", "merged"))
    ids = torch.randint(0, 1000, (2, 16))
    with torch.no_grad():
        assert (adapted(input_ids=ids).logits - merged(input_ids=ids).logits).abs().max() < 1e-4
    from ppsplit.checkpoint.dcp import saved_keys
    from ppsplit.checkpoint.folder import manifest_of, read_meta

    optim = {k for k in saved_keys(os.path.join(cwd, "lora")) if k.startswith("optim.state.")}
    assert optim and all(".lora_" in k for k in optim)  # optimizer state for the adapters alone
    assert read_meta(os.path.join(cwd, "base"))["files"] == manifest_of(os.path.join(cwd, "base"))  # only read


CLAIMS = {  # a substring of a README block -> what its runs' reports must show
    "launcher.requeue=true launcher.max_requeue=30": requeued_to_the_last_step,
    "checkpoint.every=2 checkpoint.keep=2": goes_on_from_the_newest,
    "data=text data.path=toy/corpus.txt": trains_below_the_unigram_entropy,
    "peft=lora stages=2": fine_tunes_adapters_over_the_pretrained_base,
    "-m stages=2,4 split=even,flops": sweep_rows_match_reports,
    "parallel.dp=2 parallel.tp=2": eight_ranks_with_a_tie,
    "seq_lens=[16,32,48]": lengths_vary,
    "model.model_class=Qwen2ForCausalLM": any_class,
    "checkpoint.load=ck/b": chain_resumes,
    "-m launcher=slurm": slurm_points_run_side_by_side,
    "launcher.nodes=2": across_two_nodes,
}


SHELL = [(body, line) for info, body, line in blocks()
         if info in ("", "sh", "bash") and commands(body) and commands(body) != [sample_command()]]
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
    runs = []
    setup = "pip install" in body  # the set-up lines run as the new interpreter they are
    for command in commands(body):  # in one folder: a later line may read what an earlier wrote
        before = reports_under(tmp_path)
        proc = run_command(command, tmp_path, forked=not setup)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        written = sorted(reports_under(tmp_path) - before)
        assert all(load(r)["ok"] for r in written), (command, written)
        assert written or not command.startswith("python -m ppsplit "), command  # every run reports
        runs.append((command, written))
    for key, check in CLAIMS.items():
        if key in body:
            check(runs, str(tmp_path))


def run_command(command: str, cwd, forked: bool = True) -> subprocess.CompletedProcess:
    """A README command line as written. ``[VAR=value ...] python -m ppsplit ARGS`` is split as
    the shell would and run as ``ppsplit`` (forked from the tests' warm launcher: the same
    program, without the interpreter's start; ``forked=False`` starts it anew); anything else
    goes to the shell."""
    words = shlex.split(command, comments=True)
    env = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if forked and words[:3] == ["python", "-m", "ppsplit"]:
        return run_cli(*words[3:], cwd=cwd, timeout=900, env=env)
    return subprocess.run(command, shell=True, cwd=cwd, capture_output=True, text=True, timeout=900,
                          stdin=subprocess.DEVNULL)


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
        line = re.sub(r", [\d,]+ tok/s", ", N tok/s", line)
        line = re.sub(r"(max loss rel diff |first-step grad diff )[\d.]+e-\d+", r"\1E", line)
        line = re.sub(r"[\d.]+e-\d\d from the unsplit", "E from the unsplit", line)
        if re.match(r"  (bubble \(step|stages per microbatch)", line):  # measured times and shares
            line = re.sub(r"\d+\.\d+", "N", re.sub(r"step \d+,", "step K,", line))
        out.append(line)
    return out


@pytest.mark.slow
def test_the_sample_output_is_what_the_command_prints(tmp_path):
    """The README's first command, run once: its output is the sample, and its report passes."""
    command = sample_command()
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
    (report,) = reports_under(tmp_path)
    data = load(report)
    assert data["ok"] and data["fqn_check"]["ok"] and data["split_points"] == ["transformer.h.2"]
    assert data["run"]["launcher"] == "local" and data["run"]["ranks"] == 2
