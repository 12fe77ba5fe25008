"""How a run writes: files whole or not at all (a crash or a signal leaves no half-written
file), strict JSON, the rows of ``metrics.csv``, and progress lines on the console."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import sys
import tempfile
import time

# the columns of metrics.csv, one row per step
COLUMNS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "time_s", "val_loss", "val_ppl", "restart")


class Progress:
    """What a run is doing, as it does it: one line per phase with the seconds it took, and the
    steps with the last stage's loss (a bar on a terminal; in a log or under CI a line every
    few seconds and at the end), so that a long run shows it is alive."""

    PLAIN_EVERY_S = 2.0

    def __init__(self, enabled: bool = True, stream=None):
        self.enabled = enabled
        self.stream = stream
        self.start = time.perf_counter()
        self.marks: dict[str, float] = {}
        self._last = self.start
        self._bar = None
        self._printed_at = 0.0

    @property
    def out(self):
        return self.stream or sys.stdout

    def __call__(self, line: str) -> None:
        if self.enabled:
            self._close_bar()
            print(f"[{time.perf_counter() - self.start:6.1f}s] {line}", file=self.out, flush=True)

    def phase(self, name: str, line: str) -> None:
        now = time.perf_counter()
        self.marks[name] = now - self._last
        self._last = now
        self(f"{line} ({self.marks[name]:.1f} s)")

    def step(self, done: int, total: int, loss: float | None = None, lr: float | None = None,
             tokens_per_s: float | None = None, **_measured) -> None:
        """``done`` of ``total`` steps finished; the last one's loss, learning rate and tokens/s."""
        if not self.enabled:
            return
        shown = ", ".join(part for part in (
            None if loss is None else f"loss {loss:.6f}",
            None if lr is None else f"lr {lr:.3g}",
            None if not tokens_per_s else f"{tokens_per_s:,.0f} tok/s") if part)
        if self.out.isatty() and not os.environ.get("CI"):
            if self._bar is None:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc="steps", unit="step", file=self.out, leave=True)
            self._bar.update(done - self._bar.n)
            if shown:
                self._bar.set_postfix_str(shown)
            if done >= total:
                self._close_bar()
            return
        now = time.perf_counter()
        if done >= total or now - self._printed_at >= self.PLAIN_EVERY_S:
            self._printed_at = now
            self(f"step {done}/{total} done" + (f", {shown}" if shown else ""))

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def strict(value):
    """``value`` with every NaN or infinity written as null, so the JSON is strict."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """A temporary name beside ``path`` to write to; it becomes ``path`` (mode 0644) only when
    the block ends without an error, so a crash or a signal leaves no half-written file."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    stem, ext = os.path.splitext(os.path.basename(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{stem}-", suffix=ext)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json(path: str, data: dict) -> None:
    """Write ``data`` to ``path`` atomically as strict JSON (a non-finite number is null),
    readable by all (0644)."""
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        json.dump(strict(data), f, indent=2, sort_keys=False, allow_nan=False)
        f.write("\n")


def write_rows(path: str, rows) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in COLUMNS})


def read_rows(path: str) -> list[dict]:
    """``metrics.csv`` as rows (numbers as numbers, empty cells as None)."""
    if not os.path.isfile(path):
        return []
    with open(path, newline="") as f:
        rows = []
        for raw in csv.DictReader(f):
            row = {k: (None if v in ("", None) else float(v)) for k, v in raw.items()}
            row["step"] = int(row["step"])
            row["restart"] = int(row.get("restart") or 0)
            rows.append(row)
    return rows
