"""Prove a split is the original model: its stages' FQNs partition the original state_dict,
ties stay ties, values are the original's, and the chained stages compute what the model does."""

from __future__ import annotations

import contextlib
import math

from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from ppsplit.stages.tolerance import Difference, Tolerance, scalar_difference, tensor_difference, worst
from ppsplit.stages.trace import Split


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
    """The chained stages against the unsplit model on the same microbatches: the largest
    differences (for the report) and every compared value with its scale, so that
    :meth:`ok` applies the rule of :mod:`ppsplit.stages.tolerance` at any ``rtol``."""
    forward_max_abs_diff: float
    loss_abs_diff: float
    grad_max_abs_diff: float
    worst_grad: str
    items: list = field(default_factory=list, repr=False)  # (name, kind, max abs diff, scale)

    def as_dict(self) -> dict:
        return {"forward_max_abs_diff": self.forward_max_abs_diff, "loss_abs_diff": self.loss_abs_diff,
                "grad_max_abs_diff": self.grad_max_abs_diff, "worst_grad": self.worst_grad}

    def differences(self, rtol: float = 1e-5) -> list[Difference]:
        tol = Tolerance(rtol)
        return [Difference(name, kind, diff, scale, tol.bound(scale) if math.isfinite(scale) else 0.0)
                for name, kind, diff, scale in self.items]

    def ok(self, rtol: float = 1e-5) -> bool:
        """Every output, the loss and every gradient within ``rtol`` of the tensor's scale."""
        return all(d.ok for d in self.differences(rtol))

    def worst(self, rtol: float = 1e-5) -> Difference | None:
        return worst(self.differences(rtol))


def verify_numerics(
    model: torch.nn.Module,
    split: Split,
    microbatches: Sequence,
    loss_fn: Callable,
    masks=None,
) -> Numerics:
    """Forward, loss and gradients of the chained stages against the unsplit model.

    Each microbatch is run separately, as the pipeline schedules do. With a
    :class:`ppsplit.train.objective.Objective` the loss is the whole batch's (each scored item over the
    count in every microbatch); with any other ``loss_fn``, the mean of the microbatches' losses.
    A tied tensor's gradient is summed over the stages that hold it before comparing. Gradients
    of ``model`` and of the stages are overwritten. ``masks`` (a :class:`ppsplit.train.dropout.MaskSeeds`)
    draws a model's dropout masks alike on both sides.
    """
    # The stages may share the model's tensors: take the model's gradients first, then clear
    # them and take the stages'.
    for module in (model, *split.stages):
        module.zero_grad(set_to_none=True)
    loss_of = _whole_batch_loss(loss_fn, microbatches)
    ref_outs, ref_loss = [], 0.0
    with _masks_drawn(masks, model=model, points=split.points):
        for mb in microbatches:
            out = model(*mb.args, **mb.kwargs)
            loss = loss_of(out, mb.labels)
            loss.backward()
            ref_outs.append(out)
            ref_loss += loss.item()
    ref_grads = {k: None if p.grad is None else p.grad.clone()
                 for k, p in model.named_parameters(remove_duplicate=False)}
    for module in (model, *split.stages):
        module.zero_grad(set_to_none=True)
    with _masks_drawn(masks, stages=split.stages):
        items, split_loss = _run_split(split, microbatches, ref_outs, loss_of)
    items.append(("loss", "loss", abs(ref_loss - split_loss) if math.isfinite(split_loss) else math.inf,
                  abs(ref_loss)))

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
    grad_diff, worst_grad = 0.0, ""
    for key, ref in ref_grads.items():
        got = summed.get(key)
        if ref is None and got is None:
            continue
        ref = torch.zeros_like(got) if ref is None else ref
        got = torch.zeros_like(ref) if got is None else got
        d = tensor_difference(key, "gradient", got, ref, Tolerance(0.0))
        items.append((key, "gradient", d.max_abs_diff, d.scale))
        if d.max_abs_diff > grad_diff:
            grad_diff, worst_grad = d.max_abs_diff, key
    fwd = max((diff for _, kind, diff, _ in items if kind == "output"), default=0.0)
    return Numerics(fwd, items_of(items, "loss")[0][2], grad_diff, worst_grad, items)


def _whole_batch_loss(loss_fn, microbatches) -> Callable:
    """Each microbatch's part of the whole batch's loss."""
    if not (hasattr(loss_fn, "total") and hasattr(loss_fn, "count")):
        return lambda out, labels: loss_fn(out, labels) / len(microbatches)
    weight = 1.0 / max(1, sum(loss_fn.count(mb.labels) for mb in microbatches))
    return lambda out, labels: loss_fn.total(out, labels) * weight


def _run_split(split, microbatches, ref_outs, loss_of):
    items, split_loss = [], 0.0
    for k, (mb, ref_out) in enumerate(zip(microbatches, ref_outs)):
        out = split(*mb.args, **mb.kwargs)
        items += _output_items(k, ref_out, out)
        loss = loss_of(out, mb.labels)
        loss.backward()
        split_loss += loss.item()
    return items, split_loss


