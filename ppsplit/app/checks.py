"""The checks of a job that need more than one value, or the model: the schedule, the layout and
the launcher together, the model's config (its class, positions, heads, blocks), and the
checkpoint folders. All run before any folder, trace or process exists."""

from __future__ import annotations

import math
import os
from typing import Any

from dataclasses import dataclass

from ppsplit.config.schedules import ZERO_BUBBLE, RankPlan
from ppsplit.config.spec import JobSpec
from ppsplit.errors import PpsplitError


@dataclass
class Checked:
    """A job that passed every check made before tracing: its spec, the model's transformers
    config, and the model's structure on the meta device (built once, for every check that needs
    the model: the stage count, a checkpoint's keys, the parameter count of ``model.init=auto``)."""
    spec: JobSpec
    config: Any
    meta_model: Any


def check_run(spec: JobSpec) -> None:
    """The schedule, the layout and the launcher can run together (only where ranks run)."""
    if spec.launcher.requeue and not (spec.checkpoint.every and spec.checkpoint.dir):
        raise PpsplitError("launcher.requeue=true goes on from the step folders checkpoint.every writes; allowed: "
                           "checkpoint.every=N and checkpoint.dir=DIR with it")
    if spec.debug.defect and (not spec.distributed or spec.steps == 0):
        raise PpsplitError(f"debug.defect={spec.debug.defect}: the ranks inject it; allowed: launcher=local or "
                           "launcher=slurm with steps >= 1")
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
    check_local_gpus(spec.launcher.name, spec.world_size)
    debug = spec.debug
    if debug.crash_rank is not None and debug.crash_rank >= spec.world_size:
        raise PpsplitError(f"debug.crash_rank={debug.crash_rank}: allowed: 0 to {spec.world_size - 1} "
                           f"(this run has {spec.world_size} rank(s))")


def check_local_gpus(launcher: str, ranks: int, visible: int | None = None) -> None:
    """Local ranks on a machine with GPUs take one each (``cuda:{local_rank}``; NCCL refuses two
    ranks on one GPU): more ranks than visible GPUs is refused. ``visible``: the count (default:
    torch's)."""
    if launcher != "local":
        return
    if visible is None:
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible and ranks > visible:
        raise PpsplitError(f"launcher=local: this run needs {ranks} ranks, one GPU each, and {visible} GPU(s) are "
                           "visible; allowed: at most that many ranks (stages x parallel.dp x parallel.tp), or "
                           "launcher=slurm across nodes")


def validate(spec: JobSpec) -> Checked:
    """Everything that can be checked before the model is traced, in one pass: the values that
    need the model, the layout and the launcher, the checkpoint folders, the SLURM controller."""
    config, meta_model = check_model(spec)
    check_run(spec)
    _check_checkpoint_folders(spec)
    if spec.launcher.name == "slurm" and spec.steps > 0:
        from ppsplit.launch.slurm import check_slurm_controller

        check_slurm_controller(spec.launcher.partition, spec.launcher.nodes)
    return Checked(spec, config, meta_model)


def _check_checkpoint_folders(spec: JobSpec) -> None:
    """Refuse a folder a checkpoint must not be written into, or one that cannot be loaded."""
    ck = spec.checkpoint
    if ck.every is not None and ck.dir:
        from ppsplit.checkpoint import series

        series.check_folder(ck.dir, ck.auto)  # refuses a folder it must not write step folders into
        holder = series.Lock.holder(ck.dir)
        if holder:
            raise PpsplitError(f"checkpoint.dir={ck.dir!r} is in use by another run (pid {holder}); "
                               "allowed: another folder, or wait until that run ends")
    elif ck.save and ck.dir:
        from ppsplit.checkpoint.folder import Target

        Target(ck.dir, ck.overwrite)  # refuses a folder it must not touch
    if ck.auto:
        from ppsplit.checkpoint import series
        from ppsplit.checkpoint.folder import check_loadable

        newest = series.check_auto_resume(ck.dir, series.data_identity(spec))
        if newest:
            check_loadable(newest, spec.model.class_name)
    elif ck.load:
        from ppsplit.checkpoint.folder import check_loadable

        check_loadable(spec.checkpoint.load, spec.model.class_name)
        if spec.steps == 0:
            raise PpsplitError("checkpoint.load with steps=0: nothing to resume; allowed: steps >= 1")


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
    against its heads. Returns the transformers config and the model built from it on meta."""
    import torch

    from ppsplit.models import build

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
    if spec.peft.on:
        model = _check_adapters(spec, model)
    if spec.data.sft:
        _check_sft(spec, cls)
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
    if spec.data.real and m.inputs == "image_classification":
        raise PpsplitError(f"data={spec.data.name}: {m.class_name} takes images, and trains on data=synthetic only; "
                           "allowed: data=synthetic")
    if spec.data.real and spec.seq_lens:
        raise PpsplitError(f"seq_lens={list(spec.seq_lens)} with data={spec.data.name}: the corpus is packed into "
                           "blocks of seq_len; allowed: seq_lens=null")
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
        if spec.dropout and build.stochastic_settings(m.class_name, m.config, m.pretrained):
            raise PpsplitError(f"dropout=true with parallel.tp={spec.parallel.tp}: a tensor-parallel rank draws "
                               "dropout for its shard, which cannot match the unsplit model's masks; allowed: "
                               "dropout=false, or parallel.tp=1")
    return config, model


def _check_adapters(spec: JobSpec, model):
    """The adapters fit the model and the layout: they are made here on meta (a target that
    matches nothing is named now), and what cannot yet be checked against the unsplit model is
    refused."""
    from ppsplit.models.adapters import adapt

    p = spec.peft
    if p.dropout and spec.parallel.tp > 1:
        raise PpsplitError(f"peft.dropout={p.dropout:g} with parallel.tp={spec.parallel.tp}: a tensor-parallel rank "
                           "draws the adapters' dropout for its own part of their work, which cannot match the "
                           "unsplit model's masks; allowed: peft.dropout=0, or parallel.tp=1")
    return adapt(model, p, spec.seed)


def _check_sft(spec: JobSpec, cls) -> None:
    import inspect

    m = spec.model
    if m.inputs not in ("causal_lm", "seq2seq"):
        raise PpsplitError(f"data=sft with {m.class_name} ({m.inputs}): instruction data trains causal LMs and "
                           "encoder-decoders; allowed: model=gpt2, llama, qwen2_moe, t5, bart, or model=hf with such a "
                           "class")
    if m.inputs == "seq2seq":
        if spec.data.sft.packing:
            raise PpsplitError(f"data.packing=true with {m.class_name}: an encoder-decoder takes one example a row "
                               "(the prompt to the encoder, the completion to the decoder); allowed: data.packing=false")
        return
    if spec.data.sft.packing and "position_ids" not in inspect.signature(cls.forward).parameters:
        raise PpsplitError(f"data.packing=true: {m.class_name} takes no position_ids, so packed examples would see "
                           "each other; allowed: data.packing=false")


def _check_stage_count(spec: JobSpec, model) -> None:
    """More stages than blocks is refused here, before tracing; the traced count (blocks that
    run) is checked again by the split."""
    from ppsplit.stages.points import find_blocks

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
