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
from ppsplit.checkpoint_series import data_identity
from ppsplit.job_spec import AUTO, JobSpec
from ppsplit.plan import balance, stage_costs
from ppsplit.report import Progress
from ppsplit.trace_split import split as split_model
from ppsplit.verify import verify_fqns, verify_numerics


def run_job(spec: JobSpec, output_dir: str, progress: Progress | None = None) -> int:
    """The whole job; under ``launcher.requeue``, one SLURM job after another until its last
    step, each going on from the checkpoint the one before saved when SLURM signalled it."""
    from ppsplit.checkpoint_series import newest
    from ppsplit.dispatch import JobStopped

    say = progress or Progress(enabled=False)
    restarts: list[dict] = []
    whole = spec.steps
    if spec.checkpoint.load and not spec.checkpoint.auto:
        from ppsplit.checkpoint_folder import read_meta

        whole += int(read_meta(spec.checkpoint.load)["step"])
    while True:
        try:
            return _run_once(spec, output_dir, say, restarts)
        except JobStopped as err:
            if err.cancelled or not (spec.launcher.requeue and len(restarts) < spec.launcher.max_requeue):
                raise
            # signalled before its first step, a job saves nothing new: the next starts as it did
            saved = err.saved or (newest(spec.checkpoint.dir) if spec.checkpoint.auto else spec.checkpoint.load)
            restarts.append({"job": err.job, "stopped_at": err.step, "checkpoint": saved})
            say(f"{err.job} was signalled by SLURM at step {err.step}: going on in a new job from "
                f"{saved or 'step 0'} (restart {len(restarts)} of launcher.max_requeue={spec.launcher.max_requeue})")
            if err.saved:
                spec = spec.with_checkpoint(load=AUTO, steps=whole)


def _run_once(spec: JobSpec, output_dir: str, say, restarts: list[dict]) -> int:
    config = validate(spec)
    auto = spec.checkpoint.auto
    if auto:
        spec, done = _resolve_auto(spec, say, config)
        if done is not None:
            return _nothing_left(spec, output_dir, *done)
    target = None
    if spec.checkpoint.save:
        folder = spec.checkpoint.dir or os.path.join(output_dir, "checkpoint")
        if spec.checkpoint.every:
            from ppsplit.checkpoint_folder import read_meta
            from ppsplit.checkpoint_series import Series

            at = int(read_meta(spec.checkpoint.load)["step"]) if spec.checkpoint.load else 0
            target = Series(folder, spec.checkpoint.every, spec.checkpoint.keep, at + spec.steps, auto,
                            loaded=spec.checkpoint.load)
        else:
            from ppsplit.checkpoint_folder import Target

            target = Target(folder, spec.checkpoint.overwrite)
    try:
        return _run_job(spec, output_dir, say, config, target, restarts)
    finally:
        if hasattr(target, "close"):
            target.close()


def _resolve_auto(spec: JobSpec, say, config) -> tuple[JobSpec, tuple | None]:
    """``checkpoint.load=auto``: the newest step folder to go on from, with the steps left of
    ``steps`` (the whole run's), or a fresh start when there is none. One of another model
    config is refused (this run's resumes would go on from another model)."""
    from ppsplit.checkpoint import _config_changes
    from ppsplit.checkpoint_folder import read_meta
    from ppsplit.checkpoint_series import newest

    found = newest(spec.checkpoint.dir)
    if found is None:
        say(f"checkpoint.load=auto: no checkpoint in {spec.checkpoint.dir} yet; starting at step 0")
        return spec.with_checkpoint(load=None), None
    meta = read_meta(found)
    changed = _config_changes(meta.get("model_config"), config)
    if changed:
        raise PpsplitError(f"checkpoint.load=auto: {found} holds another model: saved with {changed}; allowed: "
                           "the same model config, or another checkpoint.dir")
    at = int(meta["step"])
    if at >= spec.steps:
        return spec, (found, at)
    say(f"checkpoint.load=auto: going on from {found} (step {at} of steps={spec.steps})")
    return spec.with_checkpoint(load=found, steps=spec.steps - at), None


def _nothing_left(spec: JobSpec, output_dir: str, found: str, at: int) -> int:
    """A run resumed at or past its last step: nothing to train; said, and reported."""
    path = os.path.join(output_dir, "report.json")
    report.write_json(path, {"model": spec.model.name, "model_class": spec.model.class_name,
                             "nothing_left": {"checkpoint": found, "step": at, "steps": spec.steps},
                             "started_at": time.time(), "finished_at": time.time(), "ok": True})
    print(f"checkpoint.load=auto: {found} is at step {at}, and steps={spec.steps}: nothing left to train", flush=True)
    print(f"PASSED; report: {path}", flush=True)
    return 0


