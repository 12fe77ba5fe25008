"""Time to split: ``ppsplit.split`` + ``ppsplit.verify_fqns`` against torch's ``pipeline()``.

ppsplit's side includes the FQN proof, since a ppsplit user always gets both; torch's side is
``pipeline()`` alone. Both trace the same model at the same example input into 2 stages.
``pipeline()`` patches the model it is given (``annotate_split_points``), so every sample of
either side gets its own deep copy of the model, made untimed in the case's setup.

The layer series (GPT2 hidden 256 at 4 to 32 layers) shows whether either cost grows linearly
with depth: time per layer should stay flat, and a least-squares line gives the per-layer slope
and the fixed cost.
"""

from __future__ import annotations

import copy

from bench import harness, models

NAME = "split_time"
TARGET_RATIO = 1.2  # from the issue: ppsplit at most 1.2x pipeline()


def _cases(base, ids, point: str, split_only: bool = False) -> dict[str, harness.Case]:
    import ppsplit
    from torch.distributed.pipelining import SplitPoint, pipeline

    def ppsplit_side(model):
        split = ppsplit.split(model, (ids,), dict(models.CALL_KWARGS), points=[point])
        report = ppsplit.verify_fqns(model, split)
        assert report.ok, report.problems()
        return split

    def split_only_side(model):
        return ppsplit.split(model, (ids,), dict(models.CALL_KWARGS), points=[point])

    def pipeline_side(model):
        return pipeline(model, mb_args=(ids,), mb_kwargs=dict(models.CALL_KWARGS),
                        split_spec={point: SplitPoint.BEGINNING})

    fresh = lambda: copy.deepcopy(base)  # noqa: E731 - pipeline() would patch a shared model
    cases = {
        "ppsplit": harness.Case(ppsplit_side, setup=fresh),
        "pipeline": harness.Case(pipeline_side, setup=fresh),
    }
    if split_only:
        # Diagnostic: how much of ppsplit's side is the FQN proof (it compares every value).
        cases["ppsplit_split_only"] = harness.Case(split_only_side, setup=fresh)
    return cases


def _even_point(n_layer: int) -> str:
    return f"transformer.h.{(n_layer + 1) // 2}"


def _measure(shape: dict, seq: int, repeats: int, warmup: int, split_only: bool = False) -> dict:
    import ppsplit

    base = models.gpt2(**shape)
    ids = models.token_ids(base, 1, seq)
    point = _even_point(shape["n_layer"])
    # ppsplit's own even split must agree with the point handed to pipeline(), or the two
    # sides would not be doing the same job.
    assert ppsplit.split(base, (ids,), dict(models.CALL_KWARGS), stages=2).points == [point]
    samples = harness.interleaved(_cases(base, ids, point, split_only), repeats=repeats,
                                  warmup=warmup)
    sides = {k: harness.summary(v) for k, v in samples.items()}
    row = {
        "model": dict(shape),
        "input_shape": [1, seq],
        "stages": 2,
        "split_points": [point],
        **sides,
        **harness.ratio(samples["ppsplit"], samples["pipeline"]),
    }
    if split_only:
        row["split_only_ratio"] = harness.ratio(samples["ppsplit_split_only"],
                                                samples["pipeline"])["ratio"]
    return row


