"""Instruction and chat data (``data=sft``): local jsonl or parquet records in TRL's two formats,
found from the records themselves.

- Conversational: a ``messages`` list of ``{role, content}``, rendered with the tokenizer's own
  chat template. Most shipped templates carry no ``{% generation %}`` markers, so the answer
  spans are found by rendering the conversation one message at a time: the text a message adds
  to the rendering before it is that message's, and an assistant message's text is what it adds
  past the generation prompt (the template's header for the answer is not scored). Each piece
  is tokenized on its own, so the pieces' tokens are exactly the example's.
- Prompt-completion: ``prompt`` and ``completion`` strings; the completion (and the end-of-text
  token) is the answer.

An encoder-decoder takes prompt-completion records: the prompt is the encoder's input, the
completion (and its end) the decoder's labels, one example a row with an attention mask.

Only the answers are scored (``data.loss_on=answer``), or every token (``all``); the first token
of an example is never scored (in a packed row, nothing before it is its own). An example longer
than ``seq_len`` is refused, or cut (``data.truncate``). With ``data.packing`` (the default) whole
examples are packed best fit into rows of ``seq_len``, their position ids restarting at each
one: with no attention mask and no cache, transformers turns restarting positions into a
block-diagonal causal mask, in eager, sdpa and through ``torch.export``, so each example attends
only to itself. Without packing, a row holds one example, padded on the right, with an
attention mask.
"""

from __future__ import annotations

import bisect
import os

import numpy as np

from ppsplit.config.tasks import IGNORE
from ppsplit.errors import PpsplitError


def read_records(files: list[str], cache: str):
    """The records of the files, as a ``datasets`` table (its cache in ``cache``)."""
    import datasets

    datasets.disable_progress_bars()
    kind = "parquet" if all(f.endswith(".parquet") for f in files) else "json"
    try:
        return datasets.load_dataset(kind, data_files=files, split="train", cache_dir=cache)
    except Exception as err:
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PpsplitError(f"data.path: {files[0]} does not read as {kind} records: {text}") from None


def record_format(spec, columns: list[str], source: str) -> str:
    """``conversational`` or ``prompt_completion``, from the records' fields."""
    if spec.sft.messages_field in columns:
        return "conversational"
    if spec.sft.prompt_field in columns and spec.sft.completion_field in columns:
        return "prompt_completion"
    raise PpsplitError(
        f"data.path: the records of {source} have neither {spec.sft.messages_field!r} nor {spec.sft.prompt_field!r} and "
        f"{spec.sft.completion_field!r}; their fields: {', '.join(columns)}; allowed: data.messages_field, or "
        "data.prompt_field and data.completion_field, naming fields that are there")


