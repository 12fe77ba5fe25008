"""Train the pipeline (in this process, or on the ranks) and the unsplit model on the same
batches and steps, and compare them step for step: the loss and the gradient norm of every step,
the first step's gradients, the validation losses, every trained tensor and every tied copy
(:func:`ppsplit.stages.verify.compare_training`). ``verify`` chooses how much of the run the unsplit
reference trains: its first N steps (default 10: all of a short run), all of it (``full``), or
none (``off``)."""

from __future__ import annotations

import copy
import os
import socket

from ppsplit.models import build
from ppsplit.faults import pause
from ppsplit.config.spec import JobSpec
from ppsplit.stages.tolerance import Tolerance


def train_and_compare(spec: JobSpec, model, split, source, loss_fn, ranks, target, say, resume=None,
                      masks=None, log=None, saves=None) -> dict:
    from ppsplit.stages.verify import compare_training

    results = None
    reference_model = model
    load = spec.checkpoint.load
    if ranks is None:  # inline: the chained stages in this process
        reference_model = copy.deepcopy(model)  # the stages share the model's tensors
        mine = _train_inline(spec, model, split, source, loss_fn, target, say, load, masks, log, saves)
    else:
        # Wait first: a reference trained meanwhile would take the ranks' CPUs and distort their
        # step times.
        pause("train", spec.debug.pause_at, spec.debug.pause_mode)
        results = sorted(ranks.wait(), key=lambda r: r["rank"])
        mine = _from_ranks(spec, split, results)
        if log is not None:
            for k, row in enumerate(_rows(mine)):
                log.record(k, **row)  # the steps the heartbeats did not carry
        if ranks.stop_signal is not None:  # a stop signal: the ranks saved where they stood, and ended
            from ppsplit.errors import Interrupted

            raise Interrupted(ranks.stop_signal)
        if ranks.stopped_at() is not None:  # ... or SLURM's signal to their job
            from ppsplit.errors import JobStopped

            cancelled = ranks.backend.cancelled()  # scancel: the user's; a time limit, a requeue: SLURM's
            ranks.backend.cancel()  # a job SLURM requeued would start again: it is this run's no more
            raise JobStopped(ranks.stopped_at(), ranks.backend.describe().split(";")[0], cancelled)
    say.phase("train", f"ranks finished {spec.steps} step(s)" if ranks else f"trained {spec.steps} step(s)")
    reference = None
    if mine["diverged"] is not None:
        cmp = {"losses": list(mine["losses"]), "reference_losses": None, "max_loss_rel_diff": None,
               "grad_max_abs_diff": None, "worst_grad": "", "ties": [], "ok": False, "mismatch": None}
    else:
        reference = _train_reference(spec, model, reference_model, split, source, loss_fn, load, masks, say)
        cmp = compare_training(reference, mine, split.tie_groups, computed=Tolerance(spec.tolerance),
                               trained=Tolerance(spec.tie_tolerance))
        if mine["fqn_problems"]:
            cmp["ok"] = False
    return {
        "launcher": spec.launcher.name,
        "schedule": spec.schedule,
        "mesh": spec.parallel.record(spec.plan.ranks if ranks is not None else 1),
        "ranks": spec.world_size if ranks is not None else 1,
        "stages_per_rank": spec.plan.stages_per_rank if ranks is not None else len(split.stages),
        "steps": spec.steps,
        "resumed_from": resume,
        "optimizer": spec.optimizer,
        "train": {"lr_schedule": spec.train.lr_schedule, "warmup_steps": spec.train.warmup_steps,
                  "grad_accumulation": spec.train.grad_accumulation, "clip_grad_norm": spec.train.clip_grad_norm,
                  "precision": spec.train.precision, "activation_checkpointing": spec.train.activation_checkpointing,
                  "dropout": spec.dropout},
        "verify": {"mode": spec.verify.mode, "reference_steps": _ref_steps(spec) if reference is not None else 0},
        **cmp,
        "grad_norms": mine["grad_norms"],
        "reference_grad_norms": reference["grad_norms"] if reference else None,
        "lrs": mine["lrs"],
        "val_losses": mine["val_losses"],
        "reference_val_losses": reference["val_losses"] if reference else None,
        "clipped_steps": sum(1 for n in mine["grad_norms"] if spec.train.clip_grad_norm
                             and n > spec.train.clip_grad_norm),
        "metrics": log.summary() if log is not None else None,
        "diverged": mine["diverged"],
        "rank_fqn_problems": mine["fqn_problems"],
        "step_time_s": mine["step_time_s"],
        "step_times_s": mine["step_times_s"],
        "checkpoint": None,
        "final_state_digests": mine["digests"],
        "tie_comm_groups": results[0]["tie_comm_groups"] if results else [],
        "rank_layout": mine["rank_layout"],
        "rank_pids": [r["pid"] for r in results] if results else [],
        "seq_lens": [spec.seq_len_at(step) for step in range(spec.steps)],
        "driver_host": socket.gethostname(),
        "nodes": _nodes(results or []),
    }


