"""Timing, statistics, tables and JSON output shared by the benchmarks.

Every timed figure follows the same rules: both sides of a ratio are measured in the same run,
after a warm-up, with their samples interleaved (A, B, A, B, ...) so that slow drifts of a shared
machine hit both sides alike; each side is reported as median, min and max, and a side whose
max/min spread exceeds ``NOISE_LIMIT`` makes the figure noisy (a warning is printed and stored).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
NOISE_LIMIT = 1.3
DEFAULT_THREADS = 1


@contextlib.contextmanager
def torch_threads(n: int = DEFAULT_THREADS):
    """Run with ``n`` torch threads, then restore the caller's count (the smoke test runs the
    benchmarks inside pytest, which should not be left single-threaded)."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(old)


@dataclass
class Case:
    """One side of a comparison.

    ``setup`` (untimed) runs before every sample and its result is handed to ``run``; it is
    for work that must be fresh each time but is not what is measured (building a model that
    the measured call consumes). ``inner`` calls of ``run`` make one sample, for calls too short
    to time one by one; a sample is reported per call.
    """

    run: Callable[[Any], Any]
    setup: Callable[[], Any] | None = None
    inner: int = 1


def time_sample(case: Case) -> float:
    state = case.setup() if case.setup is not None else None
    # Collect now so a previous sample's garbage is not collected inside this one.
    gc.collect()
    start = time.perf_counter()
    for _ in range(case.inner):
        out = case.run(state)
    elapsed = time.perf_counter() - start
    del out, state
    return elapsed / case.inner


def interleaved(cases: dict[str, Case], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each case: ``warmup`` discarded rounds, then ``repeats`` rounds that
    each take one sample of every case in turn, in reverse order every other round (A B, B A),
    so that neither side always runs first or right after a third."""
    for _ in range(warmup):
        for case in cases.values():
            time_sample(case)
    samples: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    # What exists now (the models, their traces, a test session's heap) outlives the samples:
    # frozen, the collection before each sample looks only at what came after (the full one
    # took about 0.3 s a sample here), and what the samples left is still collected.
    gc.collect()
    gc.freeze()
    try:
        for round_ in range(repeats):
            for name in names if round_ % 2 == 0 else names[::-1]:
                samples[name].append(time_sample(cases[name]))
    finally:
        gc.unfreeze()
    return samples


def summary(samples: list[float]) -> dict:
    lo, hi = min(samples), max(samples)
    return {
        "median": statistics.median(samples),
        "min": lo,
        "max": hi,
        "spread": hi / lo if lo > 0 else float("inf"),
        "n": len(samples),
        "samples": list(samples),
    }


def ratio(a: list[float], b: list[float]) -> dict:
    """median(a) / median(b), with the range of the per-round ratios a[i] / b[i] (the samples
    of one round were taken next to each other, so their ratio is the least drift-prone)."""
    pairs = [x / y for x, y in zip(a, b) if y > 0]
    return {
        "ratio": statistics.median(a) / statistics.median(b),
        "pair_min": min(pairs) if pairs else None,
        "pair_max": max(pairs) if pairs else None,
    }


def noise_warnings(label: str, sides: dict[str, dict]) -> list[str]:
    """Warnings for each side (a ``summary``) whose max/min spread is above ``NOISE_LIMIT``."""
    return [
        f"WARNING: {label}: noisy figure: {name} spread max/min = {s['spread']:.2f}x "
        f"(> {NOISE_LIMIT}x)"
        for name, s in sides.items()
        if s["spread"] > NOISE_LIMIT
    ]


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 0:  # a fitted intercept can fall below zero
        return "-" + fmt_time(-seconds)
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def fmt_stats(s: dict) -> str:
    """``median [min, max]``."""
    return f"{fmt_time(s['median'])} [{fmt_time(s['min'])}, {fmt_time(s['max'])}]"


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cells[0], widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells[1:]]
    return "\n".join(lines)


def machine_info() -> dict:
    import transformers

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count()
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        # The machine may be shared; the load tells a reader how much to trust the timings.
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def load_note() -> str | None:
    """A line to print when other work is competing for the CPUs."""
    if not hasattr(os, "getloadavg"):
        return None
    load = os.getloadavg()[0]
    cpus = os.cpu_count() or 1
    if load > 0.5:
        return (f"note: load average {load:.2f} on {cpus} CPUs at start; other work shares the "
                "machine, timings may be noisy")
    return None


@contextlib.contextmanager
def session(threads: int = DEFAULT_THREADS):
    """A benchmark's run: ``threads`` torch threads, the load note printed; yields (threads, note)."""
    with torch_threads(threads) as n:
        note = load_note()
        if note:
            print(note)
        yield n, note


def write_json(name: str, data: dict, out_dir: str | None = None) -> str:
    """Write ``data`` with the machine's description to ``<out_dir>/<name>.json``, say where,
    and return the path. Call it while the benchmark's thread count is still in force.

    By default full runs write to ``bench/results/`` and quick runs to ``bench/results/quick/``,
    so a smoke run never overwrites the real figures."""
    if out_dir is None:
        out_dir = os.path.join(RESULTS_DIR, "quick") if data.get("quick") else RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    payload = {"benchmark": name, **data, "machine": machine_info()}
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
        f.write("\n")
    print(f"wrote {path}")
    return path