def _fit(xs: list[float], ys: list[float]) -> dict:
    """Least-squares line y = slope * x + intercept."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return {"slope_s_per_layer": slope, "intercept_s": my - slope * mx}


def main(quick: bool = False, out_dir: str | None = None) -> dict:
    with harness.torch_threads(harness.DEFAULT_THREADS) as threads:
        note = harness.load_note()
        if note:
            print(note)
        if quick:
            main_shape, seq, repeats = dict(models.GPT2_TINY), 32, 2
            series_shapes = [dict(models.GPT2_TINY, n_layer=n) for n in (2, 4)]
            series_repeats, series_warmup = 2, 0
        else:
            main_shape, seq, repeats = dict(models.GPT2_124M), 128, 3
            series_shapes = [
                dict(n_layer=n, n_embd=256, n_head=8, vocab_size=8000, n_positions=1024)
                for n in (4, 8, 16, 32)
            ]
            series_repeats, series_warmup = 3, 1

        warnings: list[str] = []
        main_row = _measure(main_shape, seq, repeats=repeats, warmup=1, split_only=True)
        main_row["meets_target"] = main_row["ratio"] <= TARGET_RATIO
        warnings += harness.noise_warnings(
            f"{NAME} n_layer={main_shape['n_layer']} n_embd={main_shape['n_embd']}",
            {k: main_row[k] for k in ("ppsplit", "pipeline", "ppsplit_split_only")})

        series = []
        for shape in series_shapes:
            # The main case already warmed up export and pipeline() in this process; quick mode
            # relies on that to stay short, full mode warms up again at every size.
            row = _measure(shape, seq, repeats=series_repeats, warmup=series_warmup)
            n = shape["n_layer"]
            for side in ("ppsplit", "pipeline"):
                row[f"{side}_per_layer_s"] = row[side]["median"] / n
            warnings += harness.noise_warnings(
                f"{NAME} series n_layer={n}", {k: row[k] for k in ("ppsplit", "pipeline")})
            series.append(row)
        layers = [r["model"]["n_layer"] for r in series]
        fit = {side: _fit(layers, [r[side]["median"] for r in series])
               for side in ("ppsplit", "pipeline")}

        print(f"\n== {NAME}: ppsplit.split + verify_fqns vs torch pipeline(), 2 stages, "
              f"torch threads={threads} ==")
        headers = ["model", "input", "ppsplit median [min, max]", "pipeline() median [min, max]",
                   "ratio", "round ratios"]
        def label(r):
            m = r["model"]
            return f"gpt2 {m['n_layer']}L x {m['n_embd']}, vocab {m['vocab_size']}"
        rows = [[label(main_row), "x".join(map(str, main_row["input_shape"])),
                 harness.fmt_stats(main_row["ppsplit"]), harness.fmt_stats(main_row["pipeline"]),
                 f"{main_row['ratio']:.3f}x",
                 f"{main_row['pair_min']:.3f}-{main_row['pair_max']:.3f}"]]
        print(harness.table(headers, rows))
        print(f"diagnostic: ppsplit.split alone (no verify_fqns) "
              f"{harness.fmt_stats(main_row['ppsplit_split_only'])}, "
              f"{main_row['split_only_ratio']:.3f}x pipeline()")
        print(f"target: ppsplit <= {TARGET_RATIO}x pipeline(): "
              f"{'met' if main_row['meets_target'] else 'NOT met'} ({main_row['ratio']:.3f}x)")

        print(f"\nlayer series (hidden {series_shapes[0]['n_embd']}, input 1x{seq}), "
              f"time per layer = median / layers:")
        headers = ["layers", "ppsplit median [min, max]", "pipeline() median [min, max]", "ratio",
                   "ppsplit / layer", "pipeline() / layer"]
        rows = [[r["model"]["n_layer"], harness.fmt_stats(r["ppsplit"]),
                 harness.fmt_stats(r["pipeline"]), f"{r['ratio']:.3f}x",
                 harness.fmt_time(r["ppsplit_per_layer_s"]),
                 harness.fmt_time(r["pipeline_per_layer_s"])] for r in series]
        print(harness.table(headers, rows))
        for side, f in fit.items():
            print(f"linear fit {side}: {harness.fmt_time(f['slope_s_per_layer'])} per layer "
                  f"+ {harness.fmt_time(f['intercept_s'])} fixed")
        for w in warnings:
            print(w)

        data = {
            "quick": quick,
            "threads": threads,
            "target_max_ratio": TARGET_RATIO,
            "ratio": main_row["ratio"],
            "main": main_row,
            "series": series,
            "series_fit": fit,
            "warnings": warnings,
            "load_note": note,
        }
        harness.write_json(NAME, data, out_dir)
        return data


if __name__ == "__main__":
    main()
