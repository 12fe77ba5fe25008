"""What one split traced for varying sequence lengths costs against splits traced at one length.

A GPT2 split in two is traced once with a dynamic sequence dimension (``dynamic={"seq": ...}``)
and, for comparison, once per length at that fixed shape. At each length, the chained stages'
forward+backward (the work of one training microbatch) is timed on both, side by side, and the
unsplit model's as the baseline. Both splits give the unsplit model's outputs exactly (checked
before timing). What the dynamic one adds: each stage reads the sizes it needs off its inputs
(``sym_size``), checks its inputs against the trace's bounds, and the regions that depend on the
length (the causal mask) are built on every call instead of once (``stage_code.fold_constants``
folds only regions that read no input).
"""

from __future__ import annotations

import math
import time

import torch

from bench import harness, models

NAME = "dynamic_shapes"

# (label, model shape, batch, sequence lengths, target dynamic/static at each length)
SIZES = [
    ("8L x 256", dict(n_layer=8, n_embd=256, n_head=8, vocab_size=8000, n_positions=1024), 2, (64, 128, 256), 1.10),
    ("4L x 64", dict(models.GPT2_TINY), 4, (16, 32, 64), 1.25),
]


def _step(forward, ids):
    out = forward(ids)
    logits = out[0] if isinstance(out, (tuple, list)) else out
    logits.float().sum().backward()


def _measure(label, shape, batch, lengths, target, repeats: int, sample_s: float) -> dict:
    import ppsplit

    model = models.gpt2(**shape)
    kwargs = dict(models.CALL_KWARGS)
    example = models.token_ids(model, batch, lengths[0])
    start = time.perf_counter()
    dynamic = ppsplit.split(model, (example,), kwargs, stages=2,
                            dynamic={"seq": (min(lengths), max(lengths))})
    dynamic_trace_s = time.perf_counter() - start
    rows = []
    for length in lengths:
        ids = models.token_ids(model, batch, length, seed=length)
        start = time.perf_counter()
        static = ppsplit.split(model, (ids,), kwargs, stages=2)
        static_trace_s = time.perf_counter() - start
        with torch.no_grad():
            want = model(ids, **kwargs)[0]
            diffs = {name: (s(ids, **kwargs)[0] - want).abs().max().item()
                     for name, s in (("dynamic", dynamic), ("static", static))}
        assert all(d == 0.0 for d in diffs.values()), diffs

        def side(forward):
            def run(_):
                model.zero_grad(set_to_none=True)
                _step(forward, ids)
            return run

        eager = side(lambda x: model(x, **kwargs))
        for _ in range(2):
            eager(None)
        t0 = time.perf_counter()
        eager(None)
        inner = max(1, math.ceil(sample_s / max(time.perf_counter() - t0, 1e-6)))
        cases = {
            "dynamic": harness.Case(side(lambda x: dynamic(x, **kwargs)), inner=inner),
            "static": harness.Case(side(lambda x: static(x, **kwargs)), inner=inner),
            "eager": harness.Case(eager, inner=inner),
        }
        samples = harness.interleaved(cases, repeats=repeats, warmup=1)
        sides = {k: harness.summary(v) for k, v in samples.items()}
        dyn = harness.ratio(samples["dynamic"], samples["static"])
        rows.append({
            "seq": length, "static_trace_s": static_trace_s, "max_abs_diff_vs_unsplit": diffs,
            "calls_per_sample": inner, **sides,
            "dynamic_over_static": dyn["ratio"], "dynamic_over_static_pairs": [dyn["pair_min"], dyn["pair_max"]],
            "static_over_eager": harness.ratio(samples["static"], samples["eager"])["ratio"],
            "meets_target": dyn["ratio"] <= target,
        })
    return {"label": label, "model": dict(shape), "batch": batch, "lengths": list(lengths),
            "dynamic_trace_s": dynamic_trace_s, "target_max_ratio": target, "lengths_measured": rows}


def main(quick: bool = False, out_dir: str | None = None) -> dict:
    with harness.torch_threads(harness.DEFAULT_THREADS) as threads:
        note = harness.load_note()
        if note:
            print(note)
        sizes = SIZES[1:] if quick else SIZES
        repeats, sample_s = (5, 0.02) if quick else (15, 0.2)
        results, warnings = [], []
        for label, shape, batch, lengths, target in sizes:
            if quick:  # the shortest and the longest: the dynamic trace spans the same range
                lengths = (lengths[0], lengths[-1])
            result = _measure(label, shape, batch, lengths, target, repeats, sample_s)
            for r in result["lengths_measured"]:
                warnings += harness.noise_warnings(f"{NAME} {label} seq {r['seq']}",
                                                   {k: r[k] for k in ("dynamic", "static", "eager")})
            results.append(result)

        print(f"\n== {NAME}: GPT2 in 2 stages, chained forward+backward per microbatch, "
              f"torch threads={threads} ==")
        headers = ["model", "batch x seq", "dynamic [min, max]", "static [min, max]", "eager [min, max]",
                   "dynamic/static", "static/eager", "target"]
        table = [[res["label"], f"{res['batch']}x{r['seq']}", harness.fmt_stats(r["dynamic"]),
                  harness.fmt_stats(r["static"]), harness.fmt_stats(r["eager"]),
                  f"{r['dynamic_over_static']:.3f}x", f"{r['static_over_eager']:.3f}x",
                  f"<= {res['target_max_ratio']}x {'met' if r['meets_target'] else 'NOT met'}"]
                 for res in results for r in res["lengths_measured"]]
        print(harness.table(headers, table))
        for res in results:
            print(f"{res['label']}: one dynamic trace {res['dynamic_trace_s']:.1f} s for "
                  f"{len(res['lengths'])} lengths; one static trace per length "
                  + ", ".join(f"{r['static_trace_s']:.1f} s" for r in res["lengths_measured"]))
        for w in warnings:
            print(w)
        data = {"quick": quick, "threads": threads,
                "compared": "one split traced with a dynamic sequence length vs one split traced per length, "
                            "chained forward+backward at each length, and the unsplit model",
                # the headline: the largest dynamic/static ratio over the first size's lengths
                "ratio": max(r["dynamic_over_static"] for r in results[0]["lengths_measured"]),
                "sizes": results, "warnings": warnings, "load_note": note}
        harness.write_json(NAME, data, out_dir)
        return data


if __name__ == "__main__":
    main()
