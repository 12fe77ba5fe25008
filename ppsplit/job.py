"""The main job, step by step: build, trace and split, verify, run, report."""

from __future__ import annotations

import os
import time

from omegaconf import DictConfig, OmegaConf

from ppsplit import build, report
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
    }


def split_args(cfg: DictConfig) -> dict:
    if cfg.split.name == "manual":
        return {"points": list(cfg.split.points)}
    return {"stages": int(cfg.stages)}


def run_job(cfg: DictConfig, output_dir: str) -> int:
    settings = model_settings(cfg)
    build.loss_fn(settings["loss"])  # refuse an unknown loss before building anything
    t0 = time.perf_counter()
    model = build.build_model(settings["class_name"], settings["config"], settings["pretrained"], cfg.seed)
    batch = build.make_batch(settings["inputs"], model, cfg.batch_size, cfg.seq_len, cfg.seed,
                             step=0, call_kwargs=settings["call_kwargs"])
    microbatches = batch.microbatches(cfg.microbatches)
    example = microbatches[0]
    t1 = time.perf_counter()
    split = split_model(model, example.args, example.kwargs, **split_args(cfg))
    t2 = time.perf_counter()
    fqn = verify_fqns(model, split)
    numerics = verify_numerics(model, split, microbatches, build.loss_fn(settings["loss"]))
    t3 = time.perf_counter()

    rows = report.stage_rows(split)
    numerics_ok = numerics.ok(cfg.tolerance)
    ok = fqn.ok and numerics_ok
    print(f"ppsplit: {cfg.model.name} ({settings['class_name']}) in {len(split)} stages, "
          f"split at {', '.join(split.points) or '(none)'}")
    print(report.format_table(rows))
    for group in fqn.tied:
        print(f"tied: {' = '.join(group['keys'])}  (stages {', '.join(map(str, group['stages']))})")
    print(f"FQN check: {'passed' if fqn.ok else 'FAILED'}: {fqn.original_keys} original keys"
          + "".join(f"\n  {p}" for p in fqn.problems()))
    print(f"numerics: {'passed' if numerics_ok else 'FAILED'}: forward {numerics.forward_max_abs_diff:.2e}, "
          f"loss {numerics.loss_abs_diff:.2e}, grad {numerics.grad_max_abs_diff:.2e} "
          f"(tolerance {cfg.tolerance:g})")

    data = {
        "model": cfg.model.name,
        "model_class": settings["class_name"],
        "stages": len(split),
        "split_strategy": cfg.split.name,
        "split_points": split.points,
        "fqn_check": fqn.as_dict(),
        "stage_info": rows,
        "numerics": {**numerics.as_dict(), "ok": numerics_ok, "tolerance": cfg.tolerance},
        "timings_s": {"build": t1 - t0, "split": t2 - t1, "verify": t3 - t2},
        "ok": ok,
    }
    path = os.path.join(output_dir, "report.json")
    report.write_json(path, data)
    print(f"{'PASSED' if ok else 'FAILED'}; report: {path}")
    return 0 if ok else 1
