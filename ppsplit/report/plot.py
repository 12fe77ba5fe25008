"""``timeline.png``: one step of the pipeline as it ran, a Gantt chart.

A row per rank; along it, each action of the rank's stages as a bar coloured by its kind
(forward, full backward, backward-input, backward-weight), labelled with the stage and
microbatch where it is wide enough; below the bars, a thin band of the send/receive waits; the
optimizer step at the end of the row. What stays white inside the step is the bubble. The title
gives the measured bubble and the one the schedule's action lists imply.
"""

from __future__ import annotations

COLOURS = {"forward": "#4C72B0", "backward": "#DD8452", "backward_input": "#C44E52",
           "backward_weight": "#55A868", "optimizer": "#8C8C8C", "wait": "#E0A0A0"}
LABELS = {"forward": "forward", "backward": "backward (full)", "backward_input": "backward, input",
          "backward_weight": "backward, weight", "optimizer": "optimizer step", "wait": "send/recv wait"}


def gantt(timelines: list[dict], step: int, path: str, summary: dict) -> None:
    """Draw ``step`` (0-based) of ``timelines`` into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = sorted(timelines, key=lambda t: t["rank"])
    spans = [(s, e) for t in rows for k, s, e, _ in t["steps"] if k == step]
    begin = min(s for s, _ in spans)
    end = max(e for _, e in spans)
    width_ms = max((end - begin) * 1e3, 1e-6)
    fig, ax = plt.subplots(figsize=(11, 1.0 + 0.75 * len(rows)))
    used = set()
    for y, t in enumerate(rows):
        for k, s, e, optimizer in t["steps"]:
            if k != step:
                continue
            ax.broken_barh([((s - begin) * 1e3, (e - s) * 1e3)], (y - 0.42, 0.84), facecolors="none",
                           edgecolors="#BBBBBB", linewidth=0.8)
            if optimizer:
                ax.broken_barh([((optimizer - begin) * 1e3, (e - optimizer) * 1e3)], (y - 0.3, 0.6),
                               facecolors=COLOURS["optimizer"])
                used.add("optimizer")
        for action, stage, mb, k, s, e in t["events"]:
            if k != step:
                continue
            x, w = (s - begin) * 1e3, (e - s) * 1e3
            ax.broken_barh([(x, w)], (y - 0.3, 0.6), facecolors=COLOURS[action], edgecolors="white", linewidth=0.4)
            used.add(action)
            if w > width_ms / 45:
                ax.text(x + w / 2, y, f"s{stage}\nmb{mb}", ha="center", va="center", fontsize=6, color="white")
        waits = [((s - begin) * 1e3, (e - s) * 1e3) for _, k, s, e in t.get("waits", ()) if k == step]
        if waits:
            ax.broken_barh(waits, (y + 0.32, 0.1), facecolors=COLOURS["wait"])
            used.add("wait")
    ax.set_yticks(range(len(rows)), [f"rank {t['rank']}\nstages {_stages(t)}" for t in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, width_ms * 1.01)
    ax.set_xlabel(f"ms from the start of step {step + 1}")
    measured, planned = summary.get("bubble_mean"), summary.get("bubble_theory")
    title = f"step {step + 1} (the median), as it ran"
    if measured is not None:
        title += f": bubble {measured:.2f} measured"
        if planned is not None:
            title += f", {planned:.2f} by the schedule's action lists"
    ax.set_title(title + " (white = idle)", fontsize=10)
    fig.legend(handles=[Patch(color=COLOURS[a], label=LABELS[a]) for a in COLOURS if a in used],
               loc="lower center", ncol=6, fontsize=8, frameon=False)
    ax.grid(axis="x", color="#EEEEEE")
    ax.set_axisbelow(True)
    fig.tight_layout(rect=(0, 0.4 / fig.get_figheight(), 1, 1))  # room for the legend below the axis
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def _stages(t: dict) -> str:
    return ",".join(str(s) for s in sorted({e[1] for e in t["events"]})) or "-"
