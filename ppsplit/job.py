"""The main job, step by step: build, trace and split, verify, run, report."""

from __future__ import annotations

import copy
import os
import time

import torch

from omegaconf import DictConfig, OmegaConf

from ppsplit import build, report
from ppsplit.errors import PpsplitError
from ppsplit.plan import balance, stage_costs
from ppsplit.trace_split import split as split_model
from ppsplit.verify import verify_fqns, verify_numerics


def model_settings(cfg: DictConfig) -> dict:
    """The plain-Python description of the model that every rank rebuilds from."""
    m = cfg.model
    return {
        "class_name": m.model_class,
        "config": OmegaConf.to_container(m.config, resolve=True) if m.get("config") else {},
        "pretrained": m.get("pretrained"),
        "inputs": m.inputs,
        "loss": m.loss,
        "call_kwargs": OmegaConf.to_container(m.call_kwargs, resolve=True) if m.get("call_kwargs") else {},
        "init": m.get("init") or "auto",
    }


def split_args(cfg: DictConfig) -> dict:
    """The keyword arguments of :func:`ppsplit.split` that ``cfg.split`` describes."""
    sp = cfg.split
    if sp.name == "manual":
        return {"points": list(sp.points)}
    if sp.name == "layers":
        layers = list(sp.layers) if sp.get("layers") else None
        return {"strategy": "layers", "layers": layers, "stages": None if layers else int(cfg.stages),
                "first_stage_less": int(sp.get("first_stage_less") or 0),
                "last_stage_less": int(sp.get("last_stage_less") or 0)}
    return {"strategy": sp.name, "stages": int(cfg.stages), "microbatches": int(cfg.microbatches)}


def stage_count(cfg: DictConfig) -> int:
    sp = cfg.split
    if sp.name == "manual":
        return len(sp.points) + 1
    if sp.name == "layers" and sp.get("layers"):
        return len(sp.layers)
    return int(cfg.stages)


def task_for(cfg: DictConfig, settings: dict, plan, output_dir: str) -> dict:
    """Everything a rank needs, as plain data (submitit pickles it)."""
    debug = OmegaConf.to_container(cfg.debug, resolve=True) if cfg.get("debug") else {}
    return {
        "model": settings,
        "init": settings["init"],
        "split": split_args(cfg),
        "seed": cfg.seed,
        "batch_size": cfg.batch_size,
        "seq_len": cfg.seq_len,
        "microbatches": cfg.microbatches,
        "steps": cfg.steps,
        "schedule": cfg.schedule.name,
        "stages_per_rank": plan.stages_per_rank,
        "placement": plan.placement,
        "optimizer": OmegaConf.to_container(cfg.optimizer, resolve=True),
        "timeout_s": float(cfg.timeout_s),
        "threads": int(cfg.launcher.get("cpus_per_task") or 1),
        "debug": debug,
        "checkpoint_dir": checkpoint_dir(cfg, output_dir),
        "pid_dir": os.path.join(output_dir, "ranks"),
    }


def checkpoint_dir(cfg: DictConfig, output_dir: str) -> str | None:
    ckpt = cfg.get("checkpoint") or {}
    if not ckpt.get("save"):
        return None
    return os.path.abspath(ckpt.get("dir") or os.path.join(output_dir, "checkpoint"))


def plan_for(cfg: DictConfig, stages: int):
    from ppsplit.dispatch import plan_ranks

    return plan_ranks(cfg.schedule.name, stages, cfg.schedule.get("stages_per_rank"), cfg.microbatches)


def run_job(cfg: DictConfig, output_dir: str) -> int:
    settings = model_settings(cfg)
    build.loss_fn(settings["loss"])  # refuse an unknown loss before building anything
    build.make_optimizer(OmegaConf.to_container(cfg.optimizer, resolve=True), [torch.zeros(1, requires_grad=True)])
    distributed = cfg.launcher.name != "inline"
    plan = plan_for(cfg, stage_count(cfg))  # impossible schedules are refused before any work

    started_at = time.time()
    t0 = time.perf_counter()
    init = build.resolve_init(settings["init"], settings["class_name"], settings["config"],
                              settings["pretrained"])
    settings["init"] = init
    meta = init == "meta"
    if meta and not distributed and cfg.steps > 0:
        raise PpsplitError("model.init=meta needs ranks to hold the weights; use launcher=local or "
                           "launcher=slurm, or steps=0 to only split and check")
    if meta:
        model = build.build_on_meta(settings["class_name"], settings["config"], settings["pretrained"])
    else:
        model = build.build_model(settings["class_name"], settings["config"], settings["pretrained"], cfg.seed)
    loss_fn = build.loss_fn(settings["loss"])
    config = model.config

    def batch_for(step):
        return build.make_batch(settings["inputs"], config, cfg.batch_size, cfg.seq_len, cfg.seed,
                                step=step, call_kwargs=settings["call_kwargs"])

    microbatches = batch_for(0).microbatches(cfg.microbatches)
    example = microbatches[0].to("meta") if meta else microbatches[0]
    t1 = time.perf_counter()
    split = split_model(model, example.args, example.kwargs, **split_args(cfg))
    t2 = time.perf_counter()
    job_handle = None
    if distributed and cfg.steps > 0:
        # Start the ranks first: the driver checks the split while they build their stages.
        from ppsplit import dispatch

        task = task_for(cfg, settings, plan, output_dir)
        launcher = OmegaConf.to_container(cfg.launcher, resolve=True)
        job_handle = dispatch.submit(task, launcher, os.path.join(output_dir, "submitit"), plan.ranks)
    try:
        fqn = verify_fqns(model, split)
        numerics = None if meta else verify_numerics(model, split, microbatches, loss_fn)
        t3 = time.perf_counter()
        costs = stage_costs(split, cfg.microbatches)
        rows = report.stage_rows(split, costs)
        balance_of = {kind: balance(values) for kind, values in costs.items()}
        numerics_ok = numerics is None or numerics.ok(cfg.tolerance)
        print(report.format_checks(cfg.model.name, settings["class_name"], split, rows, balance_of,
                                   fqn, numerics, cfg.tolerance))
        run = None
        if cfg.steps > 0:
            run = train_and_compare(cfg, model, split, batch_for, loss_fn, plan, job_handle, output_dir)
            print(report.format_run(run))
    except BaseException:
        if job_handle is not None:  # never leave ranks running behind a failed driver
            dispatch.cancel(job_handle)
        raise

    ok = fqn.ok and numerics_ok and (run is None or run["ok"])
    data = {
        "model": cfg.model.name,
        "model_class": settings["class_name"],
        "stages": len(split),
        "split_strategy": cfg.split.name,
        "split_points": split.points,
        "balance": balance_of,
        "fqn_check": fqn.as_dict(),
        "stage_info": rows,
        "init": init,
        "numerics": ({"skipped": "model.init=meta"} if numerics is None else
                     {**numerics.as_dict(), "ok": numerics_ok, "tolerance": cfg.tolerance}),
        "run": run,
        "timings_s": {"build": t1 - t0, "split": t2 - t1, "verify": t3 - t2},
        "started_at": started_at,
        "finished_at": time.time(),
        "ok": ok,
    }
    path = os.path.join(output_dir, "report.json")
    report.write_json(path, data)
    print(f"{'PASSED' if ok else 'FAILED'}; report: {path}")
    return 0 if ok else 1


