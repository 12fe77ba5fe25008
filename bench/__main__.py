"""Run the benchmarks: ``python -m bench [--only NAME ...] [--quick] [--out DIR]``.

Each prints its table and writes ``<out>/<name>.json`` (default ``bench/results/``, or
``bench/results/quick/`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback

# In the order they run; the slow, multi-process one last.
BENCHMARKS = ("split_time", "stage_overhead", "dynamic_shapes", "tied_memory", "balance", "meta_memory",
              "pipeline_efficiency", "layouts", "rank_memory", "training", "finetune", "corpora", "checkpoint_cost", "timeline_overhead",
              "pipeline_bubbles", "step_overheads", "gpu_check")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Run ppsplit's benchmarks; each prints a table and writes JSON.")
    parser.add_argument("--only", action="append", choices=BENCHMARKS, metavar="NAME",
                        help=f"run only this benchmark (repeatable): {', '.join(BENCHMARKS)}")
    parser.add_argument("--quick", action="store_true", help="smallest sizes (the smoke test's)")
    parser.add_argument("--out", default=None, help="folder for the JSON results (default: bench/results, "
                                                    "bench/results/quick with --quick)")
    args = parser.parse_args(argv)
    chosen = [b for b in BENCHMARKS if not args.only or b in args.only]
    failed = []
    for name in chosen:
        start = time.perf_counter()
        print(f"\n### {name}{' (quick)' if args.quick else ''}", flush=True)
        try:
            importlib.import_module(f"bench.{name}").main(quick=args.quick, out_dir=args.out)
        except Exception:  # one broken benchmark should not hide the others' figures
            traceback.print_exc()
            failed.append(name)
        print(f"### {name}: {time.perf_counter() - start:.1f} s", flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
