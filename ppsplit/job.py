"""The main job, step by step: validate, build, prepare the data, trace and split, start the
ranks, verify, train and compare with the unsplit model (:mod:`ppsplit.train_compare`), save,
report."""

from __future__ import annotations

import contextlib
import os
import time

from ppsplit import build, report
from ppsplit.debug import pause
from ppsplit.errors import PpsplitError
from ppsplit.job_checks import validate
from ppsplit.job_spec import JobSpec
from ppsplit.plan import balance, stage_costs
from ppsplit.report import Progress
from ppsplit.trace_split import split as split_model
from ppsplit.verify import verify_fqns, verify_numerics


def run_job(spec: JobSpec, output_dir: str, progress: Progress | None = None) -> int:
    say = progress or Progress(enabled=False)
    m = spec.model
    config = validate(spec)
    target = None
    if spec.checkpoint.save:
        from ppsplit.checkpoint_folder import Target

        target = Target(spec.checkpoint.dir or os.path.join(output_dir, "checkpoint"), spec.checkpoint.overwrite)
    if spec.launcher.name == "slurm" and spec.steps > 0:
        from ppsplit.slurm_ranks import check_slurm_controller

        check_slurm_controller(spec.launcher.partition, spec.launcher.nodes)
    resume = None
    if spec.checkpoint.load:
        from ppsplit.checkpoint import check_resumable

        resume = check_resumable(spec.checkpoint.load, build.build_on_meta(m.class_name, m.config, m.pretrained))
    data_file = _prepare_data(spec, config, say)

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
    from ppsplit.data import BatchSource

    first_index = (resume["step"] if resume else 0) * spec.train.grad_accumulation
    source = BatchSource(spec, model.config, data_file, first_index, resume and resume.get("next_sample"))
    microbatches = source.batch(first_index).microbatches(spec.microbatches * spec.parallel.dp)
    example = microbatches[0].to("meta") if meta else microbatches[0]
    pause("trace", spec.debug.pause_at, spec.debug.pause_mode)
    split = split_model(model, example.args, example.kwargs, **spec.split_kwargs())
    if masks is not None:
        for handle in masks.on_model(model, split.points):  # refuses points it cannot draw alike at
            handle.remove()
    if spec.parallel.tp > 1 and spec.steps > 0 and spec.distributed:
        from ppsplit.layout import check_tensor_parallel

        check_tensor_parallel(split, model, m.tp_plan, spec.parallel.tp)  # refused before any rank starts
    sizes = f" for sequence lengths {spec.dynamic['seq'][0]} to {spec.dynamic['seq'][1]}" if spec.dynamic else ""
    say.phase("split", f"traced and split into {len(split)} stages at {', '.join(split.points) or '(none)'}{sizes}")

    try:
        with contextlib.ExitStack() as stack:
            ranks = None
            costs = stage_costs(split, spec.microbatches)
            if spec.distributed and spec.steps > 0:
                # Start the ranks first: the driver checks the split while they build their stages.
                from ppsplit import dispatch

                log = _metrics_log(spec, output_dir, costs, resume)
                stack.callback(log.close)
                ranks = stack.enter_context(dispatch.Ranks(spec, output_dir, say, on_step=log.record))
                staging = target.stage(os.urandom(4).hex()) if target else None
                ranks.start({"checkpoint_dir": staging, "load_dir": spec.checkpoint.load,
                             "hf_dir": os.path.join(staging, "hf") if staging and spec.checkpoint.hf else None,
                             "data_file": data_file, "first_index": source.first_index,
                             "first_sample": source.first_sample})
            pause("check", spec.debug.pause_at, spec.debug.pause_mode)
            fqn = verify_fqns(model, split)
            numerics = None
            if not meta:
                from ppsplit.training import precision_context

                with precision_context(spec.train.precision, "cpu"):  # as the ranks will compute
                    numerics = verify_numerics(model, split, microbatches, loss_fn, masks)
            say.phase("verify", "checked the FQNs" + ("" if meta else " and the numerics"))
            if ranks is not None:
                ranks.say_started()
            rows = report.stage_rows(split, costs)
            balance_of = {kind: balance(values) for kind, values in costs.items()}
            numerics_ok = numerics is None or numerics.ok(spec.tolerance)
            print(report.format_checks(m.name, m.class_name, split, rows, balance_of,
                                       fqn, numerics, spec.tolerance), flush=True)
            run = None
            if spec.steps > 0:
                from ppsplit.train_compare import train_and_compare

                if ranks is None:
                    log = _metrics_log(spec, output_dir, costs, resume)
                    stack.callback(log.close)
                    if target:
                        target.stage(os.urandom(4).hex())
                run = train_and_compare(spec, model, split, source, loss_fn, ranks, target, say, resume, masks, log)
                print(report.format_run(run), flush=True)
        ok = fqn.ok and numerics_ok and (run is None or run["ok"])
        if target:
            if ok:
                pause("save", spec.debug.pause_at, spec.debug.pause_mode)
                run["checkpoint"] = target.commit(checkpoint_meta(spec, split, resume, source, model.config),
                                                  model.config, m.class_name)
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
        "data": _data_section(spec, data_file),
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


