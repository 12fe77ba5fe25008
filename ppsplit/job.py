"""The main job, step by step: build, trace and split, verify, run, report."""

from __future__ import annotations

import contextlib
import copy
import os
import socket
import time

from ppsplit import build, report
from ppsplit.debug import pause
from ppsplit.report import Progress
from ppsplit.errors import PpsplitError
from ppsplit.job_checks import validate
from ppsplit.job_spec import JobSpec
from ppsplit.plan import balance, stage_costs
from ppsplit.tolerance import DRIFT, Tolerance
from ppsplit.trace_split import split as split_model
from ppsplit.verify import verify_fqns, verify_numerics


def run_job(spec: JobSpec, output_dir: str, progress: Progress | None = None) -> int:
    say = progress or Progress(enabled=False)
    m = spec.model
    validate(spec)
    target = None
    if spec.checkpoint.save:
        from ppsplit.checkpoint_folder import Target

        target = Target(spec.checkpoint.dir or os.path.join(output_dir, "checkpoint"), spec.checkpoint.overwrite)
    if spec.launcher.name == "slurm" and spec.steps > 0:
        from ppsplit.slurm_ranks import check_slurm_controller

        check_slurm_controller(spec.launcher.partition, spec.launcher.nodes)

    started_at = time.time()
    if spec.launcher.name == "local" and spec.steps > 0:
        from ppsplit.local_ranks import launcher

        launcher().preload(f"transformers.{m.class_name}")  # its imports overlap the build and trace
    init = build.resolve_init(m.init, m.class_name, m.config, m.pretrained)
    spec = spec.with_model(init=init)
    meta = init == "meta"
    pause("build", spec.debug.pause_at, spec.debug.pause_mode)
    if meta and not spec.distributed and spec.steps > 0:
        raise PpsplitError("model.init=meta needs ranks to hold the weights; use launcher=local or "
                           "launcher=slurm, or steps=0 to only split and check")
    if meta:
        model = build.build_on_meta(m.class_name, m.config, m.pretrained, spec.dropout)
    else:
        model = build.build_model(m.class_name, m.config, m.pretrained, spec.seed, spec.dropout)
    say.phase("build", f"built {m.class_name} ({'meta device' if meta else 'real weights'}, "
                       f"{build.count_tensor_params(model):,} parameters)")
    masks = _dropout(spec, say)
    if m.pretrained and m.config:
        say(f"model.config over {m.pretrained}/config.json: "
            + ", ".join(f"{k}={v!r}" for k, v in m.config.items()))
    loss_fn = build.loss_fn(m.loss)
    config = model.config

    def batch_for(step):
        return build.make_batch(m.inputs, config, spec.batch_size, spec.seq_len_at(step), spec.seed,
                                step=step, call_kwargs=m.call_kwargs)

    microbatches = batch_for(0).microbatches(spec.microbatches * spec.parallel.dp)
    example = microbatches[0].to("meta") if meta else microbatches[0]
    pause("trace", spec.debug.pause_at, spec.debug.pause_mode)
    split = split_model(model, example.args, example.kwargs, **spec.split_kwargs())
    if masks is not None:
        for handle in masks.on_model(model, split.points):  # refuses points it cannot draw alike at
            handle.remove()
    if spec.parallel.tp > 1 and spec.steps > 0 and spec.distributed:
        from ppsplit.layout import check_tensor_parallel

        check_tensor_parallel(split, model, m.tp_plan, spec.parallel.tp)  # refused before any rank starts
    resume = None
    if spec.checkpoint.load:
        from ppsplit.checkpoint import check_resumable

        resume = check_resumable(spec.checkpoint.load, model)
    sizes = f" for sequence lengths {spec.dynamic['seq'][0]} to {spec.dynamic['seq'][1]}" if spec.dynamic else ""
    say.phase("split", f"traced and split into {len(split)} stages at {', '.join(split.points) or '(none)'}{sizes}")

    try:
        with contextlib.ExitStack() as stack:
            ranks = None
            if spec.distributed and spec.steps > 0:
                # Start the ranks first: the driver checks the split while they build their stages.
                from ppsplit import dispatch

                ranks = stack.enter_context(dispatch.Ranks(spec, output_dir, say))
                staging = target.stage(os.urandom(4).hex()) if target else None
                ranks.start({"checkpoint_dir": staging, "load_dir": spec.checkpoint.load,
                             "hf_dir": os.path.join(staging, "hf") if staging and spec.checkpoint.hf else None})
            pause("check", spec.debug.pause_at, spec.debug.pause_mode)
            fqn = verify_fqns(model, split)
            numerics = None if meta else verify_numerics(model, split, microbatches, loss_fn, masks)
            say.phase("verify", "checked the FQNs" + ("" if meta else " and the numerics"))
            if ranks is not None:
                ranks.say_started()
            costs = stage_costs(split, spec.microbatches)
            rows = report.stage_rows(split, costs)
            balance_of = {kind: balance(values) for kind, values in costs.items()}
            numerics_ok = numerics is None or numerics.ok(spec.tolerance)
            print(report.format_checks(m.name, m.class_name, split, rows, balance_of,
                                       fqn, numerics, spec.tolerance), flush=True)
            run = None
            if spec.steps > 0:
                if ranks is None and target:
                    target.stage(os.urandom(4).hex())
                run = train_and_compare(spec, model, split, batch_for, loss_fn, ranks, target, say, resume, masks)
                print(report.format_run(run), flush=True)
        ok = fqn.ok and numerics_ok and (run is None or run["ok"])
        if target:
            if ok:
                pause("save", spec.debug.pause_at, spec.debug.pause_mode)
                run["checkpoint"] = target.commit(checkpoint_meta(spec, split, resume), config, m.class_name)
                say(f"checkpoint: {run['checkpoint']}")
            else:
                target.discard()
    except BaseException:
        if target:
            target.discard()
        raise

    data = {
        "model": m.name,
        "model_class": m.class_name,
        "stages": len(split),
        "layout": {"pp": spec.plan.ranks if spec.distributed else 1, "dp": spec.parallel.dp,
                   "tp": spec.parallel.tp, "fsdp": spec.parallel.fsdp and spec.parallel.dp > 1},
        "split_strategy": spec.split.strategy,
        "split_points": split.points,
        "balance": balance_of,
        "fqn_check": fqn.as_dict(),
        "stage_info": rows,
        "init": init,
        "numerics": ({"skipped": "model.init=meta"} if numerics is None else
                     {**numerics.as_dict(), "ok": numerics_ok, "tolerance": spec.tolerance,
                      "mismatch": None if numerics_ok else _as_mismatch(numerics.worst(spec.tolerance))}),
        "run": run,
        "timings_s": dict(say.marks),
        "started_at": started_at,
        "finished_at": time.time(),
        "ok": ok,
    }
    path = os.path.join(output_dir, "report.json")
    pause("report", spec.debug.pause_at, spec.debug.pause_mode)
    report.write_json(path, data)
    print(f"{'PASSED' if ok else 'FAILED'}; report: {path}", flush=True)
    return 0 if ok else 1


