"""What a step's loss is: the unsplit model's loss on the whole global batch in one forward.

Each task's loss is a sum over the items it scores, divided by how many items the whole optimizer
step scores. The items: the tokens whose label is not ``IGNORE`` (for a causal LM the labels
after the shift, so position 0 is never counted), or one per sample for image classification.
The count covers every microbatch, accumulated batch and data-parallel rank of the step; it is
read from the labels before the step runs, the same on every rank, since each rank draws the
whole global batch before taking its share.

A piece of the step (a microbatch on one rank) then adds its sum times ``1 / count``, so the
pieces add up to the whole batch's mean however the batch is cut, and so do their gradients. A
mean of each piece's mean would weigh a token by how many others share its microbatch: the model
trained would depend on ``microbatches``, ``train.grad_accumulation`` and ``parallel.dp``
whenever pieces score different counts (masked LM, padding, answer-only fine-tuning).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ppsplit.config.values import TASKS
from ppsplit.errors import PpsplitError
from ppsplit.config.tasks import IGNORE



def logits_of(output) -> torch.Tensor:
    """The prediction scores: the first leaf of a model's or a last stage's output."""
    while isinstance(output, (tuple, list)):
        output = output[0]
    return output


def _scored(task: str, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, labels) flattened to one row per item, a causal LM's shifted by one."""
    if task == "image_classification":
        return logits, labels
    if task == "causal_lm":
        logits, labels = logits[:, :-1], labels[:, 1:]
    return logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)


class Objective:
    """A task's loss, by the rule above. ``total(output, labels)``: the sum over the scored
    items; ``count(labels)``: how many there are; calling it gives one batch's own mean."""

    def __init__(self, task: str):
        if task not in TASKS:
            raise PpsplitError(f"model.loss={task!r} is not known; allowed: {', '.join(TASKS)}")
        self.task = task

    def total(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        logits, labels = _scored(self.task, logits_of(output), labels)
        return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE, reduction="sum")

    def count(self, labels: torch.Tensor) -> int:
        if self.task == "causal_lm":
            labels = labels[:, 1:]
        return int((labels != IGNORE).sum())

    def __call__(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        return self.total(output, labels) / max(1, self.count(labels))

    def __repr__(self) -> str:
        return f"Objective({self.task!r})"


class WeightedLoss:
    """The loss a pipeline schedule calls on each microbatch: the microbatch's sum times
    ``weight``, the weight of each scored item in the step (set before each schedule step;
    ``1 / count`` times the data-parallel degree, since replicas average their gradients).
    Schedules built over it must not divide by the microbatch count again (``scale_grads=False``).
    ``pieces``: the old rule, each microbatch's own mean over ``pieces`` (a defect for tests)."""

    def __init__(self, objective: Objective, pieces: int | None = None):
        self.objective, self.pieces = objective, pieces
        self.weight = 1.0

    def __call__(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        if self.pieces:
            return self.objective(output, labels) / self.pieces
        return self.objective.total(output, labels) * self.weight
