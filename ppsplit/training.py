"""One optimizer step, the same way on the ranks, in the inline pipeline and for the unsplit
reference, so that the comparison holds step for step:

1. ``train.grad_accumulation`` batches, each its microbatches, forward and backward (the loss of
   each scaled by 1/accumulation), under ``train.precision``;
2. the gradients synchronised (tied copies summed, replicas averaged);
3. the global gradient norm taken (before clipping) and, with ``train.clip_grad_norm``, every
   gradient scaled down to it (:mod:`ppsplit.optim`);
4. a non-finite loss or gradient stops the run, naming the step;
5. the optimizer and learning-rate schedule step.

Precision ``bf16``: the forward runs under ``torch.autocast`` in bfloat16 while the parameters,
their gradients and the optimizer stay float32 (under FSDP2 a ``MixedPrecisionPolicy`` gathers
bfloat16 parameters and reduces gradients in float32). Activations cross stage boundaries in
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

from ppsplit.optim import clip_


@dataclass
class StepStats:
    step: int  # the optimizer step, counted from the run's first (0)
    loss: float | None  # the mean over the accumulated batches; None on a rank without the loss
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
    """Runs optimizer steps over one set of modules. ``forward_backward(i)`` runs the ``i``-th
    batch of the run (its microbatches, forward and backward, the loss already scaled by
    1/accumulation) and returns its loss (None where the loss is not computed); ``sync`` makes
    the gradients whole (ties, replicas); ``norm`` returns the global gradient norm."""
    forward_backward: Callable[[int], float | None]
    sync: Callable[[], None]
    norm: Callable[[], float]
    params: list
    optimizers: list
    schedules: list
    accumulation: int = 1
    clip: float | None = None
    finite: Callable[[float | None], bool] | None = None  # False stops the run (all ranks agree)
    first_grads: dict = field(default_factory=dict)
    grads_of: Callable[[], dict] | None = None  # the gradients to keep after the first step

    def step(self, k: int) -> StepStats | None:
        """Optimizer step ``k`` of this run; None when a loss or gradient was not finite (the
        optimizer has not stepped)."""
        start = time.perf_counter()
        losses = [self.forward_backward(k * self.accumulation + a) for a in range(self.accumulation)]
        losses = [x for x in losses if x is not None]
        loss = sum(losses) / len(losses) if losses else None
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
