"""Run one rank: rebuild the split, keep this rank's stages, and train them under a pipeline
schedule from ``torch.distributed.pipelining``.

Locally each rank is ``python -m ppsplit.run_rank LAUNCH RANK WORLD`` (started by
:mod:`ppsplit.dispatch`); on SLURM submitit runs :func:`rank_entry` in every task. Both rendezvous
on the driver's store and report over it (:mod:`ppsplit.control`).
"""

from __future__ import annotations

import hashlib
import math
import os
import pickle
import statistics
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from ppsplit import build
from ppsplit.control import RankChannel
from ppsplit.debug import inject_crash, perturb_one_weight, repeat_first_microbatch
from ppsplit.job_spec import JobSpec
from ppsplit.schedules import SCHEDULES, stages_of_rank
from ppsplit.stage_code import adopt_tensors, retarget_devices, same_kind
from ppsplit.ties import TieSync
from ppsplit.trace_split import split as split_model


def median_after_first(times: list[float]) -> float | None:
    """The step time: the median of the steps after the first (which also warms up)."""
    return statistics.median(times[1:]) if len(times) > 1 else (times[0] if times else None)


def unique_params(modules) -> list[torch.nn.Parameter]:
    seen, out = set(), []
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _contiguous_outputs(module, args, output):
    if isinstance(output, tuple):
        return tuple(t.contiguous() if isinstance(t, torch.Tensor) else t for t in output)
    return output.contiguous() if isinstance(output, torch.Tensor) else output


# --- the process ------------------------------------------------------------------------------

def rank_entry(launch_file: str, rank: int | None = None, world: int | None = None) -> None:
    """Every rank process runs this: rendezvous, train, write the result, say done. Any error,
    an ``Exception`` or not, is sent to the driver before the process ends."""
    with open(launch_file, "rb") as f:
        launch = pickle.load(f)
    local_rank = rank
    if rank is None:  # a SLURM task, started by submitit
        import submitit

        env = submitit.JobEnvironment()
        rank, world, local_rank = env.global_rank, env.num_tasks, env.local_rank
    spec: JobSpec = launch["spec"]
    driver_pid = int(os.environ["PPSPLIT_DRIVER_PID"]) if "PPSPLIT_DRIVER_PID" in os.environ else None
    channel = RankChannel(launch["host"], launch["port"], launch["token"], rank, spec.timeout_s, driver_pid)
    try:
        with open(os.path.join(launch["folder"], f"rank{rank}.pid"), "w") as f:
            f.write(f"{os.getpid()} {os.uname().nodename}\n")
    except OSError:  # a full disk: the channel still carries everything that matters
        pass
    try:
        result = run(spec, launch, rank, world, local_rank, channel)
        path = os.path.join(launch["folder"], f"rank{rank}.result.pt")
        torch.save(result, path + ".partial")
        os.replace(path + ".partial", path)
        channel.report("done")
        channel.finish()
    except BaseException as err:
        channel.fail(err)
        traceback.print_exc()
        sys.stderr.flush()
        raise
    finally:
        channel.stop()


def run(spec: JobSpec, launch: dict, rank: int, world: int, local_rank: int, channel) -> dict:
    torch.set_num_threads(spec.launcher.cpus_per_task)
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    channel.report("rendezvous")
    # The driver names a stalled rank after timeout_s; the collectives' own timeout is only the
    # backstop, so it is longer.
    dist.init_process_group("nccl" if cuda else "gloo", store=channel.process_group_store(), rank=rank,
                            world_size=world, timeout=timedelta(seconds=2 * spec.timeout_s + 30))
    try:
        return train_rank(spec, launch, rank, world, device, channel)
    finally:
        dist.destroy_process_group()


