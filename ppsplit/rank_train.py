"""What one rank does: rebuild the split, keep and lay out its stages, and train them under a
pipeline schedule from ``torch.distributed.pipelining``, one optimizer step at a time exactly
as the unsplit reference does (:mod:`ppsplit.training`), evaluating on held-out batches through
the forward-only schedule, reporting each step to the driver and saving checkpoints."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ppsplit import build
from ppsplit.checkpoint_series import staging_path
from ppsplit.debug import inject_crash, perturb_one_weight, repeat_first_microbatch
from ppsplit.job_spec import JobSpec
from ppsplit.stage_state import (average_grads, first_non_finite, full_tensors, gathered_state,
                                 local_bytes, median_after_first, peak_rss_bytes, separate_local_copies)
from ppsplit.schedules import SCHEDULES, stages_of_rank
from ppsplit.ties import TieSync
from ppsplit.timeline import Recorder
from ppsplit.trace_split import split as split_model
from ppsplit.objective import WeightedLoss
from ppsplit.training import (Stepper, apply_activation_checkpointing, checkpoint_pattern, counted_once,
                              eval_indices, precision_context, step_batches)


@dataclass
class RankStages:
    """This rank's stages, laid out, and what it needs to know of the whole split."""
    split: object
    modules: dict  # stage index -> module
    mine: list[int]
    layout: object
    coords: tuple[int, int, int]  # (pp, dp, tp)
    mesh: object
    flows: list | None
    config: object
    fqn_problems: list[str]
    rss_growth: int

    @property
    def keeper(self) -> bool:
        """The rank of its stages that sends their whole tensors (dp 0, tp 0)."""
        return self.coords[1] == 0 and self.coords[2] == 0


def build_stages(spec: JobSpec, launch: dict, rank: int, device, channel, source_of) -> RankStages:
    """This rank's stages, laid out and holding only what the rank holds.

    The model is built and traced without weights (:func:`ppsplit.materialize.trace_device`); the rank keeps its stages,
    lays them out (tensor parallel, FSDP2) on meta, and only then gives them storage, each tensor
    its local part alone, filled with the unsplit model's values one block at a time
    (:mod:`ppsplit.materialize`): a rank's memory follows its stage and its shard."""
    from ppsplit import layout as lay
    from ppsplit.materialize import materialize_stages, stand_ins, to_meta, trace_device

    m, plan = spec.model, spec.plan
    layout = lay.Layout(plan.ranks, spec.parallel.dp, spec.parallel.tp, spec.parallel.fsdp)
    pp_rank, dp_rank, tp_rank = layout.coords(rank)
    mesh = lay.device_mesh(layout, device.type) if layout.world > plan.ranks else None
    channel.report("building the model")
    model = build.build_on_meta(m.class_name, m.config, m.pretrained, spec.dropout)
    channel.report("tracing and splitting")
    example = source_of(model.config).batch(0).shard(dp_rank, layout.dp).microbatches(spec.microbatches)[0]
    on = trace_device(device)
    stand_ins(model, on)
    example = example.to(on)
    split = split_model(model, example.args, example.kwargs, **spec.split_kwargs())
    mine = stages_of_rank(pp_rank, plan.ranks, plan.stages_per_rank, plan.placement)
    modules = {i: split.stages[i] for i in mine}
    to_meta(model, *modules.values())
    rss_before = peak_rss_bytes()
    channel.report("building this rank's stages")
    flows = lay.tp_flows(split, model, m.tp_plan, layout.tp) if layout.tp > 1 else None
    separate_local_copies(modules)
    split.stages = [modules.get(i) for i in range(len(split.stages))]  # drop the other ranks' stages
    pattern = checkpoint_pattern(spec.train.activation_checkpointing, split.blocks)
    for i in mine:  # before FSDP wraps the blocks, as torchtitan orders them
        apply_activation_checkpointing(modules[i], pattern)
    if mesh is not None:
        channel.report("laying out the stages")
        for i in mine:
            lay.parallelize(split, i, model, mesh, m.tp_plan, layout.fsdp, flows,
                            bf16=spec.parallel.fsdp_param_dtype == "bfloat16",
                            fsdp_unit_bytes=spec.parallel.fsdp_unit_bytes)
    channel.report("materialising this rank's stages")
    materialize_stages(model, split, mine, spec.seed, m.pretrained, device, stages=modules)
    config = model.config
    del model
    problems = [f"stage {i}: {sorted(set(modules[i].state_dict()) ^ set(split.stage_keys[i]))[:4]}"
                for i in mine if set(modules[i].state_dict()) != set(split.stage_keys[i])]
    for module in modules.values():
        # Stage outputs go over the wire: gloo sends only contiguous tensors (T5's and BERT's
        # masks are expanded views), and in the traced dtype (float32 under bf16 autocast). A
        # hook keeps the stage's FQNs untouched.
        module.register_forward_hook(_wire_outputs)
    return RankStages(split, modules, mine, layout, (pp_rank, dp_rank, tp_rank), mesh, flows, config, problems,
                      peak_rss_bytes() - rss_before)


