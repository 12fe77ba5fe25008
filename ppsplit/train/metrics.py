"""What a training run measures, written as it goes: ``metrics.csv`` in the run folder (a row per
optimizer step: loss, learning rate, gradient norm before clipping, tokens/s, MFU, and the
validation loss and perplexity where one was taken, and ``restart``: how many times SLURM's
signal had moved the run to a new job by then, under ``launcher.requeue``), the same scalars as TensorBoard event files
(``metrics.tensorboard=true``), and ``loss.png`` at the end.

Tokens/s counts the global batch's tokens (``batch_size x seq_len x grad_accumulation``) over the
step's time on its slowest rank. MFU is the step's model FLOPs (forward and backward, from
:mod:`ppsplit.stages.plan`) over that time and the sum of every rank's peak. Each rank measures its own
peak once before it trains, on the device it computes on and in the dtype it trains in
(bfloat16 under ``train.precision=bf16``, else float32): a short matmul on its GPU, or on its
host's CPU at its thread count (the machine's own speed for this kind of work, not a datasheet
figure); an inline run measures the driver's, where it computes.
"""

from __future__ import annotations

import csv
import math
import os
import threading
import time

from ppsplit.output import COLUMNS, atomic_path, read_rows

def matmul_peak(threads: int = 1, size: int | None = None, seconds: float = 0.1, device=None,
                precision: str = "fp32") -> float:
    """FLOP/s of a square matmul on ``device`` (default: the CPU, at ``threads`` torch threads)
    in the dtype ``precision`` trains in (``train.precision``: bf16 or fp32); ``size`` by default
    256 on a CPU, 4096 on a GPU, which is synchronised before the clock is read."""
    import torch

    device = torch.device(device or "cpu")
    cuda = device.type == "cuda"
    size = size or (4096 if cuda else 256)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size, device=device, dtype=dtype)
        torch.mm(a, a)
        if cuda:
            torch.cuda.synchronize(device)
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            torch.mm(a, a)
            count += 1
            if cuda:
                torch.cuda.synchronize(device)
        return 2 * size ** 3 * count / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(saved)