def _ref_steps(spec: JobSpec) -> int:
    return spec.verify.reference_steps(spec.steps)


def _train_inline(spec, model, split, source, loss_fn, target, say, load, masks, log, saves) -> dict:
    from ppsplit.parallel.stage_state import tensor_digest
    from ppsplit.parallel.ties import TieSync
    from ppsplit.train.loop import apply_activation_checkpointing, checkpoint_pattern, train_in_process

    modules = dict(enumerate(split.stages))
    ties = TieSync(split.tie_groups, split.stage_keys, modules, {i: 0 for i in modules}, 0)
    pattern = checkpoint_pattern(spec.train.activation_checkpointing, split.blocks)
    for stage in split.stages:
        apply_activation_checkpointing(stage, pattern)
    say(f"training {spec.steps} step(s) inline")
    handles = masks.on_stages(modules) if masks is not None else []

    def on_step(done, stats, val_loss):
        say.step(done, spec.steps, loss=stats.loss, lr=stats.lr,
                 tokens_per_s=log.tokens(done - 1) / stats.time_s if log and stats.time_s else None)
        if log is not None:
            log.record(done - 1, stats.loss, stats.lr, stats.grad_norm, stats.time_s, val_loss)

    def periodic(step, optimizer):
        if step % saves.series.every == 0:
            from ppsplit.checkpoint import dcp as checkpoint
            from ppsplit.checkpoint.series import staging_path

            say(f"saving the checkpoint of step {step}")
            checkpoint.save(staging_path(saves.series.folder, step, saves.series.token), {0: model}, {0: optimizer},
                            tie_groups=split.tie_groups)
            saves.saved(step)

    out = train_in_process(split, split.stages, source, spec, spec.microbatches, loss_fn, after_backward=ties.sum_grads,
                           load=(load, model, split.tie_groups) if load else None, on_step=on_step, masks=masks,
                           after_step=periodic if saves else None)
    for handle in handles:
        handle.remove()
    if target and out["diverged"] is None:
        from ppsplit.checkpoint import dcp as checkpoint

        # The stages share the model's tensors, and the optimizer holds them once.
        checkpoint.save(target.staging, {0: model}, {0: out["optimizer"]},
                        hf=os.path.join(target.staging, "hf") if spec.checkpoint.hf else None,
                        tie_groups=split.tie_groups)
    return {**out, "states": out["state"], "fqn_problems": [], "rank_layout": [],
            "digests": {k: tensor_digest(v) for st in split.stages for k, v in st.state_dict().items()}}