def _wire_outputs(module, args, output):
    def wire(t):
        if not isinstance(t, torch.Tensor):
            return t
        if t.dtype == torch.bfloat16:
            t = t.float()
        return t.contiguous()

    return tuple(wire(t) for t in output) if isinstance(output, tuple) else wire(output)


def make_schedules(spec: JobSpec, r: RankStages, device, loss_fn, recorder=None) -> dict:
    """This rank's stages under the schedule, one per sequence length: PipelineStage fixes its
    send and receive buffers, so each length gets its own (over the same modules). ``loss_fn``
    (a :class:`ppsplit.objective.WeightedLoss`) weighs each microbatch itself: the schedules do
    not divide the gradients by the microbatch count (which would also divide what earlier
    accumulated batches left in them)."""
    from torch.distributed import pipelining

    plan, n_stages = spec.plan, len(r.split.stages)
    pp_group = r.mesh["pp"].get_group() if r.mesh is not None else None
    schedule_cls = getattr(pipelining, SCHEDULES[spec.schedule][0])

    def schedule_for(sizes):
        pipe_stages = []
        for i in r.mine:
            ins, outs = r.split.stage_io_meta(i, sizes, tp=r.layout.tp)  # a shard where a value crosses sharded
            pipe_stages.append(pipelining.PipelineStage(
                r.modules[i], i, n_stages, device, input_args=ins, output_args=outs[0] if len(outs) == 1 else outs,
                group=pp_group))
            if spec.parallel.fsdp_reshard == "microbatch" and r.layout.fsdp and r.layout.dp > 1:
                from ppsplit.layout import reshard_every_microbatch

                reshard_every_microbatch(pipe_stages[-1])
            if recorder is not None:
                recorder.wrap(pipe_stages[-1], i)
        return schedule_cls(pipe_stages if len(pipe_stages) > 1 or plan.placement != "single" else pipe_stages[0],
                            n_microbatches=spec.microbatches, loss_fn=loss_fn, scale_grads=False)

    return {length: schedule_for({"seq": length} if spec.dynamic else None)
            for length in dict.fromkeys(spec.seq_lens or (spec.seq_len,))}