def train_rank(spec: JobSpec, launch: dict, rank: int, world: int, device: torch.device, channel) -> dict:
    from torch.distributed import pipelining

    from ppsplit import checkpoint as ckpt
    from ppsplit import layout as lay

    m = spec.model
    plan = spec.plan
    layout = lay.Layout(plan.ranks, spec.parallel.dp, spec.parallel.tp, spec.parallel.fsdp)
    pp_rank, dp_rank, tp_rank = layout.coords(rank)
    mesh = lay.device_mesh(layout, device.type) if layout.world > plan.ranks else None
    pp_group = mesh["pp"].get_group() if mesh is not None else None
    meta = m.init == "meta"
    channel.report("building the model")
    model = build.build_on_meta(m.class_name, m.config, m.pretrained, spec.dropout) if meta else \
        build.build_model(m.class_name, m.config, m.pretrained, spec.seed, spec.dropout)
    loss_fn = build.loss_fn(m.loss)
    config = model.config

    def batch_for(step):
        """This data-parallel rank's part of step ``step``'s batch."""
        batch = build.make_batch(m.inputs, config, spec.batch_size, spec.seq_len_at(step), spec.seed,
                                 step=step, call_kwargs=m.call_kwargs)
        return batch.shard(dp_rank, layout.dp)

    channel.report("tracing and splitting")
    example = batch_for(0).microbatches(spec.microbatches)[0]
    if meta:
        example = example.to("meta")
    split = split_model(model, example.args, example.kwargs, **spec.split_kwargs())
    n_stages = len(split.stages)
    mine = stages_of_rank(pp_rank, plan.ranks, plan.stages_per_rank, plan.placement)
    rss_before = peak_rss_bytes()
    channel.report("building this rank's stages")
    flows = None
    if layout.tp > 1:
        flows = lay.check_tensor_parallel(split, model, m.tp_plan, layout.tp)
    if meta:
        modules = materialize_stages(model, split, mine, spec.seed, m.pretrained, device)
    else:
        modules = {i: split.stages[i].to(device) for i in mine}
    separate_local_copies(modules)
    split.stages = [modules.get(i) for i in range(n_stages)]  # drop the other ranks' stages
    if mesh is not None:
        channel.report("laying out the stages")
        for i in mine:
            lay.parallelize(split, i, model, mesh, m.tp_plan, layout.fsdp, flows)
    del model
    fqn_problems = [f"stage {i}: {sorted(set(modules[i].state_dict()) ^ set(split.stage_keys[i]))[:4]}"
                    for i in mine if set(modules[i].state_dict()) != set(split.stage_keys[i])]
    rss_growth = peak_rss_bytes() - rss_before
    rank_of_stage = {i: r for r in range(plan.ranks)
                     for i in stages_of_rank(r, plan.ranks, plan.stages_per_rank, plan.placement)}

    for module in modules.values():
        # Stage outputs go over the wire, and gloo sends only contiguous tensors (T5's and
        # BERT's masks are expanded views). A hook keeps the stage's FQNs untouched.
        module.register_forward_hook(_contiguous_outputs)
    schedule_cls = getattr(pipelining, SCHEDULES[spec.schedule][0])

    def schedule_for(sizes: dict | None):
        """The stages of this rank and their schedule, for one shape of microbatch: PipelineStage
        fixes its send and receive buffers, so each sequence length gets its own (over the same
        modules)."""
        pipe_stages = []
        for i in mine:
            ins, outs = split.stage_io_meta(i, sizes)
            if flows is not None:  # a value that crosses stages sharded travels as this rank's shard
                ins = tuple(lay.local_shape(t, s, layout.tp) for t, s in zip(ins, flows[i].inputs))
                outs = tuple(lay.local_shape(t, s, layout.tp) for t, s in zip(outs, flows[i].outputs))
            pipe_stages.append(pipelining.PipelineStage(
                modules[i], i, n_stages, device,
                input_args=ins,
                output_args=outs[0] if len(outs) == 1 else outs,
                group=pp_group,
            ))
        return schedule_cls(
            pipe_stages if len(pipe_stages) > 1 or plan.placement != "single" else pipe_stages[0],
            n_microbatches=spec.microbatches,
            loss_fn=loss_fn,
        )

    schedules = {length: schedule_for({"seq": length} if spec.dynamic else None)
                 for length in dict.fromkeys(spec.seq_lens or (spec.seq_len,))}
    channel.report("synchronising tied weights")
    ties = TieSync(split.tie_groups, split.stage_keys, modules, rank_of_stage, rank, layout)
    optimizers = {i: build.make_optimizer(spec.optimizer, modules[i].parameters()) for i in mine}
    start_step = 0
    if launch.get("load_dir"):
        channel.report("loading the checkpoint")
        start_step = ckpt.load(launch["load_dir"], modules, optimizers, split.tie_groups)
    replicas = mesh["dp"].get_group() if mesh is not None and layout.dp > 1 and not layout.fsdp else None
    debug = spec.debug
    keeper = dp_rank == 0 and tp_rank == 0  # the rank of its stages that sends their full tensors
    tied_keys = {k for g in split.tie_groups for k in g}
    if debug.defect == "perturbed_weight" and 0 in mine:
        perturb_one_weight(modules[0], tied_keys)

    losses, times, first_grads, diverged = [], [], {}, None
    masks = None
    if spec.dropout:
        from ppsplit.dropout import MaskSeeds

        masks = MaskSeeds(spec.seed, first_microbatch=dp_rank * spec.microbatches)
        masks.on_stages(modules)
    for step in range(start_step, start_step + spec.steps):
        channel.report("step", step - start_step)
        if masks is not None:
            masks.start_step(step)
        if debug.crash_rank == rank and debug.crash_step == step - start_step:
            inject_crash(debug.crash_mode, rank, step - start_step)
        batch = batch_for(step)
        if debug.defect == "repeated_microbatch":
            batch = repeat_first_microbatch(batch, spec.microbatches)
        args = split.flat_inputs(batch.args, batch.kwargs) if 0 in mine else ()
        kwargs = {}
        mb_losses: list[torch.Tensor] = []
        if n_stages - 1 in mine:
            kwargs = {"target": batch.labels.to(device), "losses": mb_losses}
        dist.barrier()
        start = time.perf_counter()
        schedules[spec.seq_len_at(step)].step(*(a.to(device) for a in args), **kwargs)
        if replicas is not None:
            average_grads(modules, replicas, layout.dp)
        if debug.defect == "dropped_stage_grad" and n_stages - 1 in mine:
            modules[n_stages - 1].zero_grad(set_to_none=False)
        if debug.defect != "unsynced_tie":
            ties.sum_grads()
        loss = torch.stack([l.detach().float() for l in mb_losses]).mean().item() if mb_losses else None
        diverged = check_finite(step - start_step, loss, modules, device)
        if diverged is not None:
            break
        if step == start_step:
            first_grads = full_tensors(((k, p.grad) for i in mine
                                        for k, p in modules[i].named_parameters(remove_duplicate=False)
                                        if p.grad is not None), keeper)
        for optimizer in optimizers.values():
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        if debug.check_ties:
            ties.check_equal(step)
        if loss is not None:
            losses.append(loss)
        channel.step_done(step - start_step, loss)

    final = full_tensors(((k, v) for i in mine for k, v in modules[i].state_dict().items()), keeper)
    # every trained tensor goes to the driver's comparison when it trains a reference (not on meta)
    state = {k: v for k, v in final.items() if debug.return_state or k in tied_keys or not meta}
    if launch.get("checkpoint_dir") and diverged is None:
        channel.report("saving the checkpoint")
        ckpt.save(launch["checkpoint_dir"], modules, optimizers, hf=launch.get("hf_dir"),
                  tie_groups=split.tie_groups)
    channel.report("sending the result")
    return {
        "rank": rank,
        "coords": {"pp": pp_rank, "dp": dp_rank, "tp": tp_rank},
        "keeper": keeper,
        "stages": mine,
        "start_step": start_step,
        "losses": losses,
        "diverged": diverged,
        "step_times_s": times,
        "step_time_s": median_after_first(times),
        "first_grads": first_grads,
        "state": {i: {k: v for k, v in state.items() if k in split.stage_keys[i]} for i in mine} if keeper else {},
        "fqn_problems": fqn_problems,
        # The optimizers hold the parameters as this rank keeps them between steps (FSDP's shards).
        "param_bytes": local_bytes(p for o in optimizers.values() for g in o.param_groups for p in g["params"]),
        "stage_bytes": local_bytes(p for o in optimizers.values() for g in o.param_groups for p in g["params"])
        + local_bytes(b for i in mine for b in modules[i].buffers()),
        "optimizer_bytes": local_bytes(v for o in optimizers.values() for st in o.state.values()
                                       for v in st.values() if isinstance(v, torch.Tensor)),
        "rss_growth_bytes": rss_growth,
        "digests": {k: tensor_digest(v) for k, v in final.items()} if keeper else {},
        "tie_comm_groups": ties.comm_groups(),
        "pid": os.getpid(),
        "host": os.uname().nodename,
    }


