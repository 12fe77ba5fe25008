"""Build a Hugging Face model from its config (random weights) or a local folder, and make
deterministic example batches, labels and the loss for it."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from ppsplit.errors import PpsplitError
from ppsplit.config.tasks import IGNORE, model_class
from ppsplit.config.spec import INITS
from ppsplit.models.init import initialize
from ppsplit.config.values import TASKS



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


@dataclass
class Batch:
    args: tuple
    kwargs: dict
    labels: torch.Tensor

    def to(self, device) -> "Batch":
        def move(t):
            return t.to(device) if isinstance(t, torch.Tensor) else t

        return Batch(tuple(move(a) for a in self.args), {k: move(v) for k, v in self.kwargs.items()},
                     move(self.labels))

    def microbatches(self, n: int) -> list["Batch"]:
        """``n`` equal slices along the batch dimension, as the pipeline schedules cut it."""
        def chunk(t):
            return torch.tensor_split(t, n) if isinstance(t, torch.Tensor) else [t] * n

        args = [chunk(a) for a in self.args]
        kwargs = {k: chunk(v) for k, v in self.kwargs.items()}
        labels = chunk(self.labels)
        return [
            Batch(tuple(a[i] for a in args), {k: v[i] for k, v in kwargs.items()}, labels[i])
            for i in range(n)
        ]

    @staticmethod
    def cat(batches: list["Batch"]) -> "Batch":
        """One batch of every sample of ``batches``, in order (what is not a tensor: the first's)."""
        if len(batches) == 1:
            return batches[0]

        def join(values):
            return torch.cat(values) if isinstance(values[0], torch.Tensor) else values[0]

        first = batches[0]
        return Batch(tuple(join([b.args[i] for b in batches]) for i in range(len(first.args))),
                     {k: join([b.kwargs[k] for b in batches]) for k in first.kwargs},
                     join([b.labels for b in batches]))

    def shard(self, index: int, count: int) -> "Batch":
        """Data-parallel rank ``index`` of ``count``'s contiguous part of the batch."""
        return self if count == 1 else self.microbatches(count)[index]


def make_batch(
    kind: str,
    model,
    batch_size: int,
    seq_len: int,
    seed: int,
    step: int = 0,
    call_kwargs: dict | None = None,
    padded: bool = False,
) -> Batch:
    """A deterministic batch for ``step``: random token ids from ``seed`` and ``step``.
    ``padded``: each row's labels end at a length drawn from seq_len/4 to seq_len, the rest
    not scored (right padding: a causal LM's scored positions see only the row's own tokens)."""
    if kind not in TASKS:
        raise PpsplitError(f"model.inputs={kind!r} is not known; allowed: {', '.join(TASKS)}")
    cfg = getattr(model, "config", model)  # a model or its transformers config
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(step))
    kwargs = dict(call_kwargs or {})
    if kind == "image_classification":  # seq_len does not apply: images at the config's size
        size = cfg.image_size[0] if isinstance(cfg.image_size, (list, tuple)) else cfg.image_size
        pixels = torch.randn(batch_size, cfg.num_channels, size, size, generator=gen)
        return Batch((pixels,), kwargs, torch.randint(0, cfg.num_labels, (batch_size,), generator=gen))
    vocab = cfg.vocab_size
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=gen)
    batch = _token_batch(kind, cfg, ids, gen, kwargs)
    if padded:
        lengths = torch.randint(max(2, seq_len // 4), seq_len + 1, (batch_size, 1), generator=gen)
        batch.labels[torch.arange(seq_len) >= lengths] = IGNORE
    return batch


def _token_batch(kind: str, cfg, ids: torch.Tensor, gen: torch.Generator, kwargs: dict) -> Batch:
    batch_size, seq_len = ids.shape
    vocab = cfg.vocab_size
    if kind == "causal_lm":
        return Batch((ids,), kwargs, ids.clone())
    if kind == "masked_lm":
        # Mask about 15% of positions, at least one per row; only those are scored.
        masked = torch.rand(batch_size, seq_len, generator=gen) < 0.15
        masked[torch.arange(batch_size), torch.randint(0, seq_len, (batch_size,), generator=gen)] = True
        labels = torch.where(masked, ids, torch.full_like(ids, IGNORE))
        mask_id = getattr(cfg, "mask_token_id", None) or min(103, vocab - 1)
        return Batch((ids.masked_fill(masked, mask_id),), kwargs, labels)
    labels = torch.randint(0, vocab, (batch_size, seq_len), generator=gen)
    start = cfg.decoder_start_token_id if cfg.decoder_start_token_id is not None else 0
    decoder_ids = torch.cat([torch.full((batch_size, 1), start), labels[:, :-1]], dim=1)
    kwargs["decoder_input_ids"] = decoder_ids
    return Batch((ids,), kwargs, labels)






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
