"""What the model trains on: the ``data`` config group.

- ``synthetic`` (the default): random token ids drawn from ``seed`` and the step (random images
  for a vision model).
- ``text`` (``.txt`` files or globs), ``jsonl`` and ``parquet`` (a named text field): local
  files, read as a stream (``ppsplit.data.read``: no hub, no file read whole, a document over
  a million characters cut into pieces), tokenized with the model's tokenizer from a local
  folder (``data.tokenizer=DIR``, else ``model.pretrained``) in ``data.num_proc`` processes,
  and packed as they stream by into the token store (``ppsplit.data.pack``,
  ``ppsplit.data.store``) in ``data.cache_dir``, under a fingerprint of the files, the
  tokenizer and these settings, so the next run finds it at once. Documents stay in file
  order; ``data.val_fraction`` of them are held out for validation, drawn from ``seed`` in
  windows of 20 (``ppsplit.data.order.held_out``); each side is the documents joined with the
  tokenizer's EOS (or SEP) after every one, cut into blocks of ``seq_len`` tokens.

The training stream is indexed by sample, not by step: sample ``i`` is block ``order_e(i % n)``
of epoch ``e = i // n``, each epoch a bijection of the blocks keyed by ``seed`` and ``e``
(``ppsplit.data.order``). A step takes the next ``batch_size`` samples; each data-parallel rank
runs its contiguous share of them, and the unsplit reference runs all of them. The index of
the next sample goes into the checkpoint, so a resumed run continues at exactly that sample.
Ranks memory-map the store and read the rows of their batches alone. What a block becomes
depends on the task:

- causal LM: ``input_ids`` = the block, ``labels`` = the block (the loss shifts them);
- masked LM: 15% of the positions, drawn from (seed, sample), scored; of those 80% become the
  mask token, 10% a random token, 10% stay (BERT's recipe);
- encoder-decoder: denoising. The encoder reads the block with 15% of its tokens replaced by the
  mask token (or, without one, the unknown token); the decoder predicts the whole block.
"""

from __future__ import annotations

import hashlib
import json
import os
import numpy as np
import torch

from ppsplit.config.tasks import IGNORE
from ppsplit.data.batch import Batch, make_batch
from ppsplit.data.order import BlockOrder
from ppsplit.data.read import files_of
from ppsplit.data.store import FORMAT, open_store
from ppsplit.errors import PpsplitError
from ppsplit.config.train_spec import DataSpec

MASK_RATE = 0.15


def tokenizer_folder(spec: DataSpec, pretrained: str | None) -> str:
    folder = spec.tokenizer or pretrained
    if not folder:
        raise PpsplitError(f"data={spec.name} needs a tokenizer: data.tokenizer=DIR (a local tokenizer folder) "
                           "or model.pretrained=DIR")
    return os.path.abspath(os.path.expanduser(folder))


def load_tokenizer(folder: str):
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    key = "data.tokenizer"
    if not os.path.isdir(folder):
        raise PpsplitError(f"{key}={folder!r} is not a folder; allowed: a tokenizer folder written by save_pretrained")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as err:  # transformers raises many kinds
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PpsplitError(f"{key}={folder!r} does not load as a tokenizer: {text}") from None
    finally:
        hf_logging.set_verbosity(verbosity)


def separator_of(tokenizer) -> int:
    for name in ("eos_token_id", "sep_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    raise PpsplitError("data.tokenizer: it has neither an EOS nor a SEP token to put between documents; "
                       "allowed: a tokenizer with eos_token (or sep_token)")