def train_rank(spec: JobSpec, launch: dict, rank: int, world: int, device: torch.device, channel) -> dict:
    from ppsplit import checkpoint as ckpt
    from ppsplit.data import BatchSource
    from ppsplit.optim import make_lr_schedule, make_optimizer, step_sums

    m, plan = spec.model, spec.plan

    def source_of(config):
        return BatchSource(spec, config, launch.get("data_file"), launch.get("first_sample", 0))

    r = build_stages(spec, launch, rank, device, channel, source_of)
    split, modules, mine = r.split, r.modules, r.mine
    pp_rank, dp_rank, _ = r.coords
    n_stages, layout = len(split.stages), r.layout
    objective = build.loss_fn(m.loss)
    pieces = spec.microbatches * spec.train.grad_accumulation if spec.debug.defect == "mean_of_means" else None
    loss_fn = WeightedLoss(objective, pieces)
    recorder = Recorder(rank, pp_rank, r.keeper)
    schedules = make_schedules(spec, r, device, loss_fn, recorder)
    if rank == 0:  # every pipeline rank's action lists, the same on each: one copy is enough
        recorder.keep_order(next(iter(schedules.values())), n_stages, spec.microbatches)
    rank_of_stage = {i: p for p in range(plan.ranks)
                     for i in stages_of_rank(p, plan.ranks, plan.stages_per_rank, plan.placement)}
    channel.report("synchronising tied weights")
    ties = TieSync(split.tie_groups, split.stage_keys, modules, rank_of_stage, rank, layout)
    optimizers = {i: make_optimizer(spec.optimizer, modules[i].named_parameters()) for i in mine}
    start_step = 0
    if launch.get("load_dir"):
        channel.report("loading the checkpoint")
        start_step = ckpt.load(launch["load_dir"], modules, optimizers, split.tie_groups)
    lr_schedules = [make_lr_schedule(o, spec.train, start_step + spec.steps, start_step) for o in optimizers.values()]
    replicas = r.mesh["dp"].get_group() if r.mesh is not None and layout.dp > 1 and not layout.fsdp else None
    debug = spec.debug
    tied_keys = {k for g in split.tie_groups for k in g}
    if debug.defect == "perturbed_weight" and 0 in mine:
        perturb_one_weight(modules[0], tied_keys)
    masks = None
    if spec.dropout:
        from ppsplit.dropout import MaskSeeds

        masks = MaskSeeds(spec.seed, first_microbatch=dp_rank * spec.microbatches)
        masks.on_stages(modules)
    source = source_of(r.config)
    owner = counted_once(split.tie_groups, split.stage_keys)
    norm_params = [(k, p) for i in mine for k, p in modules[i].named_parameters() if owner.get(k, i) == i]

    def run_batch(schedule, batch) -> float | None:
        args = split.flat_inputs(batch.args, batch.kwargs) if 0 in mine else ()
        kwargs, mb_losses = {}, []
        if n_stages - 1 in mine:
            kwargs = {"target": batch.labels.to(device), "losses": mb_losses}
        with precision_context(spec.train.precision, device.type):
            schedule.step(*(a.to(device) for a in args), **kwargs)
        if not mb_losses:
            return None
        return torch.stack([x.detach().float() for x in mb_losses]).sum().item()

    def forward_backward(batch, weight: float) -> float | None:
        # Each rank draws the whole global batch (its count is the step's) and runs its share.
        # Replicas average their gradients, so each weighs its items dp times: the average is
        # the sum, and so is the driver's mean of the ranks' losses.
        loss_fn.weight = weight * layout.dp
        batch = batch.shard(dp_rank, layout.dp)
        if debug.defect == "repeated_microbatch":
            batch = repeat_first_microbatch(batch, spec.microbatches)
        return run_batch(schedules[seq_len[0]], batch)

    seq_len = [spec.seq_len]  # the running step's

    def batches_of(k: int) -> list:
        seq_len[0] = spec.seq_len_at(start_step + k)
        return step_batches(source, spec, start_step, k)

    def sync() -> None:
        recorder.optimizer_begin()  # from here: the gradients synchronised, clipped, applied
        if replicas is not None:
            average_grads(modules, replicas, layout.dp)
        if debug.defect == "dropped_stage_grad" and n_stages - 1 in mine:
            modules[n_stages - 1].zero_grad(set_to_none=False)
        if debug.defect != "unsynced_tie":
            ties.sum_grads()

    series = launch.get("series")  # checkpoint.every: a step folder each N steps
    agreed = {"norm": 0.0, "bad_loss": False, "stop": False}

    def norm() -> float:
        """The step's one collective beyond the layout's own: the gradient norm, whether any
        rank's loss is not finite, and whether any rank was asked to stop (checkpoint.every)."""
        loss = stepper.last_loss
        flags = [float(loss is not None and not math.isfinite(loss)),
                 float(series is not None and channel.stop_requested.is_set())]
        agreed["norm"], (bad_loss, stop) = step_sums(norm_params, {"dp": dp_rank, "tp": r.coords[2]}, flags, device)
        agreed["bad_loss"], agreed["stop"] = bad_loss > 0, stop > 0
        return agreed["norm"]

    stepper = Stepper(batches_of, lambda b: objective.count(b.labels), forward_backward, sync, norm,
                      [p for i in mine for p in modules[i].parameters()], list(optimizers.values()), lr_schedules,
                      spec.train.clip_grad_norm,
                      finite=lambda _bad: math.isfinite(agreed["norm"]) and not agreed["bad_loss"],
                      grads_of=None if spec.verify.mode == "off" else lambda: full_tensors(((k, p.grad) for i in mine
                                                     for k, p in modules[i].named_parameters(remove_duplicate=False)
                                                     if p.grad is not None), r.keeper))
    stats, diverged, val, saved, stopped = [], None, [], [], None

    def save_step(at: int) -> None:
        channel.report("saving the checkpoint", at)
        ckpt.save(staging_path(series["dir"], at, series["token"]), modules, optimizers, tie_groups=split.tie_groups)
        saved.append(at)
        channel.checkpoint_saved(at)

    evals = eval_indices(spec.steps, spec.eval.every) if spec.eval.batches else set()
    for k in range(spec.steps):
        channel.report("step", k)
        if masks is not None:
            masks.start_step(start_step + k)
        if debug.crash_rank == rank and debug.crash_step == k:
            inject_crash(debug.crash_mode, rank, k)
        if agreed["stop"]:  # a stop signal, agreed in the last step's sums: save where training stands, and end
            if start_step + k not in saved:
                save_step(start_step + k)
            stopped = start_step + k
            break
        recorder.step_begin(k)
        result = stepper.step(k)
        recorder.step_end()
        if result is None:
            loss = stepper.last_loss
            diverged = {"step": k, "loss": loss, "non_finite_loss": loss is not None and loss != loss,
                        "non_finite_grad": first_non_finite((key, p) for st in modules.values()
                                                            for key, p in st.named_parameters())}
            break
        stats.append(result)
        if debug.check_ties:
            ties.check_equal(start_step + k)
        if k in evals:
            val.append({"step": k + 1, "loss": _evaluate(spec, source, r, rank_of_stage, objective, masks, device,
                                                         start_step + k)})
        channel.step_done(k, result.loss, {"lr": result.lr, "grad_norm": result.grad_norm, "time_s": result.time_s,
                                           **({"val_loss": val[-1]["loss"]} if k in evals else {})})
        if series and k < spec.steps - 1 and (start_step + k + 1) % series["every"] == 0:  # the last: the final one
            save_step(start_step + k + 1)

    # Every trained tensor goes to the driver's comparison when it trains a reference (not on
    # meta); the others are gathered one at a time for their digests, not kept.
    state, digests = gathered_state(((k, v) for i in mine for k, v in modules[i].state_dict().items()), r.keeper,
                                    lambda k: debug.return_state or k in tied_keys or m.init != "meta")
    if launch.get("checkpoint_dir") and diverged is None and stopped is None:
        channel.report("saving the checkpoint")
        ckpt.save(launch["checkpoint_dir"], modules, optimizers, hf=launch.get("hf_dir"), tie_groups=split.tie_groups)
    channel.report("sending the result")
    held = [p for o in optimizers.values() for g in o.param_groups for p in g["params"]]
    times = [s.time_s for s in stats]
    return {
        "rank": rank, "coords": {"pp": pp_rank, "dp": dp_rank, "tp": r.coords[2]}, "keeper": r.keeper,
        "stages": mine, "start_step": start_step,
        "losses": [s.loss for s in stats if s.loss is not None],
        "grad_norms": [s.grad_norm for s in stats], "lrs": [s.lr for s in stats], "val_losses": val,
        "diverged": diverged, "saved_steps": saved, "stopped_at": stopped, "timeline": recorder.as_dict(),
        "step_times_s": times, "step_time_s": median_after_first(times),
        "first_grads": stepper.first_grads or {},
        "state": {i: {k: v for k, v in state.items() if k in split.stage_keys[i]} for i in mine} if r.keeper else {},
        "fqn_problems": r.fqn_problems,
        # The optimizers hold the parameters as this rank keeps them between steps (FSDP's shards).
        "param_bytes": local_bytes(held),
        "stage_bytes": local_bytes(held) + local_bytes(b for i in mine for b in modules[i].buffers()),
        "optimizer_bytes": local_bytes(v for o in optimizers.values() for st in o.state.values()
                                       for v in st.values() if isinstance(v, torch.Tensor)),
        "rss_growth_bytes": r.rss_growth, "peak_rss_bytes": peak_rss_bytes(),
        "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "digests": digests, "peak_flops": channel.peak_flops,
        "tie_comm_groups": ties.comm_groups(), "pid": os.getpid(), "host": os.uname().nodename,
    }


