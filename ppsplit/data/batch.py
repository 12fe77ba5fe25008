"""A batch as the stages and the unsplit model take it (positional and keyword inputs, and the
labels), cut into microbatches, data-parallel shards or joined; and synthetic batches, drawn
from the seed and the step."""

from __future__ import annotations

from dataclasses import dataclass
import torch

from ppsplit.config.tasks import IGNORE
from ppsplit.config.values import TASKS
from ppsplit.errors import PpsplitError


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
