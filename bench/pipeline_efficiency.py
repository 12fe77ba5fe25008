"""Step time of a 2-rank pipeline over the ideal, for each schedule, microbatch count and split.

The ideal for p stages and m microbatches is (T1 / p) * (m + p - 1) / m: a perfect split of one
unsplit forward+backward of the full batch (T1) over p ranks, plus the fill and drain bubble of
p - 1 microbatches. T1 is measured in this process on one thread (ranks also run one thread
each). The step time is ppsplit's own: ``run.step_time_s`` in ``report.json`` from
``ppsplit.app.cli.run``, the median over the steps after the first of the slowest rank; a step
includes the optimizer step and the tied-gradient all-reduce, which T1 does not.

T1 samples are interleaved with the jobs (one before each job), so both sides of every ratio
see the same machine state. Caveat: while the ranks run, ppsplit's driver process trains the
unsplit reference model on the same data; on a machine with fewer than ranks + 1 CPUs the
driver competes with the ranks for part of the steps, and the figure is pessimistic.
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

NAME = "pipeline_efficiency"
STAGES = 2
FULL = dict(model=["model.config.n_layer=8", "model.config.n_embd=256", "model.config.n_head=8",
                   "model.config.vocab_size=8000"],
            batch_size=16, seq_len=128, microbatches=(4, 8, 16), schedules=("gpipe", "1f1b"), steps=6)
# ppsplit's default tiny GPT2 (conf/model/gpt2.yaml).
QUICK = dict(model=[], batch_size=8, seq_len=32, microbatches=(4,), schedules=("gpipe",), steps=2)


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir

    import ppsplit.app.cli

    with initialize_config_dir(config_dir=ppsplit.app.cli.CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def strategies(quick: bool) -> list[str]:
    """The split strategies in ``conf/split`` that need nothing beyond ``stages``."""
    import ppsplit.app.cli

    if quick:
        return ["even"]
    names = sorted(os.path.splitext(f)[0] for f in os.listdir(os.path.join(ppsplit.app.cli.CONF_DIR, "split"))
                   if f.endswith(".yaml"))
    # manual needs split.points; even goes first as the reference.
    return ["even"] + [n for n in names if n not in ("even", "manual")]


def base_overrides(spec: dict) -> list[str]:
    return ["model=gpt2", *spec["model"], f"batch_size={spec['batch_size']}",
            f"seq_len={spec['seq_len']}", f"stages={STAGES}", "launcher=local"]


def planned_points(cfg) -> list[str] | None:
    """Where ppsplit would split for ``cfg``, without running the job (to skip strategies that
    land on the same points as one already measured). None if ppsplit's API does not say."""
    try:
        import ppsplit
        from ppsplit.models import build
        from ppsplit.data.batch import make_batch
        from ppsplit.config.spec import from_config

        spec = from_config(cfg)
        s = spec.model
        model = build.build_model(s.class_name, s.config, s.pretrained, cfg.seed)
        batch = make_batch(s.inputs, model, cfg.batch_size, cfg.seq_len, cfg.seed,
                                 call_kwargs=s.call_kwargs)
        mb = batch.microbatches(cfg.microbatches)[0]
        return list(ppsplit.split(model, mb.args, mb.kwargs, **spec.split_kwargs()).points)
    except Exception:  # an evolving API must not stop the benchmark; every strategy then runs
        return None


class T1:
    """One unsplit forward+backward of the full batch, in this process."""

    def __init__(self, cfg):
        from ppsplit.models import build
        from ppsplit.data.batch import make_batch
        from ppsplit.train.objective import Objective
        from ppsplit.config.spec import from_config

        s = from_config(cfg).model
        self.model = build.build_model(s.class_name, s.config, s.pretrained, cfg.seed)
        self.batch = make_batch(s.inputs, self.model, cfg.batch_size, cfg.seq_len,
                                      cfg.seed, call_kwargs=s.call_kwargs)
        self.loss_fn = Objective(s.loss)
        self.case = harness.Case(self._step, setup=self._zero)

    def _zero(self):
        self.model.zero_grad(set_to_none=True)

    def _step(self, _):
        b = self.batch
        self.loss_fn(self.model(*b.args, **b.kwargs), b.labels).backward()

    def sample(self) -> float:
        return harness.time_sample(self.case)


def slowest_rank_steps(report: dict) -> list[float] | None:
    """Per step after the first, the slowest rank's time (``run.step_times_s`` in the report)."""
    steps = (report.get("run") or {}).get("step_times_s") or []
    return steps[1:] or None