def train_and_compare(cfg, model, split, batch_for, loss_fn, plan, job_handle, output_dir) -> dict:
    """Train the stages (in this process, or on the ranks) and the unsplit model on the same data
    and steps, and compare them."""
    from ppsplit.run_rank import tensor_digest, train_in_process
    from ppsplit.ties import TieSync
    from ppsplit.verify import compare_training

    optimizer = OmegaConf.to_container(cfg.optimizer, resolve=True)
    results = None
    reference_model = model
    if job_handle is None:  # inline: the chained stages in this process, ties summed locally
        # The stages share the model's tensors; train the unsplit reference on a copy.
        reference_model = copy.deepcopy(model)
        modules = dict(enumerate(split.stages))
        ties = TieSync(split.tie_groups, split.stage_keys, modules, {i: 0 for i in modules}, 0)
        pipelined = train_in_process(split, split.stages, batch_for, cfg.steps, cfg.microbatches,
                                     loss_fn, optimizer, after_backward=ties.sum_grads)
        losses, first_grads, states = pipelined["losses"], pipelined["first_grads"], pipelined["state"]
        step_time = pipelined["step_time_s"]
        digests = {k: tensor_digest(v) for m in split.stages for k, v in m.state_dict().items()}
        ckpt = checkpoint_dir(cfg, output_dir)
        if ckpt:
            from ppsplit.run_rank import save_checkpoint

            save_checkpoint(ckpt, modules)
    else:
        from ppsplit import dispatch

        # Wait first: a reference trained meanwhile would take the ranks' CPUs and distort their
        # step times.
        results = dispatch.wait(job_handle, plan.ranks, float(cfg.timeout_s))
        results.sort(key=lambda r: r["rank"])
        last = len(split.stages) - 1
        losses = next(r["losses"] for r in results if last in r["stages"])
        first_grads = [r["first_grads"] for r in results]
        states = [st for r in results for st in r["state"].values()]
        step_time = max(r["step_time_s"] for r in results) if results[0]["step_time_s"] is not None else None
        digests = {k: v for r in results for k, v in r["digests"].items()}
    if any(p.is_meta for p in model.parameters()):
        # The unsplit reference needs the whole model in memory: only when it is small.
        size = sum(p.numel() for p in model.parameters())  # a tied tensor once
        s = model_settings(cfg)
        reference_model = (build.build_model(s["class_name"], s["config"], s["pretrained"], cfg.seed)
                           if size <= build.INIT_THRESHOLD_PARAMS else None)
    reference = (None if reference_model is None else
                 train_in_process(reference_model, [reference_model], batch_for, cfg.steps,
                                  cfg.microbatches, loss_fn, optimizer))
    cmp = compare_training(reference, losses, first_grads, states, split.tie_groups,
                           loss_rtol=1e-5, grad_atol=cfg.tolerance, tie_atol=cfg.tie_tolerance)
    if results:
        cmp["rank_memory"] = [{"rank": r["rank"], "stage_bytes": r["stage_bytes"],
                               "rss_growth_bytes": r["rss_growth_bytes"]} for r in results]
    return {
        "launcher": cfg.launcher.name,
        "schedule": cfg.schedule.name,
        "ranks": plan.ranks if job_handle is not None else 1,
        "stages_per_rank": plan.stages_per_rank if job_handle is not None else len(split.stages),
        "steps": cfg.steps,
        "optimizer": optimizer,
        **cmp,
        "step_time_s": step_time,
        "checkpoint": checkpoint_dir(cfg, output_dir),
        "final_state_digests": digests,
        "tie_comm_groups": results[0]["tie_comm_groups"] if results else [],
        "rank_pids": [r["pid"] for r in results] if results else [],
    }