def _from_ranks(spec, split, results) -> dict:
    keepers = [r for r in results if r["keeper"]]
    last = len(split.stages) - 1
    on_last = [r for r in results if last in r["stages"] and r["coords"]["tp"] == 0]
    losses = [sum(xs) / len(xs) for xs in zip(*[r["losses"] for r in on_last])]  # the mean over dp ranks
    vals = []
    for entries in zip(*[r["val_losses"] for r in on_last]):
        vals.append({"step": entries[0]["step"], "loss": sum(e["loss"] for e in entries) / len(entries)})
    times = [r["step_time_s"] for r in results if r["step_time_s"] is not None]
    peaks = [r.get("peak_flops") for r in results]
    return {
        "losses": losses, "val_losses": vals, "peak_flops": sum(peaks) if all(peaks) else None,
        "grad_norms": results[0]["grad_norms"], "lrs": results[0]["lrs"],
        "first_grads": [r["first_grads"] for r in keepers],
        "states": [st for r in keepers for st in r["state"].values()],
        "step_time_s": max(times) if times else None,
        "step_times_s": [max(ts) for ts in zip(*[r["step_times_s"] for r in results])],  # the slowest rank's
        "digests": {k: v for r in keepers for k, v in r["digests"].items()},
        "diverged": _merge_diverged([r["diverged"] for r in results if r["diverged"]]),
        "fqn_problems": [f"rank {r['rank']}: {p}" for r in results for p in r["fqn_problems"]],
        "rank_layout": [{"rank": r["rank"], **r["coords"], "stages": r["stages"], "host": r["host"], "pid": r["pid"],
                         "stage_bytes": r["stage_bytes"], "param_bytes": r["param_bytes"],
                         "optimizer_bytes": r["optimizer_bytes"], "rss_growth_bytes": r["rss_growth_bytes"],
                         "peak_rss_bytes": r["peak_rss_bytes"], "cuda_max_allocated_bytes": r["cuda_max_allocated_bytes"]}
                        for r in results],
    }


def _rows(mine: dict) -> list[dict]:
    val = {v["step"]: v["loss"] for v in mine["val_losses"]}
    return [{"loss": loss, "lr": lr, "grad_norm": norm, "time_s": t, "val_loss": val.get(k + 1),
             "peak_flops": mine.get("peak_flops")}
            for k, (loss, lr, norm, t) in enumerate(zip(mine["losses"], mine["lrs"], mine["grad_norms"],
                                                         mine["step_times_s"]))]


def _train_reference(spec, model, reference_model, split, source, loss_fn, load, masks, say) -> dict | None:
    """The unsplit model trained on the same global batches and steps (``verify`` permitting and
    the model fitting in the driver)."""
    from ppsplit.train.loop import apply_activation_checkpointing, checkpoint_pattern, train_in_process

    steps = _ref_steps(spec)
    if steps == 0:
        return None
    if any(p.is_meta for p in model.parameters()):
        # The unsplit reference needs the whole model in memory: only when it is small.
        size = sum(p.numel() for p in model.parameters())  # a tied tensor once
        if size > build.INIT_THRESHOLD_PARAMS:
            return None
        reference_model = build.model_of(spec)
    apply_activation_checkpointing(reference_model, checkpoint_pattern(spec.train.activation_checkpointing,
                                                                       split.blocks))
    handles = masks.on_model(reference_model, split.points) if masks is not None else []
    # The whole step's batches in one forward and backward; with dropout, in the ranks'
    # microbatches, whose masks are drawn per microbatch (the same loss either way).
    pieces = spec.microbatches * spec.parallel.dp if masks is not None else None
    reference = train_in_process(reference_model, [reference_model], source, spec, pieces, loss_fn,
                                 load=(load, reference_model, split.tie_groups) if load else None, masks=masks,
                                 steps=steps)
    for handle in handles:
        handle.remove()
    say.phase("reference", "trained the unsplit reference" + (f" ({steps} of {spec.steps} steps)"
                                                              if steps < spec.steps else ""))
    return reference


def _nodes(results: list[dict]) -> dict[str, list[int]]:
    """Each node's host name and the ranks that ran there, in rank order."""
    out: dict[str, list[int]] = {}
    for r in sorted(results, key=lambda r: r["rank"]):
        out.setdefault(r["host"], []).append(r["rank"])
    return out


def _merge_diverged(seen: list[dict]) -> dict | None:
    """The ranks' views of one diverged step, as one: the loss from the last stage, the first
    parameter with a non-finite gradient."""
    if not seen:
        return None
    out = {"step": seen[0]["step"], "loss": None, "non_finite_loss": False, "non_finite_grad": None}
    for d in seen:
        if d["loss"] is not None:
            out["loss"] = d["loss"]
        out["non_finite_loss"] |= d["non_finite_loss"]
        out["non_finite_grad"] = out["non_finite_grad"] or d["non_finite_grad"]
    return out
