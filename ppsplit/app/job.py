"""The main job, step by step: validate, build, prepare the data, trace and split, start the
ranks, verify, train and compare with the unsplit model (:mod:`ppsplit.train.compare`), save,
report."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any

from ppsplit.models import build
from ppsplit.train.objective import Objective

from ppsplit.report import text as report
from ppsplit.faults import pause
from ppsplit.errors import PpsplitError
from ppsplit.app.checks import Checked, validate
from ppsplit.checkpoint.meta import checkpoint_meta
from ppsplit.config.spec import AUTO, JobSpec
from ppsplit.stages.plan import balance, stage_costs
from ppsplit.output import Progress, write_json
from ppsplit.train.metrics import open_log
from ppsplit.stages.trace import split as split_model
from ppsplit.stages.verify import verify_fqns, verify_numerics


def run_job(spec: JobSpec, output_dir: str, progress: Progress | None = None, checked: Checked | None = None) -> int:
    """The whole job; under ``launcher.requeue``, one SLURM job after another until its last
    step, each going on from the checkpoint the one before saved when SLURM signalled it.
    ``checked``: ``spec`` already validated (by the command line's guard)."""
    from ppsplit.checkpoint.series import newest
    from ppsplit.errors import JobStopped

    say = progress or Progress(enabled=False)
    restarts: list[dict] = []
    whole = spec.steps
    if spec.checkpoint.load and not spec.checkpoint.auto:
        from ppsplit.checkpoint.folder import read_meta

        whole += int(read_meta(spec.checkpoint.load)["step"])
    while True:
        try:
            return _run_once(checked if checked and checked.spec == spec else validate(spec), output_dir, say,
                             restarts)
        except JobStopped as err:
            if err.cancelled or not (spec.launcher.requeue and len(restarts) < spec.launcher.max_requeue):
                if spec.launcher.requeue and not err.cancelled:
                    err.used_up = spec.launcher.max_requeue
                raise
            # signalled before its first step, a job saves nothing new: the next starts as it did
            saved = err.saved or (newest(spec.checkpoint.dir) if spec.checkpoint.auto else spec.checkpoint.load)
            restarts.append({"job": err.job, "stopped_at": err.step, "checkpoint": saved})
            say(f"{err.job} was signalled by SLURM at step {err.step}: going on in a new job from "
                f"{saved or 'step 0'} (restart {len(restarts)} of launcher.max_requeue={spec.launcher.max_requeue})")
            if err.saved:
                spec = spec.with_checkpoint(load=AUTO, steps=whole)


def _run_once(checked: Checked, output_dir: str, say, restarts: list[dict]) -> int:
    spec = checked.spec
    auto = spec.checkpoint.auto
    if auto:
        spec, done = _resolve_auto(spec, say, checked.config)
        if done is not None:
            return _nothing_left(spec, output_dir, *done)
    target = None
    if spec.checkpoint.save:
        folder = spec.checkpoint.dir or os.path.join(output_dir, "checkpoint")
        if spec.checkpoint.every:
            from ppsplit.checkpoint.folder import read_meta
            from ppsplit.checkpoint.series import Series

            at = int(read_meta(spec.checkpoint.load)["step"]) if spec.checkpoint.load else 0
            target = Series(folder, spec.checkpoint.every, spec.checkpoint.keep, at + spec.steps, auto,
                            loaded=spec.checkpoint.load)
        else:
            from ppsplit.checkpoint.folder import Target

            target = Target(folder, spec.checkpoint.overwrite)
    try:
        return _run_job(spec, output_dir, say, checked, target, restarts)
    finally:
        if hasattr(target, "close"):
            target.close()


def _resolve_auto(spec: JobSpec, say, config) -> tuple[JobSpec, tuple | None]:
    """``checkpoint.load=auto``: the newest step folder to go on from, with the steps left of
    ``steps`` (the whole run's), or a fresh start when there is none. One of another model
    config is refused (this run's resumes would go on from another model)."""
    from ppsplit.checkpoint.dcp import _config_changes
    from ppsplit.checkpoint.folder import read_meta
    from ppsplit.checkpoint.series import newest

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
    write_json(path, {"model": spec.model.name, "model_class": spec.model.class_name,
                             "nothing_left": {"checkpoint": found, "step": at, "steps": spec.steps},
                             "started_at": time.time(), "finished_at": time.time(), "ok": True})
    print(f"checkpoint.load=auto: {found} is at step {at}, and steps={spec.steps}: nothing left to train", flush=True)
    print(f"PASSED; report: {path}", flush=True)
    return 0


def _run_job(spec: JobSpec, output_dir: str, say, checked: Checked, target, restarts=()) -> int:
    m = spec.model
    resume = None
    if spec.checkpoint.load:
        from ppsplit.checkpoint.dcp import check_resumable
        from ppsplit.checkpoint.meta import peft_record

        resume = check_resumable(spec.checkpoint.load, checked.meta_model,
                                 peft_record(spec) if spec.peft.on else None)
    data_file = _prepare_data(spec, checked.config, say)
    started_at = time.time()
    if spec.launcher.name == "local" and spec.steps > 0:
        from ppsplit.launch.local import launcher

        launcher().preload(f"transformers.{m.class_name}")  # its imports overlap the build and trace
    spec, skipped = _choose_init(spec, checked.meta_model)
    model = _build_model(spec, say)
    masks = _dropout(spec, say)
    if m.pretrained and m.config:
        say(f"model.config over {m.pretrained}/config.json: "
            + ", ".join(f"{k}={v!r}" for k, v in m.config.items()))
    from ppsplit.data.corpus import BatchSource

    first_index = (resume["step"] if resume else 0) * spec.train.grad_accumulation
    source = BatchSource(spec, model.config, data_file, first_index, resume and resume.get("next_sample"))
    microbatches = source.batch(first_index).microbatches(spec.microbatches * spec.parallel.dp)
    split = _trace_and_split(spec, model, microbatches[0], masks, say)
    job = _Job(spec, output_dir, say, model, split, source, Objective(m.loss), masks, target, resume,
               list(restarts), data_file)
    checks = job.check_and_train(microbatches, skipped)
    data = job.report_data(checks, skipped, started_at)
    path = os.path.join(output_dir, "report.json")
    pause("report", spec.debug.pause_at, spec.debug.pause_mode)
    write_json(path, data)
    print(f"{'PASSED' if data['ok'] else 'FAILED'}; report: {path}", flush=True)
    return 0 if data["ok"] else 1


def _choose_init(spec: JobSpec, meta_model) -> tuple[JobSpec, str]:
    """``model.init`` resolved (``auto`` by the parameter count), and what the numerics check
    says when it is skipped."""
    m = spec.model
    init = build.resolve_init(m.init, m.class_name, m.config, m.pretrained, model=meta_model)
    skipped = f"model.init={init}"
    if init == "real" and spec.verify.mode == "off" and spec.distributed and spec.steps > 0:
        init, skipped = "meta", "verify=off"  # no unsplit model anywhere: the ranks hold the weights
    return spec.with_model(init=init), skipped


def _build_model(spec: JobSpec, say):
    """The unsplit model the driver traces: real weights, or its structure on meta."""
    m, meta = spec.model, spec.model.init == "meta"
    pause("build", spec.debug.pause_at, spec.debug.pause_mode)
    if meta and not spec.distributed and spec.steps > 0:
        raise PpsplitError("model.init=meta needs ranks to hold the weights; use launcher=local or "
                           "launcher=slurm, or steps=0 to only split and check")
    model = build.model_of(spec, meta)
    trained = f"; peft={spec.peft.name} trains {sum(p.numel() for p in model.parameters() if p.requires_grad):,}" \
        if spec.peft.on else ""
    say.phase("build", f"built {m.class_name} ({'meta device' if meta else 'real weights'}, "
                       f"{build.count_tensor_params(model):,} parameters{trained})")
    return model


def _trace_and_split(spec: JobSpec, model, example, masks, say):
    """The model exported on the first microbatch and split into stages; refused here when the
    dropout masks or the tensor-parallel layout cannot follow the split."""
    example = example.to("meta") if spec.model.init == "meta" else example
    pause("trace", spec.debug.pause_at, spec.debug.pause_mode)
    split = split_model(model, example.args, example.kwargs, **spec.split_kwargs())
    if masks is not None:
        for handle in masks.on_model(model, split.points):  # refuses points it cannot draw alike at
            handle.remove()
    if spec.parallel.tp > 1 and spec.steps > 0 and spec.distributed:
        from ppsplit.stages.shard_flow import check_tensor_parallel

        check_tensor_parallel(split, model, spec.model.tp_plan, spec.parallel.tp)  # refused before any rank starts
    sizes = f" for sequence lengths {spec.dynamic['seq'][0]} to {spec.dynamic['seq'][1]}" if spec.dynamic else ""
    say.phase("split", f"traced and split into {len(split)} stages at {', '.join(split.points) or '(none)'}{sizes}")
    return split


@dataclass
class _Checks:
    """What the driver found: the FQN check, the numerics (None when skipped), the stage table,
    the balance, and the training run (None with steps=0)."""
    fqn: Any
    numerics: Any
    numerics_ok: bool
    rows: list
    balance_of: dict
    run: dict | None

    @property
    def ok(self) -> bool:
        return self.fqn.ok and self.numerics_ok and (self.run is None or self.run["ok"])


@dataclass
class _Job:
    """One run's driver once the model is split: it starts the ranks, checks the split, trains
    and compares, saves, and gathers the report."""
    spec: JobSpec
    output_dir: str
    say: Any
    model: Any
    split: Any
    source: Any
    loss_fn: Any
    masks: Any
    target: Any
    resume: dict | None
    restarts: list
    data_file: str | None
    log: Any = None
    saves: Any = None

    def check_and_train(self, microbatches, skipped: str) -> _Checks:
        try:
            with contextlib.ExitStack() as stack:
                costs = stage_costs(self.split, self.spec.microbatches)
                ranks = self._start_ranks(stack, costs) if self.spec.distributed and self.spec.steps > 0 else None
                checks = self._verify(microbatches, costs, ranks, skipped)
                if self.spec.steps > 0:
                    checks.run = self._train(stack, costs, ranks)
            self._save(checks)
            return checks
        except BaseException as err:
            self._keep_saved(err)
            raise

    def _start_ranks(self, stack, costs):
        """Start the ranks first: the driver checks the split while they build their stages."""
        from ppsplit.launch import dispatch

        spec, target = self.spec, self.target
        self._open_log(stack, costs)
        ranks = stack.enter_context(dispatch.Ranks(spec, self.output_dir, self.say,
                                                   on_step=_then(self.log.record, self.saves),
                                                   on_saved=self.saves.saved if self.saves else None))
        staging = target.stage(os.urandom(4).hex()) if target else None
        ranks.start({"checkpoint_dir": staging, "load_dir": spec.checkpoint.load,
                     "series": {"dir": target.folder, "every": target.every, "token": target.token}
                     if self.saves else None,
                     "hf_dir": os.path.join(staging, "hf") if staging and spec.checkpoint.hf else None,
                     "data_file": self.data_file, "first_index": self.source.first_index,
                     "first_sample": self.source.first_sample})
        return ranks

    def _open_log(self, stack, costs) -> None:
        self.log = open_log(self.spec, self.output_dir, costs, self.resume, len(self.restarts))
        stack.callback(self.log.close)
        self.saves = _periodic(self.spec, self.target, self.split, self.resume, self.source, self.model.config,
                               self.log, self.say)

    def _verify(self, microbatches, costs, ranks, skipped: str) -> _Checks:
        spec, m = self.spec, self.spec.model
        meta = m.init == "meta"
        pause("check", spec.debug.pause_at, spec.debug.pause_mode)
        fqn = verify_fqns(self.model, self.split)
        numerics = None
        if not meta:
            from ppsplit.train.loop import precision_context

            with precision_context(spec.train.precision, "cpu"):  # as the ranks will compute
                numerics = verify_numerics(self.model, self.split, microbatches, self.loss_fn, self.masks)
        self.say.phase("verify", "checked the FQNs" + ("" if meta else " and the numerics"))
        if ranks is not None:
            ranks.check()  # a rank that failed meanwhile is named here, before anything else is said
            ranks.say_started()
        rows = report.stage_rows(self.split, costs)
        balance_of = {kind: balance(values) for kind, values in costs.items()}
        numerics_ok = numerics is None or numerics.ok(spec.tolerance)
        print(report.format_checks(m.name, m.class_name, self.split, rows, balance_of,
                                   fqn, numerics, spec.tolerance, skipped), flush=True)
        return _Checks(fqn, numerics, numerics_ok, rows, balance_of, None)

    def _train(self, stack, costs, ranks) -> dict:
        from ppsplit.train.compare import train_and_compare

        spec, target = self.spec, self.target
        if ranks is None:
            self._open_log(stack, costs)
            if target:
                target.stage(os.urandom(4).hex())
        run = train_and_compare(spec, self.model, self.split, self.source, self.loss_fn, ranks, target, self.say,
                                self.resume, self.masks, self.log, self.saves)
        if self.saves:
            self.saves.flush(force=True)  # the steps whose rows came only with the results
            run["checkpoints"] = list(target.committed)
        if spec.launcher.requeue:
            run["restarts"] = list(self.restarts)
        if ranks is not None:
            from ppsplit.report import timeline

            run["timeline"] = timeline.write(self.output_dir, ranks.results)
        print(report.format_run(run), flush=True)
        return run

    def _save(self, checks: _Checks) -> None:
        target, run = self.target, checks.run
        if not target:
            return
        if not checks.ok:
            target.discard()
            return
        pause("save", self.spec.debug.pause_at, self.spec.debug.pause_mode)
        log, config = self.log, self.model.config
        if self.spec.peft.on and self.spec.checkpoint.hf:
            config = self._export_adapters(target.staging)
        run["checkpoint"] = target.commit(checkpoint_meta(self.spec, self.split, self.resume, self.source,
                                                          self.model.config),
                                          config, self.spec.model.class_name,
                                          rows=log.rows_through(log.last_step()) if log else None)
        if self.saves:
            run["checkpoints"] = list(target.committed)
        self.say(f"checkpoint: {run['checkpoint']}")

    def _peft_section(self) -> dict:
        p = self.spec.peft
        merged = os.path.join(self.target.folder, "merged") if p.merge and self.target else None
        return {"name": p.name, "r": p.r, "alpha": p.alpha,
                "target_modules": list(p.target_modules) if isinstance(p.target_modules, tuple) else p.target_modules,
                "trained_params": sum(q.numel() for q in self.model.parameters() if q.requires_grad),
                "params": build.count_tensor_params(self.model), "merged": merged}

    def _export_adapters(self, staging: str) -> None:
        """The adapter folder peft loads, and the merged model (``peft.merge``); None: no
        ``config.json`` goes into the adapter folder."""
        from ppsplit.checkpoint.adapters import finish_adapter, write_merged

        hf = os.path.join(staging, "hf")
        finish_adapter(hf, self.model)
        if self.spec.peft.merge:
            write_merged(self.spec, hf, os.path.join(staging, "merged"))
        return None

    def _keep_saved(self, err: BaseException) -> None:
        """Whatever ended the run, the periodic checkpoints the ranks finished stand."""
        if self.saves:
            try:
                self.saves.flush(force=True)
            except Exception:
                pass
            if self.target.committed and hasattr(err, "saved"):  # a stop signal, SLURM's: the run goes on from here
                err.saved = self.target.committed[-1]
        if self.target:
            self.target.discard()

    def report_data(self, checks: _Checks, skipped: str, started_at: float) -> dict:
        spec, numerics = self.spec, checks.numerics
        return {
            "model": spec.model.name,
            "model_class": spec.model.class_name,
            "stages": len(self.split),
            "layout": spec.parallel.record(spec.plan.ranks if spec.distributed else 1),
            "split_strategy": spec.split.strategy,
            "split_points": self.split.points,
            "balance": checks.balance_of,
            "fqn_check": checks.fqn.as_dict(),
            "stage_info": checks.rows,
            "init": spec.model.init,
            "numerics": ({"skipped": skipped} if numerics is None else
                         {**numerics.as_dict(), "ok": checks.numerics_ok, "tolerance": spec.tolerance,
                          "mismatch": None if checks.numerics_ok else _as_mismatch(numerics.worst(spec.tolerance))}),
            "data": _data_section(spec, self.data_file),
            **({"peft": self._peft_section()} if spec.peft.on else {}),
            "run": checks.run,
            "timings_s": dict(self.say.marks),
            "started_at": started_at,
            "finished_at": time.time(),
            "ok": checks.ok,
        }


def _periodic(spec: JobSpec, target, split, resume, source, config, log, say):
    """The driver's side of ``checkpoint.every``: the step folders the ranks save, sealed."""
    if not spec.checkpoint.every or target is None:
        return None
    from ppsplit.checkpoint.series import PeriodicSaves

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
    from ppsplit.data.corpus import prepare

    seq2seq = spec.data.sft and spec.model.inputs == "seq2seq"
    path = prepare(spec.data, spec.model.pretrained, spec.seq_len, spec.seed, config.vocab_size,
                   progress=say.enabled, batch_size=spec.batch_size if spec.eval.batches else 0,
                   decoder_start=(config.decoder_start_token_id or 0) if seq2seq else None)
    from ppsplit.data.store import describe

    say.phase("data", f"data: {os.path.basename(path)} ({spec.data.name}, {describe(path)}, "
                      f"blocks of {spec.seq_len})")
    return path


def _data_section(spec: JobSpec, data_file: str | None) -> dict:
    d = spec.data
    out = {"name": d.name, **({"padded": True} if d.padded else {})}
    if data_file:
        from ppsplit.data.corpus import TokenBlocks
        from ppsplit.data.store import size_of

        blocks = TokenBlocks(data_file, spec.seed)
        out.update(path=list(d.path), field=d.field, tokenizer=blocks.meta.get("tokenizer"), cache=data_file,
                   documents=blocks.meta.get("documents"), val_documents=blocks.meta.get("val_documents"),
                   train_blocks=int(len(blocks.train)), val_blocks=int(len(blocks.val)), seq_len=spec.seq_len,
                   cache_bytes=size_of(data_file),
                   **{k: blocks.meta[k] for k in ("corpus_bytes", "num_proc", "tokenize_s") if k in blocks.meta})
        if d.sft:
            out["sft"] = {"format": blocks.meta.get("format"), "loss_on": d.sft.loss_on, "packing": d.sft.packing,
                          "truncate": d.sft.truncate, "scored_tokens": blocks.meta.get("scored_tokens")}
    return out


def _dropout(spec: JobSpec, say):
    """Say what ``dropout`` does to this model (and ``peft.dropout`` to its adapters); the mask
    seeds when some dropout stays on."""
    m = spec.model
    settings = build.stochastic_settings(m.class_name, m.config, m.pretrained)
    adapters = spec.peft.on and spec.peft.dropout
    if not settings and not adapters:
        return None
    by_value: dict[float, list[str]] = {}
    for key, value in settings.items():
        by_value.setdefault(value, []).append(key)
    found = "; ".join(f"p={value:g} in the config: {', '.join(keys)}" for value, keys in by_value.items())
    on = []
    if settings and not spec.dropout:
        say(f"dropout off for the check and the training ({found}); dropout=true trains with it")
    elif settings:
        on.append(found)
    if adapters:
        on.append(f"p={spec.peft.dropout:g} on the adapters' input: peft.dropout")
    if not on:
        return None
    from ppsplit.train.dropout import MaskSeeds

    say(f"dropout on ({'; '.join(on)}): masks drawn alike in the stages and the unsplit model")
    return MaskSeeds(spec.seed)


def _as_mismatch(d) -> dict | None:
    return None if d is None else {**d.as_dict(), "tie_copy": d.kind == "tie copy"}
