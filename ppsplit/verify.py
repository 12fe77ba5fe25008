"""Prove a split is the original model: its stages' FQNs partition the original state_dict,
ties stay ties, values are the original's, and the chained stages compute what the model does."""

from __future__ import annotations

import math

from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from ppsplit.trace_split import Split


@dataclass
class FqnReport:
    ok: bool
    original_keys: int
    missing: list[str] = field(default_factory=list)  # in the original, in no stage
    unexpected: list[str] = field(default_factory=list)  # in a stage, not in the original
    duplicated: list[str] = field(default_factory=list)  # untied key held by several stages
    tied: list[dict] = field(default_factory=list)  # {"keys": [...], "stages": [...]}
    split_ties: list[str] = field(default_factory=list)  # tied names that are two tensors in one stage
    value_mismatch: list[str] = field(default_factory=list)  # stage tensor != original's
    # transformers' declared ties (all_tied_weights_keys) that the model's tensors do not show:
    # informational, the tensors are the truth
    declared_ties_not_found: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)

    def problems(self) -> list[str]:
        return [
            f"{name}: {', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''}"
            for name in ("missing", "unexpected", "duplicated", "split_ties", "value_mismatch")
            if (keys := getattr(self, name))
        ]


def verify_fqns(model: torch.nn.Module, split: Split, check_values: bool = True) -> FqnReport:
    """Check the stage state_dicts against ``model.state_dict()``.

    Every original key is in a stage and no stage has a key the original lacks; a key is in one
    stage unless it is tied in the original; inside a stage all names of one tied tensor are one
    tensor; and (``check_values``) every stage tensor equals the original's.
    """
    original = model.state_dict(keep_vars=True)
    stage_sds = [stage.state_dict(keep_vars=True) for stage in split.stages]
    groups = split.tie_groups  # the model's ties, and keys several stages hold (a shared layer)
    tied_keys = {k for g in groups for k in g}

    holders: dict[str, list[int]] = {}
    for s, sd in enumerate(stage_sds):
        for key in sd:
            holders.setdefault(key, []).append(s)
    missing = sorted(set(original) - set(holders))
    unexpected = sorted(set(holders) - set(original))
    duplicated = sorted(k for k, ss in holders.items() if len(ss) > 1 and k not in tied_keys)

    split_ties = []
    for group in groups:
        for s, sd in enumerate(stage_sds):
            present = [k for k in group if k in sd]
            if len({id(sd[k]) for k in present}) > 1:
                split_ties.extend(f"stage {s}: {k}" for k in present)
    tied = [
        {"keys": group, "stages": sorted({s for k in group for s in holders.get(k, [])})}
        for group in groups
    ]

    mismatch = []
    if check_values:
        for s, sd in enumerate(stage_sds):
            for key, tensor in sd.items():
                ref = original.get(key)
                if ref is None or ref is tensor or ref.is_meta or tensor.is_meta:
                    continue  # a shared tensor is the original's value by identity
                if ref.shape != tensor.shape or not torch.equal(ref.detach(), tensor.detach()):
                    mismatch.append(f"stage {s}: {key}")
    ok = not (missing or unexpected or duplicated or split_ties or mismatch)
    return FqnReport(ok, len(original), missing, unexpected, duplicated, tied, split_ties, mismatch,
                     declared_ties_not_found(model, groups))


def declared_ties_not_found(model: torch.nn.Module, groups) -> list[str]:
    """Cross-check the tie groups found from the tensors with the ties transformers declares."""
    declared = getattr(model, "all_tied_weights_keys", None)
    if declared is None:
        declared = getattr(model, "_tied_weights_keys", None)
    if not isinstance(declared, dict):
        return []
    group_of = {k: i for i, g in enumerate(groups) for k in g}
    return [f"{a} = {b}" for a, b in declared.items()
            if group_of.get(a) is None or group_of.get(a) != group_of.get(b)]


@dataclass
class Numerics:
    forward_max_abs_diff: float
    loss_abs_diff: float
    grad_max_abs_diff: float
    worst_grad: str

    def as_dict(self) -> dict:
        return asdict(self)

    def ok(self, tol: float = 1e-5) -> bool:
        return max(self.forward_max_abs_diff, self.loss_abs_diff, self.grad_max_abs_diff) <= tol


