"""What a corpus costs to prepare and to read, on corpora generated here (the standard library's
docstrings, paragraph order shuffled anew in every copy; a byte-level BPE of 1000 tokens
trained on them, ``ppsplit.data.toy_corpus``). FULL: 50 MB, 200 MB and 1 GB; QUICK: 0.5 and 2 MB.

1. Tokenizing: MB/s at ``data.num_proc`` 1 and 2, on the smallest corpus, the two interleaved.
2. Memory, per corpus: a real ppsplit job (``data=text``, 2 stages on 2 local ranks,
   ``steps=2``, ``verify=off``, ``seq_len=128``, ``batch_size=8``, ``data.num_proc=2``, a cache
   of its own so it tokenizes): the driver's peak RSS (VmHWM, read by the driver process as it
   exits), the worst rank's (the report's ``peak_rss_bytes``) and the store's size against the
   corpus. Target: from the smallest corpus to the largest, ranks within 32 MiB and the
   driver within 128 MiB.
3. Chat records (``data=sft``, LoRA on a 2-layer LLaMA, the same job otherwise; FULL: 10 and 50
   MB of the toy chat records, repeated in orders of their own; QUICK: 0.2 MB): the
   driver's and the worst rank's peak RSS.
4. Reading: drawing a training batch (``BatchSource.batch``: the rows, then the task's inputs)
   from the memory-mapped store against the same blocks held in memory (what every rank held
   before: the whole packed corpus, loaded), interleaved, on the largest corpus; and the step
   time of that job, for scale.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from bench import harness
from ppsplit.parallel.stage_state import peak_rss_bytes

NAME = "corpora"
FULL = dict(sizes_mb=[50, 200, 1000], sft_mb=[10, 50], reads=256, repeats=7, kb=300)
QUICK = dict(sizes_mb=[0.5, 2], sft_mb=[0.2], reads=16, repeats=3, kb=60)
JOB = ["model=gpt2", "stages=2", "steps=2", "verify=off", "seq_len=128", "batch_size=8", "eval.batches=0",
       "metrics.csv=false", "metrics.plot=false", "model.config.vocab_size=1000"]
TARGET_RANK_MIB, TARGET_DRIVER_MIB = 32, 128
# the driver records its own peak as it exits (forked ranks, whose pid differs, do not)
DRIVER = ("import atexit, os, runpy, sys\n"
          "pid, out = os.getpid(), sys.argv.pop(1)\n"
          "def peak():\n"
          "    if os.getpid() == pid:\n"
          "        hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
          "        open(out, 'w').write(str(int(hwm.split()[1]) * 1024))\n"
          "atexit.register(peak)\n"
          "sys.argv[0] = 'ppsplit'\n"
          "runpy.run_module('ppsplit', run_name='__main__')\n")


def write_records(path: str, records: list[str], size_mb: float, seed: int = 0) -> int:
    """``size_mb`` of JSON lines, each copy of ``records`` in an order of its own."""
    rng = np.random.default_rng(seed)
    target, written = int(size_mb * 1e6), 0
    with open(path, "w") as f:
        while written < target:
            chunk = "".join(records[i] for i in rng.permutation(len(records)))
            f.write(chunk)
            written += len(chunk.encode())
    return os.path.getsize(path)


def write_corpus(path: str, base: list[str], size_mb: float, seed: int = 0) -> int:
    """``size_mb`` of paragraphs, blank-line separated, each copy of ``base`` in an order of its own."""
    rng = np.random.default_rng(seed)
    target, written = int(size_mb * 1e6), 0
    with open(path, "w") as f:
        while written < target:
            chunk = "\n\n".join(base[i] for i in rng.permutation(len(base))) + "\n\n"
            f.write(chunk)
            written += len(chunk.encode())
    return os.path.getsize(path)


def tokenize_rates(corpus: str, tokenizer: str, repeats: int) -> dict:
    """MB/s of a fresh preparation at 1 and at 2 processes."""
    from ppsplit.data.corpus import prepare
    from ppsplit.config.train_spec import DataSpec

    def case(processes):
        def run(cache):
            spec = DataSpec(name="text", path=(corpus,), field="text", tokenizer=tokenizer, val_fraction=0.05,
                            cache_dir=cache.name, sample_by="paragraph", num_proc=processes, padded=False, sft=None)
            prepare(spec, None, 128, 0, 1000, progress=False)
            cache.cleanup()
        return harness.Case(run=run, setup=lambda: tempfile.TemporaryDirectory(prefix="ppsplit-bench-store-"))

    samples = harness.interleaved({"1": case(1), "2": case(2)}, repeats=max(1, repeats // 3), warmup=0)
    mb = os.path.getsize(corpus) / 1e6
    return {n: {"mb_per_s": mb / harness.summary(s)["median"], "seconds": harness.summary(s)} for n, s in samples.items()}


SFT_JOB = ["model=llama", "model.config.num_hidden_layers=2", "data=sft", "peft=lora", "data.truncate=true"]


def run_job(corpus: str, tokenizer: str, kind: list[str] = ("data=text", "model=gpt2", "data.num_proc=2"),
            fresh: bool = True) -> dict:
    """A job's figures. ``fresh``: in a new interpreter, whose own peak is the driver's; else (the
    smoke test) in this process, whose peak says nothing of the driver."""
    with tempfile.TemporaryDirectory(prefix="ppsplit-bench-") as tmp:
        overrides = [*JOB, *kind, f"data.path={corpus}", f"data.tokenizer={tokenizer}", f"data.cache_dir={tmp}/cache"]
        if fresh:
            peak_file = os.path.join(tmp, "driver_peak")
            proc = subprocess.run([sys.executable, "-c", DRIVER, peak_file, *overrides, f"hydra.run.dir={tmp}/run"],
                                  capture_output=True, text=True, stdin=subprocess.DEVNULL)
            if proc.returncode != 0:
                raise RuntimeError((proc.stdout + proc.stderr)[-2000:])
            driver_peak = int(open(peak_file).read())
        else:
            _in_process(overrides, os.path.join(tmp, "run"))
            driver_peak = peak_rss_bytes()
        with open(os.path.join(tmp, "run", "report.json")) as f:
            report = json.load(f)
        run, data = report["run"], report["data"]
        return {"corpus_bytes": data.get("corpus_bytes", os.path.getsize(corpus)), "cache_bytes": data["cache_bytes"],
                "tokenize_s": data.get("tokenize_s"), "train_blocks": data["train_blocks"],
                "driver_peak_bytes": driver_peak,
                "worst_rank_peak_bytes": max(r["peak_rss_bytes"] for r in run["rank_layout"]),
                "step_s": float(np.median(run["step_times_s"][1:])),
                "store": _keep_store(os.path.join(tmp, "cache"))}


def _in_process(overrides: list[str], run_dir: str) -> None:
    import contextlib
    import io

    import ppsplit.app.cli
    from bench.finetune import compose

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = ppsplit.app.cli.run(compose(overrides), run_dir)
    if code != 0:
        raise RuntimeError(out.getvalue()[-2000:])


def _keep_store(cache: str) -> str:
    """The job's store, moved out of its folder before that goes, for the reading figures."""
    import shutil

    (name,) = [n for n in os.listdir(cache) if n.startswith("packed-")]
    keep = tempfile.mkdtemp(prefix="ppsplit-bench-store-")
    shutil.move(os.path.join(cache, name), os.path.join(keep, name))
    return os.path.join(keep, name)


