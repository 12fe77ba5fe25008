"""The composed config as one typed, validated job description.

Every value a user can set is checked here, once, before any work starts: the type, the range,
and the combinations that cannot run (a schedule torch would refuse at run time, a layout the
launcher cannot give, a sequence longer than the model's positions). A bad value is a
:class:`PpsplitError` whose one line names the key and what is allowed. The driver and every
rank then work from the same frozen :class:`JobSpec`, never from the raw config.

:func:`from_config` needs no torch; :func:`check_model` reads the model's transformers config.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

from ppsplit.errors import PpsplitError, nearest

STRATEGIES = ("even", "manual", "layers", "params", "flops")
LAUNCHERS = ("inline", "local", "slurm")
CRASH_MODES = ("raise", "exit", "hang", "base")
INITS = ("real", "meta", "auto")
# What a model is trained on, from its task: the inputs ppsplit makes and the loss it takes
# (model.inputs and model.loss; "auto" reads the task from the class name).
TASKS = ("causal_lm", "masked_lm", "seq2seq", "image_classification")
# transformers' class-name endings for each task ("auto" reads the task from them).
TASK_SUFFIXES = (
    ("ForCausalLM", "causal_lm"),
    ("LMHeadModel", "causal_lm"),
    ("ForMaskedLM", "masked_lm"),
    ("ForConditionalGeneration", "seq2seq"),
    ("ForSeq2SeqLM", "seq2seq"),
    ("ForImageClassification", "image_classification"),
)
# transformers' tensor-parallel styles that ppsplit applies (ppsplit.layout maps them to torch's).
TP_STYLES = ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise", "replicate")

# Each schedule: its torch.distributed.pipelining class, and how stages map to ranks
# ("single": one stage per rank; "loop": rank r runs r, r+R, ...; "v": rank r runs r and 2R-1-r).
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", "single"),
    "1f1b": ("Schedule1F1B", "single"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop"),
    "looped_bfs": ("ScheduleLoopedBFS", "loop"),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", "loop"),
    "zbv": ("ScheduleZBVZeroBubble", "v"),
    "dualpipev": ("ScheduleDualPipeV", "v"),
}


ZERO_BUBBLE = ("interleaved_zb", "zbv", "dualpipev")  # backward split into input and weight parts


@dataclass(frozen=True)
class ModelSpec:
    name: str
    class_name: str
    config: dict
    pretrained: str | None
    init: str  # real | meta | auto
    inputs: str
    loss: str
    call_kwargs: dict
    tp_plan: dict | None = None  # FQN pattern -> style; None: the model's own (transformers' tp_plan)


@dataclass(frozen=True)
class SplitSpec:
    strategy: str
    points: tuple[str, ...] | None = None
    layers: tuple[int, ...] | None = None
    first_stage_less: int = 0
    last_stage_less: int = 0


@dataclass(frozen=True)
class LauncherSpec:
    name: str
    cpus_per_task: int = 1  # also each rank's torch thread count
    port: int | None = None  # the driver's rendezvous port; None: any free port
    partition: str | None = None
    time_min: int | None = None
    nodes: int = 1
    tasks_per_node: int | None = None
    gpus_per_task: int | None = None
    additional_parameters: dict = field(default_factory=dict)
    driver_host: str = "auto"  # where SLURM ranks reach the driver; auto: see dispatch.driver_address


@dataclass(frozen=True)
class ParallelSpec:
    dp: int = 1
    tp: int = 1
    fsdp: bool = True


@dataclass(frozen=True)
class CheckpointSpec:
    save: bool = False
    dir: str | None = None  # absolute; None: checkpoint/ in the run folder
    overwrite: bool = False
    load: str | None = None
    hf: bool = False


@dataclass(frozen=True)
class DebugSpec:
    crash_rank: int | None = None
    crash_step: int | None = None
    crash_mode: str = "raise"
    check_ties: bool = False
    return_state: bool = False


@dataclass(frozen=True)
class RankPlan:
    ranks: int  # pipeline ranks (one data- and tensor-parallel coordinate)
    stages_per_rank: int
    placement: str  # "single", "loop" or "v"


@dataclass(frozen=True)
class JobSpec:
    model: ModelSpec
    split: SplitSpec
    schedule: str
    stages_per_rank: int | None
    launcher: LauncherSpec
    optimizer: dict
    parallel: ParallelSpec
    checkpoint: CheckpointSpec
    debug: DebugSpec
    stages: int
    microbatches: int
    batch_size: int
    seq_len: int
    seed: int
    steps: int
    tolerance: float
    tie_tolerance: float
    timeout_s: float
    seq_lens: tuple[int, ...] = ()  # per-step sequence lengths, cycled; () : every step at seq_len

    @property
    def plan(self) -> RankPlan:
        return plan_ranks(self.schedule, self.stages, self.stages_per_rank, self.microbatches)

    @property
    def world_size(self) -> int:
        return self.plan.ranks * self.parallel.dp * self.parallel.tp

    @property
    def distributed(self) -> bool:
        return self.launcher.name != "inline"

    def seq_len_at(self, step: int) -> int:
        """The sequence length of step ``step`` (counted from 0)."""
        return self.seq_lens[step % len(self.seq_lens)] if self.seq_lens else self.seq_len

    @property
    def dynamic(self) -> dict[str, tuple[int, int]] | None:
        """The sizes the split must serve, when the steps' sequence lengths differ."""
        if len(set(self.seq_lens)) > 1:
            return {"seq": (min(self.seq_lens), max(self.seq_lens))}
        return None

    @property
    def local_batch_size(self) -> int:
        """The samples of one step that each data-parallel rank runs."""
        return self.batch_size // self.parallel.dp

    def _strategy_kwargs(self) -> dict:
        sp = self.split
        if sp.strategy == "manual":
            return {"points": list(sp.points)}
        if sp.strategy == "layers":
            return {"strategy": "layers", "layers": list(sp.layers) if sp.layers else None,
                    "stages": None if sp.layers else self.stages,
                    "first_stage_less": sp.first_stage_less, "last_stage_less": sp.last_stage_less}
        return {"strategy": sp.strategy, "stages": self.stages, "microbatches": self.microbatches}

    def split_kwargs(self) -> dict:
        """The keyword arguments of :func:`ppsplit.split` this job's split takes."""
        return {**self._strategy_kwargs(), **({"dynamic": self.dynamic} if self.dynamic else {})}

    def with_model(self, **changes) -> "JobSpec":
        return replace(self, model=replace(self.model, **changes))


