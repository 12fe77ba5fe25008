"""What one rank does: rebuild the split, keep and lay out its stages, and train them under a
pipeline schedule from ``torch.distributed.pipelining``, one optimizer step at a time exactly
as the unsplit reference does (:mod:`ppsplit.train.loop`), evaluating on held-out batches through
the forward-only schedule, reporting each step to the driver and saving checkpoints."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ppsplit.models import build
from ppsplit.data.corpus import BatchSource
from ppsplit.train.objective import Objective, WeightedLoss
from ppsplit.checkpoint.series import staging_path
from ppsplit.faults import Faults
from ppsplit.config.spec import JobSpec
from ppsplit.parallel.stage_state import full_tensors, gathered_state, local_bytes, median_after_first, peak_rss_bytes
from ppsplit.parallel.layout import average_grads
from ppsplit.parallel.ties import separate_local_copies
from ppsplit.config.schedules import SCHEDULES, stages_of_rank
from ppsplit.parallel.ties import TieSync
from ppsplit.train.recorder import Recorder
from ppsplit.stages.trace import split as split_model
from ppsplit.train.loop import (StepHooks, Stepper, held_out_sums, run_steps, apply_activation_checkpointing, checkpoint_pattern, counted_once,
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

    The model is built and traced without weights (:func:`ppsplit.parallel.materialize.trace_device`); the rank keeps its stages,
    lays them out (tensor parallel, FSDP2) on meta, and only then gives them storage, each tensor
    its local part alone, filled with the unsplit model's values one block at a time
    (:mod:`ppsplit.parallel.materialize`): a rank's memory follows its stage and its shard."""
    from ppsplit.parallel import layout as lay
    from ppsplit.parallel.materialize import materialize_stages, stand_ins, to_meta, trace_device

    m, plan = spec.model, spec.plan
    layout = lay.Layout(plan.ranks, spec.parallel.dp, spec.parallel.tp, spec.parallel.fsdp)
    pp_rank, dp_rank, tp_rank = layout.coords(rank)
    mesh = lay.device_mesh(layout, device.type) if layout.world > plan.ranks else None
    channel.report("building the model")
    model = build.model_of(spec, meta=True)
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
    (a :class:`ppsplit.train.objective.WeightedLoss`) weighs each microbatch itself: the schedules do
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
                from ppsplit.parallel.layout import reshard_every_microbatch

                reshard_every_microbatch(pipe_stages[-1])
            if recorder is not None:
                recorder.wrap(pipe_stages[-1], i)
        return schedule_cls(pipe_stages if len(pipe_stages) > 1 or plan.placement != "single" else pipe_stages[0],
                            n_microbatches=spec.microbatches, loss_fn=loss_fn, scale_grads=False)

    return {length: schedule_for({"seq": length} if spec.dynamic else None)
            for length in dict.fromkeys(spec.seq_lens or (spec.seq_len,))}


def train_rank(spec: JobSpec, launch: dict, rank: int, world: int, device: torch.device, channel) -> dict:
    """Build this rank's stages, train them ``spec.steps`` steps, and return what the driver
    compares and reports."""
    run = _RankRun(spec, launch, rank, device, channel)
    try:
        run.train()
        return run.result()
    finally:
        # The Stepper holds the run's methods, and the run the Stepper: the stages and schedules
        # go now, before the process group is destroyed, not at some later collection.
        run.__dict__.clear()


