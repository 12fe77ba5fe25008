"""The composed config as one typed, validated job description.

Every value a user can set is checked here, once, before any work starts: the type, the range,
and the combinations that cannot run (a schedule torch would refuse at run time, a layout the
launcher cannot give, a sequence longer than the model's positions). A bad value is a
:class:`PpsplitError` whose one line names the key and what is allowed. The driver and every
rank then work from the same frozen :class:`JobSpec`, never from the raw config.

:func:`from_config` needs no torch; :func:`check_model` reads the model's transformers config.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from ppsplit.config.values import (boolean, choice, get, integer, mapping, number, opt_integer, plain,
                                    text)
from ppsplit.faults import DEFECTS, DRIVER_PHASES, PAUSE_MODES
from ppsplit.errors import PpsplitError
from ppsplit.config.schedules import SCHEDULES, RankPlan, plan_ranks
from ppsplit.config.tasks import class_from_pretrained, task_of
from ppsplit.config.values import TASKS
from ppsplit.config.train_spec import (BF16_TIE_TOLERANCE, BF16_TOLERANCE, DataSpec, EvalSpec, MetricsSpec, PeftSpec,
                                       TrainSpec, VerifySpec, data_spec, eval_spec, metrics_spec, peft_spec, train_spec,
                                       verify_spec)

STRATEGIES = ("even", "manual", "layers", "params", "flops")
LAUNCHERS = ("inline", "local", "slurm")
CRASH_MODES = ("raise", "exit", "hang", "base", "abort")
INITS = ("real", "meta", "auto")
# transformers' tensor-parallel styles that ppsplit applies (ppsplit.parallel.layout maps them to torch's).
TP_STYLES = ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise", "replicate")

AUTO = "auto"  # checkpoint.load=auto

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
    tp_plan: dict | None  # FQN pattern -> style; None: the model's own (transformers' tp_plan)


@dataclass(frozen=True)
class SplitSpec:
    strategy: str
    points: tuple[str, ...] | None
    layers: tuple[int, ...] | None
    first_stage_less: int
    last_stage_less: int


@dataclass(frozen=True)
class LauncherSpec:
    name: str
    cpus_per_task: int  # also each rank's torch thread count
    port: int | None  # the driver's rendezvous port; None: any free port
    partition: str | None
    time_min: int | None
    nodes: int
    tasks_per_node: int | None
    gpus_per_task: int | None
    additional_parameters: dict
    driver_host: str | None  # where SLURM ranks reach the driver; auto: see launch.slurm.driver_address; None: not SLURM
    requeue: bool  # a job SLURM signals (time limit, preemption) saves, and the run goes on in a new one
    max_requeue: int
    signal_delay_s: int | None  # SLURM signals the ranks this long before the time limit


FSDP_RESHARD = ("step", "microbatch")  # when FSDP reshards and reduce-scatters under a pipeline schedule
FSDP_PARAM_DTYPES = ("float32", "bfloat16")  # what FSDP gathers under train.precision=bf16


@dataclass(frozen=True)
class ParallelSpec:
    dp: int
    tp: int
    fsdp: bool
    fsdp_reshard: str  # step: torch's (one reduce-scatter a step); microbatch: a shard's memory
    fsdp_unit_mib: float | None  # None: one FSDP unit per block; else units of at most this many MiB
    fsdp_param_dtype: str  # bfloat16: FSDP gathers bf16 parameters (train.precision=bf16 only)

    @property
    def fsdp_unit_bytes(self) -> int | None:
        return None if self.fsdp_unit_mib is None else int(self.fsdp_unit_mib * 2**20)

    def record(self, pp: int) -> dict:
        """The layout as the report gives it: FSDP's settings where FSDP runs."""
        fsdp = self.fsdp and self.dp > 1
        out = {"pp": pp, "dp": self.dp, "tp": self.tp, "fsdp": fsdp}
        if fsdp:
            out.update(fsdp_reshard=self.fsdp_reshard, fsdp_unit_mib=self.fsdp_unit_mib,
                       fsdp_param_dtype=self.fsdp_param_dtype)
        return out