def full_tensors(named, keep: bool) -> dict[str, torch.Tensor]:
    """Whole tensors on the CPU by FQN; a sharded one is gathered (every rank of its mesh takes
    part, in the same order), and kept only where ``keep``."""
    out = {}
    for key, t in named:
        whole = t.full_tensor() if hasattr(t, "full_tensor") else t
        if keep:
            out[key] = whole.detach().cpu().clone()
    return out


def local_bytes(tensors) -> int:
    """Bytes this rank holds for ``tensors`` (its shard of a sharded one), each tensor once."""
    seen = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        seen[id(t)] = local.numel() * local.element_size()
    return sum(seen.values())


@torch.no_grad()
def average_grads(modules: dict, group, size: int) -> None:
    """Replicated data parallelism (``parallel.fsdp=false``): each gradient becomes the mean over
    the data-parallel ranks."""
    for module in modules.values():
        for p in module.parameters():
            if p.grad is not None:
                local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(local, group=group)
                local.div_(size)


def first_non_finite(named_params) -> str | None:
    """The FQN of the first parameter whose gradient holds a NaN or an infinity."""
    for key, p in named_params:
        grad = p.grad
        if grad is None:
            continue
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        if not bool(torch.isfinite(local).all()):
            return key
    return None


def check_finite(step: int, loss: float | None, modules: dict, device) -> dict | None:
    """Whether any rank saw a non-finite loss or gradient this step (one small all-reduce, so
    every rank stops at the same step); what this rank saw, or None when all is finite."""
    bad_loss = loss is not None and not math.isfinite(loss)
    bad_grad = first_non_finite((k, p) for st in modules.values() for k, p in st.named_parameters())
    flag = torch.tensor([float(bad_loss), float(bad_grad is not None)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not bool(flag.any()):
        return None
    return {"step": step, "loss": loss, "non_finite_loss": bad_loss, "non_finite_grad": bad_grad}


def separate_local_copies(modules: dict[int, torch.nn.Module]) -> None:
    """Give each stage on this rank its own tensor for a tie its stages share.

    Splitting hands every stage the caller's tensor, so the first and last stage of a V
    placement (both on rank 0) would hold one tensor; torch's schedules scale and write each
    stage's gradients on their own, which would count that tensor twice. TieSync then sums the
    copies' gradients like any other pair of copies."""
    owner: dict[int, int] = {}
    for i in sorted(modules):
        stage = modules[i]
        named = dict(stage.named_parameters(remove_duplicate=False))
        named.update(stage.named_buffers(remove_duplicate=False))
        copies: dict[int, torch.Tensor] = {}
        replace = {}
        for fqn, tensor in named.items():
            if owner.get(id(tensor), i) != i:
                if id(tensor) not in copies:
                    copies[id(tensor)] = same_kind(tensor, tensor.detach().clone())
                replace[fqn] = copies[id(tensor)]
        if replace:
            adopt_tensors(stage, replace, only_known=True)
        for tensor in list(stage.parameters()) + list(stage.buffers()):
            owner.setdefault(id(tensor), i)


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far.

    Read from /proc (VmHWM, kept per address space): getrusage's ru_maxrss survives fork and
    exec, so a rank would report its driver's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def materialize_stages(model, split, indices, seed: int, pretrained: str | None, device) -> dict[int, torch.nn.Module]:
    """Give stages ``indices`` of a split traced on meta real tensors on ``device``, and only them.

    Their tensors are materialised in the meta model, initialised by the model's own
    initialisation (deterministic per tensor from the seed, so equal to the unsplit model's) or
    read from the local checkpoint (only the keys these stages hold), then adopted by the stages.
    Non-persistent buffers are recomputed by the initialisation: no checkpoint holds them."""
    stages = {i: split.stages[i] for i in indices}
    names = {i: set(st.state_dict()) | {n for n, _ in st.named_buffers(remove_duplicate=False)}
             for i, st in stages.items()}
    every = set().union(*names.values())
    build.materialize(model, every, device)
    build.initialize(model, seed)
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    if pretrained:
        keys = sorted(k for st in stages.values() for k in st.state_dict())
        with torch.no_grad():
            for fqn, value in build.read_checkpoint_tensors(pretrained, keys, split.tie_groups).items():
                named[fqn].copy_(value)
    for i, stage in stages.items():
        missing = adopt_tensors(stage, {n: named[n] for n in names[i] if n in named})
        left = missing + [n for n, t in stage.named_buffers() if t.is_meta]
        if left:
            raise RuntimeError(f"stage {i}: no value for {', '.join(sorted(set(left))[:5])}")
        retarget_devices(stage, device)
    return stages


def tensor_digest(tensor: torch.Tensor) -> str:
    """A short hash of a tensor's values, to prove two copies equal without shipping them."""
    data = tensor.detach().cpu().contiguous()
    return hashlib.sha1(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()[:16]


def train_in_process(forward, modules, batch_for, steps, microbatches, loss_fn, optimizer_spec,
                     after_backward=None, load: tuple | None = None, on_step=None, masks=None) -> dict:
    """Train ``forward`` (the unsplit model, or the chained stages) in this process exactly as the
    schedules do: mean of the microbatch losses, then ``after_backward``, then one optimizer step.
    Stops at the first step with a non-finite loss or gradient (``diverged``).

    ``modules`` are what holds the parameters; gradients of the first step and the final state
    are returned by FQN, per module. ``load``: (checkpoint folder, the module whose FQNs key it,
    tie groups) to resume from, at the step it reached. ``masks``: the
    :class:`~ppsplit.dropout.MaskSeeds` whose hooks ``forward`` carries (dropout masks drawn
    alike in the stages and the unsplit model).
    """
    from ppsplit import checkpoint as ckpt

    optimizer = build.make_optimizer(optimizer_spec, unique_params(modules))
    optimizer.zero_grad(set_to_none=True)  # start from no gradients, whatever ran before
    start_step = 0
    if load is not None:
        folder, holder, tie_groups = load
        start_step = ckpt.load(folder, {0: holder}, {0: optimizer}, tie_groups)
    initial = {k: v.detach().clone() for m in modules for k, v in m.state_dict().items()}
    losses, times, first_grads, diverged = [], [], [], None
    for step in range(start_step, start_step + steps):
        start = time.perf_counter()
        total = 0.0
        if masks is not None:
            masks.start_step(step)
        for mb in batch_for(step).microbatches(microbatches):
            loss = loss_fn(forward(*mb.args, **mb.kwargs), mb.labels)
            (loss / microbatches).backward()
            total += loss.item()
        if after_backward is not None:
            after_backward()
        loss = total / microbatches
        bad_grad = first_non_finite((k, p) for m in modules for k, p in m.named_parameters())
        if not math.isfinite(loss) or bad_grad is not None:
            diverged = {"step": step - start_step, "loss": loss, "non_finite_loss": not math.isfinite(loss),
                        "non_finite_grad": bad_grad}
            break
        if step == start_step:
            first_grads = [
                {k: p.grad.detach().clone() for k, p in m.named_parameters(remove_duplicate=False)
                 if p.grad is not None}
                for m in modules
            ]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(loss)
        if on_step is not None:
            on_step(step - start_step + 1, loss)
    return {
        "losses": losses,
        "diverged": diverged,
        "step_times_s": times,
        "step_time_s": median_after_first(times),
        "first_grads": first_grads,
        "state": [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in modules],
        "initial": initial,
        "optimizer": optimizer,
        "start_step": start_step,
    }


def forked(argv: list[str]) -> None:
    """A local rank (``LAUNCH RANK WORLD``), forked by :mod:`ppsplit.local_ranks`."""
    launch_file, rank, world = argv[0], int(argv[1]), int(argv[2])
    try:
        rank_entry(launch_file, rank, world)
    except BaseException:
        sys.exit(1)