@contextlib.contextmanager
def _masks_drawn(masks, model=None, points=(), stages=()):
    """Within the block, ``masks`` seeds each stage's start (in ``stages``, or at ``points`` of
    ``model``), from step 0."""
    if masks is None:
        yield
        return
    masks.start_step(0)
    handles = masks.on_model(model, list(points)) if model is not None else masks.on_stages(dict(enumerate(stages)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def items_of(items, kind):
    return [item for item in items if item[1] == kind]


def _output_items(k: int, a, b) -> list[tuple]:
    from ppsplit.torch_private import pytree

    la = [t for t in pytree.tree_leaves(a) if isinstance(t, torch.Tensor)]
    lb = [t for t in pytree.tree_leaves(b) if isinstance(t, torch.Tensor)]
    if len(la) != len(lb):
        return [(f"microbatch {k} outputs", "output", math.inf, math.nan)]
    out = []
    for i, (want, got) in enumerate(zip(la, lb)):
        d = tensor_difference(f"microbatch {k} output {i}", "output", got, want, Tolerance(0.0))
        out.append((d.name, d.kind, d.max_abs_diff, d.scale))
    return out


def compare_training(reference: dict | None, mine: dict, tie_groups: Sequence[Sequence[str]],
                     computed: Tolerance = Tolerance(1e-5), trained: Tolerance = Tolerance(1e-4)) -> dict:
    """Compare a pipelined training run with the unsplit model's
    (:func:`ppsplit.train.loop.train_in_process`), by the rule of :mod:`ppsplit.stages.tolerance`: what
    the first step computes (its loss, gradient norm and gradients) at ``computed``; what comes
    after optimizer steps (later losses and gradient norms, validation losses, every trained
    tensor and tied copy) at ``trained``. The copies of a tie must also be bitwise equal.

    ``mine``: the pipeline's ``losses``, ``grad_norms``, ``val_losses`` (``{"step", "loss"}``),
    ``first_grads`` and ``states`` (per stage or rank, tensors by original FQN: the gradients of
    the first step, after tied gradients were summed and clipping, and the final values). A
    reference that ran fewer steps (``verify=N``) is compared on those; without a ``reference``
    (``verify=off``, or a model too large for the driver) only the ties and the losses'
    finiteness are checked.
    """
    losses, states = list(mine["losses"]), mine["states"]
    ref_steps = len(reference["losses"]) if reference is not None else 0
    whole = reference is not None and ref_steps == len(losses)
    ref_state = reference["state"][0] if whole else None
    weights = _weight_scale(reference["initial"] if whole else {})
    tied = {k for group in tie_groups for k in group}
    ties, differences = _compare_ties(tie_groups, states, ref_state, trained, weights)
    if reference is None:
        ok = all(math.isfinite(x) for x in losses) and all(t["copies_bitwise_equal"] for t in ties)
        return {"losses": losses, "reference_losses": None, "max_loss_rel_diff": None,
                "grad_max_abs_diff": None, "worst_grad": "", "ties": ties, "ok": ok,
                "mismatch": None if ok else _mismatch(differences)}

    ref_losses = reference["losses"]
    compared = losses[:ref_steps]
    differences += _compare_step_scalars(compared, mine, reference, computed, trained)
    max_rel = _max_loss_rel_diff(compared, ref_losses)
    grad_differences, grad_diff, worst_grad = _compare_first_grads(mine["first_grads"], reference, computed)
    differences += grad_differences
    if ref_state is not None:
        differences += _compare_trained_tensors(states, ref_state, tied, trained, weights)
    ok = all(d.ok for d in differences)
    return {
        "losses": losses,
        "reference_losses": list(ref_losses),
        "max_loss_rel_diff": max_rel,
        "grad_max_abs_diff": grad_diff,
        "worst_grad": worst_grad,
        "ties": ties,
        "ok": ok,
        "mismatch": None if ok else _mismatch(differences),
    }


def _weight_scale(initial: dict) -> float:
    """The largest entry of the model's floating-point weights before training: a trained
    tensor's scale is at least this (see ppsplit.stages.tolerance); 0.0 without weights."""
    return max((v.detach().abs().max().item() for v in initial.values()
                if v.is_floating_point() and v.numel()), default=0.0)


def _compare_ties(tie_groups: Sequence[Sequence[str]], states, ref_state: dict | None, trained: Tolerance,
                  weights: float) -> tuple[list[dict], list[Difference]]:
    """The report of each tie group the run holds, and its differences: its copies must be
    bitwise equal, and (with ``ref_state``) each near the reference's trained value."""
    differences: list[Difference] = []
    ties = []
    for group in tie_groups:
        copies = [(key, state[key]) for state in states for key in group if key in state]
        if not copies:
            continue
        first = copies[0][1]
        bitwise = all(torch.equal(first, t) for _, t in copies)
        vs_ref = None if ref_state is None else [
            tensor_difference(k, "tie copy", t, ref_state.get(k), trained, weights) for k, t in copies]
        if not bitwise:
            differences.append(Difference(f"{group[0]} (its copies are not bitwise equal)", "tie copy",
                                          math.inf, math.nan, 0.0))
        differences += vs_ref or []
        ties.append({
            "keys": list(group),
            "copies": len(copies),
            "copies_bitwise_equal": bitwise,
            "max_abs_diff_vs_reference": None if vs_ref is None else max(d.max_abs_diff for d in vs_ref),
        })
    return ties, differences


def _compare_step_scalars(compared: list, mine: dict, reference: dict, computed: Tolerance,
                          trained: Tolerance) -> list[Difference]:
    """The differences of the per-step numbers: the step count, each loss and gradient norm, and
    the validation losses at the steps both runs evaluated."""
    differences: list[Difference] = []
    ref_losses = reference["losses"]
    if len(compared) != len(ref_losses):
        differences.append(Difference(f"(steps: {len(compared)} against {len(ref_losses)})", "loss",
                                      math.inf, math.nan, 0.0))
    # The first step computes from the same weights on both sides; every later one from weights
    # that optimizer steps have made (ppsplit.stages.tolerance: the trained level).
    for step, (got, want) in enumerate(zip(compared, ref_losses)):
        differences.append(scalar_difference(f"at step {step + 1}", "loss", got, want, trained if step else computed))
    for step, (got, want) in enumerate(zip(mine.get("grad_norms", []), reference.get("grad_norms", []))):
        differences.append(scalar_difference(f"at step {step + 1}", "gradient norm", got, want,
                                             trained if step else computed))
    ref_val = {v["step"]: v["loss"] for v in reference.get("val_losses", [])}
    for v in mine.get("val_losses", []):
        if v["step"] in ref_val:
            differences.append(scalar_difference(f"at step {v['step']}", "validation loss", v["loss"],
                                                 ref_val[v["step"]], trained))
    return differences


def _max_loss_rel_diff(compared: list, ref_losses: list) -> float:
    """The largest relative difference of the compared losses, for the report; inf when the step
    counts differ or any difference is not finite."""
    rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(compared, ref_losses)]
    # max() skips a NaN that is not first: any non-finite value fails the comparison
    return (max(rel, default=0.0) if len(compared) == len(ref_losses) and all(map(math.isfinite, rel))
            else float("inf"))


def _compare_first_grads(first_grads: list, reference: dict, computed: Tolerance
                         ) -> tuple[list[Difference], float, str]:
    """The differences of the first step's gradients from the reference's, each at its module's
    scale, with the largest absolute difference (inf if any is not finite) and its key."""
    differences: list[Difference] = []
    ref_grads = reference["first_grads"][0] if reference["first_grads"] else {}
    module_scale = gradient_scales_by_module(ref_grads)
    grad_diff, worst_grad = 0.0, ""
    for grads in first_grads:
        for key, grad in grads.items():
            d = tensor_difference(key, "gradient", grad, ref_grads.get(key), computed,
                                  module_scale.get(key.rpartition(".")[0], 0.0))
            differences.append(d)
            if not math.isfinite(d.max_abs_diff) or d.max_abs_diff > grad_diff:
                grad_diff, worst_grad = d.max_abs_diff if math.isfinite(d.max_abs_diff) else math.inf, key
    return differences, grad_diff, worst_grad


def _compare_trained_tensors(states, ref_state: dict, tied: set, trained: Tolerance,
                             weights: float) -> list[Difference]:
    """The differences of every trained tensor from the reference's final value; tied copies are
    left to :func:`_compare_ties`."""
    differences: list[Difference] = []
    for state in states:
        for key, value in state.items():
            if key not in tied:
                differences.append(tensor_difference(key, "trained tensor", value, ref_state.get(key), trained,
                                                     weights))
    return differences


def gradient_scales_by_module(grads: dict) -> dict[str, float]:
    """The largest gradient entry of each module's tensors (``a.b.weight`` and ``a.b.bias``
    under ``a.b``): the scale a gradient of that module is compared at when its own is smaller
    (ppsplit.stages.tolerance). An attention key bias, to which softmax is blind, has a gradient that
    is zero but for rounding, and that rounding is the size of the module's other terms."""
    scales: dict[str, float] = {}
    for key, grad in grads.items():
        if grad is not None and grad.numel():
            module, top = key.rpartition(".")[0], grad.detach().abs().max().item()
            if math.isfinite(top):
                scales[module] = max(scales.get(module, 0.0), top)
    return scales


def _mismatch(differences: list[Difference]) -> dict | None:
    """The first failing value, for the report: the furthest past its bound."""
    d = worst(differences)
    return None if d is None or d.ok else {**d.as_dict(), "tie_copy": d.kind == "tie copy"}