@dataclass(frozen=True)
class CheckpointSpec:
    save: bool
    dir: str | None  # absolute; None: checkpoint/ in the run folder
    overwrite: bool
    load: str | None  # a checkpoint folder, or "auto": the newest step folder under dir
    hf: bool
    every: int | None  # a step folder under dir every N steps (and at the end)
    keep: int | None  # the newest K step folders kept; None: all

    @property
    def auto(self) -> bool:
        return self.load == AUTO


@dataclass(frozen=True)
class DebugSpec:
    crash_rank: int | None
    crash_step: int | None
    crash_mode: str
    check_ties: bool
    return_state: bool
    pause_at: str | None  # a driver phase to wait in (see ppsplit.faults.pause)
    pause_mode: str
    defect: str | None  # a defect the ranks inject (see ppsplit.faults.DEFECTS)


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
    seq_lens: tuple[int, ...]  # per-step sequence lengths, cycled; () : every step at seq_len
    dropout: bool  # keep the model's dropout (masks aligned with the unsplit model's)
    data: DataSpec
    train: TrainSpec
    eval: EvalSpec
    metrics: MetricsSpec
    verify: VerifySpec
    peft: PeftSpec

    @property
    def plan(self) -> RankPlan:
        return plan_ranks(self.schedule, self.stages, self.stages_per_rank, self.microbatches)

    @property
    def world_size(self) -> int:
        return self.plan.ranks * self.parallel.dp * self.parallel.tp

    @property
    def draws_masks(self) -> bool:
        """Training draws dropout masks that both sides must draw alike: the model's own
        (``dropout=true``) or the adapters' (``peft.dropout`` above 0)."""
        return self.dropout or bool(self.peft.on and self.peft.dropout)

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

    def with_checkpoint(self, steps: int | None = None, **changes) -> "JobSpec":
        return replace(self, checkpoint=replace(self.checkpoint, **changes),
                       steps=self.steps if steps is None else steps)


# --- the whole config ------------------------------------------------------------------------

