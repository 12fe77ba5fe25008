"""Build a Hugging Face model from its config (random weights) or a local folder, and make
deterministic example batches, labels and the loss for it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ppsplit.errors import PpsplitError, nearest

MODEL_CLASSES = (
    "GPT2LMHeadModel",
    "LlamaForCausalLM",
    "BertForMaskedLM",
    "T5ForConditionalGeneration",
)
INPUT_KINDS = ("causal_lm", "masked_lm", "seq2seq")
LOSSES = ("causal_lm", "masked_lm", "seq2seq")
IGNORE = -100  # label value the losses skip, as in transformers


def model_class(name: str):
    import transformers

    cls = getattr(transformers, name, None) if name in MODEL_CLASSES else None
    if cls is None:
        raise PpsplitError(
            f"model.model_class={name!r} is not supported; allowed: {', '.join(MODEL_CLASSES)}"
            f"{nearest(name, MODEL_CLASSES)}"
        )
    return cls


def build_model(
    class_name: str,
    config: dict[str, Any] | None = None,
    pretrained: str | None = None,
    seed: int = 0,
) -> torch.nn.Module:
    """A transformers model: from a local ``pretrained`` folder, or from ``config`` with random
    weights drawn deterministically from ``seed``. No model hub is ever contacted."""
    cls = model_class(class_name)
    if pretrained:
        return load_pretrained(cls, pretrained)
    torch.manual_seed(seed)
    cfg = cls.config_class(**dict(config or {}))
    return cls(cfg)


def load_pretrained(cls, folder: str) -> torch.nn.Module:
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
    try:
        return cls.from_pretrained(folder, local_files_only=True)
    except Exception as err:  # transformers raises many types; report one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PpsplitError(f"model.pretrained={folder!r} could not be loaded: {first}") from None


@dataclass
class Batch:
    args: tuple
    kwargs: dict
    labels: torch.Tensor

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


def make_batch(
    kind: str,
    model: torch.nn.Module,
    batch_size: int,
    seq_len: int,
    seed: int,
    step: int = 0,
    call_kwargs: dict | None = None,
) -> Batch:
    """A deterministic batch for ``step``: random token ids from ``seed`` and ``step``."""
    if kind not in INPUT_KINDS:
        raise PpsplitError(f"model.inputs={kind!r} is not known; allowed: {', '.join(INPUT_KINDS)}")
    cfg = model.config
    vocab = cfg.vocab_size
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(step))
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=gen)
    kwargs = dict(call_kwargs or {})
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


def logits_of(output) -> torch.Tensor:
    """The prediction scores: the first leaf of a model's or a last stage's output."""
    while isinstance(output, (tuple, list)):
        output = output[0]
    return output


def causal_lm_loss(output, labels: torch.Tensor) -> torch.Tensor:
    logits = logits_of(output)
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
        ignore_index=IGNORE,
    )


def token_loss(output, labels: torch.Tensor) -> torch.Tensor:
    logits = logits_of(output)
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE
    )


def loss_fn(name: str) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    losses = {"causal_lm": causal_lm_loss, "masked_lm": token_loss, "seq2seq": token_loss}
    if name not in losses:
        raise PpsplitError(f"model.loss={name!r} is not known; allowed: {', '.join(LOSSES)}")
    return losses[name]


OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW, "adam": torch.optim.Adam}


def make_optimizer(spec: dict, params) -> torch.optim.Optimizer:
    """An optimizer from its config: ``{"name": "adamw", "lr": 1e-3, ...}``."""
    spec = dict(spec)
    name = spec.pop("name", None)
    if name not in OPTIMIZERS:
        raise PpsplitError(f"optimizer={name!r} is not known; allowed: {', '.join(OPTIMIZERS)}")
    try:
        return OPTIMIZERS[name](params, **spec)
    except (TypeError, ValueError) as err:
        raise PpsplitError(f"optimizer={name} with {spec}: {err}") from None