def _run_job(spec: JobSpec, output_dir: str, say, config, target, restarts=()) -> int:
    m = spec.model
    saves = log = None
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
    skipped = f"model.init={init}"
    if init == "real" and spec.verify.mode == "off" and spec.distributed and spec.steps > 0:
        init, skipped = "meta", "verify=off"  # no unsplit model anywhere: the ranks hold the weights
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

                log = _metrics_log(spec, output_dir, costs, resume, len(restarts))
                stack.callback(log.close)
                saves = _periodic(spec, target, split, resume, source, model.config, log, say)
                ranks = stack.enter_context(dispatch.Ranks(spec, output_dir, say, on_step=_then(log.record, saves),
                                                           on_saved=saves.saved if saves else None))
                staging = target.stage(os.urandom(4).hex()) if target else None
                ranks.start({"checkpoint_dir": staging, "load_dir": spec.checkpoint.load,
                             "series": {"dir": target.folder, "every": target.every, "token": target.token}
                             if saves else None,
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
                ranks.check()  # a rank that failed meanwhile is named here, before anything else is said
                ranks.say_started()
            rows = report.stage_rows(split, costs)
            balance_of = {kind: balance(values) for kind, values in costs.items()}
            numerics_ok = numerics is None or numerics.ok(spec.tolerance)
            print(report.format_checks(m.name, m.class_name, split, rows, balance_of,
                                       fqn, numerics, spec.tolerance, skipped), flush=True)
            run = None
            if spec.steps > 0:
                from ppsplit.train_compare import train_and_compare

                if ranks is None:
                    log = _metrics_log(spec, output_dir, costs, resume, len(restarts))
                    stack.callback(log.close)
                    saves = _periodic(spec, target, split, resume, source, model.config, log, say)
                    if target:
                        target.stage(os.urandom(4).hex())
                run = train_and_compare(spec, model, split, source, loss_fn, ranks, target, say, resume, masks, log,
                                        saves)
                if saves:
                    saves.flush(force=True)  # the steps whose rows came only with the results
                    run["checkpoints"] = list(target.committed)
                if spec.launcher.requeue:
                    run["restarts"] = list(restarts)
                if ranks is not None:
                    from ppsplit import timeline

                    run["timeline"] = timeline.write(output_dir, ranks.results)
                print(report.format_run(run), flush=True)
        ok = fqn.ok and numerics_ok and (run is None or run["ok"])
        if target:
            if ok:
                pause("save", spec.debug.pause_at, spec.debug.pause_mode)
                run["checkpoint"] = target.commit(checkpoint_meta(spec, split, resume, source, model.config),
                                                  model.config, m.class_name,
                                                  rows=log.rows_through(log.last_step()) if log else None)
                if saves:
                    run["checkpoints"] = list(target.committed)
                say(f"checkpoint: {run['checkpoint']}")
            else:
                target.discard()
    except BaseException as err:
        if saves:
            try:  # the periodic checkpoints the ranks finished stand, whatever ended the run
                saves.flush(force=True)
            except Exception:
                pass
            if target.committed and hasattr(err, "saved"):  # a stop signal, SLURM's: the run goes on from here
                err.saved = target.committed[-1]
        if target:
            target.discard()
        raise

    data = {
        "model": m.name,
        "model_class": m.class_name,
        "stages": len(split),
        "layout": spec.parallel.record(spec.plan.ranks if spec.distributed else 1),
        "split_strategy": spec.split.strategy,
        "split_points": split.points,
        "balance": balance_of,
        "fqn_check": fqn.as_dict(),
        "stage_info": rows,
        "init": init,
        "numerics": ({"skipped": skipped} if numerics is None else
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


def _periodic(spec: JobSpec, target, split, resume, source, config, log, say):
    """The driver's side of ``checkpoint.every``: the step folders the ranks save, sealed."""
    if not spec.checkpoint.every or target is None:
        return None
    from ppsplit.checkpoint_series import PeriodicSaves

    saves = PeriodicSaves(target, lambda step: checkpoint_meta(spec, split, resume, source, config, step=step), log)
    saves.say = say
    return saves


def _then(record, saves):
    """The metrics log's ``record``, then the periodic saves that waited for its row."""
    if saves is None:
        return record

    def both(*args, **kwargs):
        record(*args, **kwargs)
        saves.flush()

    return both


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
    out = {"name": d.name, **({"padded": True} if d.padded else {})}
    if data_file:
        from ppsplit.data import TokenBlocks

        blocks = TokenBlocks(data_file, spec.seed)
        out.update(path=list(d.path), field=d.field, tokenizer=blocks.meta.get("tokenizer"), cache=data_file,
                   documents=blocks.meta.get("documents"), val_documents=blocks.meta.get("val_documents"),
                   train_blocks=int(len(blocks.train)), val_blocks=int(len(blocks.val)), seq_len=spec.seq_len)
    return out


def _metrics_log(spec: JobSpec, output_dir: str, costs: dict, resume, restart: int = 0):
    from ppsplit.metrics import MetricsLog, matmul_peak

    ranks = spec.world_size if spec.distributed else 1
    flops = sum(costs["flops"]) * spec.parallel.dp * spec.train.grad_accumulation  # the global batch's
    prior = None
    if resume:  # the rows up to the checkpoint's step, so that metrics.csv goes on
        from ppsplit.metrics import read_rows

        prior = read_rows(os.path.join(resume["checkpoint"], "metrics.csv"))
    # Ranks measure their own peaks (their device, their dtype); an inline run computes here.
    peak = None if spec.distributed else matmul_peak(spec.launcher.cpus_per_task, precision=spec.train.precision)
    return MetricsLog(output_dir, spec, flops, peak, ranks,
                      first_step=resume["step"] if resume else 0, prior=prior, restart=restart)


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


def checkpoint_meta(spec: JobSpec, split, resume: dict | None, source, config=None, step: int | None = None) -> dict:
    """What ``ppsplit.json`` records beside a checkpoint: where training stands (the step, the
    data stream's next batch and sample) and how it was laid out. ``step``: a periodic one's
    (default: the run's last)."""
    if step is None:
        step = (resume["step"] if resume else 0) + spec.steps
    next_index = step * spec.train.grad_accumulation
    return {
        "model": spec.model.name,
        "model_class": spec.model.class_name,
        "model_config": _json_config(config) if config is not None else None,
        "step": step,
        "resumed_from": resume,
        "data": {**data_identity(spec),
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
