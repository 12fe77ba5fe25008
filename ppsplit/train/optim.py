"""The optimizer step, built the same way on every rank, in the inline pipeline and for the
unsplit reference: the optimizer from its config (weight decay by FQN), the learning-rate
schedule, and clipping by the global gradient norm.

Weight decay: with ``optimizer.weight_decay`` given, it applies to matrices (two or more
dimensions: linear and embedding weights) and not to biases and norm weights; without it, the
optimizer's own default applies to every parameter.

Schedules (``train.lr_schedule``): ``constant``, ``linear`` and ``cosine``, each after
``train.warmup_steps`` of linear warm-up from ``lr / warmup_steps``; linear and cosine decay to
``lr * train.min_lr_ratio`` at the run's last step.

Clipping (``train.clip_grad_norm``): the norm is taken over every gradient of the model, on
every pipeline, data- and tensor-parallel rank, with a tied tensor counted once (its summed
gradient, not each copy's), exactly as ``torch.nn.utils.clip_grad_norm_`` takes it on the
unsplit model; then every gradient is scaled by ``min(1, max_norm / (norm + 1e-6))``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ppsplit.config.spec import OPTIMIZERS
from ppsplit.errors import PpsplitError



def make_optimizer(spec: dict, named_params) -> torch.optim.Optimizer:
    """An optimizer from its config (``{"name": "adamw", "lr": 1e-3, ...}``) over the named
    parameters (FQN, tensor), each tensor once."""
    spec = dict(spec)
    name = spec.pop("name", None)
    if name not in OPTIMIZERS:
        raise PpsplitError(f"optimizer={name!r} is not known; allowed: {', '.join(OPTIMIZERS)}")
    seen, params = set(), []
    for fqn, p in named_params:
        if id(p) not in seen and p.requires_grad:  # an adapted model's base is frozen
            seen.add(id(p))
            params.append(p)
    groups = params
    if "weight_decay" in spec:
        decay = spec.pop("weight_decay")
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
    try:
        return getattr(torch.optim, OPTIMIZERS[name])(groups, **spec)
    except (TypeError, ValueError) as err:
        raise PpsplitError(f"optimizer={name} with {spec}: {err}") from None


def lr_factor(step: int, schedule: str, warmup: int, total: int, min_ratio: float) -> float:
    """The multiple of the base learning rate at optimizer step ``step`` (from 0) of ``total``."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(total - 1 - warmup, 1)
    done = min(max(step - warmup, 0) / span, 1.0)
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * done
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * done))


def make_lr_schedule(optimizer, train, total_steps: int, start_step: int = 0):
    """A ``LambdaLR`` over the optimizer that is at ``start_step`` of ``total_steps``."""
    def factor(step):
        return lr_factor(step + start_step, train.lr_schedule, train.warmup_steps, total_steps, train.min_lr_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _squares(grad: torch.Tensor) -> torch.Tensor:
    """The whole tensor's sum of squares, also for a sharded (DTensor) gradient."""
    norm = torch.linalg.vector_norm(grad.float() if not hasattr(grad, "full_tensor") else grad, 2)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm.float() ** 2


def grad_norm(named_params) -> float:
    """The L2 norm of the gradients of ``named_params``, each tensor once, in this process (the
    unsplit model, or the chained stages, which share its tensors). Ranks use :func:`step_sums`."""
    total = torch.zeros(())
    seen = set()
    for _, p in named_params:
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        total = total + _squares(p.grad).to(total.device)
    return float(total.sqrt())


def _share(grad: torch.Tensor, coords: dict[str, int]) -> tuple[torch.Tensor, bool] | None:
    """This rank's part of ``grad`` and whether this rank counts it in a sum over every rank: a
    shard always, a replica only at coordinate 0 of each mesh dimension it is replicated over (a
    plain tensor is replicated over every one). None for a partial placement (its values sum
    across ranks, its squares do not)."""
    if not hasattr(grad, "to_local"):
        return grad, not any(coords.values())
    names = grad.device_mesh.mesh_dim_names or ()
    counts = True
    for dim, coord in coords.items():
        if dim in names:
            placement = grad.placements[names.index(dim)]
            if placement.is_partial():
                return None
            counts = counts and (not placement.is_replicate() or coord == 0)  # _StridedShard too
        else:
            counts = counts and coord == 0
    return grad.to_local(), counts


def step_sums(named_params, coords: dict[str, int], flags: list[float], device=None) -> tuple[float, list[float]]:
    """The global gradient norm and ``flags`` summed over every rank, in one all-reduce of a
    few numbers, however deep the stages are: each rank adds the squares of the gradient
    elements it counts (:func:`_share`; ``named_params`` holds each tied tensor on one stage
    only), so every element of the model counts once. ``coords``: this rank's data- and
    tensor-parallel coordinates (``{"dp": 0, "tp": 1}``). A non-finite gradient makes the norm
    non-finite; only then is its FQN looked for."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    seen = set()
    for _, p in named_params:
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        share = _share(p.grad, coords)
        if share is None:  # its whole sum of squares, on every rank of its mesh: counted on one
            squares, counts = _squares(p.grad), not any(coords.values())
        else:
            local, counts = share
            squares = torch.linalg.vector_norm(local.float(), 2) ** 2
        if counts:
            total = total + squares.to(total)
    summed = torch.cat([total.reshape(1), torch.tensor(flags, dtype=torch.float64, device=total.device)])
    dist.all_reduce(summed)
    values = summed.tolist()
    return math.sqrt(values[0]), values[1:]


@torch.no_grad()
def clip_(params, max_norm: float, norm: float) -> float:
    """Scale every gradient by ``min(1, max_norm / (norm + 1e-6))``, as ``clip_grad_norm_``
    does; returns the factor."""
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0:
        seen = set()
        for p in params:
            if p.grad is not None and id(p) not in seen:
                seen.add(id(p))
                local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                local.mul_(coef)
    return coef
