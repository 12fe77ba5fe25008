"""Build a Hugging Face model from its config (random weights) or a local folder, and make
deterministic example batches, labels and the loss for it."""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from ppsplit.errors import PpsplitError
from ppsplit.config.tasks import model_class
from ppsplit.config.spec import INITS
from ppsplit.models.init import initialize



def build_model(
    class_name: str,
    config: dict[str, Any] | None = None,
    pretrained: str | None = None,
    seed: int = 0,
    dropout: bool = False,
) -> torch.nn.Module:
    """A transformers model: from a local ``pretrained`` folder, or from ``config`` with random
    weights drawn deterministically from ``seed``. No model hub is ever contacted. Without
    ``dropout`` every stochastic layer is off (see :func:`stochastic_settings`)."""
    cls = model_class(class_name)
    if pretrained:  # in training mode, as a model built from its config is (from_pretrained gives eval)
        return load_pretrained(cls, pretrained, config, dropout).train()
    torch.manual_seed(seed)
    cfg = load_config(cls, config, dropout=dropout)
    # Re-initialise deterministically per tensor, so a rank that builds only its stage from the
    # meta device (model.init=meta) gets exactly these values.
    return initialize(cls(cfg), seed)


def check_pretrained_folder(folder: str) -> str:
    folder = os.path.expanduser(str(folder))
    if not os.path.isdir(folder):
        raise PpsplitError(f"model.pretrained={folder!r} is not a folder; give a local model folder")
    names = set(os.listdir(folder))
    has_weights = any(n.endswith((".safetensors", ".bin")) or n.endswith(".index.json") for n in names)
    if "config.json" not in names or not has_weights:
        raise PpsplitError(
            f"model.pretrained={folder!r} holds no model; expected config.json and weights "
            "(*.safetensors or *.bin) as written by save_pretrained"
        )
    return folder


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def load_config(cls, config: dict | None = None, pretrained: str | None = None, dropout: bool = False):
    """The model's transformers config: ``config`` as the fields of a new one or, with
    ``pretrained``, applied on top of that folder's ``config.json``; without ``dropout``, every
    probability of dropping something set to 0."""
    cfg = _load_config(cls, config, pretrained)
    if not dropout:
        for holder, key, _ in _stochastic(cfg):
            setattr(holder, key, 0.0)
    return cfg


# Config fields that make a layer random in training: dropout, layer drop, drop path, jitter.
_STOCHASTIC = re.compile(r"dropout|pdrop|layerdrop|drop_path|drop_rate|jitter", re.I)


def _stochastic(cfg, prefix: str = "") -> list[tuple[Any, str, float]]:
    found = []
    for key, value in vars(cfg).items():
        if key.startswith("_"):
            continue
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a sub-config (text_config...)
            found += _stochastic(value, f"{prefix}{key}.")
        elif (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
              and _STOCHASTIC.search(key)):
            found.append((cfg, key, value))
    return found


def stochastic_settings(class_name: str, config: dict | None = None, pretrained: str | None = None) -> dict:
    """The model's config fields that make training random (dropout, layer drop, drop path,
    router jitter) and are above 0, by name: what ``dropout=false`` switches off."""
    cfg = _load_config(model_class(class_name), config, pretrained)
    return {key: value for _, key, value in _stochastic(cfg)}


def _load_config(cls, config: dict | None, pretrained: str | None):
    if pretrained:
        folder = check_pretrained_folder(pretrained)
        try:
            cfg = cls.config_class.from_pretrained(folder, local_files_only=True)
        except Exception as err:  # a corrupt or foreign config.json
            raise PpsplitError(f"model.pretrained={folder!r}: its config.json cannot be read as a "
                               f"{cls.config_class.__name__}: {_first_line(err)}") from None
        for key, value in (config or {}).items():
            setattr(cfg, key, value)
        return cfg
    try:
        return cls.config_class(**dict(config or {}))
    except Exception as err:
        raise PpsplitError(f"model.config: {cls.config_class.__name__} refuses it: {_first_line(err)}") from None


def load_pretrained(cls, folder: str, config: dict | None = None, dropout: bool = False) -> torch.nn.Module:
    cfg = load_config(cls, config, folder, dropout)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line per phase is ppsplit's; no bars from the loader
    try:
        return cls.from_pretrained(folder, config=cfg, local_files_only=True)
    except Exception as err:  # transformers raises many types; report one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PpsplitError(f"model.pretrained={folder!r} could not be loaded: {first}") from None


# --- Initialisation that does not need the whole model in memory -------------------------------

INIT_THRESHOLD_PARAMS = 1_000_000_000  # model.init=auto traces on meta above this many parameters


def build_on_meta(class_name: str, config: dict | None = None, pretrained: str | None = None,
                  dropout: bool = False) -> torch.nn.Module:
    """The model's structure with every parameter and buffer on the meta device: no memory.
    With ``pretrained``, the structure comes from that folder's config.json."""
    cls = model_class(class_name)
    cfg = load_config(cls, config, pretrained, dropout)
    with torch.device("meta"):
        return cls(cfg)


def count_tensor_params(model: torch.nn.Module) -> int:
    """Parameters of ``model``, a tied tensor once."""
    return sum(p.numel() for p in model.parameters())


def count_params(class_name: str, config: dict | None = None, pretrained: str | None = None) -> int:
    return sum(p.numel() for p in build_on_meta(class_name, config, pretrained).parameters())


def resolve_init(init: str, class_name: str, config: dict | None, pretrained: str | None,
                 threshold: int = INIT_THRESHOLD_PARAMS, model: torch.nn.Module | None = None) -> str:
    """``real`` or ``meta``: ``auto`` traces on meta once the model has more than ``threshold``
    parameters. ``model``: its structure, when one was built already (else one is, on meta)."""
    if init not in INITS:
        raise PpsplitError(f"model.init={init!r} is not known; allowed: {', '.join(INITS)}")
    if init != "auto":
        return init
    count = count_tensor_params(model) if model is not None else count_params(class_name, config, pretrained)
    return "meta" if count > threshold else "real"


def model_of(spec, meta: bool = False) -> torch.nn.Module:
    """The job's model (a ``JobSpec``'s): real weights, or its structure on meta, with its
    adapters when ``peft`` asks for them."""
    m = spec.model
    if meta:
        model = build_on_meta(m.class_name, m.config, m.pretrained, spec.dropout)
    else:
        model = build_model(m.class_name, m.config, m.pretrained, spec.seed, spec.dropout)
    if spec.peft.on:
        from ppsplit.models.adapters import adapt

        model = adapt(model, spec.peft, spec.seed)
    return model