def from_config(cfg, overrides=None) -> JobSpec:
    """Turn a composed Hydra config into a :class:`JobSpec`, refusing every bad value.

    ``overrides``: the command line's overrides (``model.config.n_layer=6``), when known. With
    ``model.pretrained`` the model's config is that folder's ``config.json``, and of
    ``model.config`` only the fields given there apply (the model file's own fields describe the
    random-weights model)."""
    stages = integer("stages", get(cfg, "stages"), 1)
    microbatches = integer("microbatches", get(cfg, "microbatches"), 1)
    batch_size = integer("batch_size", get(cfg, "batch_size"), 1)
    seq_len = integer("seq_len", get(cfg, "seq_len"), 1)
    seq_lens = get(cfg, "seq_lens")
    if seq_lens is not None:
        if not isinstance(seq_lens, list) or not seq_lens:
            raise PpsplitError(f"seq_lens={seq_lens!r}: allowed: a list of sequence lengths, e.g. [32,64], or null")
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 2 for x in seq_lens):
            raise PpsplitError(f"seq_lens={list(seq_lens)}: allowed: integers >= 2, e.g. [32,64]")
        seq_lens = tuple(seq_lens)
        seq_len = seq_lens[0]  # the example the split is traced at
    seed = integer("seed", get(cfg, "seed"), 0)
    steps = integer("steps", get(cfg, "steps"), 0)
    train = train_spec(cfg, steps)
    bf16 = train.precision == "bf16"
    tolerance = get(cfg, "tolerance")
    tolerance = (BF16_TOLERANCE if bf16 else 1e-5) if tolerance is None else number("tolerance", tolerance)
    tie_tolerance = get(cfg, "tie_tolerance")
    adaptive = _optimizer_spec(cfg)["name"] in ADAPTIVE  # see ppsplit.stages.tolerance
    tie_tolerance = ((BF16_TIE_TOLERANCE if bf16 else ADAPTIVE_TIE_TOLERANCE if adaptive else 1e-4)
                     if tie_tolerance is None else number("tie_tolerance", tie_tolerance))
    timeout_s = number("timeout_s", get(cfg, "timeout_s"), exclusive=True)

    model = _model_spec(cfg, overrides)
    split = _split_spec(cfg)
    if split.strategy == "manual":
        stages = len(split.points) + 1
    elif split.strategy == "layers" and split.layers:
        stages = len(split.layers)

    schedule = choice("schedule", get(cfg, "schedule.name"), SCHEDULES)
    stages_per_rank = opt_integer("schedule.stages_per_rank", get(cfg, "schedule.stages_per_rank"), 1)
    launcher = _launcher_spec(cfg)
    optimizer = _optimizer_spec(cfg)
    parallel = ParallelSpec(
        dp=integer("parallel.dp", get(cfg, "parallel.dp"), 1),
        tp=integer("parallel.tp", get(cfg, "parallel.tp"), 1),
        fsdp=boolean("parallel.fsdp", get(cfg, "parallel.fsdp")),
        fsdp_reshard=choice("parallel.fsdp_reshard", get(cfg, "parallel.fsdp_reshard"), FSDP_RESHARD),
        fsdp_unit_mib=(None if get(cfg, "parallel.fsdp_unit_mib") is None
                       else number("parallel.fsdp_unit_mib", get(cfg, "parallel.fsdp_unit_mib"), 0.0, exclusive=True)),
        fsdp_param_dtype=choice("parallel.fsdp_param_dtype", get(cfg, "parallel.fsdp_param_dtype"),
                                FSDP_PARAM_DTYPES),
    )
    if parallel.fsdp_param_dtype == "bfloat16" and not bf16:
        raise PpsplitError(f"parallel.fsdp_param_dtype=bfloat16 with train.precision={train.precision}: "
                           "allowed: train.precision=bf16, or parallel.fsdp_param_dtype=float32")
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
                   tie_tolerance=tie_tolerance, timeout_s=timeout_s, seq_lens=seq_lens or (),
                   dropout=boolean("dropout", get(cfg, "dropout")), data=data_spec(cfg), train=train,
                   eval=eval_spec(cfg), metrics=metrics_spec(cfg), verify=verify_spec(cfg), peft=peft_spec(cfg))
    if spec.steps == 0 and checkpoint.save:
        raise PpsplitError("checkpoint.save=true with steps=0: nothing is trained; allowed: steps >= 1")
    if checkpoint.hf and not checkpoint.save:
        raise PpsplitError("checkpoint.hf=true needs checkpoint.save=true")
    if spec.peft.merge and not checkpoint.hf:
        raise PpsplitError("peft.merge=true writes the merged model beside the adapter folder; allowed: "
                           "checkpoint.save=true checkpoint.hf=true with it")
    return spec


def overridden_keys(overrides) -> set[str]:
    """The keys a list of Hydra overrides sets (``+a.b=1`` -> ``a.b``)."""
    keys = set()
    for item in overrides or ():
        key = str(item).split("=", 1)[0].lstrip("+~")
        keys.add(key)
    return keys


