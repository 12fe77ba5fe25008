"""Models bigger than one machine.

1. Driver: wall time and peak RSS to trace, split and check LLaMA at 7B shape (4 stages) and 70B
   shape (8 stages) on meta, beside ``torch.distributed.pipelining.pipeline()`` on meta. Each
   sample runs in a fresh process (peak RSS is per process), the two sides interleaved.
2. Tracing cost as the model grows (8, 16, 32, 64 layers at 7B width): time per layer.
3. Ranks: each rank's peak RSS growth while it materialises and initialises only its stage,
   over the stage's bytes, at a LLaMA shape whose full fp32 size exceeds one rank's share of
   this machine (4 ranks). The fixed overhead (interpreter, torch, transformers, the meta trace)
   is the RSS before materialising, stated beside it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from bench import harness

LLAMA_7B = dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, use_cache=False)
LLAMA_70B = dict(num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                 num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, use_cache=False)
# About 2.7B parameters: 10.9 GB in fp32, more than a quarter of this machine's 24 GB.
LLAMA_2B7 = dict(num_hidden_layers=32, hidden_size=2560, intermediate_size=6912, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=32000, max_position_embeddings=2048, use_cache=False)
TINY = dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000, max_position_embeddings=128, use_cache=False)

# Run in a child process: one measurement, printed as JSON on the last line.
CHILD = r"""
import json, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
torch.set_num_threads(1)
mode, config, stages, seq, rank = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
from ppsplit.models import build
import ppsplit
from ppsplit.parallel.stage_state import peak_rss_bytes as rss  # VmHWM: ru_maxrss would carry the parent's peak
model = build.build_on_meta("LlamaForCausalLM", config)
ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
kwargs = {"return_dict": False, "use_cache": False}
n = config["num_hidden_layers"]
points = [f"model.layers.{i * n // stages}" for i in range(1, stages)]
before = rss()
start = time.perf_counter()
if mode == "ppsplit":
    split = ppsplit.split(model, (ids,), kwargs, points=points)
    assert ppsplit.verify_fqns(model, split).ok
elif mode == "pipeline":
    from torch.distributed.pipelining import SplitPoint, pipeline
    pipeline(model, mb_args=(ids,), mb_kwargs=kwargs, split_spec={p: SplitPoint.BEGINNING for p in points})
elif mode == "rank":
    from ppsplit.parallel.materialize import materialize_stages
    split = ppsplit.split(model, (ids,), kwargs, points=points)
    before = rss()
    stage = materialize_stages(model, split, [rank], 0, None, torch.device("cpu"))[rank]
    uniq = {id(t): t for t in stage.state_dict().values()}
    stage_bytes = sum(t.numel() * t.element_size() for t in uniq.values())
    print(json.dumps({"stage_bytes": stage_bytes, "rss_before": before, "peak_rss": rss()}))
    sys.exit(0)
elapsed = time.perf_counter() - start
print(json.dumps({"seconds": elapsed, "peak_rss": rss(), "rss_before": before}))
"""


_PREFETCHED: dict = {}


def _prefetch(calls) -> None:
    """Quick mode (a smoke test, not a measurement): run these children two at a time ahead."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        for key, result in zip(calls, pool.map(lambda c: _run_child(*c), calls)):
            _PREFETCHED.setdefault(key, []).append(result)


def child(mode: str, config: dict, stages: int, seq: int = 128, rank: int = 0) -> dict:
    ready = _PREFETCHED.get((mode, json.dumps(config), stages, seq, rank))
    if ready:  # quick mode: the one sample of these arguments serves every ask
        return ready[-1]
    return _run_child(mode, json.dumps(config), stages, seq, rank)


