"""When a result counts as the unsplit model's: one rule for every comparison ppsplit makes.

A value ``got`` (a stage output, a loss, a gradient, a trained tensor, a tied copy) matches the
unsplit model's ``want`` when

    max |got - want|  <=  atol + rtol * scale

over the whole tensor (for a loss, the loss itself). This is ``torch.testing``'s rule with the
scale taken per tensor, not per element: float32 rounding in a sum is relative to the terms
summed, and an element that is a near-cancelling sum (a gradient close to zero, a tied gradient
summed from four stages in another order) carries the rounding of its terms, not of its own
small size. ``atol`` is only a floor for a tensor that is zero throughout.

Two levels, both from the config:

- ``tolerance`` (rtol, default 1e-5: about 80 float32 units in the last place) for what one
  forward and backward compute: stage outputs, losses, gradients, gradient norms, validation
  losses; the scale is the value's own (``max |want|``), for a gradient the largest of its
  module's gradients if that is larger: a gradient that is zero but for rounding (an attention
  key bias, to which softmax is blind) carries the rounding of the module's other terms. BERT
  at pp2 x dp2 in bf16: the key bias's gradient 1.3e-7 from the unsplit model's at a scale of
  its own of 4e-8.
- ``tie_tolerance`` (rtol, default 1e-4 under SGD, 1e-3 under Adam and AdamW) for what comes
  after optimizer steps (later losses and gradient norms, each trained parameter, every copy of
  a tied one); the scale is the tensor's own or the model's weight scale (the largest entry of
  any of its parameters before training), whichever is larger. An adaptive optimizer divides
  each gradient by its own running size, so an entry whose gradient is rounding noise (a row of
  a vocabulary-parallel embedding no token of the batch uses, an attention key bias, to which
  softmax is blind) moves by up to the learning rate in a direction the noise picks, differently
  on each side. Measured, T5 at pp2 x dp2 x tp2, three steps at lr 1e-3: the tied embedding
  1.2e-7 from the unsplit model's under SGD, 1.5e-4 under AdamW, and the gradient norm at step 3
  1.1e-4 apart (relative); ALBERT's key bias 1.7e-7 apart after moving 4.9e-7.

bf16 (``train.precision=bf16``): 2e-2 and 5e-2 (a bfloat16 product keeps 8 bits).

What the rule still catches, by tests that inject each: a tied copy left unsynchronised
(copies that differ at all fail, and their gradients are off by a whole stage's share), one
stage's gradient dropped, a microbatch processed twice (its loss is off by about 1/m), and a
1e-3 change of one weight (the first step's gradients of the layers before it move by far more
than 1e-5 of their scale).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ATOL_FLOOR = 1e-8  # for a tensor that is zero throughout


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float = ATOL_FLOOR

    def bound(self, scale: float) -> float:
        return self.atol + self.rtol * scale


@dataclass
class Difference:
    """How far one value is from the unsplit model's, against its bound."""
    name: str  # the FQN (or "loss at step K", "forward output K")
    kind: str  # "output", "loss", "gradient", "trained tensor" or "tie copy"
    max_abs_diff: float
    scale: float
    bound: float

    @property
    def ok(self) -> bool:
        return math.isfinite(self.max_abs_diff) and self.max_abs_diff <= self.bound

    @property
    def excess(self) -> float:
        """How many bounds away: above 1 fails."""
        if not math.isfinite(self.max_abs_diff):
            return math.inf
        return self.max_abs_diff / self.bound if self.bound > 0 else (math.inf if self.max_abs_diff else 0.0)

    def as_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "max_abs_diff": self.max_abs_diff, "scale": self.scale,
                "bound": self.bound, "ok": self.ok}

    def describe(self) -> str:
        return (f"{self.kind} {self.name}: off by {self.max_abs_diff:.2e} at scale {self.scale:.2e} "
                f"(allowed {self.bound:.2e})")


def tensor_difference(name: str, kind: str, got, want, tol: Tolerance, scale_floor: float = 0.0) -> Difference:
    """``got`` against ``want`` (tensors of one shape, or None for a missing one); the scale is
    ``max |want|``, or ``scale_floor`` if that is larger (a trained tensor: the model's)."""
    if got is None or want is None or tuple(got.shape) != tuple(want.shape):
        return Difference(name, kind, math.inf, math.nan, 0.0)
    if not want.numel():
        return Difference(name, kind, 0.0, 0.0, tol.bound(0.0))
    g, w = got.detach().float(), want.detach().float()
    diff = (g - w).abs().max().item()
    scale = max(w.abs().max().item(), scale_floor)
    if not math.isfinite(scale):
        return Difference(name, kind, math.inf, scale, 0.0)
    return Difference(name, kind, diff if math.isfinite(diff) else math.inf, scale, tol.bound(scale))


def scalar_difference(name: str, kind: str, got: float, want: float, tol: Tolerance) -> Difference:
    if got is None or want is None or not (math.isfinite(got) and math.isfinite(want)):
        return Difference(name, kind, math.inf, math.nan if want is None else abs(want), 0.0)
    return Difference(name, kind, abs(got - want), abs(want), tol.bound(abs(want)))


def worst(differences) -> Difference | None:
    """The failing difference furthest past its bound, else the closest to it (None if none)."""
    differences = list(differences)
    if not differences:
        return None
    failing = [d for d in differences if not d.ok]
    return max(failing or differences, key=lambda d: d.excess)