@torch.no_grad()
def _evaluate(spec, source, r: RankStages, rank_of_stage, loss_fn, masks, device, step) -> float | None:
    """The loss over every held-out token (:mod:`ppsplit.objective`), forward only: each microbatch through the stages
    in order, a stage's outputs sent to the rank of the next (torch's zero-bubble schedules cannot
    run without a backward, so evaluation does not go through the schedule). The loss is on the
    ranks of the last stage; None elsewhere."""
    from ppsplit.trace_split import as_tuple

    split, n = r.split, len(r.split.stages)
    pp, dp, tp = r.coords
    last, total, count = n - 1, 0.0, 0

    def peer(stage):
        return r.layout.rank_of(rank_of_stage[stage], dp, tp)

    for j, batch in enumerate(source.validation(spec.eval.batches)):
        if masks is not None:
            masks.start_step(-1 - j - 1000 * step)
        count += loss_fn.count(batch.labels)  # the whole held-out batch's, on every rank
        for mb in batch.shard(dp, r.layout.dp).microbatches(spec.microbatches):
            values = ()
            for s in range(n):
                if s not in r.mine:
                    continue
                if s == 0:
                    values = tuple(t.to(device) for t in split.flat_inputs(mb.args, mb.kwargs))
                elif rank_of_stage[s - 1] != pp:
                    ins, _ = split.stage_io_meta(s, tp=r.layout.tp)
                    values = tuple(torch.empty(t.shape, dtype=t.dtype, device=device) for t in ins)
                    for t in values:
                        dist.recv(t, src=peer(s - 1))
                with precision_context(spec.train.precision, device.type):
                    values = as_tuple(r.modules[s](*values))
                if s < last and rank_of_stage[s + 1] != pp:
                    for t in values:
                        dist.send(t.contiguous(), dst=peer(s + 1))
            if last in r.mine:
                with precision_context(spec.train.precision, device.type):
                    total += loss_fn.total(values[0] if len(values) == 1 else values, mb.labels.to(device)).item()
    # Each rank's part of the loss over every held-out token, dp times (the driver averages).
    return total * r.layout.dp / count if last in r.mine and count else None