def fingerprint(spec: DataSpec, files: list[str], tok_folder: str, seq_len: int, seed: int) -> str:
    """What the store depends on: the files (path, size, time: a stat each, however many), the
    tokenizer's files (contents), the settings and the store's format."""
    h = hashlib.sha256()
    # sample_by applies to text files alone; the others' caches were keyed with "paragraph" and stay so
    settings = [FORMAT, spec.name, spec.field, spec.sample_by or "paragraph", spec.val_fraction, seq_len, seed]
    h.update(json.dumps(settings + ([vars(spec.sft)] if spec.sft else [])).encode())
    for path in files:
        st = os.stat(path)
        h.update(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode())
    for name in sorted(os.listdir(tok_folder)):
        path = os.path.join(tok_folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                h.update(name.encode() + hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:24]


def cache_folder(spec: DataSpec) -> str:
    return os.path.abspath(os.path.expanduser(spec.cache_dir or os.path.join("~", ".cache", "ppsplit", "data")))


def prepare(spec: DataSpec, pretrained: str | None, seq_len: int, seed: int, vocab_size: int,
            progress: bool = True, batch_size: int = 0, decoder_start: int | None = None) -> str:
    """Tokenize and pack the corpus once (or find it packed already); returns the token store
    the ranks read. Refuses, in one line, what cannot train: no files, an empty corpus, a
    missing field, a tokenizer that does not load or is larger than the model's vocabulary."""
    files = files_of(spec)
    folder = tokenizer_folder(spec, pretrained)
    tokenizer = load_tokenizer(folder)
    if len(tokenizer) > vocab_size:
        raise PpsplitError(f"data.tokenizer={folder!r} has {len(tokenizer)} tokens, more than the model's "
                           f"vocab_size={vocab_size}; allowed: model.config.vocab_size >= {len(tokenizer)}")
    key = fingerprint(spec, files, folder, seq_len, seed) + ("" if decoder_start is None else f"-s2s{decoder_start}")
    path = os.path.join(cache_folder(spec), f"packed-{key}")
    meta = {"files": files if len(files) <= 100 else files[:100] + [f"... {len(files)} files"], "tokenizer": folder}
    if not os.path.isdir(path) and spec.sft:
        from ppsplit.data.sft import prepare_sft

        prepare_sft(spec, tokenizer, files, seq_len, seed, path, meta, decoder_start, progress)
    elif not os.path.isdir(path):
        from ppsplit.data.pack import pack_corpus

        pack_corpus(spec, files, tokenizer, separator_of(tokenizer), seq_len, seed, path, progress,
                    {**meta, "mask_token_id": tokenizer.mask_token_id, "unk_token_id": tokenizer.unk_token_id})
    if batch_size:
        held_out = len(open_store(path)[0]["val"])
        if held_out < batch_size:
            raise PpsplitError(f"data.val_fraction={spec.val_fraction:g}: the held-out documents fill {held_out} "
                               f"block(s) of seq_len={seq_len}, fewer than one batch (batch_size={batch_size}); "
                               "allowed: a larger fraction or corpus, or eval.batches=0")
    return path


class TokenBlocks:
    """The token store as batches: training samples by index (see the module docstring), the
    validation blocks in order; memory-mapped, so a batch reads its own rows alone."""

    def __init__(self, path: str, seed: int):
        self.arrays, self.meta = open_store(path)  # data=sft: labels and positions too
        self.train, self.val = self.arrays["train"], self.arrays["val"]
        self.sft = "train_labels" in self.arrays
        self.order = BlockOrder(len(self.train), seed)

    def rows(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The rows of samples ``first`` .. ``first + count - 1`` of the training stream, and
        their indices."""
        index = np.arange(first, first + count)
        return self.order.blocks(index), index

    def samples(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Blocks ``first`` .. ``first + count - 1`` of the training stream, and their indices."""
        rows, index = self.rows(first, count)
        return self.train[rows], index


def make_inputs(kind: str, tokens: np.ndarray, sample_ids: np.ndarray, config, seed: int, call_kwargs: dict,
                mask_token_id: int | None, unk_token_id: int | None) -> Batch:
    """The batch a task trains on, from packed blocks (see the module docstring)."""
    ids = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
    kwargs = dict(call_kwargs or {})
    if kind == "causal_lm":
        return Batch((ids,), kwargs, ids.clone())
    masked, replace = _mask_positions(ids, sample_ids, seed, config.vocab_size)
    if kind == "masked_lm":
        if mask_token_id is None:
            raise PpsplitError("data: masked LM needs the tokenizer's mask token; allowed: a tokenizer with mask_token")
        labels = torch.where(masked, ids, torch.full_like(ids, IGNORE))
        inputs = torch.where(masked & (replace < 0.8), torch.full_like(ids, mask_token_id), ids)
        random_ids = _random_tokens(ids, sample_ids, seed, config.vocab_size)
        inputs = torch.where(masked & (replace >= 0.8) & (replace < 0.9), random_ids, inputs)
        return Batch((inputs,), kwargs, labels)
    if kind == "seq2seq":
        filler = mask_token_id if mask_token_id is not None else unk_token_id
        if filler is None:
            raise PpsplitError("data: the denoising objective needs the tokenizer's mask or unknown token")
        start = config.decoder_start_token_id if config.decoder_start_token_id is not None else 0
        kwargs["decoder_input_ids"] = torch.cat([torch.full((ids.shape[0], 1), start), ids[:, :-1]], dim=1)
        return Batch((torch.where(masked, torch.full_like(ids, filler), ids),), kwargs, ids.clone())
    raise PpsplitError(f"data: a model that takes {kind} inputs trains on data=synthetic only")


def _generator(sample: int, seed: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + int(sample) * 7919 + salt)


def _mask_positions(ids, sample_ids, seed, vocab):
    """Per sample (seeded by its index): which positions are masked (at least one), and a draw
    in [0, 1) per position that picks mask / random / keep."""
    masked, replace = torch.zeros_like(ids, dtype=torch.bool), torch.zeros(ids.shape)
    for row, sample in enumerate(sample_ids):
        gen = _generator(sample, seed, 1)
        masked[row] = torch.rand(ids.shape[1], generator=gen) < MASK_RATE
        masked[row, torch.randint(0, ids.shape[1], (1,), generator=gen)] = True
        replace[row] = torch.rand(ids.shape[1], generator=gen)
    return masked, replace


def _random_tokens(ids, sample_ids, seed, vocab):
    out = torch.empty_like(ids)
    for row, sample in enumerate(sample_ids):
        out[row] = torch.randint(0, vocab, (ids.shape[1],), generator=_generator(sample, seed, 2))
    return out


class BatchSource:
    """Every batch of a job, the same in the driver, the ranks and the reference: ``batch(i)``
    is the global batch with index ``i`` in the training stream (a step of ``grad_accumulation``
    batches takes several), ``validation()`` the held-out batches. ``first_index`` and
    ``first_sample``: where a resumed run's stream stands (batch index and sample)."""

    def __init__(self, spec, config, cache_file: str | None = None, first_index: int = 0,
                 first_sample: int | None = None):
        self.spec, self.config = spec, config
        self.first_index = first_index
        self.first_sample = first_index * spec.batch_size if first_sample is None else first_sample
        self.blocks = TokenBlocks(cache_file, spec.seed) if cache_file else None

    def batch(self, index: int, seq_len: int | None = None) -> Batch:
        spec, m = self.spec, self.spec.model
        if self.blocks is None:
            return make_batch(m.inputs, self.config, spec.batch_size, seq_len or spec.seq_len, spec.seed,
                              step=index, call_kwargs=m.call_kwargs, padded=spec.data.padded)
        if self.blocks.sft:
            from ppsplit.data.sft import sft_inputs

            return sft_inputs(self.blocks.arrays, "train", self.blocks.rows(self.sample_of(index), spec.batch_size)[0],
                              m.call_kwargs)
        return self._inputs(*self.blocks.samples(self.sample_of(index), spec.batch_size))

    def sample_of(self, index: int) -> int:
        """The first sample of batch ``index``."""
        return self.first_sample + (index - self.first_index) * self.spec.batch_size

    def validation(self, count: int) -> list[Batch]:
        """Up to ``count`` held-out batches of ``batch_size`` (synthetic: batches of a stream of
        their own)."""
        spec, m = self.spec, self.spec.model
        if self.blocks is None:
            return [make_batch(m.inputs, self.config, spec.batch_size, spec.seq_len, spec.seed + 7_777_777,
                               step=i, call_kwargs=m.call_kwargs, padded=spec.data.padded) for i in range(count)]
        val, b = self.blocks.val, spec.batch_size
        out = []
        for i in range(min(count, len(val) // b)):
            ids = np.arange(i * b, (i + 1) * b)
            if self.blocks.sft:
                from ppsplit.data.sft import sft_inputs

                out.append(sft_inputs(self.blocks.arrays, "val", ids, m.call_kwargs))
            else:
                out.append(self._inputs(val[ids], -1 - ids))  # masks of their own: negative sample ids
        return out

    def _inputs(self, tokens, sample_ids) -> Batch:
        m, meta = self.spec.model, self.blocks.meta
        return make_inputs(m.inputs, tokens, sample_ids, self.config, self.spec.seed, m.call_kwargs,
                           meta.get("mask_token_id"), meta.get("unk_token_id"))