# --- reading values --------------------------------------------------------------------------

def _plain(value):
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _get(cfg, key: str, default=None):
    from omegaconf import OmegaConf

    try:
        value = OmegaConf.select(cfg, key, default=default, throw_on_missing=True)
    except Exception as err:  # a missing mandatory value (???) or a broken interpolation
        raise PpsplitError(f"{key}: {str(err).splitlines()[0]}") from None
    return _plain(value)


def _int(key: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PpsplitError(f"{key}={value!r}: must be an integer{_range(minimum, maximum)}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise PpsplitError(f"{key}={value!r}: allowed: an integer{_range(minimum, maximum)}")
    return value


def _range(minimum, maximum) -> str:
    if minimum is not None and maximum is not None:
        return f" {minimum} to {maximum}"
    if minimum is not None:
        return f" >= {minimum}"
    return f" <= {maximum}" if maximum is not None else ""


def _opt_int(key: str, value, minimum: int | None = None) -> int | None:
    return None if value is None else _int(key, value, minimum)


def _number(key: str, value, minimum: float = 0.0, exclusive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PpsplitError(f"{key}={value!r}: must be a finite number {'>' if exclusive else '>='} {minimum:g}")
    if value < minimum or (exclusive and value == minimum):
        raise PpsplitError(f"{key}={value!r}: allowed: a number {'>' if exclusive else '>='} {minimum:g}")
    return float(value)


def _bool(key: str, value) -> bool:
    if not isinstance(value, bool):
        raise PpsplitError(f"{key}={value!r}: allowed: true or false")
    return value


def _choice(key: str, value, allowed) -> str:
    if value not in allowed:
        raise PpsplitError(f"{key}={value!r} is not known; allowed: {', '.join(allowed)}"
                           f"{nearest(str(value), allowed)}")
    return value


def _text(key: str, value, optional: bool = True) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise PpsplitError(f"{key}={value!r}: must be a non-empty string")
    return value


def _mapping(key: str, value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise PpsplitError(f"{key}={value!r}: must be a mapping, e.g. {{name: value}}")
    return value


# --- the whole config ------------------------------------------------------------------------

def from_config(cfg, overrides=None) -> JobSpec:
    """Turn a composed Hydra config into a :class:`JobSpec`, refusing every bad value.

    ``overrides``: the command line's overrides (``model.config.n_layer=6``), when known. With
    ``model.pretrained`` the model's config is that folder's ``config.json``, and of
    ``model.config`` only the fields given there apply (the model file's own fields describe the
    random-weights model)."""
    stages = _int("stages", _get(cfg, "stages"), 1)
    microbatches = _int("microbatches", _get(cfg, "microbatches"), 1)
    batch_size = _int("batch_size", _get(cfg, "batch_size"), 1)
    seq_len = _int("seq_len", _get(cfg, "seq_len"), 1)
    seq_lens = _get(cfg, "seq_lens")
    if seq_lens is not None:
        if not isinstance(seq_lens, list) or not seq_lens:
            raise PpsplitError(f"seq_lens={seq_lens!r}: allowed: a list of sequence lengths, e.g. [32,64], or null")
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 2 for x in seq_lens):
            raise PpsplitError(f"seq_lens={list(seq_lens)}: allowed: integers >= 2, e.g. [32,64]")
        seq_lens = tuple(seq_lens)
        seq_len = seq_lens[0]  # the example the split is traced at
    seed = _int("seed", _get(cfg, "seed"), 0)
    steps = _int("steps", _get(cfg, "steps"), 0)
    tolerance = _number("tolerance", _get(cfg, "tolerance"))
    tie_tolerance = _number("tie_tolerance", _get(cfg, "tie_tolerance"))
    timeout_s = _number("timeout_s", _get(cfg, "timeout_s"), exclusive=True)

    model = _model_spec(cfg, overrides)
    split = _split_spec(cfg)
    if split.strategy == "manual":
        stages = len(split.points) + 1
    elif split.strategy == "layers" and split.layers:
        stages = len(split.layers)

    schedule = _choice("schedule", _get(cfg, "schedule.name"), SCHEDULES)
    stages_per_rank = _opt_int("schedule.stages_per_rank", _get(cfg, "schedule.stages_per_rank"), 1)
    launcher = _launcher_spec(cfg)
    optimizer = _optimizer_spec(cfg)
    parallel = ParallelSpec(
        dp=_int("parallel.dp", _get(cfg, "parallel.dp", 1), 1),
        tp=_int("parallel.tp", _get(cfg, "parallel.tp", 1), 1),
        fsdp=_bool("parallel.fsdp", _get(cfg, "parallel.fsdp", True)),
    )
    checkpoint = _checkpoint_spec(cfg)
    debug = _debug_spec(cfg)

    per_step = microbatches * parallel.dp
    if batch_size % per_step:
        what = f"microbatches={microbatches}" + (f" x parallel.dp={parallel.dp}" if parallel.dp > 1 else "")
        raise PpsplitError(f"batch_size={batch_size} is not divisible by {what}; allowed: a batch_size "
                           f"that is a multiple of {per_step}")
    spec = JobSpec(model=model, split=split, schedule=schedule, stages_per_rank=stages_per_rank,
                   launcher=launcher, optimizer=optimizer, parallel=parallel, checkpoint=checkpoint,
                   debug=debug, stages=stages, microbatches=microbatches, batch_size=batch_size,
                   seq_len=seq_len, seed=seed, steps=steps, tolerance=tolerance,
                   tie_tolerance=tie_tolerance, timeout_s=timeout_s, seq_lens=seq_lens or ())
    if spec.steps == 0 and checkpoint.save:
        raise PpsplitError("checkpoint.save=true with steps=0: nothing is trained; allowed: steps >= 1")
    if checkpoint.hf and not checkpoint.save:
        raise PpsplitError("checkpoint.hf=true needs checkpoint.save=true")
    return spec


def check_run(spec: JobSpec) -> None:
    """The schedule, the layout and the launcher can run together (only where ranks run)."""
    if not spec.distributed or spec.steps == 0:
        par = spec.parallel
        if par.dp > 1 or par.tp > 1:
            raise PpsplitError(f"parallel.dp={par.dp} parallel.tp={par.tp} needs ranks; launcher=inline runs "
                               "one process and steps=0 runs none; allowed: launcher=local or launcher=slurm "
                               "with steps >= 1")
        return
    plan = spec.plan  # impossible schedules are refused here
    _check_layout(spec, plan)
    if spec.parallel.dp > 1 and spec.parallel.fsdp and spec.schedule in ZERO_BUBBLE:
        raise PpsplitError(
            f"schedule={spec.schedule} with parallel.fsdp=true: this schedule splits each backward in two "
            "(zero bubble), and under FSDP2 its weight gradients come out wrong in torch 2.13 (measured "
            "5e-2 to 9e-2 from the unsplit model); allowed: parallel.fsdp=false (replicated data parallel), "
            "or gpipe, 1f1b, interleaved_1f1b or looped_bfs")
    debug = spec.debug
    if debug.crash_rank is not None and debug.crash_rank >= spec.world_size:
        raise PpsplitError(f"debug.crash_rank={debug.crash_rank}: allowed: 0 to {spec.world_size - 1} "
                           f"(this run has {spec.world_size} rank(s))")


def validate(spec: JobSpec):
    """Everything that can be checked before the model is traced; returns the model's config."""
    config = check_model(spec)
    check_run(spec)
    if spec.checkpoint.save and spec.checkpoint.dir:
        from ppsplit.checkpoint import Target

        Target(spec.checkpoint.dir, spec.checkpoint.overwrite)  # refuses a folder it must not touch
    if spec.checkpoint.load:
        from ppsplit.checkpoint import check_loadable

        check_loadable(spec.checkpoint.load, spec.model.class_name)
        if spec.steps == 0:
            raise PpsplitError("checkpoint.load with steps=0: nothing to resume; allowed: steps >= 1")
    return config


def overridden_keys(overrides) -> set[str]:
    """The keys a list of Hydra overrides sets (``+a.b=1`` -> ``a.b``)."""
    keys = set()
    for item in overrides or ():
        key = str(item).split("=", 1)[0].lstrip("+~")
        keys.add(key)
    return keys


def task_of(class_name: str) -> str:
    """The task a transformers model class is trained for, from its name's ending."""
    for suffix, task in TASK_SUFFIXES:
        if class_name.endswith(suffix) and len(class_name) > len(suffix):
            return task
    from ppsplit import build  # a name that is not a model class at all is told so, with the nearest

    build.model_class(class_name)
    endings = ", ".join(f"*{suffix}" for suffix, _ in TASK_SUFFIXES)
    raise PpsplitError(f"model.model_class={class_name!r} has no task ppsplit can train; allowed: a "
                       f"transformers class named {endings} (or set model.inputs and model.loss)")


def class_from_pretrained(folder: str) -> str:
    """The model class named by ``architectures`` in ``folder``'s config.json."""
    import json

    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            names = json.load(f).get("architectures") or []
    except (OSError, ValueError, AttributeError) as err:
        raise PpsplitError(f"model.pretrained={folder!r}: its config.json cannot be read "
                           f"({type(err).__name__}); give model.model_class") from None
    if not names or not isinstance(names[0], str):
        raise PpsplitError(f"model.pretrained={folder!r}: config.json names no architectures; "
                           "give model.model_class")
    return names[0]


def _model_spec(cfg, overrides=None) -> ModelSpec:
    name = _text("model.name", _get(cfg, "model.name"), optional=False)
    class_name = _text("model.model_class", _get(cfg, "model.model_class"))
    config = _mapping("model.config", _get(cfg, "model.config"))
    pretrained = _text("model.pretrained", _get(cfg, "model.pretrained"))
    if pretrained is not None:
        pretrained = os.path.abspath(os.path.expanduser(pretrained))
        given = overridden_keys(overrides)
        config = {k: v for k, v in config.items() if f"model.config.{k}" in given}
    if class_name is None:
        if pretrained is None:
            raise PpsplitError(f"model={name} needs model.model_class (a transformers class, e.g. "
                               "model.model_class=Qwen2ForCausalLM) or model.pretrained=DIR")
        class_name = class_from_pretrained(pretrained)
    inputs = _choice("model.inputs", _get(cfg, "model.inputs", "auto") or "auto", ("auto",) + TASKS)
    loss = _choice("model.loss", _get(cfg, "model.loss", "auto") or "auto", ("auto",) + TASKS)
    inputs = task_of(class_name) if inputs == "auto" else inputs
    loss = task_of(class_name) if loss == "auto" else loss
    call_kwargs = _get(cfg, "model.call_kwargs")
    if call_kwargs is None:  # tuples out; and no cache, which torch.export cannot carry
        call_kwargs = {"return_dict": False}
        if inputs in ("causal_lm", "seq2seq"):
            call_kwargs["use_cache"] = False
    tp_plan = _get(cfg, "model.tp_plan")
    if tp_plan is not None:
        tp_plan = _mapping("model.tp_plan", tp_plan)
        for pattern, style in tp_plan.items():
            _choice(f"model.tp_plan.{pattern}", style, TP_STYLES)
    return ModelSpec(
        name=name,
        class_name=class_name,
        config=config,
        pretrained=pretrained,
        init=_choice("model.init", _get(cfg, "model.init", "auto") or "auto", INITS),
        inputs=inputs,
        loss=loss,
        call_kwargs=_mapping("model.call_kwargs", call_kwargs),
        tp_plan=tp_plan,
    )


def _split_spec(cfg) -> SplitSpec:
    strategy = _choice("split", _get(cfg, "split.name"), STRATEGIES)
    if strategy == "manual":
        from omegaconf import OmegaConf

        node = OmegaConf.select(cfg, "split.points")
        if node is None or OmegaConf.is_missing(cfg.split, "points"):
            raise PpsplitError("split=manual needs split.points, e.g. 'split.points=[transformer.h.2]'")
        points = _plain(node)
        if not isinstance(points, list) or not points or not all(isinstance(p, str) and p for p in points):
            raise PpsplitError(f"split.points={points!r}: must be a non-empty list of module FQNs, "
                               "e.g. [transformer.h.2]")
        return SplitSpec("manual", points=tuple(points))
    if strategy == "layers":
        layers = _get(cfg, "split.layers")
        if layers is not None:
            if not isinstance(layers, list) or not layers:
                raise PpsplitError(f"split.layers={layers!r}: must be a list of block counts, e.g. [3,4,4,3]")
            layers = tuple(_int("split.layers[]", x, 1) for x in layers)
        return SplitSpec("layers", layers=layers,
                         first_stage_less=_int("split.first_stage_less", _get(cfg, "split.first_stage_less", 0) or 0, 0),
                         last_stage_less=_int("split.last_stage_less", _get(cfg, "split.last_stage_less", 0) or 0, 0))
    return SplitSpec(strategy)


def _launcher_spec(cfg) -> LauncherSpec:
    name = _choice("launcher", _get(cfg, "launcher.name"), LAUNCHERS)
    port = _opt_int("launcher.port", _get(cfg, "launcher.port"), 1)
    if port is not None and port > 65535:
        raise PpsplitError(f"launcher.port={port}: allowed: 1 to 65535, or null for any free port")
    return LauncherSpec(
        name=name,
        cpus_per_task=_int("launcher.cpus_per_task", _get(cfg, "launcher.cpus_per_task", 1), 1),
        port=port,
        partition=_text("launcher.partition", _get(cfg, "launcher.partition")),
        time_min=_opt_int("launcher.time_min", _get(cfg, "launcher.time_min"), 1),
        nodes=_int("launcher.nodes", _get(cfg, "launcher.nodes", 1), 1),
        tasks_per_node=_opt_int("launcher.tasks_per_node", _get(cfg, "launcher.tasks_per_node"), 1),
        gpus_per_task=_opt_int("launcher.gpus_per_task", _get(cfg, "launcher.gpus_per_task"), 0),
        additional_parameters=_mapping("launcher.additional_parameters",
                                       _get(cfg, "launcher.additional_parameters")),
        driver_host=_text("launcher.driver_host", _get(cfg, "launcher.driver_host", "auto")) or "auto",
    )


OPTIMIZERS = ("sgd", "adamw", "adam")


def _optimizer_spec(cfg) -> dict:
    spec = _mapping("optimizer", _get(cfg, "optimizer"))
    _choice("optimizer", spec.get("name"), OPTIMIZERS)
    for key, value in spec.items():
        if key == "name":
            continue
        if key in ("lr", "weight_decay", "momentum", "eps", "dampening"):
            _number(f"optimizer.{key}", value)
    return dict(spec)


def _checkpoint_spec(cfg) -> CheckpointSpec:
    directory = _text("checkpoint.dir", _get(cfg, "checkpoint.dir"))
    load = _text("checkpoint.load", _get(cfg, "checkpoint.load"))
    return CheckpointSpec(
        save=_bool("checkpoint.save", _get(cfg, "checkpoint.save", False)),
        dir=os.path.abspath(os.path.expanduser(directory)) if directory else None,
        overwrite=_bool("checkpoint.overwrite", _get(cfg, "checkpoint.overwrite", False)),
        load=os.path.abspath(os.path.expanduser(load)) if load else None,
        hf=_bool("checkpoint.hf", _get(cfg, "checkpoint.hf", False)),
    )


def _debug_spec(cfg) -> DebugSpec:
    return DebugSpec(
        crash_rank=_opt_int("debug.crash_rank", _get(cfg, "debug.crash_rank"), 0),
        crash_step=_opt_int("debug.crash_step", _get(cfg, "debug.crash_step"), 0),
        crash_mode=_choice("debug.crash_mode", _get(cfg, "debug.crash_mode", "raise"), CRASH_MODES),
        check_ties=_bool("debug.check_ties", _get(cfg, "debug.check_ties", False)),
        return_state=_bool("debug.return_state", _get(cfg, "debug.return_state", False)),
    )


def plan_ranks(schedule: str, stages: int, stages_per_rank: int | None, microbatches: int) -> RankPlan:
    """Map stages to pipeline ranks for ``schedule``, refusing combinations it cannot run (the
    rules torch's schedules check only once the ranks have started)."""
    _choice("schedule", schedule, SCHEDULES)
    placement = SCHEDULES[schedule][1]
    if placement == "single":
        if stages_per_rank not in (None, 1):
            raise PpsplitError(
                f"schedule={schedule} runs one stage per rank, not schedule.stages_per_rank={stages_per_rank}; "
                "use interleaved_1f1b, looped_bfs, interleaved_zb, zbv or dualpipev for more"
            )
        per_rank = 1
    else:
        per_rank = 2 if stages_per_rank is None else stages_per_rank
        if placement == "v" and per_rank != 2:
            raise PpsplitError(
                f"schedule={schedule} needs exactly 2 stages per rank (V placement), "
                f"not schedule.stages_per_rank={per_rank}"
            )
        if stages % per_rank:
            raise PpsplitError(
                f"stages={stages} is not divisible by schedule.stages_per_rank={per_rank}; "
                f"allowed: a multiple of {per_rank}"
            )
    ranks = stages // per_rank
    if placement != "single" and microbatches < ranks:
        raise PpsplitError(
            f"microbatches={microbatches}: schedule={schedule} needs microbatches >= ranks ({ranks})"
        )
    if schedule in ("1f1b", "dualpipev") and microbatches < stages and ranks > 1:
        raise PpsplitError(
            f"microbatches={microbatches}: schedule={schedule} needs microbatches >= stages ({stages})"
        )
    if schedule in ("interleaved_1f1b", "interleaved_zb"):
        rounds = max(1, microbatches // ranks)
        if microbatches % rounds:
            raise PpsplitError(
                f"microbatches={microbatches}: schedule={schedule} needs a multiple of "
                f"max(1, microbatches // ranks) = {rounds}; allowed e.g. {ranks * rounds} or {ranks * (rounds + 1)}"
            )
    return RankPlan(ranks, per_rank, placement)


def _check_layout(spec: JobSpec, plan: RankPlan) -> None:
    """The launcher can give the ranks this layout needs."""
    launcher, par = spec.launcher, spec.parallel
    world = plan.ranks * par.dp * par.tp
    if launcher.name == "slurm":
        per_node = launcher.tasks_per_node or math.ceil(world / launcher.nodes)
        if launcher.nodes * per_node != world:
            raise PpsplitError(
                f"launcher.nodes={launcher.nodes} x launcher.tasks_per_node={per_node} gives "
                f"{launcher.nodes * per_node} ranks; this run needs {world} "
                f"({plan.ranks} pipeline x {par.dp} data x {par.tp} tensor parallel)")
    if launcher.name == "local":
        limit = max(64, 8 * (os.cpu_count() or 1))
        if world > limit:
            raise PpsplitError(f"{world} ranks on this machine ({plan.ranks} pipeline x {par.dp} data x "
                               f"{par.tp} tensor parallel): allowed at most {limit} local ranks; "
                               "use launcher=slurm")


# --- values that need the model's config -----------------------------------------------------

def check_model(spec: JobSpec) -> Any:
    """Check the values that depend on the model: its class, its config (or the config.json of
    ``model.pretrained``), the sequence length against its positions, the tensor-parallel degree
    against its heads. Returns the transformers config."""
    import torch

    from ppsplit import build

    m = spec.model
    cls = build.model_class(m.class_name)
    if m.pretrained:
        build.check_pretrained_folder(m.pretrained)
    config = build.load_config(cls, m.config, m.pretrained)
    try:
        with torch.device("meta"):
            model = cls(config)  # the model's own checks of its config (heads that divide the width...)
    except Exception as err:
        raise PpsplitError(f"model.config: {m.class_name} refuses it: {build._first_line(err)}") from None
    _check_stage_count(spec, model)
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and max(spec.seq_lens or (spec.seq_len,)) > positions:
        key = f"seq_lens={list(spec.seq_lens)}" if spec.seq_lens else f"seq_len={spec.seq_len}"
        raise PpsplitError(
            f"{key} is beyond the model's max_position_embeddings={positions}; "
            f"allowed: {2 if spec.seq_lens else 1} to {positions} (or raise the model's positions)")
    if spec.dynamic and m.inputs == "image_classification":
        raise PpsplitError(f"seq_lens={list(spec.seq_lens)}: {m.class_name} takes images, which have no "
                           "sequence length; allowed: null")
    if spec.dynamic and spec.parallel.tp > 1:
        raise PpsplitError(f"seq_lens={list(spec.seq_lens)} with parallel.tp={spec.parallel.tp}: tensor "
                           "parallelism rewrites the traced view sizes, which are fixed; allowed: "
                           "parallel.tp=1 with seq_lens, or one sequence length")
    if m.inputs == "seq2seq" and not getattr(config, "is_encoder_decoder", False):
        raise PpsplitError(f"model.model_class={m.class_name!r} is not an encoder-decoder, so it cannot "
                           "take model.inputs=seq2seq; allowed: causal_lm, masked_lm or image_classification")
    if m.inputs == "image_classification":
        for key in ("image_size", "num_channels", "num_labels"):
            value = getattr(config, key, None)
            value = value[0] if isinstance(value, (list, tuple)) and value else value
            if not isinstance(value, int) or value < 1:
                raise PpsplitError(f"model.config.{key}={value!r}: image classification needs it; "
                                   "allowed: a positive integer")
    else:
        vocab = getattr(config, "vocab_size", None)
        if not isinstance(vocab, int) or vocab < 2:
            raise PpsplitError(f"model.config.vocab_size={vocab!r}: allowed: an integer >= 2")
    if spec.parallel.tp > 1:
        _check_heads(config, spec.parallel.tp)
    return config


def _check_stage_count(spec: JobSpec, model) -> None:
    """More stages than blocks is refused here, before tracing; the traced count (blocks that
    run) is checked again by the split."""
    from ppsplit.trace_split import find_blocks

    if spec.split.strategy in ("manual",) or spec.split.layers:
        return
    blocks = len(find_blocks(model))
    if blocks and spec.stages > blocks:
        raise PpsplitError(f"stages={spec.stages}: more stages than the model's {blocks} blocks; "
                           f"allowed: 1 to {blocks}")
    if spec.split.strategy == "layers" and blocks:
        share = blocks // spec.stages
        for key in ("first_stage_less", "last_stage_less"):
            less = getattr(spec.split, key)
            if less and less >= share:
                raise PpsplitError(f"split.{key}={less}: the even share is {share} block(s) per stage "
                                   f"({blocks} blocks, {spec.stages} stages); allowed: 0 to {max(share - 1, 0)}")


def _check_heads(config, tp: int) -> None:
    for attr in ("num_attention_heads", "num_key_value_heads", "num_heads", "n_head"):
        heads = getattr(config, attr, None)
        if isinstance(heads, int) and heads % tp:
            raise PpsplitError(f"parallel.tp={tp} does not divide the model's {attr}={heads}; "
                               f"allowed: a divisor of {heads}")
