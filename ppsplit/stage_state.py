"""The tensors of a rank's stages: whole tensors gathered from shards, the bytes a rank holds,
replicas' gradients averaged, a tie's copies separated between stages of one rank, and digests."""

from __future__ import annotations

import hashlib
import statistics

import torch
import torch.distributed as dist

from ppsplit.stage_code import adopt_tensors, same_kind


def median_after_first(times: list[float]) -> float | None:
    """The step time: the median of the steps after the first (which also warms up)."""
    return statistics.median(times[1:]) if len(times) > 1 else (times[0] if times else None)


def full_tensors(named, keep: bool) -> dict[str, torch.Tensor]:
    """Whole tensors on the CPU by FQN; a sharded one is gathered (every rank of its mesh takes
    part, in the same order), and kept only where ``keep``."""
    out = {}
    for key, t in named:
        whole = t.full_tensor() if hasattr(t, "full_tensor") else t
        if keep:
            out[key] = whole.detach().cpu().clone()
    return out


def gathered_state(named, keeper: bool, keep) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Each tensor whole (a shard gathered, every rank of its mesh taking part), one at a time:
    on the keeper, its digest, and a CPU copy where ``keep(fqn)``; nothing elsewhere. Only the
    copies asked for are held, never the whole stage at once."""
    state, digests = {}, {}
    for key, t in named:
        whole = t.full_tensor() if hasattr(t, "full_tensor") else t
        if keeper:
            digests[key] = tensor_digest(whole)
            if keep(key):
                state[key] = whole.detach().cpu().clone()
        del whole
    return state, digests


def local_bytes(tensors) -> int:
    """Bytes this rank holds for ``tensors`` (its shard of a sharded one), each tensor once."""
    seen = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        seen[id(t)] = local.numel() * local.element_size()
    return sum(seen.values())


BUCKET_BYTES = 25 << 20  # replicas' gradients are averaged this many bytes at a time (DDP's default)


@torch.no_grad()
def average_grads(modules: dict, group, size: int, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Replicated data parallelism (``parallel.fsdp=false``): each gradient becomes the mean over
    the data-parallel ranks, in buckets of up to ``bucket_bytes`` (the gradients of one dtype
    and device copied into one flat tensor, all-reduced once, copied back), as DDP does: a few
    all-reduces a step however many tensors the stages hold."""
    for bucket in _buckets([p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                            for module in modules.values() for p in module.parameters() if p.grad is not None],
                           bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def _buckets(grads: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of gradients of one dtype and device, each up to ``bucket_bytes`` (a
    larger gradient alone)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if not out or (g.dtype, g.device) != (out[-1][0].dtype, out[-1][0].device) or size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(g)
        size += nbytes
    return out


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


def tensor_digest(tensor: torch.Tensor) -> str:
    """A short hash of a tensor's values, to prove two copies equal without shipping them."""
    data = tensor.detach().cpu().contiguous()
    return hashlib.sha1(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()[:16]
