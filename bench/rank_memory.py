"""Per-rank peak memory against what the rank holds, at pp2, pp2 x dp2 (FSDP2, both reshard
modes), pp2 x tp2 and pp4, for a LLaMA whose parameters dominate a rank's memory.

Each layout is a real ppsplit job (``python -m ppsplit``, local ranks, one torch thread each,
AdamW, ``verify=off``: the driver holds no weights). Per rank the report gives its peak RSS
(VmHWM), the bytes of its parameters and optimizer state as it keeps them between steps (its
shards), and so the bytes it holds at the optimizer step: parameters + gradients (one per
parameter, of its shape) + optimizer state. The fixed overhead (the interpreter, torch,
transformers, the meta trace, gloo, the schedule's buffers) is measured on its own: the same
job, layout and layer count with the model's width cut to almost nothing, rank by rank.

At pp2 x dp2, FSDP2 runs three ways: torch's (one unit per block, resharded and reduce-scattered
once a step), ``parallel.fsdp_reshard=microbatch`` (after every microbatch), and that with
``parallel.fsdp_unit_mib`` carving each block into units of a layer or two (``UNITS``).

Each job runs twice: with glibc's default malloc, and with ``GLIBC_TUNABLES`` set so that freed
tensor memory goes back to the system at once (``RELEASE``: a fixed 1 MiB mmap threshold, on
transparent huge pages so the page faults stay cheap). glibc's default raises its mmap
threshold after the first large free, so later tensors come from heaps that keep freed memory:
RSS then holds what the allocator kept as well as what the rank holds.

Targets: (peak - overhead) / held <= 1.3 on every rank; at dp=2 the peak less the overhead
is <= 0.6x of the same pipeline stage's at dp=1.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench import harness

NAME = "rank_memory"
MICROBATCH = ["parallel.dp=2", "parallel.fsdp_reshard=microbatch"]
UNITS = "pp2xdp2 reshard=microbatch units"  # FSDP units of at most size["unit_mib"]: a block's layers
LAYOUTS = {"pp2": [], "pp2xdp2": ["parallel.dp=2"], "pp2xdp2 reshard=microbatch": MICROBATCH,
           UNITS: MICROBATCH, "pp2xtp2": ["parallel.tp=2"], "pp4": ["stages=4"]}
DP_LAYOUTS = ("pp2xdp2", "pp2xdp2 reshard=microbatch", UNITS)
QUICK_LAYOUTS = ("pp2", UNITS)
# unit_mib: a block is 49 MiB (FULL): attention 12, each MLP matrix 11; QUICK's 3.1 and 0.7
FULL = dict(hidden=1024, layers=8, intermediate=2816, heads=16, kv_heads=8, vocab=8000, unit_mib=8)
QUICK = dict(hidden=256, layers=4, intermediate=704, heads=8, kv_heads=4, vocab=2000, unit_mib=0.5)
RELEASE = "glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=1048576"
ALLOCATORS = {"default": None, "release": RELEASE}
TARGET_HELD = 1.3
TARGET_DP = 0.6


def model_overrides(size: dict) -> list[str]:
    return ["model=llama", f"model.config.num_hidden_layers={size['layers']}",
            f"model.config.hidden_size={size['hidden']}", f"model.config.intermediate_size={size['intermediate']}",
            f"model.config.num_attention_heads={size['heads']}", f"model.config.num_key_value_heads={size['kv_heads']}",
            f"model.config.vocab_size={size['vocab']}"]


def overhead_size(size: dict) -> dict:
    """The same layers and heads at a width where the weights are a few hundred KB."""
    return {**size, "hidden": 2 * size["heads"], "intermediate": 4 * size["heads"], "vocab": 256}


def run_job(overrides: list[str], tunables: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables:
        env["GLIBC_TUNABLES"] = tunables
    with tempfile.TemporaryDirectory(prefix="ppsplit-bench-") as tmp:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "ppsplit", *overrides, f"hydra.run.dir={tmp}/run"],
                              capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            return {"ok": False, "error": (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1],
                    "output_tail": (proc.stdout + proc.stderr)[-2000:]}
        with open(os.path.join(tmp, "run", "report.json")) as f:
            run = json.load(f)["run"]
    ranks = sorted(run["rank_layout"], key=lambda r: r["rank"])
    return {"ok": True, "wall_s": wall, "step_s": statistics.median(run["step_times_s"][1:]),
            "ranks": [{k: r[k] for k in ("rank", "pp", "dp", "tp", "stages", "param_bytes", "optimizer_bytes",
                                         "peak_rss_bytes")} for r in ranks]}


def figures(big: dict, small: dict) -> dict:
    """Per rank: held bytes, peak less the overhead, and their ratio."""
    rows = []
    for r, o in zip(big["ranks"], small["ranks"]):
        held = 2 * r["param_bytes"] + r["optimizer_bytes"]  # parameters, their gradients, optimizer state
        above = r["peak_rss_bytes"] - o["peak_rss_bytes"]
        rows.append({**r, "held_bytes": held, "params_optimizer_bytes": r["param_bytes"] + r["optimizer_bytes"],
                     "overhead_bytes": o["peak_rss_bytes"], "peak_over_overhead_bytes": above,
                     "ratio": above / held})
    return {"ok": True, "ranks": rows, "max_ratio": max(x["ratio"] for x in rows)}


ROUNDS = 3


def allocator_cost(overrides: list[str]) -> dict:
    """What the release setting costs in step time: pp2 jobs with each allocator, interleaved,
    the median step after the first of each."""
    times: dict[str, list[float]] = {"default": [], "release": []}
    for _ in range(ROUNDS):
        for alloc in times:
            job = run_job(overrides, ALLOCATORS[alloc])
            if job["ok"]:
                times[alloc].append(job["step_s"])
    return {"default": harness.summary(times["default"]), "release": harness.summary(times["release"]),
            "ratio": harness.ratio(times["release"], times["default"]), "samples": times}


def main(quick: bool = False, out_dir: str | None = None) -> dict:
    size = QUICK if quick else FULL
    layouts = {k: v for k, v in LAYOUTS.items() if not quick or k in QUICK_LAYOUTS}
    allocators = {"release": RELEASE} if quick else ALLOCATORS
    base = ["optimizer=adamw", "batch_size=8", "seq_len=32", "microbatches=4", f"steps={2 if quick else 3}", "verify=off",
            "timeout_s=900", "launcher=local", "launcher.cpus_per_task=1", "metrics.plot=false"]
    note = harness.load_note()
    if note:
        print(note)
    results: dict[str, dict] = {a: {} for a in allocators}
    for name, extra in layouts.items():
        if name == UNITS:
            extra = extra + [f"parallel.fsdp_unit_mib={size['unit_mib']}"]
        for alloc, tunables in allocators.items():
            big = run_job(model_overrides(size) + base + extra, tunables)
            small = run_job(model_overrides(overhead_size(size)) + base + extra, tunables)
            if not (big["ok"] and small["ok"]):
                failed = big if not big["ok"] else small
                results[alloc][name] = {"ok": False, "error": failed["error"], "output_tail": failed["output_tail"]}
                print(f"  {name}, {alloc} malloc: FAILED {failed['error']}", flush=True)
                continue
            results[alloc][name] = {**figures(big, small), "step_s": big["step_s"]}
            print(f"  {name}, {alloc} malloc: max (peak - overhead) / held {results[alloc][name]['max_ratio']:.3f} "
                  f"({big['wall_s']:.0f} s)", flush=True)
    cost = None if quick else allocator_cost(model_overrides(size) + [o for o in base if not o.startswith("steps=")]
                                            + ["steps=6"])
    dp_ratio = {a: {} for a in allocators}
    for alloc, by_layout in results.items():
        one = by_layout.get("pp2", {})
        for name in DP_LAYOUTS:
            if by_layout.get(name, {}).get("ok") and one.get("ok"):
                above = {r["pp"]: r["peak_over_overhead_bytes"] for r in one["ranks"]}
                dp_ratio[alloc][name] = max(r["peak_over_overhead_bytes"] / above[r["pp"]]
                                            for r in by_layout[name]["ranks"])
    rows = []
    for alloc, by_layout in results.items():
        for name, f in by_layout.items():
            if not f["ok"]:
                rows.append([name, alloc, "FAILED", "-", "-", "-", "-", "-"])
                continue
            worst = max(f["ranks"], key=lambda r: r["ratio"])
            ratio = dp_ratio[alloc].get(name)
            rows.append([name, alloc, f"{worst['peak_rss_bytes'] / 2**20:.0f} MiB",
                         f"{worst['overhead_bytes'] / 2**20:.0f} MiB", f"{worst['held_bytes'] / 2**20:.0f} MiB",
                         f"{f['max_ratio']:.3f}", f"{ratio:.3f}" if ratio else "-", harness.fmt_time(f["step_s"])])
    print(f"\n== {NAME}: LLaMA {size['layers']}L x {size['hidden']} (vocab {size['vocab']}), batch 8x32, m=4, "
          "AdamW, one torch thread per rank ==")
    print(harness.table(["layout", "malloc", "peak RSS (worst rank)", "overhead", "held",
                         "(peak - overhead) / held", "peak over dp=1", "step"], rows))
    if cost:
        print(f"step time at pp2, release over default malloc: {cost['ratio']['ratio']:.3f}x "
              f"[{cost['ratio']['pair_min']:.3f}, {cost['ratio']['pair_max']:.3f}] "
              f"({harness.fmt_time(cost['release']['median'])} and {harness.fmt_time(cost['default']['median'])}, "
              f"{ROUNDS} runs each, interleaved)")
    print("held: parameters + gradients + optimizer state, as the rank keeps them (its shards); "
          f"targets: <= {TARGET_HELD} on every rank, <= {TARGET_DP} at dp=2; "
          f"release: GLIBC_TUNABLES={RELEASE}")
    data_ratio = max((f["max_ratio"] for f in results.get("release", {}).values() if f["ok"]), default=None)
    data = {"quick": quick, "threads": 1,  # each rank's (launcher.cpus_per_task=1)
            "ratio": data_ratio,  # the headline: the worst rank's (peak - overhead) / held, release malloc
            "size": size, "layouts": results, "dp_ratio": dp_ratio, "allocator_cost": cost,
            "max_ratio": {a: max((f["max_ratio"] for f in r.values() if f["ok"]), default=None)
                          for a, r in results.items()},
            "targets": {"held": TARGET_HELD, "dp": TARGET_DP}, "tunables": RELEASE,
            "load_note": note}
    with harness.torch_threads(1):  # the machine's description says the ranks' thread count
        harness.write_json(NAME, data, out_dir)
    return data


if __name__ == "__main__":
    main()