def _model_spec(cfg, overrides=None) -> ModelSpec:
    name = text("model.name", get(cfg, "model.name"), optional=False)
    class_name = text("model.model_class", get(cfg, "model.model_class"))
    config = mapping("model.config", get(cfg, "model.config"))
    pretrained = text("model.pretrained", get(cfg, "model.pretrained"))
    if pretrained is not None:
        pretrained = os.path.abspath(os.path.expanduser(pretrained))
        given = overridden_keys(overrides)
        config = {k: v for k, v in config.items() if f"model.config.{k}" in given}
    if class_name is None:
        if pretrained is None:
            raise PpsplitError(f"model={name} needs model.model_class (a transformers class, e.g. "
                               "model.model_class=Qwen2ForCausalLM) or model.pretrained=DIR")
        class_name = class_from_pretrained(pretrained)
    inputs = choice("model.inputs", get(cfg, "model.inputs") or "auto", ("auto",) + TASKS)
    loss = choice("model.loss", get(cfg, "model.loss") or "auto", ("auto",) + TASKS)
    inputs = task_of(class_name) if inputs == "auto" else inputs
    loss = task_of(class_name) if loss == "auto" else loss
    call_kwargs = get(cfg, "model.call_kwargs")
    if call_kwargs is None:  # tuples out; and no cache, which torch.export cannot carry
        call_kwargs = {"return_dict": False}
        if inputs in ("causal_lm", "seq2seq"):
            call_kwargs["use_cache"] = False
    tp_plan = get(cfg, "model.tp_plan")
    if tp_plan is not None:
        tp_plan = mapping("model.tp_plan", tp_plan)
        for pattern, style in tp_plan.items():
            choice(f"model.tp_plan.{pattern}", style, TP_STYLES)
    return ModelSpec(
        name=name,
        class_name=class_name,
        config=config,
        pretrained=pretrained,
        init=choice("model.init", get(cfg, "model.init") or "auto", INITS),
        inputs=inputs,
        loss=loss,
        call_kwargs=mapping("model.call_kwargs", call_kwargs),
        tp_plan=tp_plan,
    )


def _split_spec(cfg) -> SplitSpec:
    strategy = choice("split", get(cfg, "split.name"), STRATEGIES)
    if strategy == "manual":
        from omegaconf import OmegaConf

        node = OmegaConf.select(cfg, "split.points")
        if node is None or OmegaConf.is_missing(cfg.split, "points"):
            raise PpsplitError("split=manual needs split.points, e.g. 'split.points=[transformer.h.2]'")
        points = plain(node)
        if not isinstance(points, list) or not points or not all(isinstance(p, str) and p for p in points):
            raise PpsplitError(f"split.points={points!r}: must be a non-empty list of module FQNs, "
                               "e.g. [transformer.h.2]")
        return SplitSpec("manual", points=tuple(points), layers=None, first_stage_less=0, last_stage_less=0)
    if strategy == "layers":
        layers = get(cfg, "split.layers")
        if layers is not None:
            if not isinstance(layers, list) or not layers:
                raise PpsplitError(f"split.layers={layers!r}: must be a list of block counts, e.g. [3,4,4,3]")
            layers = tuple(integer("split.layers[]", x, 1) for x in layers)
        return SplitSpec("layers", points=None, layers=layers,
                         first_stage_less=integer("split.first_stage_less", get(cfg, "split.first_stage_less") or 0, 0),
                         last_stage_less=integer("split.last_stage_less", get(cfg, "split.last_stage_less") or 0, 0))
    # The other strategies take no points, counts or shares: 0 fewer blocks is the plain even share.
    return SplitSpec(strategy, points=None, layers=None, first_stage_less=0, last_stage_less=0)


def _launcher_spec(cfg) -> LauncherSpec:
    name = choice("launcher", get(cfg, "launcher.name"), LAUNCHERS)
    port = opt_integer("launcher.port", get(cfg, "launcher.port"), 1)
    if port is not None and port > 65535:
        raise PpsplitError(f"launcher.port={port}: allowed: 1 to 65535, or null for any free port")
    slurm = name == "slurm"  # the keys of SLURM's jobs are in conf/launcher/slurm.yaml alone
    return LauncherSpec(
        name=name,
        cpus_per_task=integer("launcher.cpus_per_task", get(cfg, "launcher.cpus_per_task"), 1),
        port=port,
        partition=text("launcher.partition", get(cfg, "launcher.partition")),
        time_min=opt_integer("launcher.time_min", get(cfg, "launcher.time_min"), 1),
        nodes=integer("launcher.nodes", get(cfg, "launcher.nodes"), 1) if slurm else 1,  # one machine
        tasks_per_node=opt_integer("launcher.tasks_per_node", get(cfg, "launcher.tasks_per_node"), 1),
        gpus_per_task=opt_integer("launcher.gpus_per_task", get(cfg, "launcher.gpus_per_task"), 0),
        additional_parameters=mapping("launcher.additional_parameters",
                                       get(cfg, "launcher.additional_parameters")),
        driver_host=(text("launcher.driver_host", get(cfg, "launcher.driver_host")) or AUTO) if slurm else None,
        requeue=boolean("launcher.requeue", get(cfg, "launcher.requeue")) if slurm else False,
        max_requeue=integer("launcher.max_requeue", get(cfg, "launcher.max_requeue"), 0) if slurm else 0,
        signal_delay_s=integer("launcher.signal_delay_s", get(cfg, "launcher.signal_delay_s"), 1) if slurm else None,
    )