def read_times(store: str, reads: int, repeats: int) -> dict:
    """A batch drawn from the mapped store against the same blocks in memory."""
    from ppsplit.data.corpus import BatchSource

    spec = type("S", (), {})()
    spec.batch_size, spec.seed = 8, 0
    spec.model = type("M", (), {"inputs": "causal_lm", "call_kwargs": {}})()
    config = type("C", (), {"vocab_size": 1000})()
    mapped = BatchSource(spec, config, store)
    loaded = BatchSource(spec, config, store)
    loaded.blocks.train = np.array(loaded.blocks.train)  # the whole corpus read into memory
    far = len(mapped.blocks.train) * 3 // spec.batch_size  # batches across epochs, as a long run draws them

    def case(source):
        return harness.Case(run=lambda _: [source.batch((i * 7919) % far) for i in range(reads)])

    samples = harness.interleaved({"mapped": case(mapped), "in_memory": case(loaded)}, repeats=repeats)
    sides = {k: harness.summary([t / reads for t in s]) for k, s in samples.items()}
    return {"per_batch_s": sides, "ratio": sides["mapped"]["median"] / sides["in_memory"]["median"],
            "warnings": harness.noise_warnings("read", sides)}


def main(quick: bool = False, out_dir: str | None = None) -> dict:
    with harness.torch_threads(1):
        return _main(quick, out_dir)


