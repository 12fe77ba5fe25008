"""Step time and per-rank memory of pipeline-only, pipeline x FSDP2 and pipeline x tensor-parallel
layouts of one LLaMA on the same global batch, side by side in one run.

Each layout is a real ppsplit job (``ppsplit.app.cli.run``, local ranks, one torch thread per rank):
pp2 (2 ranks), pp2 x dp2 (4 ranks, FSDP2) and pp2 x tp2 (4 ranks). The jobs run in rounds, the
order reversed every other round, so that drift of a shared machine reaches every layout alike.
Per rank the report gives the parameter + optimizer bytes it holds between steps (its shards),
and the step time is the slowest rank's per step after the first. On a machine with fewer CPUs
than ranks the 4-rank layouts share cores: their step time is not a speed-up figure there, the
memory is.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import tempfile
import time

from bench import harness

NAME = "layouts"
LAYOUTS = {"pp2": [], "pp2xdp2": ["parallel.dp=2"], "pp2xtp2": ["parallel.tp=2"]}
FULL = dict(model=["model=llama", "model.config.num_hidden_layers=4", "model.config.hidden_size=256",
                   "model.config.intermediate_size=1024", "model.config.num_attention_heads=8",
                   "model.config.num_key_value_heads=4", "model.config.vocab_size=8000"],
            batch_size=16, seq_len=64, microbatches=4, steps=6, rounds=2)
QUICK = dict(model=["model=llama"], batch_size=8, seq_len=32, microbatches=4, steps=2, rounds=1)


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir

    from ppsplit.app.cli import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def run_layout(overrides: list[str]) -> dict:
    import ppsplit.app.cli

    out = io.StringIO()
    with tempfile.TemporaryDirectory(prefix="ppsplit-bench-") as tmp:
        start = time.perf_counter()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                code = ppsplit.app.cli.run(compose(overrides), tmp)
        except Exception as exc:  # one failing layout is reported, the others still run
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "output_tail": out.getvalue()[-2000:]}
        wall = time.perf_counter() - start
        with open(os.path.join(tmp, "report.json")) as f:
            run = json.load(f)["run"]
    ranks = run["rank_layout"]
    return {
        "ok": code == 0,
        "step_times_s": run["step_times_s"][1:],
        "held_bytes": [r["param_bytes"] + r["optimizer_bytes"] for r in ranks],
        "param_bytes": [r["param_bytes"] for r in ranks],
        "optimizer_bytes": [r["optimizer_bytes"] for r in ranks],
        "rss_growth_bytes": [r["rss_growth_bytes"] for r in ranks],
        "max_loss_rel_diff": run["max_loss_rel_diff"],
        "job_wall_s": wall,
    }


def main(quick: bool = False, out_dir: str | None = None) -> dict:
    spec = QUICK if quick else FULL
    base = [*spec["model"], "optimizer=adamw", f"batch_size={spec['batch_size']}", f"seq_len={spec['seq_len']}",
            f"microbatches={spec['microbatches']}", f"steps={spec['steps']}", "timeout_s=600",
            "launcher=local", "launcher.cpus_per_task=1"]
    with harness.torch_threads(harness.DEFAULT_THREADS) as threads:
        note = harness.load_note()
        if note:
            print(note)
        runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
        names = list(LAYOUTS)
        for round_ in range(spec["rounds"]):
            for name in names if round_ % 2 == 0 else names[::-1]:
                result = run_layout(base + LAYOUTS[name])
                runs[name].append(result)
                print(f"  round {round_ + 1} {name}: " + (
                    harness.fmt_time(statistics.median(result["step_times_s"])) if result["ok"] and
                    result["step_times_s"] else f"FAILED {result.get('error', '')}"), flush=True)
        rows, figures, warnings = [], {}, []
        for name in names:
            ok = [r for r in runs[name] if r["ok"]]
            if not ok:
                figures[name] = {"ok": False, "error": runs[name][0].get("error")}
                continue
            steps = [t for r in ok for t in r["step_times_s"]]
            stats = harness.summary(steps)
            warnings += harness.noise_warnings(f"{NAME} {name}", {"step": stats})
            held = max(ok[-1]["held_bytes"])
            figures[name] = {"ok": True, "ranks": len(ok[-1]["held_bytes"]), "step": stats,
                             "max_held_bytes": held, **ok[-1]}
        reference = figures.get("pp2", {})
        for name in names:
            f = figures[name]
            if not f.get("ok"):
                rows.append([name, "-", "FAILED", "-", "-", "-"])
                continue
            f["step_ratio"] = f["step"]["median"] / reference["step"]["median"] if reference.get("ok") else None
            f["held_ratio"] = f["max_held_bytes"] / reference["max_held_bytes"] if reference.get("ok") else None
            rows.append([name, f["ranks"], harness.fmt_stats(f["step"]),
                         f"{f['step_ratio']:.2f}x" if f["step_ratio"] else "-",
                         f"{f['max_held_bytes'] / 2**20:.2f} MiB",
                         f"{f['held_ratio']:.3f}x" if f["held_ratio"] else "-"])
        cpus = os.cpu_count() or 1
        print(f"\n== {NAME}: LLaMA, global batch {spec['batch_size']}x{spec['seq_len']}, m={spec['microbatches']}, "
              f"AdamW, torch threads={threads} per rank, {cpus} CPUs ==")
        print(harness.table(["layout", "ranks", "step (median [min, max])", "step / pp2",
                             "params+optimizer per rank (max)", "held / pp2"], rows))
        if cpus < 4:
            print(f"note: {cpus} CPUs for 4 ranks: the dp2/tp2 step times include waiting for a core")
        for w in warnings:
            print(w)
        ratios = [figures[n]["held_ratio"] for n in names if figures[n].get("held_ratio")]
        data = {"quick": quick, "threads": threads, "batch": [spec["batch_size"], spec["seq_len"]],
                "model_overrides": spec["model"], "layouts": figures,
                "ratio": figures.get("pp2xdp2", {}).get("held_ratio") or (ratios[0] if ratios else None),
                "warnings": warnings, "load_note": note}
        harness.write_json(NAME, data, out_dir)
        return data


if __name__ == "__main__":
    main()
