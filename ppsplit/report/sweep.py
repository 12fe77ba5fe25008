"""After a Hydra multirun: one row per point in ``summary.csv`` and ``summary.md``, and a plot
comparing the points (``summary.png``), in the sweep folder. A point that failed gets a row
that says why; the others are unaffected."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

COLUMNS = ("point", "overrides", "model", "stages", "layout", "strategy", "split_points", "balance_params",
           "balance_flops", "check", "step_time_s", "bubble", "bubble_theory", "imbalance", "max_loss_rel_diff", "error")


def point_dirs(sweep_dir: Path) -> list[Path]:
    dirs = [d for d in sweep_dir.iterdir() if d.is_dir() and (d / ".hydra").is_dir()]
    return sorted(dirs, key=lambda d: (0, int(d.name)) if d.name.isdigit() else (1, d.name))


def summary_row(point: Path) -> dict[str, Any]:
    overrides_file = point / ".hydra" / "overrides.yaml"
    overrides = OmegaConf.to_container(OmegaConf.load(overrides_file)) if overrides_file.exists() else []
    row: dict[str, Any] = {c: "" for c in COLUMNS}
    row.update(point=point.name, overrides=" ".join(overrides))
    report, error = point / "report.json", point / "error.json"
    if report.exists():
        data = json.loads(report.read_text())
        run = data.get("run") or {}
        if "nothing_left" in data:  # checkpoint.load=auto, already at its last step
            row.update(model=data["model"], check="passed", error="nothing left to train")
            return row
        row.update(
            model=data["model"], stages=data["stages"], strategy=data.get("split_strategy", ""),
            layout="pp{pp}xdp{dp}xtp{tp}".format(**data["layout"]) if data.get("layout") else "",
            split_points=" ".join(data["split_points"]),
            balance_params=round(data["balance"]["params"], 4),
            balance_flops=round(data["balance"]["flops"], 4),
            check="passed" if data["ok"] else "FAILED",
            step_time_s="" if run.get("step_time_s") is None else round(run["step_time_s"], 6),
            max_loss_rel_diff="" if not run else run["max_loss_rel_diff"],
            stage_flops=[s["flops"] for s in data["stage_info"]],
        )
        timeline = run.get("timeline") or {}
        for column, key in (("bubble", "bubble_mean"), ("bubble_theory", "bubble_theory"), ("imbalance", "imbalance")):
            if timeline.get(key) is not None:
                row[column] = round(timeline[key], 4)
    elif error.exists():
        data = json.loads(error.read_text())
        row.update(check="error", error=data.get("error", ""))
    else:
        row.update(check="error", error="the point wrote no report (it did not finish)")
    return row


def _md(column: str, value) -> str:
    """summary.md's rounding: balances to 3 decimals, step time in ms to 1, differences in %.1e."""
    if value == "" or value is None:
        return ""
    if column.startswith("balance_") or column in ("bubble", "bubble_theory", "imbalance"):
        return f"{float(value):.3f}"
    if column == "step_time_s":
        return f"{float(value) * 1e3:.1f} ms"
    if column == "max_loss_rel_diff":
        return f"{float(value):.1e}"
    return str(value)


