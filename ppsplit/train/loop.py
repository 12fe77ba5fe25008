"""One optimizer step, the same way on the ranks, in the inline pipeline and for the unsplit
reference, so that the comparison holds step for step:

1. ``train.grad_accumulation`` batches, each its microbatches, forward and backward under
   ``train.precision``, each scored item's loss weighted by 1 / the items the whole step scores
   (:mod:`ppsplit.train.objective`): the step's loss and gradients are the whole batch's;
2. the gradients synchronised (tied copies summed, replicas averaged);
3. the global gradient norm taken (before clipping) and, with ``train.clip_grad_norm``, every
   gradient scaled down to it (:mod:`ppsplit.train.optim`);
4. a non-finite loss or gradient stops the run, naming the step;
5. the optimizer and learning-rate schedule step.

Precision ``bf16``: the forward runs under ``torch.autocast`` in bfloat16 while the parameters,
their gradients and the optimizer stay float32; FSDP2 gathers them in float32 too, unless
``parallel.fsdp_param_dtype=bfloat16`` (a ``MixedPrecisionPolicy``: bfloat16 parameters
gathered, gradients reduced in float32, every op then computing with bfloat16 weights). Activations cross stage boundaries in
float32 (a bfloat16 value widens exactly, and narrows back to itself in the next op).

Activation checkpointing (``train.activation_checkpointing``): the modules whose FQN matches the
pattern (``blocks``: the split's blocks) recompute their forward in the backward
(``torch.utils.checkpoint``, non-reentrant, random state kept), in the stages and in the
unsplit model alike. Their FQNs do not change: the module's own ``forward`` is wrapped.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ppsplit.train.optim import clip_


@dataclass
class StepStats:
    step: int  # the optimizer step, counted from the run's first (0)
    loss: float | None  # the step's loss (ppsplit.train.objective); None on a rank without the loss
    grad_norm: float
    lr: float
    time_s: float
    clip_coef: float = 1.0


def precision_context(precision: str, device_type: str):
    if precision == "bf16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def checkpoint_pattern(pattern: str | None, blocks) -> re.Pattern | None:
    """The FQNs to recompute: ``blocks`` (the split's blocks) or an FQN pattern with ``*``."""
    if not pattern:
        return None
    if pattern == "blocks":
        names = sorted({b.partition("@")[0] for b in blocks})
        return re.compile("^(" + "|".join(re.escape(n) for n in names) + ")$") if names else None
    return re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")


def apply_activation_checkpointing(root: torch.nn.Module, pattern: re.Pattern | None) -> list[str]:
    """Recompute the forward of each module of ``root`` whose FQN matches (the outermost only);
    returns their FQNs. The tree and its names stay as they are."""
    if pattern is None:
        return []
    done: list[str] = []
    for name, module in root.named_modules():
        if not name or not pattern.match(name) or any(name.startswith(d + ".") for d in done):
            continue
        if getattr(module, "_ppsplit_recomputes", False):
            done.append(name)
            continue
        inner = module.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            from torch.utils.checkpoint import checkpoint

            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        module.forward = forward
        module._ppsplit_recomputes = True
        done.append(name)
    return done


@dataclass
class Stepper:
    """Runs optimizer steps over one set of modules. ``batches(k)`` gives step ``k``'s global
    batches (``train.grad_accumulation`` of them) and ``count(batch)`` the items a batch scores;
    ``forward_backward(batch, weight)`` runs one batch (its microbatches, forward and backward,
    each scored item's loss times ``weight``) and returns its part of the step's loss (None where
    the loss is not computed); ``sync`` makes the gradients whole (ties, replicas); ``norm``
    returns the global gradient norm."""
    batches: Callable[[int], list]
    count: Callable[[object], int]
    forward_backward: Callable[[object, float], float | None]
    sync: Callable[[], None]
    norm: Callable[[], float]
    params: list
    optimizers: list
    schedules: list
    clip: float | None = None
    finite: Callable[[float | None], bool] | None = None  # False stops the run (all ranks agree)
    first_grads: dict = field(default_factory=dict)
    grads_of: Callable[[], dict] | None = None  # the gradients to keep after the first step
    last_loss: float | None = None

    def step(self, k: int) -> StepStats | None:
        """Optimizer step ``k`` of this run; None when a loss or gradient was not finite (the
        optimizer has not stepped)."""
        start = time.perf_counter()
        batches = self.batches(k)
        weight = 1.0 / max(1, sum(self.count(b) for b in batches))
        parts = [self.forward_backward(b, weight) for b in batches]
        parts = [x for x in parts if x is not None]
        loss = sum(parts) if parts else None
        self.last_loss = loss
        self.sync()
        norm = self.norm()
        finite = math.isfinite(norm) and (loss is None or math.isfinite(loss))
        if self.finite is not None:
            finite = self.finite(None if finite else math.nan)
        if not finite:
            return None
        coef = clip_(self.params, self.clip, norm) if self.clip else 1.0
        if k == 0 and self.grads_of is not None:
            self.first_grads = self.grads_of()
        lr = self.optimizers[0].param_groups[0]["lr"] if self.optimizers else 0.0
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for schedule in self.schedules:
            schedule.step()
        return StepStats(k, loss, norm, lr, time.perf_counter() - start, coef)


def step_batches(source, spec, start_step: int, k: int) -> list:
    """The global batches of step ``k`` of a run that began at ``start_step``: indices in the
    training stream, ``train.grad_accumulation`` a step, at the step's sequence length."""
    accumulation = spec.train.grad_accumulation
    return [source.batch((start_step + k) * accumulation + a, spec.seq_len_at(start_step + k))
            for a in range(accumulation)]


def counted_once(tie_groups, stage_keys) -> dict[str, int]:
    """For each tied key, the one stage whose copy counts in the gradient norm (the first that
    holds its group); an untied key is counted wherever it is."""
    owner = {}
    for group in tie_groups:
        holders = [s for s, keys in enumerate(stage_keys) if set(keys) & set(group)]
        for key in group:
            owner[key] = min(holders) if holders else 0
    return owner


def eval_indices(steps: int, every: int) -> set[int]:
    """The optimizer steps (from 0) after which the model is evaluated: every ``every`` and the last."""
    out = {steps - 1} if steps else set()
    if every:
        out |= {k for k in range(steps) if (k + 1) % every == 0}
    return out


def train_in_process(forward, modules, source, spec, microbatches: int | None, loss_fn, after_backward=None,
                     load: tuple | None = None, on_step=None, masks=None, steps: int | None = None,
                     after_step=None) -> dict:
    """Train ``forward`` (the unsplit model, or the chained stages) in this process exactly as
    the ranks do (see the module docstring), on ``source``'s batches in ``microbatches`` each;
    None: each step's batches as one, in one forward and backward (the unsplit model on the
    whole global batch).

    ``loss_fn``: the task's :class:`ppsplit.train.objective.Objective`. ``modules`` hold the
    parameters; the gradients of the first step, the values before and after training are
    returned by FQN. ``load``: (checkpoint folder, the module whose FQNs key it, tie groups) to
    resume from. ``masks``: the dropout seeds whose hooks ``forward`` carries. ``steps``: how
    many (default: the job's; the reference may run fewer). ``after_step(step, optimizer)``:
    after each step but the last, by the step count since the run began (periodic checkpoints)."""
    steps = spec.steps if steps is None else steps
    named = [(k, p) for m in modules for k, p in m.named_parameters()]
    optimizer, schedule, start_step = _optimizer_at_start(spec, named, load)
    initial = {k: v.detach().clone() for m in modules for k, v in m.state_dict().items()}
    device_type = next((p.device.type for _, p in named), "cpu")
    stepper = _in_process_stepper(forward, modules, named, source, spec, microbatches, loss_fn, after_backward,
                                  optimizer, schedule, start_step, device_type)

    def evaluate(k: int) -> float:
        return evaluate_in_process(forward, source, spec, microbatches, loss_fn, device_type, masks, start_step + k)

    evals = eval_indices(steps, spec.eval.every) if spec.eval.batches else set()
    stats, diverged, val = run_steps(stepper, modules, steps, start_step, evals, evaluate, masks,
                                     _InProcessHooks(on_step, after_step, optimizer))
    return _training_result(stats, diverged, val, stepper, modules, initial, optimizer, start_step)


def _optimizer_at_start(spec, named: list, load: tuple | None) -> tuple:
    """The run's optimizer (with no gradients, whatever ran before, and resumed from ``load``'s
    checkpoint if given), its learning-rate schedule, and the step the run starts at."""
    from ppsplit.checkpoint import dcp as ckpt
    from ppsplit.train.optim import make_lr_schedule, make_optimizer

    optimizer = make_optimizer(spec.optimizer, named)
    optimizer.zero_grad(set_to_none=True)  # start from no gradients, whatever ran before
    start_step = 0
    if load is not None:
        folder, holder, tie_groups = load
        start_step = ckpt.load(folder, {0: holder}, {0: optimizer}, tie_groups)
    schedule = make_lr_schedule(optimizer, spec.train, start_step + spec.steps, start_step)
    return optimizer, schedule, start_step


def _in_process_stepper(forward, modules, named: list, source, spec, microbatches: int | None, loss_fn,
                        after_backward, optimizer, schedule, start_step: int, device_type: str) -> Stepper:
    """The :class:`Stepper` of an in-process run: each step's batches (as one without
    ``microbatches``) through ``forward`` and back, keeping the first step's gradients."""
    from ppsplit.data.batch import Batch
    from ppsplit.train.optim import grad_norm

    train = spec.train

    def batches(k: int) -> list:
        out = step_batches(source, spec, start_step, k)
        return out if microbatches else [Batch.cat(out)]

    def forward_backward(batch, weight: float) -> float:
        total = 0.0
        for mb in batch.microbatches(microbatches or 1):
            with precision_context(train.precision, device_type):
                loss = loss_fn.total(forward(*mb.args, **mb.kwargs), mb.labels) * weight
            loss.backward()
            total += loss.item()
        return total

    return Stepper(batches, lambda b: loss_fn.count(b.labels), forward_backward, after_backward or (lambda: None),
                   lambda: grad_norm(named), [p for _, p in named], [optimizer], [schedule],
                   train.clip_grad_norm,
                   grads_of=lambda: [{k: p.grad.detach().clone() for k, p in m.named_parameters(remove_duplicate=False)
                                      if p.grad is not None} for m in modules])


class StepHooks:
    """What a training loop does around its steps beyond the step itself; each does nothing
    here. The ranks' loop (:mod:`ppsplit.train.rank`) and the in-process one differ only in
    these."""

    def before(self, k: int) -> bool:
        """Before step ``k``; False ends the run here (a stop agreed by the ranks)."""
        return True

    def stepped(self, k: int) -> None:
        """Right after step ``k``'s optimizer step, diverged or not."""

    def finished(self, k: int, result: StepStats, val: dict | None) -> None:
        """Step ``k`` done and finite; ``val``: the evaluation after it (``{"step", "loss"}``),
        if there was one."""

    def between(self, step: int) -> None:
        """After each step but the last, by the step count since the run began."""


def run_steps(stepper: Stepper, modules, steps: int, start_step: int, evals: set[int], evaluate, masks,
              hooks: StepHooks) -> tuple[list[StepStats], dict | None, list[dict]]:
    """The one training loop: ``steps`` optimizer steps, evaluating after those in ``evals``;
    each step's stats, the divergence (None if every step was finite; the run stops at it) and
    the validation losses."""
    stats, diverged, val = [], None, []
    for k in range(steps):
        if masks is not None:
            masks.start_step(start_step + k)
        if not hooks.before(k):
            break
        result = stepper.step(k)
        hooks.stepped(k)
        if result is None:
            diverged = _divergence(k, stepper.last_loss, modules)
            break
        stats.append(result)
        if k in evals:
            val.append({"step": k + 1, "loss": evaluate(k)})
        hooks.finished(k, result, val[-1] if k in evals else None)
        if k < steps - 1:
            hooks.between(start_step + k + 1)
    return stats, diverged, val


class _InProcessHooks(StepHooks):
    def __init__(self, on_step, after_step, optimizer):
        self.on_step, self.after_step, self.optimizer = on_step, after_step, optimizer

    def finished(self, k: int, result: StepStats, val: dict | None) -> None:
        if self.on_step is not None:
            self.on_step(k + 1, result, val["loss"] if val is not None else None)

    def between(self, step: int) -> None:
        if self.after_step is not None:
            self.after_step(step, self.optimizer)


def _divergence(k: int, loss: float | None, modules) -> dict:
    """What stopped the run at step ``k``: a non-finite loss, or the first non-finite parameter."""
    from ppsplit.parallel.stage_state import first_non_finite

    bad = first_non_finite((key, p) for m in modules for key, p in m.named_parameters())
    return {"step": k, "loss": loss, "non_finite_loss": loss is not None and not math.isfinite(loss),
            "non_finite_grad": bad}


def _training_result(stats: list[StepStats], diverged: dict | None, val: list[dict], stepper: Stepper, modules,
                     initial: dict, optimizer, start_step: int) -> dict:
    """The run's report: per-step numbers, timings, first gradients and the final values by FQN."""
    from ppsplit.parallel.stage_state import median_after_first

    times = [s.time_s for s in stats]
    return {
        "losses": [s.loss for s in stats],
        "grad_norms": [s.grad_norm for s in stats],
        "lrs": [s.lr for s in stats],
        "val_losses": val,
        "diverged": diverged,
        "step_times_s": times,
        "step_time_s": median_after_first(times),
        "first_grads": stepper.first_grads or [],
        "state": [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in modules],
        "initial": initial,
        "optimizer": optimizer,
        "start_step": start_step,
    }


def evaluate_in_process(forward, source, spec, microbatches, loss_fn, device_type, masks=None, step=0) -> float:
    """The loss over every held-out token, forward only: the sum over the scored items of every
    held-out batch over their count (the ranks run the same batches through the stages)."""
    def total_of(mb) -> float:
        with precision_context(spec.train.precision, device_type):
            return loss_fn.total(forward(*mb.args, **mb.kwargs), mb.labels).item()

    total, count = held_out_sums(source, spec, loss_fn, masks, step, microbatches or 1, total_of)
    return total / count if count else math.nan


@torch.no_grad()
def held_out_sums(source, spec, loss_fn, masks, step: int, microbatches: int, total_of, shard=None) -> tuple:
    """The one evaluator: (the summed loss, the count of scored items) over the held-out
    batches, each drawn with its own dropout masks, cut into ``microbatches`` (of this data-
    parallel rank's ``shard``, (rank, size)) and given to ``total_of``, which runs them however
    the stages run (None: this rank holds no loss). The count is the whole batch's, everywhere."""
    total, count = 0.0, 0
    for j, batch in enumerate(source.validation(spec.eval.batches)):
        if masks is not None:
            masks.start_step(-1 - j - 1000 * step)
        count += loss_fn.count(batch.labels)
        for mb in (batch if shard is None else batch.shard(*shard)).microbatches(microbatches):
            got = total_of(mb)
            if got is not None:
                total += got
    return total, count
