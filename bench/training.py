"""What training costs, side by side in one run.

1. Throughput: tokens/s of a 2-stage pipeline (a real ppsplit job: 2 local ranks, one torch
   thread each, ``verify=off``) against the unsplit model trained in one process by the same
   step code (:func:`ppsplit.train.loop.train_in_process`), at one torch thread and at two (the
   pipeline's two ranks use two cores). Median step time after the first; jobs interleaved.
2. Activation checkpointing: the unsplit model's step time with every block recomputed in the
   backward against without, in one process, interleaved.
3. Metrics: what writing one step's row costs (``metrics.csv`` and TensorBoard events) against
   the step time of (1): the target is at most 2% of a step.
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

NAME = "training"
FULL = dict(model=["model=gpt2", "model.config.n_layer=8", "model.config.n_embd=256", "model.config.n_head=8",
                   "model.config.vocab_size=8000", "model.config.n_positions=256"],
            batch_size=16, seq_len=128, microbatches=4, steps=10, rounds=3)
QUICK = dict(model=["model=gpt2"], batch_size=8, seq_len=32, microbatches=4, steps=3, rounds=1)


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir

    from ppsplit.app.cli import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def common(spec: dict) -> list[str]:
    return [*spec["model"], f"batch_size={spec['batch_size']}", f"seq_len={spec['seq_len']}",
            f"microbatches={spec['microbatches']}", f"steps={spec['steps']}", "optimizer=adamw", "verify=off",
            "eval.batches=0"]


def pipeline_step_times(spec: dict) -> list[float]:
    import ppsplit.app.cli

    out = io.StringIO()
    with tempfile.TemporaryDirectory(prefix="ppsplit-bench-") as tmp:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = ppsplit.app.cli.run(compose(common(spec) + ["metrics.csv=false", "metrics.plot=false"]), tmp)
        if code != 0:
            raise RuntimeError(out.getvalue()[-2000:])
        with open(os.path.join(tmp, "report.json")) as f:
            return json.load(f)["run"]["step_times_s"][1:]


def unsplit_step_times(spec: dict, threads: int, checkpointing: str | None = None) -> list[float]:
    from ppsplit.models import build
    from ppsplit.train.objective import Objective
    from ppsplit.data.corpus import BatchSource
    from ppsplit.config.spec import from_config
    from ppsplit.train.loop import apply_activation_checkpointing, checkpoint_pattern, train_in_process

    overrides = common(spec) + ([f"train.activation_checkpointing={checkpointing}"] if checkpointing else [])
    job = from_config(compose(overrides))
    m = job.model
    model = build.build_model(m.class_name, m.config, None, job.seed)
    blocks = [f"transformer.h.{i}" for i in range(model.config.n_layer)]
    apply_activation_checkpointing(model, checkpoint_pattern(job.train.activation_checkpointing, blocks))
    with harness.torch_threads(threads):
        out = train_in_process(model, [model], BatchSource(job, model.config), job, job.microbatches,
                               Objective(m.loss))
    return out["step_times_s"][1:]


def metrics_row_cost(repeats: int) -> float:
    """Seconds to record one step (csv and TensorBoard)."""
    from ppsplit.config.spec import from_config
    from ppsplit.train.metrics import MetricsLog

    job = from_config(compose(["metrics.tensorboard=true"]))
    with tempfile.TemporaryDirectory(prefix="ppsplit-bench-") as tmp:
        log = MetricsLog(tmp, job, 1e9, 1e10, 2)
        log.record(0, 6.0, 1e-3, 1.0, 0.05, None)  # opens the files
        start = time.perf_counter()
        for k in range(1, repeats + 1):
            log.record(k, 6.0, 1e-3, 1.0, 0.05, 5.9 if k % 50 == 0 else None)
        elapsed = (time.perf_counter() - start) / repeats
        log.close()
    return elapsed


def main(quick: bool = False, out_dir: str | None = None) -> dict:
    with harness.torch_threads(1):  # as the ranks run; the unsplit sides set their own
        return _main(quick, out_dir)


def _main(quick: bool, out_dir: str | None) -> dict:
    spec = QUICK if quick else FULL
    samples = {"pipeline": [], "unsplit_1t": [], "unsplit_2t": [], "recompute": []}
    for r in range(spec["rounds"]):
        order = list(samples) if r % 2 == 0 else list(reversed(samples))
        for side in order:
            if side == "pipeline":
                samples[side] += pipeline_step_times(spec)
            elif side == "recompute":
                samples[side] += unsplit_step_times(spec, 1, "blocks")
            else:
                samples[side] += unsplit_step_times(spec, 1 if side == "unsplit_1t" else 2)
    tokens = spec["batch_size"] * spec["seq_len"]
    sides = {k: harness.summary(v) for k, v in samples.items()}
    tps = {k: tokens / statistics.median(v) for k, v in samples.items()}
    row_s = metrics_row_cost(50 if quick else 500)
    step_s = statistics.median(samples["pipeline"])
    headline = harness.ratio(samples["unsplit_2t"], samples["pipeline"])  # >1: the pipeline is faster
    data = {
        "quick": quick, "threads": 1, "batch": [spec["batch_size"], spec["seq_len"]],
        "model": spec["model"], "step_time_s": sides, "tokens_per_s": tps,
        "ratio": headline["ratio"], "ratio_pairs": [headline["pair_min"], headline["pair_max"]],
        "pipeline_over_unsplit_1t": tps["pipeline"] / tps["unsplit_1t"],
        "pipeline_over_unsplit_2t": tps["pipeline"] / tps["unsplit_2t"],
        "recompute_over_plain": statistics.median(samples["recompute"]) / statistics.median(samples["unsplit_1t"]),
        "metrics_row_s": row_s, "metrics_share_of_step": row_s / step_s,
        "warnings": harness.noise_warnings("training", sides),
    }
    print(harness.table(["side", "step (median [min, max])", "tokens/s"],
                        [[k, harness.fmt_stats(sides[k]), f"{tps[k]:,.0f}"] for k in samples]))
    print(f"pipeline / unsplit: {data['pipeline_over_unsplit_1t']:.2f}x (1 thread), "
          f"{data['pipeline_over_unsplit_2t']:.2f}x (2 threads); recompute: {data['recompute_over_plain']:.2f}x; "
          f"metrics row: {row_s * 1e6:.0f} us = {data['metrics_share_of_step'] * 100:.2f}% of a step")
    harness.write_json(NAME, data, out_dir)
    return data


if __name__ == "__main__":
    main()