def verify_numerics(
    model: torch.nn.Module,
    split: Split,
    microbatches: Sequence,
    loss_fn: Callable,
) -> Numerics:
    """Forward, loss and gradients of the chained stages against the unsplit model.

    Each microbatch is run separately and the loss is their mean, as the pipeline schedules do.
    A tied tensor's gradient is summed over the stages that hold it before comparing. Gradients
    of ``model`` and of the stages are overwritten.
    """
    # The stages may share the model's tensors: take the model's gradients first, then clear
    # them and take the stages'.
    for module in (model, *split.stages):
        module.zero_grad(set_to_none=True)
    n = len(microbatches)
    ref_outs, ref_loss = [], 0.0
    for mb in microbatches:
        out = model(*mb.args, **mb.kwargs)
        loss = loss_fn(out, mb.labels) / n
        loss.backward()
        ref_outs.append(out)
        ref_loss += loss.item()
    ref_grads = {k: None if p.grad is None else p.grad.clone()
                 for k, p in model.named_parameters(remove_duplicate=False)}
    for module in (model, *split.stages):
        module.zero_grad(set_to_none=True)
    fwd_diff, split_loss = 0.0, 0.0
    for mb, ref_out in zip(microbatches, ref_outs):
        out = split(*mb.args, **mb.kwargs)
        fwd_diff = max(fwd_diff, _max_abs_diff(ref_out, out))
        loss = loss_fn(out, mb.labels) / n
        loss.backward()
        split_loss += loss.item()

    # A tied tensor's gradient is summed over the distinct tensors the stages hold for it.
    group_of = {k: g for g in split.tie_groups for k in g}
    tensors_of: dict[str, dict[int, torch.Tensor]] = {}
    for stage in split.stages:
        for key, p in stage.named_parameters(remove_duplicate=False):
            for k in group_of.get(key, [key]):
                tensors_of.setdefault(k, {})[id(p)] = p
    summed: dict[str, torch.Tensor] = {}
    for key, tensors in tensors_of.items():
        grads = [p.grad for p in tensors.values() if p.grad is not None]
        if grads:
            summed[key] = torch.stack(grads).sum(0)
    grad_diff, worst = 0.0, ""
    for key, ref in ref_grads.items():
        got = summed.get(key)
        if ref is None and got is None:
            continue
        ref = torch.zeros_like(got) if ref is None else ref
        got = torch.zeros_like(ref) if got is None else got
        diff = (ref - got).abs().max().item() if ref.numel() else 0.0
        if diff > grad_diff:
            grad_diff, worst = diff, key
    return Numerics(fwd_diff, abs(ref_loss - split_loss), grad_diff, worst)


def _max_abs_diff(a, b) -> float:
    la = [t for t in torch.utils._pytree.tree_leaves(a) if isinstance(t, torch.Tensor)]
    lb = [t for t in torch.utils._pytree.tree_leaves(b) if isinstance(t, torch.Tensor)]
    if len(la) != len(lb):
        return float("inf")
    return max(((x.detach().float() - y.detach().float()).abs().max().item() for x, y in zip(la, lb)),
               default=0.0)


def compare_training(reference: dict, losses: Sequence[float], first_grads: Sequence[dict],
                     states: Sequence[dict], tie_groups: Sequence[Sequence[str]],
                     loss_rtol: float = 1e-5, grad_atol: float = 1e-5, tie_atol: float = 1e-6) -> dict:
    """Compare a pipelined training run with the unsplit model's (:func:`train_in_process`).

    ``first_grads`` and ``states`` hold, per stage or rank, tensors by original FQN: the
    gradients of the first step (after tied gradients were summed) and the final values.
    Without a ``reference`` (a model too large for the driver), only the ties and the losses'
    finiteness are checked.
    """
    ref_state = reference["state"][0] if reference is not None else None
    ties = []
    for group in tie_groups:
        copies = [(key, state[key]) for state in states for key in group if key in state]
        if not copies:
            continue
        first = copies[0][1]
        ties.append({
            "keys": list(group),
            "copies": len(copies),
            "copies_bitwise_equal": all(torch.equal(first, t) for _, t in copies),
            "max_abs_diff_vs_reference": None if ref_state is None else max(
                (t.float() - ref_state[k].float()).abs().max().item() for k, t in copies),
        })
    if reference is None:
        ok = all(math.isfinite(x) for x in losses) and all(t["copies_bitwise_equal"] for t in ties)
        return {"losses": list(losses), "reference_losses": None, "max_loss_rel_diff": None,
                "grad_max_abs_diff": None, "worst_grad": "", "ties": ties, "ok": ok}

    ref_losses = reference["losses"]
    rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses)]
    # max() skips a NaN that is not first: any non-finite value fails the comparison
    max_rel = (max(rel, default=0.0) if len(losses) == len(ref_losses) and all(map(math.isfinite, rel))
               else float("inf"))

    ref_grads = reference["first_grads"][0] if reference["first_grads"] else {}
    grad_diff, worst = 0.0, ""
    for grads in first_grads:
        for key, grad in grads.items():
            ref = ref_grads.get(key)
            diff = float("inf") if ref is None else (grad.float() - ref.float()).abs().max().item()
            if not math.isfinite(diff):
                diff = float("inf")
            if diff > grad_diff:
                grad_diff, worst = diff, key

    ok = (max_rel <= loss_rtol and grad_diff <= grad_atol and
          all(t["copies_bitwise_equal"] and math.isfinite(t["max_abs_diff_vs_reference"])
              and t["max_abs_diff_vs_reference"] <= tie_atol for t in ties))
    return {
        "losses": list(losses),
        "reference_losses": list(ref_losses),
        "max_loss_rel_diff": max_rel,
        "grad_max_abs_diff": grad_diff,
        "worst_grad": worst,
        "ties": ties,
        "ok": ok,
    }
