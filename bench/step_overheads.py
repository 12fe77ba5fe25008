"""What a rank does per training step beyond its layout's own communication, at growing depth.

Each layout (pp2 x dp2 with FSDP2 and clipping, pp2 x dp2 replicated, pp2 x tp2) of one LLaMA
runs as a real ppsplit job at 4, 8 and 16 layers, its processes counting their calls
(``bench/step_counting``): torch.distributed's collectives ("ours": all-reduces, barriers and
the like, which ppsplit issues itself; "fsdp": FSDP2's all-gathers and reduce-scatters), the
functional collectives DTensor issues, the pipeline's sends and receives, and host syncs (a
tensor's value read on the host). A figure is the worst rank's count in a middle step. On a GPU
each collective is a kernel launch and each host sync stalls the stream: what ppsplit adds
should not grow with depth, while FSDP's and TP's own communication does.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import subprocess
import sys
import tempfile

from bench import harness

NAME = "step_overheads"
HERE = os.path.dirname(os.path.abspath(__file__))
LAYOUTS = {
    "fsdp2": ["parallel.dp=2", "train.clip_grad_norm=1.0"],
    "replicated_dp": ["parallel.dp=2", "parallel.fsdp=false", "train.clip_grad_norm=1.0"],
    "tp": ["parallel.tp=2", "train.clip_grad_norm=1.0"],
}
COLUMNS = ("ours", "dtensor", "fsdp", "p2p", "sync")


def run_job(layout: list[str], layers: int, steps: int) -> dict:
    """The worst rank's counts in a middle step, by kind, of one job."""
    with tempfile.TemporaryDirectory(prefix="ppsplit-bench-") as tmp:
        counts_dir = os.path.join(tmp, "counts")
        os.makedirs(counts_dir)
        env = {**os.environ, "PPSPLIT_COUNT_DIR": counts_dir,
               "PYTHONPATH": os.pathsep.join([os.path.join(HERE, "step_counting"), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, "-m", "ppsplit", "model=llama", f"model.config.num_hidden_layers={layers}",
                               f"steps={steps}", "verify=off", "eval.batches=0", *layout, f"hydra.run.dir={tmp}/run"],
                              env=env, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            return {"ok": False, "error": (proc.stderr or proc.stdout)[-1500:]}
        per_rank: dict[int, collections.Counter] = {}
        middle = steps // 2
        for path in glob.glob(os.path.join(counts_dir, "*.jsonl")):
            with open(path) as f:
                for line in f:
                    row = json.loads(line)
                    if row["step"] == middle:
                        per_rank[row["rank"]] = collections.Counter(row["counts"])
    kinds = {kind: max(sum(v for k, v in c.items() if k.startswith(kind + ":")) for c in per_rank.values())
             for kind in COLUMNS}
    detail = {r: dict(sorted(c.items())) for r, c in sorted(per_rank.items())}
    return {"ok": bool(per_rank), "kinds": kinds, "ranks": detail}


def main(quick: bool = False, out_dir: str | None = None) -> dict:
    depths = (2, 4) if quick else (4, 8, 16)
    layouts = {"fsdp2": LAYOUTS["fsdp2"]} if quick else LAYOUTS
    steps = 4
    results: dict = {}
    rows = []
    for name, overrides in layouts.items():
        for layers in depths:
            got = run_job(overrides, layers, steps)
            results.setdefault(name, {})[str(layers)] = got
            kinds = got.get("kinds") or {}
            rows.append([name, layers, *(kinds.get(k, "-") for k in COLUMNS), "" if got["ok"] else "FAILED"])
    print(harness.table(["layout", "layers", "ours (all-reduce, barrier)", "DTensor collectives",
                         "FSDP gathers/scatters", "p2p", "host syncs", ""], rows))
    flat = {name: all(results[name][str(d)].get("kinds", {}).get("ours") == results[name][str(depths[0])]
                      .get("kinds", {}).get("ours") for d in depths) for name in results}
    print("ppsplit's own collectives flat in depth: " + ", ".join(f"{n} {'yes' if ok else 'NO'}" for n, ok in flat.items()))
    data = {"quick": quick, "depths": list(depths), "steps": steps, "results": results, "flat": flat}
    harness.write_json(NAME, data, out_dir)
    return data