class _RankRun:
    """One rank's training: its stages and schedules, the step's callbacks for the
    :class:`~ppsplit.train.loop.Stepper`, the loop over steps, and its result."""

    def __init__(self, spec: JobSpec, launch: dict, rank: int, device: torch.device, channel):
        from ppsplit.checkpoint import dcp as ckpt
        from ppsplit.train.optim import make_lr_schedule, make_optimizer

        self.spec, self.launch, self.rank, self.device, self.channel = spec, launch, rank, device, channel
        r = self.r = build_stages(spec, launch, rank, device, channel, self.source_of)
        self.split, self.modules, self.mine = r.split, r.modules, r.mine
        self.n_stages, self.layout = len(r.split.stages), r.layout
        plan = spec.plan
        self.faults = Faults(spec.debug, rank, spec.microbatches, spec.microbatches * spec.train.grad_accumulation)
        self.objective = Objective(spec.model.loss)
        self.loss_fn = WeightedLoss(self.objective, self.faults.loss_pieces())
        self.recorder = Recorder(rank, r.coords[0], r.keeper)
        self.schedules = make_schedules(spec, r, device, self.loss_fn, self.recorder)
        if rank == 0:  # every pipeline rank's action lists, the same on each: one copy is enough
            self.recorder.keep_order(next(iter(self.schedules.values())), self.n_stages, spec.microbatches)
        self.rank_of_stage = {i: p for p in range(plan.ranks)
                              for i in stages_of_rank(p, plan.ranks, plan.stages_per_rank, plan.placement)}
        channel.report("synchronising tied weights")
        self.ties = TieSync(self.split.tie_groups, self.split.stage_keys, self.modules, self.rank_of_stage, rank,
                            self.layout)
        self.optimizers = {i: make_optimizer(spec.optimizer, self.modules[i].named_parameters()) for i in self.mine}
        self.start_step = 0
        if launch.get("load_dir"):
            channel.report("loading the checkpoint")
            self.start_step = ckpt.load(launch["load_dir"], self.modules, self.optimizers, self.split.tie_groups)
        self.lr_schedules = [make_lr_schedule(o, spec.train, self.start_step + spec.steps, self.start_step)
                             for o in self.optimizers.values()]
        self.replicas = r.mesh["dp"].get_group() if r.mesh is not None and self.layout.dp > 1 \
            and not self.layout.fsdp else None
        self.tied_keys = {k for g in self.split.tie_groups for k in g}
        self.faults.stages_built(self.modules, self.tied_keys)
        self.masks = None
        if spec.draws_masks:
            from ppsplit.train.dropout import MaskSeeds

            self.masks = MaskSeeds(spec.seed, first_microbatch=r.coords[1] * spec.microbatches)
            self.masks.on_stages(self.modules)
        self.source = self.source_of(r.config)
        owner = counted_once(self.split.tie_groups, self.split.stage_keys)
        self.norm_params = [(k, p) for i in self.mine for k, p in self.modules[i].named_parameters()
                            if owner.get(k, i) == i]
        self.series = launch.get("series")  # checkpoint.every: a step folder each N steps
        self.agreed = {"norm": 0.0, "bad_loss": False, "stop": False}
        self.seq_len = spec.seq_len  # the running step's
        self.stepper = self._stepper()
        self.stats, self.diverged, self.val, self.saved, self.stopped = [], None, [], [], None

    def source_of(self, config):
        return BatchSource(self.spec, config, self.launch.get("data_file"), self.launch.get("first_sample", 0))

    def _stepper(self) -> Stepper:
        spec, modules, mine = self.spec, self.modules, self.mine
        grads_of = None if spec.verify.mode == "off" else lambda: full_tensors(
            ((k, p.grad) for i in mine for k, p in modules[i].named_parameters(remove_duplicate=False)
             if p.grad is not None), self.r.keeper)
        return Stepper(self.batches_of, lambda b: self.objective.count(b.labels), self.forward_backward, self.sync,
                       self.norm, [p for i in mine for p in modules[i].parameters()], list(self.optimizers.values()),
                       self.lr_schedules, spec.train.clip_grad_norm,
                       finite=lambda _bad: math.isfinite(self.agreed["norm"]) and not self.agreed["bad_loss"],
                       grads_of=grads_of)

    # --- what the Stepper calls, each step ---------------------------------------------------

    def batches_of(self, k: int) -> list:
        self.seq_len = self.spec.seq_len_at(self.start_step + k)
        return step_batches(self.source, self.spec, self.start_step, k)

    def forward_backward(self, batch, weight: float) -> float | None:
        # Each rank draws the whole global batch (its count is the step's) and runs its share.
        # Replicas average their gradients, so each weighs its items dp times: the average is
        # the sum, and so is the driver's mean of the ranks' losses.
        self.loss_fn.weight = weight * self.layout.dp
        batch = self.faults.batch(batch.shard(self.r.coords[1], self.layout.dp))
        return self._run_batch(self.schedules[self.seq_len], batch)

    def _run_batch(self, schedule, batch) -> float | None:
        args = self.split.flat_inputs(batch.args, batch.kwargs) if 0 in self.mine else ()
        kwargs, mb_losses = {}, []
        if self.n_stages - 1 in self.mine:
            kwargs = {"target": batch.labels.to(self.device), "losses": mb_losses}
        with precision_context(self.spec.train.precision, self.device.type):
            schedule.step(*(a.to(self.device) for a in args), **kwargs)
        if not mb_losses:
            return None
        return torch.stack([x.detach().float() for x in mb_losses]).sum().item()

    def sync(self) -> None:
        self.recorder.optimizer_begin()  # from here: the gradients synchronised, clipped, applied
        if self.replicas is not None:
            average_grads(self.modules, self.replicas, self.layout.dp)
        self.faults.synchronise_ties(self.modules, self.n_stages - 1, self.ties.sum_grads)

    def norm(self) -> float:
        """The step's one collective beyond the layout's own: the gradient norm, whether any
        rank's loss is not finite, and whether any rank was asked to stop (checkpoint.every)."""
        from ppsplit.train.optim import step_sums

        loss = self.stepper.last_loss
        flags = [float(loss is not None and not math.isfinite(loss)),
                 float(self.series is not None and self.channel.stop_requested.is_set())]
        self.agreed["norm"], (bad_loss, stop) = step_sums(self.norm_params, {"dp": self.r.coords[1],
                                                                             "tp": self.r.coords[2]},
                                                          flags, self.device)
        self.agreed["bad_loss"], self.agreed["stop"] = bad_loss > 0, stop > 0
        return self.agreed["norm"]

    # --- the steps ---------------------------------------------------------------------------

    def save_step(self, at: int) -> None:
        from ppsplit.checkpoint import dcp as ckpt

        self.channel.report("saving the checkpoint", at)
        ckpt.save(staging_path(self.series["dir"], at, self.series["token"]), self.modules, self.optimizers,
                  tie_groups=self.split.tie_groups)
        self.saved.append(at)
        self.channel.checkpoint_saved(at)

    def train(self) -> None:
        spec = self.spec
        evals = eval_indices(spec.steps, spec.eval.every) if spec.eval.batches else set()
        self.stats, self.diverged, self.val = run_steps(
            self.stepper, list(self.modules.values()), spec.steps, self.start_step, evals,
            lambda k: _evaluate(spec, self.source, self.r, self.rank_of_stage, self.objective, self.masks,
                                self.device, self.start_step + k),
            self.masks, _RankHooks(self))


    # --- what goes back to the driver ----------------------------------------------------------

    def result(self) -> dict:
        from ppsplit.checkpoint import dcp as ckpt

        spec, launch, r, mine, modules, optimizers = self.spec, self.launch, self.r, self.mine, self.modules, \
            self.optimizers
        # Every trained tensor goes to the driver's comparison when it trains a reference (not on
        # meta); the others are gathered one at a time for their digests, not kept.
        state, digests = gathered_state(((k, v) for i in mine for k, v in modules[i].state_dict().items()), r.keeper,
                                        lambda k: spec.debug.return_state or k in self.tied_keys
                                        or spec.model.init != "meta")
        if launch.get("checkpoint_dir") and self.diverged is None and self.stopped is None:
            self.channel.report("saving the checkpoint")
            ckpt.save(launch["checkpoint_dir"], modules, optimizers, hf=launch.get("hf_dir"),
                      tie_groups=self.split.tie_groups)
        self.channel.report("sending the result")
        return {**self._outcome(), "digests": digests,
                "state": {i: {k: v for k, v in state.items() if k in self.split.stage_keys[i]} for i in mine}
                if r.keeper else {},
                **self._memory()}

    def _outcome(self) -> dict:
        r, stats = self.r, self.stats
        times = [s.time_s for s in stats]
        return {
            "rank": self.rank, "coords": {"pp": r.coords[0], "dp": r.coords[1], "tp": r.coords[2]},
            "keeper": r.keeper, "stages": self.mine, "start_step": self.start_step,
            "losses": [s.loss for s in stats if s.loss is not None],
            "grad_norms": [s.grad_norm for s in stats], "lrs": [s.lr for s in stats], "val_losses": self.val,
            "diverged": self.diverged, "saved_steps": self.saved, "stopped_at": self.stopped,
            "timeline": self.recorder.as_dict(), "step_times_s": times, "step_time_s": median_after_first(times),
            "first_grads": self.stepper.first_grads or {}, "fqn_problems": r.fqn_problems,
            "peak_flops": self.channel.peak_flops, "tie_comm_groups": self.ties.comm_groups(),
            "pid": os.getpid(), "host": os.uname().nodename,
        }

    def _memory(self) -> dict:
        mine, modules, optimizers, device = self.mine, self.modules, self.optimizers, self.device
        # The optimizers hold the trained parameters as this rank keeps them between steps (FSDP's
        # shards); an adapted model's frozen base is held beside them.
        held = [p for o in optimizers.values() for g in o.param_groups for p in g["params"]]
        held += list({id(p): p for i in mine for p in modules[i].parameters() if not p.requires_grad}.values())
        return {
            "param_bytes": local_bytes(held),
            "stage_bytes": local_bytes(held) + local_bytes(b for i in mine for b in modules[i].buffers()),
            "optimizer_bytes": local_bytes(v for o in optimizers.values() for st in o.state.values()
                                           for v in st.values() if isinstance(v, torch.Tensor)),
            "rss_growth_bytes": self.r.rss_growth, "peak_rss_bytes": peak_rss_bytes(),
            "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        }


class _RankHooks(StepHooks):
    """What a rank does around each step: it reports to the driver, injects its faults, stops
    where the ranks agreed to (after saving), times the step, and saves every
    ``checkpoint.every`` steps."""

    def __init__(self, run: _RankRun):
        self.run = run

    def before(self, k: int) -> bool:
        run = self.run
        run.channel.report("step", k)
        run.faults.step_begins(k)
        if run.agreed["stop"]:  # a stop signal, agreed in the last step's sums: save where training stands, and end
            if run.start_step + k not in run.saved:
                run.save_step(run.start_step + k)
            run.stopped = run.start_step + k
            return False
        run.recorder.step_begin(k)
        return True

    def stepped(self, k: int) -> None:
        self.run.recorder.step_end()

    def finished(self, k: int, result, val: dict | None) -> None:
        run = self.run
        if run.spec.debug.check_ties:
            run.ties.check_equal(run.start_step + k)
        run.channel.step_done(k, result.loss, {"lr": result.lr, "grad_norm": result.grad_norm,
                                               "time_s": result.time_s,
                                               **({"val_loss": val["loss"]} if val is not None else {})})

    def between(self, step: int) -> None:
        run = self.run
        if run.series and step % run.series["every"] == 0:  # the last step's is the final checkpoint
            run.save_step(step)



def _evaluate(spec, source, r: RankStages, rank_of_stage, loss_fn, masks, device, step) -> float | None:
    """The loss over every held-out token (:func:`ppsplit.train.loop.held_out_sums`), forward
    only: each microbatch through the stages in order, a stage's outputs sent to the rank of the
    next (torch's zero-bubble schedules cannot run without a backward, so evaluation does not go
    through the schedule). The loss is on the ranks of the last stage; None elsewhere."""
    last = len(r.split.stages) - 1

    def total_of(mb) -> float | None:
        values = _forward_through_stages(spec, r, rank_of_stage, mb, device)
        if last not in r.mine:
            return None
        with precision_context(spec.train.precision, device.type):
            return loss_fn.total(values[0] if len(values) == 1 else values, mb.labels.to(device)).item()

    total, count = held_out_sums(source, spec, loss_fn, masks, step, spec.microbatches, total_of,
                                 shard=(r.coords[1], r.layout.dp))
    # Each rank's part of the loss over every held-out token, dp times (the driver averages).
    return total * r.layout.dp / count if last in r.mine and count else None


@torch.no_grad()
def _forward_through_stages(spec, r: RankStages, rank_of_stage, mb, device) -> tuple:
    """This rank's stages run on microbatch ``mb``, receiving from and sending to the ranks of
    their neighbours; the last stage's outputs where this rank holds it."""
    from ppsplit.stages.trace import as_tuple

    split, n = r.split, len(r.split.stages)
    pp, dp, tp = r.coords
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
                dist.recv(t, src=r.layout.rank_of(rank_of_stage[s - 1], dp, tp))
        with precision_context(spec.train.precision, device.type):
            values = as_tuple(r.modules[s](*values))
        if s < n - 1 and rank_of_stage[s + 1] != pp:
            for t in values:
                dist.send(t.contiguous(), dst=r.layout.rank_of(rank_of_stage[s + 1], dp, tp))
    return values
