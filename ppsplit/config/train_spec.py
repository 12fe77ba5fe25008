"""The training settings of a job, read and checked from the config: the data it trains on, the
optimizer step (schedule, accumulation, clipping, precision, recomputation), evaluation, the
metrics it writes, and how much of the run is checked against the unsplit model. No torch is
needed here."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ppsplit.config.values import boolean, choice, get, integer, number, text
from ppsplit.errors import PpsplitError

DATA_KINDS = ("synthetic", "text", "jsonl", "parquet", "sft")
LOSS_ON = ("answer", "all")
SAMPLE_BY = ("paragraph", "line", "document")
LR_SCHEDULES = ("constant", "linear", "cosine")
PRECISIONS = ("fp32", "bf16")
VERIFY = ("full", "off")
# bf16 computes each product to 8 bits of mantissa: its results are held to these rtols.
BF16_TOLERANCE, BF16_TIE_TOLERANCE = 2e-2, 5e-2


@dataclass(frozen=True)
class PeftSpec:
    """Adapters trained over a frozen model (:mod:`ppsplit.models.adapters`); ``name`` none: the
    whole model trains."""
    name: str
    r: int | None
    alpha: float | None
    dropout: float | None
    target_modules: tuple[str, ...] | str | None  # names, or one regex; None: peft's default for the class
    modules_to_save: tuple[str, ...] | None  # modules trained in full beside the adapters
    merge: bool  # checkpoint.hf also writes the model with the adapters folded in

    @property
    def on(self) -> bool:
        return self.name != "none"


PEFTS = ("none", "lora")


def peft_spec(cfg) -> PeftSpec:
    name = choice("peft", get(cfg, "peft.name"), PEFTS)
    if name == "none":
        return PeftSpec(name, None, None, None, None, None, False)
    targets = get(cfg, "peft.target_modules")
    if isinstance(targets, list):
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise PpsplitError(f"peft.target_modules={targets!r}: allowed: module names (a list), a regex, "
                               "all-linear, or null for peft's default")
        targets = tuple(targets)
    elif targets is not None:
        targets = text("peft.target_modules", targets)
    full = get(cfg, "peft.modules_to_save")
    if full is not None and (not isinstance(full, list) or not all(isinstance(t, str) and t for t in full)):
        raise PpsplitError(f"peft.modules_to_save={full!r}: allowed: a list of module names, or null")
    dropout = number("peft.dropout", get(cfg, "peft.dropout"))
    if dropout >= 1:
        raise PpsplitError(f"peft.dropout={dropout:g}: allowed: 0 to below 1")
    return PeftSpec(name, r=integer("peft.r", get(cfg, "peft.r"), 1),
                    alpha=number("peft.alpha", get(cfg, "peft.alpha"), 0.0, exclusive=True), dropout=dropout,
                    target_modules=targets, modules_to_save=tuple(full) if full else None,
                    merge=boolean("peft.merge", get(cfg, "peft.merge")))


@dataclass(frozen=True)
class SftSpec:
    """Instruction and chat records (:mod:`ppsplit.data.sft`)."""
    messages_field: str
    prompt_field: str
    completion_field: str
    loss_on: str  # answer: the assistant turns or the completion; all: every token
    packing: bool  # whole examples packed into rows (position ids restart); else one padded example a row
    truncate: bool  # an example longer than seq_len is cut; else refused


@dataclass(frozen=True)
class DataSpec:
    name: str
    path: tuple[str, ...]  # files or globs, as given
    field: str
    tokenizer: str | None
    val_fraction: float
    cache_dir: str | None
    sample_by: str | None  # text files: what one document is
    num_proc: int | None  # tokenizing processes (None: the cores this process may use)
    padded: bool  # synthetic: each row's labels end at a length of its own
    sft: SftSpec | None  # data=sft: how its records become examples and rows

    @property
    def real(self) -> bool:
        return self.name != "synthetic"


@dataclass(frozen=True)
class TrainSpec:
    lr_schedule: str
    warmup_steps: int
    min_lr_ratio: float
    grad_accumulation: int
    clip_grad_norm: float | None
    precision: str
    activation_checkpointing: str | None  # an FQN pattern, or "blocks"


@dataclass(frozen=True)
class EvalSpec:
    every: int  # validation every N optimizer steps (0: only at the end)
    batches: int  # held-out batches per evaluation (0: none)


@dataclass(frozen=True)
class MetricsSpec:
    csv: bool  # metrics.csv in the run folder, a row per step
    tensorboard: bool  # TensorBoard event files in the run folder's tensorboard/
    plot: bool  # loss.png at the end


@dataclass(frozen=True)
class VerifySpec:
    mode: str  # full: the unsplit reference runs every step; steps: the first N; off: none
    steps: int | None

    def reference_steps(self, steps: int) -> int:
        if self.mode == "off":
            return 0
        return min(steps, self.steps) if self.steps is not None else steps


def data_spec(cfg) -> DataSpec:
    name = choice("data", get(cfg, "data.name"), DATA_KINDS)
    padded = get(cfg, "data.padded")
    if name == "synthetic":
        return DataSpec(name=name, path=(), field=None, tokenizer=None, val_fraction=None, cache_dir=None,
                        sample_by=None, num_proc=None, padded=boolean("data.padded", padded), sft=None)
    if padded is not None:
        raise PpsplitError(f"data.padded={padded!r} with data={name}: only synthetic rows are padded; "
                           "allowed: data=synthetic")
    path = get(cfg, "data.path")
    if isinstance(path, str):
        path = [path]
    if not isinstance(path, list) or not path or not all(isinstance(p, str) and p for p in path):
        raise PpsplitError(f"data.path={path!r}: data={name} needs data.path: a file, a glob, or a list of them")
    fraction = number("data.val_fraction", get(cfg, "data.val_fraction"))
    if fraction >= 1:
        raise PpsplitError(f"data.val_fraction={fraction:g}: allowed: a fraction from 0 to below 1")
    cache = text("data.cache_dir", get(cfg, "data.cache_dir"))
    tokenizer = text("data.tokenizer", get(cfg, "data.tokenizer"))
    sft = _sft_spec(cfg) if name == "sft" else None
    processes = get(cfg, "data.num_proc")
    return DataSpec(name=name, path=tuple(path),
                    field=None if sft else text("data.field", get(cfg, "data.field"), optional=False),
                    tokenizer=os.path.abspath(os.path.expanduser(tokenizer)) if tokenizer else None,
                    val_fraction=fraction, cache_dir=os.path.abspath(os.path.expanduser(cache)) if cache else None,
                    sample_by=choice("data.sample_by", get(cfg, "data.sample_by"), SAMPLE_BY) if name == "text" else None,
                    num_proc=None if processes is None else integer("data.num_proc", processes, 1),
                    padded=False, sft=sft)


def _sft_spec(cfg) -> SftSpec:
    return SftSpec(messages_field=text("data.messages_field", get(cfg, "data.messages_field"), optional=False),
                   prompt_field=text("data.prompt_field", get(cfg, "data.prompt_field"), optional=False),
                   completion_field=text("data.completion_field", get(cfg, "data.completion_field"), optional=False),
                   loss_on=choice("data.loss_on", get(cfg, "data.loss_on"), LOSS_ON),
                   packing=boolean("data.packing", get(cfg, "data.packing")),
                   truncate=boolean("data.truncate", get(cfg, "data.truncate")))


def train_spec(cfg, steps: int) -> TrainSpec:
    key = "train.clip_grad_norm"
    clip = get(cfg, key)
    if clip is not None:
        clip = number(key, clip, exclusive=True)
    warmup = integer("train.warmup_steps", get(cfg, "train.warmup_steps"), 0)
    if steps and warmup > steps:
        raise PpsplitError(f"train.warmup_steps={warmup} is longer than the run (steps={steps}); "
                           f"allowed: 0 to {steps}")
    ratio = number("train.min_lr_ratio", get(cfg, "train.min_lr_ratio"))
    if ratio > 1:
        raise PpsplitError(f"train.min_lr_ratio={ratio:g}: allowed: 0 to 1")
    return TrainSpec(
        lr_schedule=choice("train.lr_schedule", get(cfg, "train.lr_schedule"), LR_SCHEDULES),
        warmup_steps=warmup, min_lr_ratio=ratio,
        grad_accumulation=integer("train.grad_accumulation", get(cfg, "train.grad_accumulation"), 1),
        clip_grad_norm=clip,
        precision=choice("train.precision", get(cfg, "train.precision"), PRECISIONS),
        activation_checkpointing=text("train.activation_checkpointing", get(cfg, "train.activation_checkpointing")),
    )


def eval_spec(cfg) -> EvalSpec:
    return EvalSpec(every=integer("eval.every", get(cfg, "eval.every"), 0),
                    batches=integer("eval.batches", get(cfg, "eval.batches"), 0))


def metrics_spec(cfg) -> MetricsSpec:
    return MetricsSpec(csv=boolean("metrics.csv", get(cfg, "metrics.csv")),
                       tensorboard=boolean("metrics.tensorboard", get(cfg, "metrics.tensorboard")),
                       plot=boolean("metrics.plot", get(cfg, "metrics.plot")))


def verify_spec(cfg) -> VerifySpec:
    value = get(cfg, "verify")
    if value in VERIFY:
        return VerifySpec(mode=value, steps=None)
    if isinstance(value, str) and value.startswith("steps="):
        value = value[len("steps="):]
        value = int(value) if value.isdigit() else value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return VerifySpec(mode="steps", steps=value)
    raise PpsplitError(f"verify={value!r} is not known; allowed: full, off, or a number of steps N "
                       "(the unsplit reference runs only the first N)")
