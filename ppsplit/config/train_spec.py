"""The training settings of a job, read and checked from the config: the data it trains on, the
optimizer step (schedule, accumulation, clipping, precision, recomputation), evaluation, the
metrics it writes, and how much of the run is checked against the unsplit model. No torch is
needed here."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ppsplit.config.values import boolean, choice, get, integer, number, text
from ppsplit.errors import PpsplitError

DATA_KINDS = ("synthetic", "text", "jsonl", "parquet")
SAMPLE_BY = ("paragraph", "line", "document")
LR_SCHEDULES = ("constant", "linear", "cosine")
PRECISIONS = ("fp32", "bf16")
VERIFY = ("full", "off")
# bf16 computes each product to 8 bits of mantissa: its results are held to these rtols.
BF16_TOLERANCE, BF16_TIE_TOLERANCE = 2e-2, 5e-2


@dataclass(frozen=True)
class DataSpec:
    name: str = "synthetic"
    path: tuple[str, ...] = ()  # files or globs, as given
    field: str = "text"
    tokenizer: str | None = None
    val_fraction: float = 0.05
    cache_dir: str | None = None
    sample_by: str = "paragraph"  # text files: what one document is
    padded: bool = False  # synthetic: each row's labels end at a length of its own

    @property
    def real(self) -> bool:
        return self.name != "synthetic"


@dataclass(frozen=True)
class TrainSpec:
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    grad_accumulation: int = 1
    clip_grad_norm: float | None = None
    precision: str = "fp32"
    activation_checkpointing: str | None = None  # an FQN pattern, or "blocks"


@dataclass(frozen=True)
class EvalSpec:
    every: int = 0  # validation every N optimizer steps (0: only at the end)
    batches: int = 2  # held-out batches per evaluation (0: none)


@dataclass(frozen=True)
class MetricsSpec:
    csv: bool = True  # metrics.csv in the run folder, a row per step
    tensorboard: bool = False  # TensorBoard event files in the run folder's tensorboard/
    plot: bool = True  # loss.png at the end


DEFAULT_VERIFY_STEPS = 10


@dataclass(frozen=True)
class VerifySpec:
    mode: str = "steps"  # full: the unsplit reference runs every step; steps: the first N; off: none
    steps: int | None = DEFAULT_VERIFY_STEPS

    def reference_steps(self, steps: int) -> int:
        if self.mode == "off":
            return 0
        return min(steps, self.steps) if self.steps is not None else steps


def data_spec(cfg) -> DataSpec:
    name = choice("data", get(cfg, "data.name", "synthetic"), DATA_KINDS)
    padded = get(cfg, "data.padded")
    if name == "synthetic":
        return DataSpec(padded=boolean("data.padded", False if padded is None else padded))
    if padded is not None:
        raise PpsplitError(f"data.padded={padded!r} with data={name}: only synthetic rows are padded; "
                           "allowed: data=synthetic")
    path = get(cfg, "data.path")
    if isinstance(path, str):
        path = [path]
    if not isinstance(path, list) or not path or not all(isinstance(p, str) and p for p in path):
        raise PpsplitError(f"data.path={path!r}: data={name} needs data.path: a file, a glob, or a list of them")
    fraction = number("data.val_fraction", get(cfg, "data.val_fraction", 0.05))
    if fraction >= 1:
        raise PpsplitError(f"data.val_fraction={fraction:g}: allowed: a fraction from 0 to below 1")
    cache = text("data.cache_dir", get(cfg, "data.cache_dir"))
    tokenizer = text("data.tokenizer", get(cfg, "data.tokenizer"))
    return DataSpec(name=name, path=tuple(path), field=text("data.field", get(cfg, "data.field", "text"),
                                                               optional=False),
                    tokenizer=os.path.abspath(os.path.expanduser(tokenizer)) if tokenizer else None,
                    val_fraction=fraction, cache_dir=os.path.abspath(os.path.expanduser(cache)) if cache else None,
                    sample_by=choice("data.sample_by", get(cfg, "data.sample_by", "paragraph"), SAMPLE_BY))


def train_spec(cfg, steps: int) -> TrainSpec:
    key = "train.clip_grad_norm"
    clip = get(cfg, key)
    if clip is not None:
        clip = number(key, clip, exclusive=True)
    warmup = integer("train.warmup_steps", get(cfg, "train.warmup_steps", 0), 0)
    if steps and warmup > steps:
        raise PpsplitError(f"train.warmup_steps={warmup} is longer than the run (steps={steps}); "
                           f"allowed: 0 to {steps}")
    ratio = number("train.min_lr_ratio", get(cfg, "train.min_lr_ratio", 0.0))
    if ratio > 1:
        raise PpsplitError(f"train.min_lr_ratio={ratio:g}: allowed: 0 to 1")
    return TrainSpec(
        lr_schedule=choice("train.lr_schedule", get(cfg, "train.lr_schedule", "constant"), LR_SCHEDULES),
        warmup_steps=warmup, min_lr_ratio=ratio,
        grad_accumulation=integer("train.grad_accumulation", get(cfg, "train.grad_accumulation", 1), 1),
        clip_grad_norm=clip,
        precision=choice("train.precision", get(cfg, "train.precision", "fp32"), PRECISIONS),
        activation_checkpointing=text("train.activation_checkpointing", get(cfg, "train.activation_checkpointing")),
    )


def eval_spec(cfg) -> EvalSpec:
    return EvalSpec(every=integer("eval.every", get(cfg, "eval.every", 0), 0),
                    batches=integer("eval.batches", get(cfg, "eval.batches", 2), 0))


def metrics_spec(cfg) -> MetricsSpec:
    return MetricsSpec(csv=boolean("metrics.csv", get(cfg, "metrics.csv", True)),
                       tensorboard=boolean("metrics.tensorboard", get(cfg, "metrics.tensorboard", False)),
                       plot=boolean("metrics.plot", get(cfg, "metrics.plot", True)))


def verify_spec(cfg) -> VerifySpec:
    value = get(cfg, "verify", DEFAULT_VERIFY_STEPS)
    if value in VERIFY:
        return VerifySpec(mode=value, steps=None)
    if isinstance(value, str) and value.startswith("steps="):
        value = value[len("steps="):]
        value = int(value) if value.isdigit() else value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return VerifySpec(mode="steps", steps=value)
    raise PpsplitError(f"verify={value!r} is not known; allowed: full, off, or a number of steps N "
                       "(the unsplit reference runs only the first N)")