class MetricsLog:
    """Rows in step order, written as they come (a step whose row arrives early waits for the
    ones before it). ``first_step``: the step a resumed run starts from; ``prior``: the rows of
    the steps before it (from the checkpoint), written first, so that the file goes on."""

    def __init__(self, run_dir: str, spec, flops_per_step: float, peak_flops: float | None, ranks: int,
                 first_step: int = 0, prior: list[dict] | None = None, restart: int = 0):
        self.run_dir, self.spec = run_dir, spec
        self.prior = [r for r in prior or () if r["step"] <= first_step]
        self.flops, self.peak, self.ranks = flops_per_step, peak_flops, ranks  # the peak per rank (None: the ranks say)
        self.first_step, self.restart = first_step, restart
        self.rows: list[dict] = []
        self._waiting: dict[int, dict] = {}
        self._lock = threading.Lock()
        self._writer = self._file = None
        self._path = os.path.join(run_dir, "metrics.csv") if spec.metrics.csv else None

    def _open(self) -> None:
        """The files, at the first row: a run refused before its first step writes none."""
        if self._path:
            os.makedirs(self.run_dir, exist_ok=True)
            fresh = not os.path.exists(self._path)
            self._file = open(self._path, "a", newline="")
            self._csv = csv.DictWriter(self._file, fieldnames=COLUMNS)
            if fresh:
                self._csv.writeheader()
                for row in self.prior:
                    self._csv.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in COLUMNS})
        if self.spec.metrics.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(os.path.join(self.run_dir, "tensorboard"))

    def tokens(self, step: int) -> int:
        return self.spec.batch_size * self.spec.seq_len_at(step) * self.spec.train.grad_accumulation

    def record(self, k: int, loss, lr, grad_norm, time_s, val_loss=None, peak_flops=None) -> None:
        """Step ``k`` of this run (from 0) measured; written once every step before it is.
        ``peak_flops``: the sum of the ranks' own peaks, as they measured them."""
        step = self.first_step + k + 1  # steps done, as the progress line counts them
        tokens_per_s = self.tokens(step - 1) / time_s if time_s else None
        if peak_flops:
            self.peak = peak_flops / self.ranks
        mfu = (self.flops / (time_s * self.ranks * self.peak) if time_s and self.peak and self.flops else None)
        row = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
               "mfu": mfu, "time_s": time_s, "val_loss": val_loss,
               "val_ppl": math.exp(min(val_loss, 700)) if val_loss is not None else None, "restart": self.restart}
        with self._lock:
            if any(r["step"] == step for r in self.rows):
                return
            self._waiting[step] = row
            while self.first_step + len(self.rows) + 1 in self._waiting:
                self._write(self._waiting.pop(self.first_step + len(self.rows) + 1))

    def _write(self, row: dict) -> None:
        if not self.rows:
            self._open()
        self.rows.append(row)
        if self._path:
            self._csv.writerow({k: ("" if v is None else v) for k, v in row.items()})
            self._file.flush()
        if self._writer is not None:
            for key in COLUMNS[1:]:
                if row[key] is not None:
                    self._writer.add_scalar(key, row[key], row["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._writer is not None:
            self._writer.close()
        if self.spec.metrics.plot and self.rows:
            plot_losses(self.prior + self.rows, os.path.join(self.run_dir, "loss.png"))

    def last_step(self) -> int:
        """The last step whose row is written (steps counted from 1)."""
        return self.first_step + len(self.rows)

    def rows_through(self, step: int) -> list[dict]:
        """Every row up to ``step``, the resumed-from run's first: what a checkpoint there keeps."""
        with self._lock:
            return [dict(r) for r in self.prior + self.rows if r["step"] <= step]

    def summary(self) -> dict:
        """Medians over the steps after the first, for the report."""
        def median(key):
            values = sorted(r[key] for r in self.rows[1:] or self.rows if r[key] is not None)
            return values[len(values) // 2] if values else None

        return {"tokens_per_s": median("tokens_per_s"), "mfu": median("mfu"), "peak_flops_per_rank": self.peak,
                "flops_per_step": self.flops, "csv": self._path,
                "tensorboard": os.path.join(self.run_dir, "tensorboard") if self.spec.metrics.tensorboard else None}


def plot_losses(rows: list[dict], path: str) -> None:
    """Train loss per step and the validation losses, in one picture."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt


    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows if r["loss"] is not None]
    ax.plot(steps, [r["loss"] for r in rows if r["loss"] is not None], label="train loss", lw=1.2)
    val = [(r["step"], r["val_loss"]) for r in rows if r["val_loss"] is not None]
    if val:
        ax.plot([v[0] for v in val], [v[1] for v in val], "o-", label="validation loss", lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("ppsplit: training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)


def open_log(spec, output_dir: str, costs: dict, resume, restart: int = 0) -> MetricsLog:
    """The run's metrics log: FLOPs per step from the stage costs, the rows a resumed run goes on
    from, and the peak of this process's device when it computes here."""
    ranks = spec.world_size if spec.distributed else 1
    flops = sum(costs["flops"]) * spec.parallel.dp * spec.train.grad_accumulation  # the global batch's
    prior = None
    if resume:  # the rows up to the checkpoint's step, so that metrics.csv goes on
        prior = read_rows(os.path.join(resume["checkpoint"], "metrics.csv"))
    # Ranks measure their own peaks (their device, their dtype); an inline run computes here.
    peak = None if spec.distributed else matmul_peak(spec.launcher.cpus_per_task, precision=spec.train.precision)
    return MetricsLog(output_dir, spec, flops, peak, ranks,
                      first_step=resume["step"] if resume else 0, prior=prior, restart=restart)
