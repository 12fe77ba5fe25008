"""Random weights that do not depend on how the model is cut: every random fill of the model's
own ``_init_weights`` draws from a generator seeded by (seed, FQN), so a stage built alone on
a rank gets the values the whole model would."""

from __future__ import annotations

import re

import torch

# What peft adds to a wrapped module's names (the adapters themselves keep theirs).
_PEFT_PARTS = re.compile(r"\.(base_layer|original_module|modules_to_save\.default)(?=\.|$)")


# Random in-place fills (Tensor methods and torch.nn.init functions) that take a generator.
_RANDOM_FILLS = ("normal_", "uniform_", "bernoulli_", "random_", "exponential_", "cauchy_",
                 "log_normal_", "geometric_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                 "xavier_uniform_", "xavier_normal_", "orthogonal_", "sparse_")


def _tensor_seed(seed: int, fqn: str) -> int:
    import hashlib

    return int(hashlib.sha256(f"{seed}:{fqn}".encode()).hexdigest()[:15], 16)


class _SeedPerTensor(torch.overrides.TorchFunctionMode):
    """Every random fill of a model tensor draws from a generator seeded by (seed, its FQN), so a
    tensor's initial value does not depend on which other tensors exist or were filled before:
    the same on a rank that holds one stage as in the unsplit model."""

    def __init__(self, seed: int, names: dict[int, str]):
        super().__init__()
        self.seed, self.names = seed, names

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if getattr(func, "__name__", "") in _RANDOM_FILLS:
            # torch.nn.init passes the tensor by keyword, Tensor methods as self
            target = args[0] if args else kwargs.get("tensor")
            fqn = self.names.get(id(target))
            if fqn is not None and not target.is_meta:
                kwargs["generator"] = torch.Generator(target.device).manual_seed(_tensor_seed(self.seed, fqn))
        return func(*args, **kwargs)


def initialize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Run the model's own initialisation (``_init_weights`` of every module), deterministic per
    tensor from ``seed``. Tensors still on the meta device are skipped at no cost, so a rank can
    materialise and initialise only its own stage's tensors. Non-persistent buffers (rotary
    ``inv_freq``, ``position_ids``) are recomputed by the same pass."""
    names: dict[int, str] = {}
    for name, tensor in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(tensor), base_key(name))  # an adapted model's base: as when built before them
    for module in model.modules():
        module._is_hf_initialized = False
        for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if hasattr(t, "_is_hf_initialized"):
                t._is_hf_initialized = False
    with torch.no_grad(), _SeedPerTensor(seed, names):
        model.initialize_weights()
        model.tie_weights()
    return model


def base_key(fqn: str) -> str:
    """The name a tensor of a peft-adapted model has in the base model (and in the base's own
    checkpoint); other names are their own."""
    if not fqn.startswith("base_model.model."):
        return fqn
    return _PEFT_PARTS.sub("", fqn.removeprefix("base_model.model."))