def run_job(overrides: list[str]) -> dict:
    import ppsplit.app.cli

    cfg = compose(overrides)
    out, err = io.StringIO(), io.StringIO()
    with tempfile.TemporaryDirectory(prefix="ppsplit-bench-") as tmp:
        start = time.perf_counter()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = ppsplit.app.cli.run(cfg, tmp)
        except Exception as exc:  # one failing point is reported, the others still run
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                    "output_tail": (out.getvalue() + err.getvalue())[-2000:]}
        wall = time.perf_counter() - start
        with open(os.path.join(tmp, "report.json")) as f:
            report = json.load(f)
        steps = slowest_rank_steps(report)
    run = report.get("run") or {}
    return {
        "ok": code == 0,
        "exit_code": code,
        "split_points": report.get("split_points"),
        "balance": report.get("balance"),
        "step_time_s": run.get("step_time_s"),
        "slowest_rank_steps_s": steps,
        "steps_summary": harness.summary(steps) if steps else None,
        "job_wall_s": wall,
        "output_tail": None if code == 0 else (out.getvalue() + err.getvalue())[-2000:],
    }


def main(quick: bool = False, out_dir: str | None = None) -> dict:
    spec = QUICK if quick else FULL
    with harness.session() as (threads, note):
        base = base_overrides(spec)
        # T1 uses the full batch and one microbatch: the same model and data as every job.
        t1 = T1(compose(base + ["microbatches=1"]))
        for _ in range(2):  # warm-up
            t1.sample()
        t1_samples: list[float] = []

        seen: dict[tuple, str] = {}
        points: list[dict] = []
        skipped: dict[str, str] = {}
        for strategy in strategies(quick):
            # A strategy's points may depend on m (flops counts per microbatch): compare all.
            planned = tuple(
                tuple(p) if (p := planned_points(compose(base + [f"split={strategy}",
                                                                 f"microbatches={m}"]))) else None
                for m in spec["microbatches"])
            if None not in planned and planned in seen:
                skipped[strategy] = f"same split points as {seen[planned]}: {list(planned[0])}"
                continue
            if None not in planned:
                seen[planned] = strategy
            for schedule in spec["schedules"]:
                for m in spec["microbatches"]:
                    overrides = base + [f"split={strategy}", f"microbatches={m}",
                                        f"schedule={schedule}", f"steps={spec['steps']}"]
                    t1_samples.append(t1.sample())
                    row = {"strategy": strategy, "schedule": schedule, "microbatches": m,
                           "overrides": overrides, **run_job(overrides)}
                    points.append(row)
                    print(f"  {strategy} {schedule} m={m}: "
                          + (harness.fmt_time(row.get("step_time_s")) if row["ok"]
                             else f"FAILED {row.get('error') or row.get('exit_code')}"),
                          flush=True)
        t1_samples.append(t1.sample())  # bracket the last job too
        t1_stats = harness.summary(t1_samples)
        t1_median = t1_stats["median"]

        warnings = harness.noise_warnings(f"{NAME} T1", {"T1": t1_stats})
        for row in points:
            m = row["microbatches"]
            row["ideal_s"] = (t1_median / STAGES) * (m + STAGES - 1) / m
            row["ratio"] = row["step_time_s"] / row["ideal_s"] if row.get("step_time_s") else None
            if row.get("steps_summary"):
                warnings += harness.noise_warnings(
                    f"{NAME} {row['strategy']} {row['schedule']} m={m}",
                    {"step time": row["steps_summary"]})
        del t1

        cpus = os.cpu_count() or 1
        print(f"\n== {NAME}: {STAGES} local ranks, step time / ideal (T1/{STAGES})(m+{STAGES - 1})/m, "
              f"batch {spec['batch_size']}x{spec['seq_len']}, torch threads={threads} "
              f"(driver and each rank) ==")
        print(f"T1 (unsplit fwd+bwd, full batch): {harness.fmt_stats(t1_stats)} over {t1_stats['n']} "
              "samples interleaved with the jobs")
        headers = ["split", "points", "schedule", "m", "step (median)", "steps [min, max]", "ideal",
                   "step/ideal"]
        rows = []
        for r in points:
            s = r.get("steps_summary")
            rows.append([r["strategy"], ",".join(r.get("split_points") or []) or "-", r["schedule"],
                         r["microbatches"], harness.fmt_time(r.get("step_time_s")),
                         f"[{harness.fmt_time(s['min'])}, {harness.fmt_time(s['max'])}]" if s else "-",
                         harness.fmt_time(r["ideal_s"]),
                         f"{r['ratio']:.3f}x" if r["ratio"] else "FAILED"])
        print(harness.table(headers, rows))
        for strategy, why in skipped.items():
            print(f"skipped split={strategy}: {why}")
        if cpus < STAGES + 1:
            print(f"note: {cpus} CPUs for {STAGES} ranks + the driver; the driver only waits while "
                  "the ranks step (it trains its reference afterwards)")
        for w in warnings:
            print(w)

        ok_ratios = [r["ratio"] for r in points if r["ratio"]]
        data = {
            "quick": quick,
            "threads": threads,
            "stages": STAGES,
            "batch": [spec["batch_size"], spec["seq_len"]],
            "model_overrides": spec["model"],
            "t1": t1_stats,
            "ratio": statistics.median(ok_ratios) if ok_ratios else None,
            "points": points,
            "skipped_strategies": skipped,
            "warnings": warnings,
            "load_note": note,
        }
        harness.write_json(NAME, data, out_dir)
        return data


if __name__ == "__main__":
    main()
