"""What a run prints and writes: the stage table, the verdict and ``report.json``."""

from __future__ import annotations

import json
import math
import os


def stage_rows(split, costs: dict) -> list[dict]:
    """One row per stage: where it begins, its blocks, parameters, FLOPs and state_dict keys."""
    rows = []
    for index, (keys, blocks) in enumerate(zip(split.stage_keys, split.stage_blocks())):
        rows.append({
            "index": index,
            "begins_at": split.points[index - 1] if index else None,
            "first_block": blocks[0] if blocks else None,
            "last_block": blocks[-1] if blocks else None,
            "num_blocks": len(blocks),
            "num_params": int(costs["params"][index]),
            "flops": costs["flops"][index],
            "state_dict_keys": len(keys),
        })
    return rows


def format_checks(name, class_name, split, rows, balance_of, fqn, numerics, tolerance,
                  skipped: str = "model.init=meta") -> str:
    """The stage table, the balance, the ties and the verdicts of the checks."""
    lines = [f"ppsplit: {name} ({class_name}) in {len(split)} stages, "
             f"split at {', '.join(split.points) or '(none)'}",
             format_table(rows),
             f"balance (max/mean): params {balance_of['params']:.3f}, flops {balance_of['flops']:.3f}"]
    for group in fqn.tied:
        if len(group["keys"]) > 1:
            lines.append(f"tied: {' = '.join(group['keys'])}  (stages {', '.join(map(str, group['stages']))})")
    shared = [g for g in fqn.tied if len(g["keys"]) == 1]
    if shared:  # one layer run in several stages (ALBERT): its keys, once
        lines.append(f"shared: {len(shared)} keys under {_common_module([g['keys'][0] for g in shared])}  "
                     f"(stages {', '.join(map(str, sorted({s for g in shared for s in g['stages']})))})")
    lines.append(f"FQN check: {'passed' if fqn.ok else 'FAILED'}: {fqn.original_keys} original keys"
                 + "".join(f"\n  {p}" for p in fqn.problems()))
    if numerics is None:
        lines.append(f"numerics: not checked in the driver ({skipped}: it holds no weights)")
    else:
        ok = numerics.ok(tolerance)
        lines.append(f"numerics: {'passed' if ok else 'FAILED'}: "
                     f"forward {numerics.forward_max_abs_diff:.2e}, loss {numerics.loss_abs_diff:.2e}, "
                     f"grad {numerics.grad_max_abs_diff:.2e} (tolerance {tolerance:g} of each tensor's scale)"
                     + ("" if ok else f"\n  first past its bound: {numerics.worst(tolerance).describe()}"))
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    head = ("stage", "begins at", "first block", "last block", "params", "GFLOP", "keys")
    body = [
        (str(r["index"]), r["begins_at"] or "(input)", r["first_block"] or "-", r["last_block"] or "-",
         f"{r['num_params']:,}", f"{r['flops'] / 1e9:.3f}", str(r["state_dict_keys"]))
        for r in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    def line(cells):
        return "  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


SCHEMA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "report.schema.json")


def schema() -> dict:
    """The JSON Schema every ``report.json`` follows (shipped in the package)."""
    with open(SCHEMA) as f:
        return json.load(f)


