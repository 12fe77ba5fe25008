"""The same dropout masks in the pipeline as in the unsplit model (``dropout=true``).

Dropout draws from the global random generator in the order its ops run. In a pipeline each
stage runs on its own rank with its own generator, so the masks would differ from the unsplit
model's and no comparison could hold. Instead, the generator is seeded at the start of every
stage's forward from (seed, step, microbatch, stage): by a hook on each stage module, and by
hooks at the same places of the unsplit model (its own forward for stage 0, each split point's
module for the others). A stage's ops run in the traced order, which is the model's, so both
sides draw the same masks. Not possible: a split at ``pipe_split()`` markers (no module to hook)
and tensor parallelism (a rank draws for its shard, not a slice of the whole mask).
"""

from __future__ import annotations

import hashlib

import torch

from ppsplit.errors import PpsplitError
from ppsplit.stages.points import END, MARKER


class MaskSeeds:
    """Seeds the generator at each stage's start. ``first_microbatch``: the global index of this
    data-parallel rank's first microbatch (each rank runs its own contiguous part of the batch)."""

    def __init__(self, seed: int, first_microbatch: int = 0):
        self.seed, self.offset = seed, first_microbatch
        self.step = 0
        self._calls: dict[int, int] = {}

    def start_step(self, step: int) -> None:
        self.step, self._calls = step, {}

    def reseed(self, stage: int) -> None:
        microbatch = self.offset + self._calls.get(stage, 0)
        self._calls[stage] = self._calls.get(stage, 0) + 1
        key = f"{self.seed}:{self.step}:{microbatch}:{stage}".encode()
        torch.manual_seed(int(hashlib.sha256(key).hexdigest()[:15], 16))

    def on_stages(self, modules: dict[int, torch.nn.Module]) -> list:
        """Seed at the start of each stage module's forward; returns the hook handles."""
        return [module.register_forward_pre_hook(lambda _m, _a, i=i: self.reseed(i))
                for i, module in modules.items()]

    def on_model(self, model: torch.nn.Module, points: list[str]) -> list:
        """Seed at the same places of the unsplit model: its forward (stage 0) and each point
        (a module's start, the K-th call of one that runs several times, or a module's end)."""
        calls: dict[tuple[str, bool], int] = {}
        wanted: dict[tuple[str, bool], dict[int, int]] = {}  # (module, at its end) -> call -> stage
        for stage, point in enumerate(points, start=1):
            if point.startswith(MARKER + ":"):
                raise PpsplitError(f"dropout=true with the split point {point!r}: a pipe_split() marker has no "
                                   "module where the unsplit model's masks can be drawn alike; allowed: "
                                   "module split points, or dropout=false")
            after = point.endswith(END)
            name, _, k = (point[:-len(END)] if after else point).partition("@")
            wanted.setdefault((name, after), {})[int(k) if k else 0] = stage

        def start(_module, _args):
            calls.clear()
            self.reseed(0)

        handles = [model.register_forward_pre_hook(start)]
        for (name, after), stages in wanted.items():
            def hook(_module, *_rest, where=(name, after), stages=stages):
                call = calls.get(where, 0)
                calls[where] = call + 1
                if call in stages:
                    self.reseed(stages[call])

            module = model.get_submodule(name)
            handles.append(module.register_forward_hook(hook) if after else module.register_forward_pre_hook(hook))
        return handles