def write_summary(sweep_dir: str | os.PathLike) -> list[dict]:
    """summary.csv, summary.md and summary.png in the sweep folder, each written whole or not at all."""
    from ppsplit.output import atomic_path

    sweep = Path(sweep_dir)
    rows = [summary_row(p) for p in point_dirs(sweep)]
    with atomic_path(sweep / "summary.csv") as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [_md(c, row[c]).replace("|", "\\|") for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    with atomic_path(sweep / "summary.md") as tmp:
        Path(tmp).write_text("\n".join(lines) + "\n")
    with atomic_path(sweep / "summary.png") as tmp:
        plot(rows, tmp)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """Per point: the stage FLOPs stacked, with the balance the strategies optimise (max/mean of
    the stage FLOPs and parameters) written over each bar, and where the ranks ran the measured
    bubble (against the schedule's) and the stages' time imbalance; the step time as points on
    an axis of its own from 0, in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 5.2))
    labels = [f"{r['point']}\n{r['model']} {r['strategy']}\nS={r['stages']} {r.get('layout', '')}"
              if r["model"] else f"{r['point']}\n(error)" for r in rows]
    labelled: set[int] = set()
    tops = []
    for x, row in enumerate(rows):
        bottom = 0.0
        for i, flops in enumerate(row.get("stage_flops") or []):
            ax.bar(x, flops / 1e9, bottom=bottom, color=plt.cm.tab10(i % 10),
                   label=None if i in labelled else f"stage {i}")
            labelled.add(i)
            bottom += flops / 1e9
        tops.append(bottom)
    top = max(tops, default=0) or 1.0
    for x, row in enumerate(rows):
        if row["balance_flops"] != "":
            text = f"flops {row['balance_flops']:.3f}\nparams {row['balance_params']:.3f}"
            if row.get("bubble", "") != "":
                text += f"\nbubble {row['bubble']:.2f}" + (f" ({row['bubble_theory']:.2f})"
                                                          if row.get("bubble_theory", "") != "" else "")
            if row.get("imbalance", "") != "":
                text += f"\nstage time {row['imbalance']:.2f}"
            ax.text(x, tops[x] + 0.02 * top, text, ha="center", va="bottom", fontsize=7)
    ax.set_ylim(0, top * 1.45)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("stage forward+backward GFLOP (stacked)")
    handles, names = ax.get_legend_handles_labels()
    times = [(x, r["step_time_s"]) for x, r in enumerate(rows) if r["step_time_s"] != ""]
    if times:
        ax2 = ax.twinx()
        ax2.plot([t[0] for t in times], [t[1] * 1e3 for t in times], "kD", linestyle="none",
                 label="step time (ms)")
        ax2.set_ylim(0, max(t[1] for t in times) * 1e3 * 2.0)  # the points below the figures over the bars
        ax2.set_ylabel("step time (ms), slowest rank, median")
        more, more_names = ax2.get_legend_handles_labels()
        handles, names = handles + more, names + more_names
    if handles:  # below the points' labels, clear of the bars and figures
        ax.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=min(len(handles), 5),
                  fontsize=7, frameon=False)
    ax.set_title("ppsplit sweep: stage FLOPs and balance (max/mean) per point\n"
                 "measured bubble (the schedule's), stage-time max/mean", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


_FAILED: list[str] = []


def failed_points() -> list[str]:
    """The points of the last sweep in this process that did not pass (the exit status is 1)."""
    return list(_FAILED)


class SweepSummary(Callback):
    """Registered in conf/config.yaml under ``hydra.callbacks``."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _FAILED.clear()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from ppsplit.faults import pause
        from ppsplit.launch.signals import install_signal_handlers, restore_signal_handlers, say_interrupted
        from ppsplit.errors import Interrupted

        sweep_dir = config.hydra.sweep.dir
        if os.path.isdir(sweep_dir):
            handlers = install_signal_handlers()  # a stop signal ends the summary within the bound
            try:
                pause("summary", OmegaConf.select(config, "debug.pause_at"),
                      OmegaConf.select(config, "debug.pause_mode") or "sleep")
                rows = write_summary(sweep_dir)  # each file whole or not at all
            except Interrupted as err:
                say_interrupted(err.signum)
                os._exit(128 + err.signum)
            finally:
                restore_signal_handlers(handlers)
            _FAILED[:] = [r["point"] for r in rows if r["check"] != "passed"]
            failed = f"; {len(_FAILED)} failed: {', '.join(_FAILED)}" if _FAILED else ""
            print(f"ppsplit: sweep summary of {len(rows)} point(s){failed}: {os.path.join(sweep_dir, 'summary.md')}")
