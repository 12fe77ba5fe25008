"""Run one rank: rebuild the split, keep this rank's stages, and train them under a pipeline
schedule from ``torch.distributed.pipelining``.

The same function runs under submitit's local executor and on SLURM: submitit's
``TorchDistributedEnvironment`` gives the rank environment in both.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ppsplit import build
from ppsplit.stage_code import adopt_tensors, retarget_devices, same_kind
from ppsplit.ties import TieSync
from ppsplit.trace_split import split as split_model

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


def median_after_first(times: list[float]) -> float | None:
    """The step time: the median of the steps after the first (which also warms up)."""
    return statistics.median(times[1:]) if len(times) > 1 else (times[0] if times else None)


def stages_of_rank(rank: int, ranks: int, per_rank: int, placement: str) -> list[int]:
    """The stage indices rank ``rank`` runs: loop placement gives rank r stages r, r+R, ...;
    V placement gives it stages r and 2R-1-r, so the first and last stage share rank 0."""
    if placement == "v":
        return [rank, 2 * ranks - 1 - rank]
    return [rank + k * ranks for k in range(per_rank)]


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


def rank_main(task: dict) -> dict:
    """The entry point of every rank process; returns what the driver compares."""
    import submitit

    env = submitit.helpers.TorchDistributedEnvironment().export(
        set_cuda_visible_devices=False, overwrite=True
    )
    if task.get("pid_dir"):
        os.makedirs(task["pid_dir"], exist_ok=True)
        with open(os.path.join(task["pid_dir"], f"rank{env.rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    torch.set_num_threads(int(task.get("threads", 1)))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{env.local_rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo", timeout=timedelta(seconds=float(task["timeout_s"]))
    )
    try:
        return train_rank(task, env.rank, env.world_size, device)
    finally:
        dist.destroy_process_group()


def train_rank(task: dict, rank: int, ranks: int, device: torch.device) -> dict:
    from torch.distributed import pipelining

    s = task["model"]
    m = task["microbatches"]
    meta = task.get("init") == "meta"
    if meta:
        model = build.build_on_meta(s["class_name"], s["config"])
    else:
        model = build.build_model(s["class_name"], s["config"], s["pretrained"], task["seed"])
    loss_fn = build.loss_fn(s["loss"])
    config = model.config

    def batch_for(step):
        return build.make_batch(s["inputs"], config, task["batch_size"], task["seq_len"],
                                task["seed"], step=step, call_kwargs=s["call_kwargs"])

    example = batch_for(0).microbatches(m)[0]
    if meta:
        example = example.to("meta")
    split = split_model(model, example.args, example.kwargs, **task["split"])
    n_stages = len(split.stages)
    mine = stages_of_rank(rank, ranks, task["stages_per_rank"], task["placement"])
    rss_before = peak_rss_bytes()
    if meta:
        modules = materialize_stages(model, split, mine, task, device)
    else:
        modules = {i: split.stages[i].to(device) for i in mine}
    del model
    separate_local_copies(modules)
    split.stages = [modules.get(i) for i in range(n_stages)]  # drop the other ranks' stages
    rss_growth = peak_rss_bytes() - rss_before
    rank_of_stage = {i: r for r in range(ranks)
                     for i in stages_of_rank(r, ranks, task["stages_per_rank"], task["placement"])}

    for module in modules.values():
        # Stage outputs go over the wire, and gloo sends only contiguous tensors (T5's and
        # BERT's masks are expanded views). A hook keeps the stage's FQNs untouched.
        module.register_forward_hook(_contiguous_outputs)
    pipe_stages = []
    for i in mine:
        ins, outs = split.stage_io_meta(i)
        pipe_stages.append(pipelining.PipelineStage(
            modules[i], i, n_stages, device,
            input_args=ins,
            output_args=outs[0] if len(outs) == 1 else outs,
        ))
    schedule_cls = getattr(pipelining, SCHEDULES[task["schedule"]][0])
    schedule = schedule_cls(
        pipe_stages if len(pipe_stages) > 1 or task["placement"] != "single" else pipe_stages[0],
        n_microbatches=m,
        loss_fn=loss_fn,
    )
    ties = TieSync(split.tie_groups, split.stage_keys, modules, rank_of_stage, rank)
    params = unique_params(modules.values())
    optimizer = build.make_optimizer(task["optimizer"], params)
    debug = task.get("debug", {})

    losses, times, first_grads = [], [], {}
    for step in range(task["steps"]):
        if debug.get("crash_rank") == rank and debug.get("crash_step") == step:
            if debug.get("crash_mode") == "exit":
                os._exit(3)  # a rank that dies without a word
            if debug.get("crash_mode") == "hang":
                time.sleep(24 * 3600)  # a rank that never answers
            raise RuntimeError(f"injected crash on rank {rank} at step {step}")
        batch = batch_for(step)
        args = split.flat_inputs(batch.args, batch.kwargs) if 0 in mine else ()
        kwargs = {}
        mb_losses: list[torch.Tensor] = []
        if n_stages - 1 in mine:
            kwargs = {"target": batch.labels.to(device), "losses": mb_losses}
        dist.barrier()
        start = time.perf_counter()
        schedule.step(*(a.to(device) for a in args), **kwargs)
        ties.sum_grads()
        if step == 0:
            first_grads = {
                key: p.grad.detach().cpu().clone()
                for i in mine for key, p in modules[i].named_parameters(remove_duplicate=False)
                if p.grad is not None
            }
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        if debug.get("check_ties"):
            ties.check_equal(step)
        if mb_losses:
            losses.append(torch.stack([l.detach().float() for l in mb_losses]).mean().item())

    keep_all = debug.get("return_state", False)
    tied_keys = {k for g in split.tie_groups for k in g}
    state = {
        i: {k: v.detach().cpu().clone() for k, v in modules[i].state_dict().items()
            if keep_all or k in tied_keys}
        for i in mine
    }
    checkpoint = task.get("checkpoint_dir")
    if checkpoint:
        save_checkpoint(checkpoint, modules)
    return {
        "rank": rank,
        "stages": mine,
        "losses": losses,
        "step_times_s": times,
        "step_time_s": median_after_first(times),
        "first_grads": first_grads,
        "state": state,
        "stage_bytes": sum(t.numel() * t.element_size()
                           for i in mine for t in {id(t): t for t in modules[i].state_dict().values()}.values()),
        "rss_growth_bytes": rss_growth,
        "digests": {k: tensor_digest(v) for i in mine for k, v in modules[i].state_dict().items()},
        "tie_comm_groups": ties.comm_groups(),
        "pid": os.getpid(),
    }


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


def materialize_stages(model, split, indices, task: dict, device) -> dict[int, torch.nn.Module]:
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
    build.initialize(model, task["seed"])
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    pretrained = task["model"].get("pretrained")
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


def save_checkpoint(path: str, modules: dict) -> None:
    """Save this rank's stages with ``torch.distributed.checkpoint`` under the original FQNs.

    Every rank calls this together; a tied key held by several ranks is one replicated entry.
    """
    import torch.distributed.checkpoint as dcp

    state = {}
    for module in modules.values():
        state.update({k: v.detach() for k, v in module.state_dict().items()})
    dcp.save(state, checkpoint_id=path)


def train_in_process(forward, modules, batch_for, steps, microbatches, loss_fn, optimizer_spec,
                     after_backward=None) -> dict:
    """Train ``forward`` (the unsplit model, or the chained stages) in this process exactly as the
    schedules do: mean of the microbatch losses, then ``after_backward``, then one optimizer step.

    ``modules`` are what holds the parameters; gradients of the first step and the final state
    are returned by FQN, per module.
    """
    optimizer = build.make_optimizer(optimizer_spec, unique_params(modules))
    optimizer.zero_grad(set_to_none=True)  # start from no gradients, whatever ran before
    losses, times, first_grads = [], [], []
    for step in range(steps):
        start = time.perf_counter()
        total = 0.0
        for mb in batch_for(step).microbatches(microbatches):
            loss = loss_fn(forward(*mb.args, **mb.kwargs), mb.labels)
            (loss / microbatches).backward()
            total += loss.item()
        if after_backward is not None:
            after_backward()
        if step == 0:
            first_grads = [
                {k: p.grad.detach().clone() for k, p in m.named_parameters(remove_duplicate=False)
                 if p.grad is not None}
                for m in modules
            ]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(total / microbatches)
    return {
        "losses": losses,
        "step_times_s": times,
        "step_time_s": median_after_first(times),
        "first_grads": first_grads,
        "state": [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in modules],
    }