def _run_child(mode: str, config: str, stages: int, seq: int, rank: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, mode, config, str(stages), str(seq), str(rank)],
                         capture_output=True, text=True, timeout=1800,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if out.returncode != 0:
        raise RuntimeError(f"{mode} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def driver_comparison(config: dict, stages: int, repeats: int) -> dict:
    samples = {"ppsplit": [], "pipeline": []}
    rss = {"ppsplit": [], "pipeline": []}
    for _ in range(repeats):  # interleaved: A, B, A, B
        for mode in samples:
            r = child(mode, config, stages)
            samples[mode].append(r["seconds"])
            rss[mode].append(r["peak_rss"])
    sides = {m: harness.summary(s) for m, s in samples.items()}
    return {"time": sides, "ratio": harness.ratio(samples["ppsplit"], samples["pipeline"]),
            "peak_rss_bytes": {m: max(v) for m, v in rss.items()},
            "warnings": harness.noise_warnings(f"driver x{stages}", sides)}


def main(quick: bool = False, out_dir: str | None = None) -> dict:
    gib = 2 ** 30
    data: dict = {"quick": quick, "threads_per_process": 1}
    shapes = [("llama-tiny", TINY, 2)] if quick else [("llama-7B", LLAMA_7B, 4), ("llama-70B", LLAMA_70B, 8)]
    repeats = 1 if quick else 3
    if quick:
        tiny = json.dumps(TINY)
        _prefetch([("ppsplit", tiny, 2, 128, 0), ("pipeline", tiny, 2, 128, 0),
                   ("ppsplit", json.dumps(dict(TINY, num_hidden_layers=2)), 2, 128, 0),
                   ("rank", tiny, 2, 128, 0), ("rank", tiny, 2, 128, 1)])
    rows = []
    data["driver"] = {}
    for name, config, stages in shapes:
        r = driver_comparison(config, stages, repeats)
        data["driver"][name] = r
        rows.append([name, stages, harness.fmt_stats(r["time"]["ppsplit"]), harness.fmt_stats(r["time"]["pipeline"]),
                     f"{r['ratio']['ratio']:.2f}", f"{r['peak_rss_bytes']['ppsplit'] / 2**20:.0f} MB",
                     f"{r['peak_rss_bytes']['pipeline'] / 2**20:.0f} MB"])
        for w in r["warnings"]:
            print(w)
    print(harness.table(["shape (meta)", "stages", "ppsplit split+check", "pipeline()", "ratio",
                         "ppsplit peak RSS", "pipeline() peak RSS"], rows))

    layer_counts = (2, 4) if quick else (8, 16, 32, 64)
    base = TINY if quick else LLAMA_7B
    growth = []
    for layers in layer_counts:
        cfg = dict(base, num_hidden_layers=layers)
        times = [child("ppsplit", cfg, 2)["seconds"] for _ in range(1 if quick else 2)]
        growth.append({"layers": layers, "seconds": statistics.median(times),
                       "seconds_per_layer": statistics.median(times) / layers})
    data["tracing_growth"] = growth
    print(harness.table(["layers", "split+check", "per layer"],
                        [[g["layers"], harness.fmt_time(g["seconds"]), harness.fmt_time(g["seconds_per_layer"])]
                         for g in growth]))

    ranks_cfg, ranks = (TINY, 2) if quick else (LLAMA_2B7, 4)
    per_rank = []
    for rank in range(ranks):
        r = child("rank", ranks_cfg, ranks, rank=rank)
        growth_bytes = r["peak_rss"] - r["rss_before"]
        per_rank.append({"rank": rank, "stage_bytes": r["stage_bytes"], "rss_before": r["rss_before"],
                         "peak_rss": r["peak_rss"], "growth_over_stage": growth_bytes / r["stage_bytes"]})
    data["ranks"] = {"config": ranks_cfg, "ranks": ranks, "per_rank": per_rank}
    print(harness.table(["rank", "stage", "RSS before (overhead)", "peak RSS", "growth / stage bytes"],
                        [[p["rank"], f"{p['stage_bytes'] / gib:.2f} GiB", f"{p['rss_before'] / 2**20:.0f} MB",
                          f"{p['peak_rss'] / gib:.2f} GiB", f"{p['growth_over_stage']:.3f}"] for p in per_rank]))
    harness.write_json("meta_memory", data, out_dir)
    return data


if __name__ == "__main__":
    main()