def format_run(run: dict) -> str:
    """The training comparison in a few lines."""
    where = f"{run['launcher']}, {run['ranks']} rank(s) x {run['stages_per_rank']} stage(s), {run['schedule']}"
    if run.get("diverged"):
        return f"run ({where}): FAILED: {diverged_message(run['diverged'], run['steps'])}\n  losses:    " + \
            _some(run["losses"], "{:.6g}")
    if run["reference_losses"] is None:
        against = ("no unsplit reference (verify=off)" if run.get("verify", {}).get("mode") == "off"
                   else "no unsplit reference (the model is too large for the driver)")
    else:
        against = (f"max loss rel diff {run['max_loss_rel_diff']:.2e}, "
                   f"first-step grad diff {run['grad_max_abs_diff']:.2e}")
    lines = [
        f"run ({where}): {'passed' if run['ok'] else 'FAILED'}: {run['steps']} steps, {against}",
        "  losses:    " + _some(run["losses"]),
    ]
    m = run.get("mismatch")
    if m:
        lines.insert(1, f"  first past its bound: {m['kind']} {m['name']}: off by {m['max_abs_diff']:.2e} at "
                        f"scale {m['scale']:.2e} (allowed {m['bound']:.2e})")
    if run["reference_losses"] is not None:
        lines.append("  reference: " + _some(run["reference_losses"]))
    for tie in run["ties"]:
        if len(tie["keys"]) > 1:
            distance = ("" if tie["max_abs_diff_vs_reference"] is None else
                        f", {tie['max_abs_diff_vs_reference']:.1e} from the unsplit model")
            lines.append(
                f"  tied {tie['keys'][0]}: {tie['copies']} names held, "
                f"{'bitwise equal' if tie['copies_bitwise_equal'] else 'DIFFERENT'}{distance}"
            )
    shared = [t for t in run["ties"] if len(t["keys"]) == 1]
    if shared:
        equal = all(t["copies_bitwise_equal"] for t in shared)
        distances = [t["max_abs_diff_vs_reference"] for t in shared if t["max_abs_diff_vs_reference"] is not None]
        lines.append(
            f"  shared {_common_module([t['keys'][0] for t in shared])} ({len(shared)} keys): copies "
            f"{'bitwise equal' if equal else 'DIFFERENT'}"
            + (f", at most {max(distances):.1e} from the unsplit model" if distances else ""))
    if run.get("step_time_s") is not None:
        lines.append(f"  step time (median after the first): {run['step_time_s'] * 1e3:.1f} ms")
    if run.get("timeline"):
        lines.extend(format_timeline(run["timeline"]))
    return "\n".join(lines)


def _some(values: list[float], form: str = "{:.6f}", ends: int = 6) -> str:
    """The values, or for a long run its first and last few with the count between."""
    if len(values) <= 2 * ends + 1:
        return ", ".join(form.format(x) for x in values)
    return ", ".join(form.format(x) for x in values[:ends]) + f", ... ({len(values) - 2 * ends} more) ..., " + \
        ", ".join(form.format(x) for x in values[-ends:])


def format_timeline(t: dict) -> list[str]:
    """The pipeline's bubble, measured and by the schedule, and the stages' times, in a few lines."""
    if t.get("bubble_mean") is None:
        return []
    ranks = ", ".join(f"rank {r} {b:.2f}" for r, b in t["bubble"].items())
    line = f"  bubble (step {t['median_step']}, the median): {t['bubble_mean']:.2f} measured ({ranks})"
    if t.get("bubble_theory") is not None:
        line += f"; {t['bubble_theory']:.2f} by the schedule's action lists"
    if t.get("bubble_expected") is not None:
        line += f", {t['bubble_expected']:.2f} with these stage times"
    if t.get("wait_mean") is not None:
        line += f"; waiting on sends/receives {t['wait_mean']:.2f}"
    stages = []
    for s in t["stages"]:
        parts = [f"F {s['forward_ms']:.2f}" if s["forward_ms"] is not None else None,
                 f"B {s['backward_ms']:.2f}" if s["backward_ms"] is not None else None,
                 f"I {s['backward_input_ms']:.2f}" if s["backward_input_ms"] is not None else None,
                 f"W {s['backward_weight_ms']:.2f}" if s["backward_weight_ms"] is not None else None]
        saved = f", {s['activation_bytes'] / 2**20:.2f} MiB saved" if s["activation_bytes"] is not None else ""
        stages.append(f"{s['stage']}: {' '.join(p for p in parts if p)} ms{saved}")
    lines = [line]
    if stages:
        imbalance = f" (imbalance {t['imbalance']:.2f})" if t.get("imbalance") is not None else ""
        lines.append(f"  stages per microbatch{imbalance}: " + "; ".join(stages))
    lines.append(f"  timeline: {t['file']}" + (f", {t['picture']}" if t.get("picture") else ""))
    return lines


def _common_module(keys: list[str]) -> str:
    """The deepest module that holds all of ``keys``."""
    parts = [k.split(".")[:-1] for k in keys]
    common = []
    for names in zip(*parts):
        if len(set(names)) > 1:
            break
        common.append(names[0])
    return ".".join(common) or "(the model)"


def diverged_message(d: dict, steps: int | None = None) -> str:
    what = []
    if d.get("non_finite_loss") or (d.get("loss") is not None and not math.isfinite(d["loss"])):
        what.append(f"the loss is {d['loss']}")
    if d.get("non_finite_grad"):
        what.append(f"the gradient of {d['non_finite_grad']} is not finite")
    of = f"/{steps}" if steps else ""
    return f"training diverged in step {d['step'] + 1}{of}: {' and '.join(what) or 'a value is not finite'}"