# optimizer.name -> its class in torch.optim
OPTIMIZERS = {"sgd": "SGD", "adamw": "AdamW", "adam": "Adam"}
ADAPTIVE = ("adamw", "adam")  # they divide each gradient by its running size
ADAPTIVE_TIE_TOLERANCE = 1e-3


def _optimizer_spec(cfg) -> dict:
    spec = mapping("optimizer", get(cfg, "optimizer"))
    choice("optimizer", spec.get("name"), tuple(OPTIMIZERS))
    for key, value in spec.items():
        if key == "name":
            continue
        if key in ("lr", "weight_decay", "momentum", "eps", "dampening"):
            number(f"optimizer.{key}", value)
    return dict(spec)


def _checkpoint_spec(cfg) -> CheckpointSpec:
    directory = text("checkpoint.dir", get(cfg, "checkpoint.dir"))
    load = text("checkpoint.load", get(cfg, "checkpoint.load"))
    every = get(cfg, "checkpoint.every")
    keep = get(cfg, "checkpoint.keep")
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise PpsplitError(f"checkpoint.every={every!r}: allowed: a whole number of steps >= 1, or null "
                           "(one checkpoint, at the end)")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise PpsplitError(f"checkpoint.keep={keep!r}: allowed: a whole number >= 1 (the newest K step "
                           "folders kept), or null (all)")
    if keep is not None and every is None:
        raise PpsplitError(f"checkpoint.keep={keep} without checkpoint.every: there is one checkpoint only; "
                           "allowed: checkpoint.every=N with it")
    overwrite = boolean("checkpoint.overwrite", get(cfg, "checkpoint.overwrite"))
    if every is not None and overwrite:
        raise PpsplitError("checkpoint.overwrite=true with checkpoint.every: step folders are never replaced; "
                           "allowed: checkpoint.load=auto to go on from the newest, or a new checkpoint.dir")
    if load == AUTO and (every is None or not directory):
        raise PpsplitError("checkpoint.load=auto resumes from the step folders checkpoint.every writes under "
                           "checkpoint.dir; allowed: checkpoint.every=N and checkpoint.dir=DIR with it")
    return CheckpointSpec(
        save=every is not None or boolean("checkpoint.save", get(cfg, "checkpoint.save")),
        dir=os.path.abspath(os.path.expanduser(directory)) if directory else None,
        overwrite=overwrite,
        load=AUTO if load == AUTO else os.path.abspath(os.path.expanduser(load)) if load else None,
        hf=boolean("checkpoint.hf", get(cfg, "checkpoint.hf")),
        every=every, keep=keep,
    )


def _debug_spec(cfg) -> DebugSpec:
    return DebugSpec(
        crash_rank=opt_integer("debug.crash_rank", get(cfg, "debug.crash_rank"), 0),
        crash_step=opt_integer("debug.crash_step", get(cfg, "debug.crash_step"), 0),
        crash_mode=choice("debug.crash_mode", get(cfg, "debug.crash_mode"), CRASH_MODES),
        check_ties=boolean("debug.check_ties", get(cfg, "debug.check_ties")),
        return_state=boolean("debug.return_state", get(cfg, "debug.return_state")),
        pause_at=None if get(cfg, "debug.pause_at") is None else
        choice("debug.pause_at", get(cfg, "debug.pause_at"), DRIVER_PHASES),
        pause_mode=choice("debug.pause_mode", get(cfg, "debug.pause_mode"), PAUSE_MODES),
        defect=None if get(cfg, "debug.defect") is None else choice("debug.defect", get(cfg, "debug.defect"), DEFECTS),
    )