def _main(quick: bool, out_dir: str | None) -> dict:
    import shutil

    from ppsplit.data.toy_corpus import docstrings, make

    size = QUICK if quick else FULL
    with tempfile.TemporaryDirectory(prefix="ppsplit-bench-corpora-") as folder:
        _, tokenizer = make(folder, kb=size["kb"], vocab=1000, chat=300)  # one tokenizer, with a chat template
        base = docstrings(size["kb"] * 1000)
        corpora = {mb: os.path.join(folder, f"corpus-{mb}mb.txt") for mb in size["sizes_mb"]}
        jobs = {}
        for mb, path in corpora.items():
            write_corpus(path, base, mb)
            jobs[mb] = run_job(path, tokenizer, fresh=not quick)
            if mb != size["sizes_mb"][-1]:
                shutil.rmtree(os.path.dirname(jobs[mb].pop("store")))
        sft = {}
        records = open(os.path.join(folder, "chat.jsonl")).readlines()
        for mb in size["sft_mb"]:
            path = os.path.join(folder, f"chat-{mb}mb.jsonl")
            write_records(path, records, mb)
            sft[mb] = run_job(path, tokenizer, SFT_JOB, fresh=not quick)
            shutil.rmtree(os.path.dirname(sft[mb].pop("store")))
            os.remove(path)
        rates = tokenize_rates(corpora[size["sizes_mb"][0]], tokenizer, size["repeats"])
        store = jobs[size["sizes_mb"][-1]].pop("store")
        reads = read_times(store, size["reads"], size["repeats"])
        shutil.rmtree(os.path.dirname(store))
    return _report(size, jobs, sft, rates, reads, quick, out_dir)


def _report(size, jobs, sft, rates, reads, quick, out_dir) -> dict:
    first, last = jobs[size["sizes_mb"][0]], jobs[size["sizes_mb"][-1]]
    rank_growth = (last["worst_rank_peak_bytes"] - first["worst_rank_peak_bytes"]) / 2**20
    driver_growth = (last["driver_peak_bytes"] - first["driver_peak_bytes"]) / 2**20
    rows = [[f"{mb} MB", f"{j['corpus_bytes'] / 1e6:.0f} MB", f"{j['cache_bytes'] / 1e6:.0f} MB "
             f"({j['cache_bytes'] / j['corpus_bytes']:.2f}x)", f"{j['corpus_bytes'] / 1e6 / j['tokenize_s']:.1f} MB/s",
             f"{j['driver_peak_bytes'] / 2**20:.0f} MiB", f"{j['worst_rank_peak_bytes'] / 2**20:.0f} MiB"]
            for mb, j in jobs.items()]
    print(harness.table(["corpus", "text", "store", "tokenized (2 proc)", "driver peak", "worst rank peak"], rows))
    print(f"growth from {size['sizes_mb'][0]} to {size['sizes_mb'][-1]} MB: ranks {rank_growth:+.1f} MiB "
          f"(target {TARGET_RANK_MIB}), driver {driver_growth:+.1f} MiB (target {TARGET_DRIVER_MIB})")
    print(harness.table(["chat records", "store", "driver peak", "worst rank peak"],
                        [[f"{mb} MB", f"{j['cache_bytes'] / 1e6:.1f} MB", f"{j['driver_peak_bytes'] / 2**20:.0f} MiB",
                          f"{j['worst_rank_peak_bytes'] / 2**20:.0f} MiB"] for mb, j in sft.items()]))
    print("tokenizing " + ", ".join(f"{n} process{'es' if n != '1' else ''}: {r['mb_per_s']:.2f} MB/s"
                                    for n, r in rates.items()))
    print(f"a batch: mapped {harness.fmt_stats(reads['per_batch_s']['mapped'])}, in memory "
          f"{harness.fmt_stats(reads['per_batch_s']['in_memory'])} (ratio {reads['ratio']:.2f}); "
          f"the step: {harness.fmt_time(last['step_s'])}")
    data = {"sizes_mb": size["sizes_mb"], "jobs": {str(k): v for k, v in jobs.items()}, "tokenize": rates,
            "sft": {str(k): v for k, v in sft.items()},
            "read": reads, "rank_growth_mib": rank_growth, "driver_growth_mib": driver_growth,
            "read_share_of_step": reads["per_batch_s"]["mapped"]["median"] / last["step_s"],
            "meets_target": bool(rank_growth <= TARGET_RANK_MIB and driver_growth <= TARGET_DRIVER_MIB),
            "ratio": reads["ratio"], "warnings": reads["warnings"], "threads": 1}
    harness.write_json(NAME, {**data, "quick": quick}, out_dir)
    return data