def checkpoint_meta(spec: JobSpec, split, resume: dict | None = None) -> dict:
    """What ``ppsplit.json`` records beside a checkpoint: where training stands and how it was laid out."""
    step = (resume["step"] if resume else 0) + spec.steps
    return {
        "model": spec.model.name,
        "model_class": spec.model.class_name,
        "step": step,
        "resumed_from": resume,
        "data": {"seed": spec.seed, "batch_size": spec.batch_size, "seq_len": spec.seq_len,
                 "seq_lens": list(spec.seq_lens),
                 "microbatches": spec.microbatches, "next_step": step},
        "optimizer": spec.optimizer,
        "layout": {"stages": len(split), "split_points": split.points, "schedule": spec.schedule,
                   "dp": spec.parallel.dp, "tp": spec.parallel.tp},
    }


def _dropout(spec: JobSpec, say):
    """Say what ``dropout`` does to this model; the mask seeds when its dropout stays on."""
    m = spec.model
    settings = build.stochastic_settings(m.class_name, m.config, m.pretrained)
    if not settings:
        return None
    by_value: dict[float, list[str]] = {}
    for key, value in settings.items():
        by_value.setdefault(value, []).append(key)
    found = "; ".join(f"p={value:g} in the config: {', '.join(keys)}" for value, keys in by_value.items())
    if not spec.dropout:
        say(f"dropout off for the check and the training ({found}); dropout=true trains with it")
        return None
    from ppsplit.dropout import MaskSeeds

    say(f"dropout on ({found}): masks drawn alike in the stages and the unsplit model")
    return MaskSeeds(spec.seed)


