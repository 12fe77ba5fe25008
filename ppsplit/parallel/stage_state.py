"""The tensors of a rank's stages as the driver sees them: whole tensors gathered from shards,
the bytes and the memory a rank holds, the first tensor that is not finite, and digests."""

from __future__ import annotations

import hashlib
import statistics

import torch


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
