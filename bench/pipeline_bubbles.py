"""The pipeline's bubble as it ran against the schedule's own, for the seven schedules, and how
much of the ranks' time is compute under the FLOP-balanced split against ``even``.

Each point is a real ppsplit run (``ppsplit.app.cli.run``, local ranks, one torch thread each) of
GPT2 at 2 and 4 pipeline ranks (the looped and V schedules hold two stages a rank, so 4 and 8
stages), read back from its ``report.json``'s ``run.timeline``:

- ``bubble``: measured, the mean over ranks of the idle share of the median step;
- ``bubble_theory``: the schedule's action lists played out with F = I = W = 1, B = 2
  (``ppsplit/train/bubble.py``); ``bubble_expected``: the same lists with the run's measured
  stage times (the bubble were sends and overheads free);
- ``efficiency``: the stages' compute in the median step (every action's time, summed over the
  ranks) over ranks x that step's time (first start to last end, optimizer included): 1.0 would
  be every rank computing all the time.

``ratio``: the median over the points of the efficiency of split=flops over that of split=even
(the two run back to back at each point). On a machine with fewer CPUs than ranks + 1 the
ranks share cores and the measured bubble holds their waiting for a CPU too.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import tempfile

from bench import harness

NAME = "pipeline_bubbles"
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev")
FULL = dict(model=["model.config.n_layer=8", "model.config.n_embd=128", "model.config.n_head=4",
                   "model.config.vocab_size=4000"],
            batch_size=16, seq_len=64, microbatches=8, ranks=(2, 4), schedules=SCHEDULES, steps=5)
QUICK = dict(model=[], batch_size=8, seq_len=32, microbatches=4, ranks=(2,), schedules=("1f1b",), steps=2)
STRATEGIES = ("even", "flops")


def stages_for(schedule: str, ranks: int) -> int:
    from ppsplit.config.schedules import SCHEDULES as PLACEMENTS

    return ranks if PLACEMENTS[schedule][1] == "single" else 2 * ranks


def run_point(overrides: list[str]) -> dict:
    from hydra import compose, initialize_config_dir

    import ppsplit.app.cli

    with initialize_config_dir(config_dir=ppsplit.app.cli.CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    out = io.StringIO()
    with tempfile.TemporaryDirectory(prefix="ppsplit-bench-") as tmp:
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                code = ppsplit.app.cli.run(cfg, tmp)
            with open(os.path.join(tmp, "report.json")) as f:
                report = json.load(f)
        except Exception as exc:  # one failing point is reported, the others still run
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "output_tail": out.getvalue()[-2000:]}
    run = report.get("run") or {}
    t = run.get("timeline") or {}
    if code != 0 or not t.get("stages"):
        return {"ok": False, "error": f"exit {code}", "output_tail": out.getvalue()[-2000:]}
    ranks = len(run["rank_layout"])
    return {"ok": True, "split_points": report["split_points"], "balance_flops": report["balance"]["flops"],
            "step_time_s": run["step_time_s"], "bubble": t["bubble_mean"], "bubble_by_rank": t["bubble"],
            "wait": t["wait_mean"], "bubble_theory": t["bubble_theory"], "bubble_theory_from": t["bubble_theory_from"],
            "bubble_expected": t["bubble_expected"], "imbalance": t["imbalance"],
            "efficiency": t["compute_ms"] / (ranks * t["step_ms"])}


def main(quick: bool = False, out_dir: str | None = None) -> dict:
    spec = QUICK if quick else FULL
    with harness.session() as (threads, note):
        points = []
        for schedule in spec["schedules"]:
            for ranks in spec["ranks"]:
                stages = stages_for(schedule, ranks)
                base = ["model=gpt2", *spec["model"], f"batch_size={spec['batch_size']}", f"seq_len={spec['seq_len']}",
                        f"microbatches={spec['microbatches']}", f"schedule={schedule}", f"stages={stages}",
                        f"steps={spec['steps']}", "launcher=local", "verify=1", "eval.batches=0", "metrics.plot=false"]
                row = {"schedule": schedule, "ranks": ranks, "stages": stages}
                for strategy in STRATEGIES:  # back to back: the two sides of the ratio see one machine state
                    row[strategy] = run_point(base + [f"split={strategy}"])
                even, flops = row["even"], row["flops"]
                row["efficiency_ratio"] = (flops["efficiency"] / even["efficiency"]
                                           if even["ok"] and flops["ok"] else None)
                points.append(row)
                print(f"  {schedule} ranks={ranks}: " + (
                    f"bubble {even['bubble']:.2f} (theory {even['bubble_theory']:.2f}), efficiency even "
                    f"{even['efficiency']:.2f} flops {flops['efficiency']:.2f}" if row["efficiency_ratio"]
                    else f"FAILED {even.get('error')} / {flops.get('error')}"), flush=True)

        print(f"\n== {NAME}: GPT2 {' '.join(spec['model']) or '(tiny default)'}, batch {spec['batch_size']}x"
              f"{spec['seq_len']}, {spec['microbatches']} microbatches, torch threads={threads} per rank ==")
        headers = ["schedule", "ranks", "stages", "bubble measured", "waits", "theory", "expected (stage times)",
                   "imbalance", "efficiency even", "efficiency flops", "flops/even"]
        rows = []
        for p in points:
            e, f = p["even"], p["flops"]
            if not p["efficiency_ratio"]:
                rows.append([p["schedule"], p["ranks"], p["stages"]] + ["FAILED"] * 8)
                continue
            rows.append([p["schedule"], p["ranks"], p["stages"], f"{e['bubble']:.2f}", f"{e['wait']:.2f}",
                         f"{e['bubble_theory']:.3f}", f"{e['bubble_expected']:.2f}", f"{e['imbalance']:.2f}",
                         f"{e['efficiency']:.2f}", f"{f['efficiency']:.2f}", f"{p['efficiency_ratio']:.2f}x"])
        print(harness.table(headers, rows))
        cpus = os.cpu_count() or 1
        if cpus < max(spec["ranks"]) + 1:
            print(f"note: {cpus} CPUs for up to {max(spec['ranks'])} ranks: ranks wait for a core as well as for "
                  "each other, and the measured bubble holds both")
        ratios = [p["efficiency_ratio"] for p in points if p["efficiency_ratio"]]
        data = {"quick": quick, "threads": threads, "model_overrides": spec["model"],
                "batch": [spec["batch_size"], spec["seq_len"]], "microbatches": spec["microbatches"],
                "ratio": statistics.median(ratios) if ratios else None, "points": points, "load_note": note}
        harness.write_json(NAME, data, out_dir)
        return data


if __name__ == "__main__":
    main()