def train_and_compare(spec: JobSpec, model, split, batch_for, loss_fn, ranks, target, say, resume=None,
                      masks=None) -> dict:
    """Train the stages (in this process, or on the ranks) and the unsplit model on the same data
    and steps, and compare them."""
    from ppsplit.run_rank import tensor_digest, train_in_process
    from ppsplit.ties import TieSync
    from ppsplit.verify import compare_training

    results = None
    reference_model = model
    global_mbs = spec.microbatches * spec.parallel.dp  # the unsplit model sees every rank's microbatches
    load = spec.checkpoint.load
    if ranks is None:  # inline: the chained stages in this process, ties summed locally
        # The stages share the model's tensors; train the unsplit reference on a copy.
        reference_model = copy.deepcopy(model)
        modules = dict(enumerate(split.stages))
        ties = TieSync(split.tie_groups, split.stage_keys, modules, {i: 0 for i in modules}, 0)
        say(f"training {spec.steps} step(s) inline")
        handles = masks.on_stages(modules) if masks is not None else []
        pipelined = train_in_process(split, split.stages, batch_for, spec.steps, spec.microbatches,
                                     loss_fn, spec.optimizer, after_backward=ties.sum_grads,
                                     load=(load, model, split.tie_groups) if load else None,
                                     on_step=lambda done, loss: say.step(done, spec.steps, loss), masks=masks)
        for handle in handles:
            handle.remove()
        losses, first_grads, states = pipelined["losses"], pipelined["first_grads"], pipelined["state"]
        diverged = pipelined["diverged"]
        step_time = pipelined["step_time_s"]
        step_times = pipelined["step_times_s"]
        digests = {k: tensor_digest(v) for st in split.stages for k, v in st.state_dict().items()}
        if target and diverged is None:
            from ppsplit import checkpoint

            # The stages share the model's tensors, and the optimizer holds them once.
            checkpoint.save(target.staging, {0: model}, {0: pipelined["optimizer"]},
                            hf=os.path.join(target.staging, "hf") if spec.checkpoint.hf else None,
                            tie_groups=split.tie_groups)
        rank_report, fqn_problems = [], []
    else:
        # Wait first: a reference trained meanwhile would take the ranks' CPUs and distort their
        # step times.
        pause("train", spec.debug.pause_at, spec.debug.pause_mode)
        results = sorted(ranks.wait(), key=lambda r: r["rank"])
        keepers = [r for r in results if r["keeper"]]
        last = len(split.stages) - 1
        per_dp = [r["losses"] for r in results if last in r["stages"] and r["coords"]["tp"] == 0]
        losses = [sum(xs) / len(xs) for xs in zip(*per_dp)]  # each data-parallel rank's mean, averaged
        first_grads = [r["first_grads"] for r in keepers]
        states = [st for r in keepers for st in r["state"].values()]
        times = [r["step_time_s"] for r in results if r["step_time_s"] is not None]
        step_time = max(times) if times else None
        step_times = [max(ts) for ts in zip(*[r["step_times_s"] for r in results])]  # the slowest rank's
        digests = {k: v for r in keepers for k, v in r["digests"].items()}
        diverged = _merge_diverged([r["diverged"] for r in results if r["diverged"]])
        fqn_problems = [f"rank {r['rank']}: {p}" for r in results for p in r["fqn_problems"]]
        rank_report = [{"rank": r["rank"], **r["coords"], "stages": r["stages"], "host": r["host"],
                        "pid": r["pid"], "stage_bytes": r["stage_bytes"], "param_bytes": r["param_bytes"],
                        "optimizer_bytes": r["optimizer_bytes"], "rss_growth_bytes": r["rss_growth_bytes"]}
                       for r in results]
    say.phase("train", f"ranks finished {spec.steps} step(s)" if ranks else f"trained {spec.steps} step(s)")
    if diverged is not None:
        cmp = {"losses": list(losses), "reference_losses": None, "max_loss_rel_diff": None,
               "grad_max_abs_diff": None, "worst_grad": "", "ties": [], "ok": False, "mismatch": None}
    else:
        if any(p.is_meta for p in model.parameters()):
            # The unsplit reference needs the whole model in memory: only when it is small.
            m = spec.model
            size = sum(p.numel() for p in model.parameters())  # a tied tensor once
            reference_model = (build.build_model(m.class_name, m.config, m.pretrained, spec.seed, spec.dropout)
                               if size <= build.INIT_THRESHOLD_PARAMS else None)
        handles = masks.on_model(reference_model, split.points) if masks and reference_model is not None else []
        reference = (None if reference_model is None else
                     train_in_process(reference_model, [reference_model], batch_for, spec.steps,
                                      global_mbs, loss_fn, spec.optimizer,
                                      load=(load, reference_model, split.tie_groups) if load else None,
                                      masks=masks))
        for handle in handles:
            handle.remove()
        if reference is not None:
            say.phase("reference", "trained the unsplit reference")
        cmp = compare_training(reference, losses, first_grads, states, split.tie_groups,
                               computed=Tolerance(spec.tolerance), trained=Tolerance(spec.tie_tolerance, drift=DRIFT),
                               initial=reference["initial"] if reference else None)
        if fqn_problems:
            cmp["ok"] = False
    return {
        "launcher": spec.launcher.name,
        "schedule": spec.schedule,
        "mesh": {"pp": spec.plan.ranks if ranks is not None else 1, "dp": spec.parallel.dp,
                 "tp": spec.parallel.tp, "fsdp": spec.parallel.fsdp and spec.parallel.dp > 1},
        "ranks": spec.world_size if ranks is not None else 1,
        "stages_per_rank": spec.plan.stages_per_rank if ranks is not None else len(split.stages),
        "steps": spec.steps,
        "resumed_from": resume,
        "optimizer": spec.optimizer,
        **cmp,
        "diverged": diverged,
        "rank_fqn_problems": fqn_problems,
        "step_time_s": step_time,
        "step_times_s": step_times,
        "checkpoint": None,
        "final_state_digests": digests,
        "tie_comm_groups": results[0]["tie_comm_groups"] if results else [],
        "rank_layout": rank_report,
        "rank_pids": [r["pid"] for r in results] if results else [],
        "seq_lens": [spec.seq_len_at(step) for step in range(spec.steps)],
        "driver_host": socket.gethostname(),
        "nodes": _nodes(results or []),
    }


def _as_mismatch(d) -> dict | None:
    return None if d is None else {**d.as_dict(), "tie_copy": d.kind == "tie copy"}


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
