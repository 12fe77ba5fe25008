"""LoRA adapters over a frozen model, through the peft library (``peft=lora``).

The adapted model keeps peft's own names (``base_model.model.<the model's FQN>``, a wrapped
layer's weight under ``.base_layer``, its adapters under ``.lora_A.default`` and
``.lora_B.default``), and the split keeps them. Only the adapters (and ``modules_to_save``)
train. Their initial values are drawn per FQN from the seed, as the model's own weights are
(:mod:`ppsplit.models.init`), so a rank that builds its stages alone gets the unsplit model's.
Under tensor parallelism the model's plan is laid over the adapters too
(:func:`ppsplit.stages.shard_flow.adapter_plan`).
"""

from __future__ import annotations

import warnings

import torch

from ppsplit.errors import PpsplitError
from ppsplit.models.init import _SeedPerTensor, base_key

def adapt(model: torch.nn.Module, spec, seed: int) -> torch.nn.Module:
    """``model`` with LoRA adapters as ``spec`` (a ``PeftSpec``) says, its base frozen."""
    import peft

    config = peft.LoraConfig(
        r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules) if isinstance(spec.target_modules, tuple) else spec.target_modules,
        modules_to_save=list(spec.modules_to_save) if spec.modules_to_save else None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # peft asks transformers what it deprecated
            adapted = peft.get_peft_model(model, config)
    except ValueError as err:
        raise PpsplitError(_refused(err, model, spec)) from None
    init_adapters(adapted, seed)
    return adapted


def _refused(err: ValueError, model, spec) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if spec.target_modules is None and "target_modules" in text:
        return (f"peft.target_modules=null: peft has no default for {type(model).__name__}; allowed: module names, "
                f"e.g. {_some_linear(model)}, or all-linear")
    given = list(spec.target_modules) if isinstance(spec.target_modules, tuple) else spec.target_modules
    return (f"peft.target_modules={given}: {text[:160]}; allowed: names of the model's modules, e.g. "
            f"{_some_linear(model)}, or all-linear")


def _some_linear(model, count: int = 4) -> str:
    names = []
    for fqn, module in model.named_modules():
        leaf = fqn.rpartition(".")[2]
        if list(module.parameters(recurse=False)) and not list(module.children()) and leaf not in names:
            names.append(leaf)
    return ", ".join(names[:count])


def init_adapters(model: torch.nn.Module, seed: int) -> None:
    """Every adapter reset as peft initialises it (A random, B zero), each random fill drawn from
    (seed, its FQN); adapters still on the meta device are left so, at no cost."""
    from peft.tuners.lora import LoraLayer


    names: dict[int, str] = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(tensor), base_key(name))  # the same however the model is held
    with torch.no_grad(), _SeedPerTensor(seed, names):
        for module in model.modules():
            if isinstance(module, LoraLayer):
                for adapter in list(module.lora_A.keys()):
                    if not module.lora_A[adapter].weight.is_meta:
                        module.reset_lora_parameters(adapter, True)


def is_adapted(model: torch.nn.Module) -> bool:
    return type(model).__module__.startswith("peft.")


def trainable(named_params) -> list[tuple[str, torch.Tensor]]:
    return [(k, p) for k, p in named_params if p.requires_grad]


PREFIX = "base_model.model."  # what peft puts before the base model's FQNs


def saved_key(fqn: str) -> str:
    """An adapter's name in peft's own files (``save_pretrained`` drops the adapter's name)."""
    return fqn.replace(".modules_to_save.default.", ".").replace(".default.", ".")