def tokenize_examples(spec, records, tokenizer, seq_len: int, source: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each record as (token ids, which are scored), truncated or refused past ``seq_len``."""
    kind = record_format(spec, records.column_names, source)
    if kind == "conversational" and not getattr(tokenizer, "chat_template", None):
        raise PpsplitError(f"data.tokenizer: {source} is conversational ({spec.sft.messages_field!r}) and the "
                           "tokenizer has no chat template; allowed: a tokenizer whose tokenizer_config.json "
                           "(or chat_template.jinja) holds one, or prompt/completion records")
    out = []
    for i, record in enumerate(records):
        where = f"record {i + 1} of {source}"
        if kind == "conversational":
            ids, scored = _conversation(tokenizer, record[spec.sft.messages_field], spec, where)
        else:
            ids, scored = _prompt_completion(tokenizer, record[spec.sft.prompt_field],
                                             record[spec.sft.completion_field], spec, where)
        if scored and spec.sft.loss_on == "all":
            scored = [True] * len(ids)
        if len(ids) > seq_len:
            if not spec.sft.truncate:
                raise PpsplitError(f"data.truncate=false: {where} is {len(ids)} tokens, longer than "
                                   f"seq_len={seq_len}; allowed: data.truncate=true, a larger seq_len, or "
                                   "shorter examples")
            ids, scored = ids[:seq_len], scored[:seq_len]
        scored = np.asarray(scored, dtype=bool)
        scored[:1] = False  # nothing of its own comes before an example's first token
        if scored.any():
            out.append((np.asarray(ids, dtype=np.int32), scored))
    return out


def _prompt_completion(tokenizer, prompt, completion, spec, where: str) -> tuple[list[int], list[bool]]:
    if not isinstance(prompt, str) or not isinstance(completion, str) or not completion:
        raise PpsplitError(f"data.path: {where}: {spec.sft.prompt_field!r} and {spec.sft.completion_field!r} must be "
                           "text, the completion not empty")
    head = tokenizer(prompt)["input_ids"]
    tail = tokenizer(completion, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        tail = tail + [tokenizer.eos_token_id]
    return head + tail, [False] * len(head) + [True] * len(tail)


def _conversation(tokenizer, messages, spec, where: str) -> tuple[list[int], list[bool]]:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise PpsplitError(f"data.path: {where}: {spec.sft.messages_field!r} must be a list of {{role, content}}")
    if spec.sft.loss_on == "answer" and not any(m["role"] == "assistant" for m in messages):
        raise PpsplitError(f"data.path: {where} has no assistant turn, so nothing of it is scored; allowed: "
                           "conversations with an assistant message, or data.loss_on=all")
    pieces: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            prompt = _render(tokenizer, messages[:i], True, where)
            pieces.append((_added(done, prompt, where), False))
            done = prompt
        text = _render(tokenizer, messages[:i + 1], False, where)
        pieces.append((_added(done, text, where), message["role"] == "assistant"))
        done = text
    ids, scored = [], []
    for text, answer in pieces:
        part = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        ids += part
        scored += [answer] * len(part)
    return ids, scored


def _render(tokenizer, messages: list, generation_prompt: bool, where: str) -> str:
    if not messages and not generation_prompt:
        return ""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as err:
        if not messages:
            return ""
        raise PpsplitError(f"data.path: {where}: the chat template refuses it: "
                           f"{str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}") from None


def _added(before: str, after: str, where: str) -> str:
    if not after.startswith(before):
        raise PpsplitError(f"data.path: {where}: the chat template does not render the conversation one message "
                           "after another (a later rendering changes an earlier one), so its answers cannot be "
                           "found; allowed: a template that appends each message")
    return after[len(before):]


def pack(examples: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad: int, packing: bool) -> dict:
    """Rows of ``seq_len``: token ids, labels (the scored tokens, else ``IGNORE``) and, packed,
    position ids restarting at each example (best fit, longest first), or, unpacked, one
    example a row and an attention mask."""
    if packing:
        rows = _best_fit([len(ids) for ids, _ in examples], seq_len)
    else:
        rows = [[i] for i in range(len(examples))]
    ids = np.full((len(rows), seq_len), pad, dtype=np.int32)
    labels = np.full((len(rows), seq_len), IGNORE, dtype=np.int32)
    extra = np.zeros((len(rows), seq_len), dtype=np.int32)  # positions, or the attention mask
    for r, members in enumerate(rows):
        at = 0
        for e in members:
            tokens, scored = examples[e]
            n = len(tokens)
            ids[r, at:at + n] = tokens
            labels[r, at:at + n] = np.where(scored, tokens, IGNORE)
            extra[r, at:at + n] = np.arange(n) if packing else 1
            at += n
        if packing and at < seq_len:
            extra[r, at:] = np.arange(seq_len - at)  # the padding is an example of its own, never scored
    return {"ids": ids, "labels": labels, ("positions" if packing else "mask"): extra}


def _best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Examples into rows: longest first, each into the row it fills best (the least room left)."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for e in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        at = bisect.bisect_left(free, (lengths[e], -1))
        if at < len(free):
            room, row = free.pop(at)
        else:
            room, row = capacity, len(rows)
            rows.append([])
        rows[row].append(e)
        if room - lengths[e] > 0:
            bisect.insort(free, (room - lengths[e], row))
    return rows


def seq2seq_examples(spec, records, tokenizer, seq_len: int, source: str) -> list[tuple[list[int], list[int]]]:
    """Each prompt-completion record as (encoder ids, decoder labels), truncated or refused past
    ``seq_len`` (each side on its own)."""
    if record_format(spec, records.column_names, source) != "prompt_completion":
        raise PpsplitError(f"data.path: {source} is conversational; an encoder-decoder takes prompt/completion "
                           f"records ({spec.sft.prompt_field!r} to the encoder, {spec.sft.completion_field!r} to the "
                           "decoder); allowed: such records, or a causal LM")
    out = []
    for i, record in enumerate(records):
        where = f"record {i + 1} of {source}"
        ids, scored = _prompt_completion(tokenizer, record[spec.sft.prompt_field], record[spec.sft.completion_field],
                                         spec, where)
        head = [t for t, s in zip(ids, scored) if not s]
        tail = [t for t, s in zip(ids, scored) if s]
        for side in (head, tail):
            if len(side) > seq_len and not spec.sft.truncate:
                raise PpsplitError(f"data.truncate=false: {where} is {len(side)} tokens on one side, longer than "
                                   f"seq_len={seq_len}; allowed: data.truncate=true, a larger seq_len, or shorter "
                                   "examples")
        out.append((head[:seq_len], tail[:seq_len]))
    return out


def pad_seq2seq(examples: list[tuple[list[int], list[int]]], seq_len: int, pad: int, start: int) -> dict:
    """One example a row: the encoder's ids and mask, the decoder's labels and its inputs (the
    labels shifted right behind ``start``)."""
    n = len(examples)
    ids, mask = np.full((n, seq_len), pad, dtype=np.int32), np.zeros((n, seq_len), dtype=np.int32)
    labels, decoder = np.full((n, seq_len), IGNORE, dtype=np.int32), np.full((n, seq_len), pad, dtype=np.int32)
    for r, (head, tail) in enumerate(examples):
        ids[r, :len(head)], mask[r, :len(head)] = head, 1
        labels[r, :len(tail)] = tail
        decoder[r, 0], decoder[r, 1:len(tail)] = start, tail[:-1]
    return {"ids": ids, "mask": mask, "labels": labels, "decoder": decoder}


def prepare_sft(spec, tokenizer, files: list[str], seq_len: int, seed: int, cache: str,
                decoder_start: int | None = None) -> tuple[dict, dict]:
    """Every record tokenized, split into training and held-out examples, and packed: the arrays
    of the cache file, and what its meta records (``cache``: the records' own cache)."""
    source = os.path.basename(files[0]) + (f" (and {len(files) - 1} more)" if len(files) > 1 else "")
    records = read_records(files, cache)
    if decoder_start is not None:  # an encoder-decoder
        examples = seq2seq_examples(spec, records, tokenizer, seq_len, source)
    else:
        examples = tokenize_examples(spec, records, tokenizer, seq_len, source)
    if not examples:
        raise PpsplitError(f"data.path: {source} holds no example with a token to score; allowed: records "
                           "with answers")
    order = np.random.default_rng([seed, 7]).permutation(len(examples))
    n_val = int(round(spec.val_fraction * len(examples))) if spec.val_fraction > 0 else 0
    if spec.val_fraction > 0 and len(examples) >= 2:
        n_val = min(max(n_val, 1), len(examples) - 1)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    arrays = {}
    for part, picked in (("val", order[:n_val]), ("train", order[n_val:])):
        chosen = [examples[i] for i in picked]
        rows = pad_seq2seq(chosen, seq_len, pad, decoder_start) if decoder_start is not None else \
            pack(chosen, seq_len, pad, spec.sft.packing)
        for key, value in rows.items():
            arrays[part if key == "ids" else f"{part}_{key}"] = value
    scored = sum(len(tail) for _, tail in examples) if decoder_start is not None else \
        int(sum(s.sum() for _, s in examples))
    meta = {"documents": len(examples), "val_documents": n_val, "format": record_format(
        spec, records.column_names, source), "scored_tokens": int(scored)}
    return arrays, meta


def sft_inputs(arrays: dict, part: str, rows, call_kwargs: dict | None):
    """The batch of rows ``rows`` of ``part`` (train or val): the ids, the labels, and the
    position ids (packed) or the attention mask (one example a row)."""
    import torch

    from ppsplit.data.batch import Batch

    def take(key):
        return torch.from_numpy(np.ascontiguousarray(arrays[key][rows])).long()

    kwargs = dict(call_kwargs or {})
    if f"{part}_positions" in arrays:
        kwargs["position_ids"] = take(f"{part}_positions")
    else:
        kwargs["attention_mask"] = take(f"{part}_mask")
    if f"{part}_decoder" in arrays:  # an encoder-decoder: the decoder reads the labels shifted right
        kwargs["decoder_input_ids"] = take(f"{part}_decoder")
    return Batch((take(part),), kwargs, take(f"{part}_labels"))