def _prepare_data(spec: JobSpec, config, say) -> str | None:
    """Tokenize and pack a corpus once, before any rank starts (refusing what cannot train)."""
    if not spec.data.real or spec.steps == 0:
        return None
    from ppsplit.data import prepare

    path = prepare(spec.data, spec.model.pretrained, spec.seq_len, spec.seed, config.vocab_size,
                   progress=say.enabled, batch_size=spec.batch_size if spec.eval.batches else 0)
    say.phase("data", f"data: {os.path.basename(path)} ({spec.data.name}, packed into blocks of {spec.seq_len})")
    return path


def _data_section(spec: JobSpec, data_file: str | None) -> dict:
    d = spec.data
    out = {"name": d.name}
    if data_file:
        from ppsplit.data import TokenBlocks

        blocks = TokenBlocks(data_file, spec.seed)
        out.update(path=list(d.path), field=d.field, tokenizer=blocks.meta.get("tokenizer"), cache=data_file,
                   documents=blocks.meta.get("documents"), val_documents=blocks.meta.get("val_documents"),
                   train_blocks=int(len(blocks.train)), val_blocks=int(len(blocks.val)), seq_len=spec.seq_len)
    return out


def _metrics_log(spec: JobSpec, output_dir: str, costs: dict, resume):
    from ppsplit.metrics import MetricsLog, matmul_peak

    ranks = spec.world_size if spec.distributed else 1
    flops = sum(costs["flops"]) * spec.parallel.dp * spec.train.grad_accumulation  # the global batch's
    return MetricsLog(output_dir, spec, flops, matmul_peak(spec.launcher.cpus_per_task), ranks,
                      first_step=resume["step"] if resume else 0)


def _json_config(config) -> dict:
    """The model's transformers config, as ``ppsplit.json`` keeps it (what differs from its defaults)."""
    import json

    out = {}
    for key, value in config.to_diff_dict().items():
        try:
            json.dumps(value)
        except TypeError:
            continue
        out[key] = value
    return out


def checkpoint_meta(spec: JobSpec, split, resume: dict | None, source, config=None) -> dict:
    """What ``ppsplit.json`` records beside a checkpoint: where training stands (the step, the
    data stream's next batch and sample) and how it was laid out."""
    step = (resume["step"] if resume else 0) + spec.steps
    next_index = step * spec.train.grad_accumulation
    return {
        "model": spec.model.name,
        "model_class": spec.model.class_name,
        "model_config": _json_config(config) if config is not None else None,
        "step": step,
        "resumed_from": resume,
        "data": {"name": spec.data.name, "path": list(spec.data.path), "seed": spec.seed,
                 "batch_size": spec.batch_size, "seq_len": spec.seq_len, "seq_lens": list(spec.seq_lens),
                 "microbatches": spec.microbatches, "next_step": step, "next_batch": next_index,
                 "next_sample": source.sample_of(next_index)},
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


def _as_mismatch(d) -> dict | None:
    return None if d is None else {**d.as_dict(), "tie_copy": d.kind == "tie copy"}
