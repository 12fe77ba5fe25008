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
from typing import Iterator

import numpy as np

from ppsplit.config.tasks import IGNORE
from ppsplit.errors import PpsplitError


def read_records(files: list[str], advance=lambda n: None):
    """The records of the files, read as a stream (``ppsplit.data.read.Records``); ``advance``
    gets the bytes read."""
    from ppsplit.data.read import Records

    return Records(files, advance)


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


def tokenize_examples(spec, records, tokenizer, seq_len: int, source: str, processes: int = 1,
                      used: dict | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Each record as (token ids, which are scored), truncated or refused past ``seq_len``, as
    the records are read, ``RECORDS`` a task in ``processes`` processes (``used["processes"]``:
    how many ran); a record with nothing to score is left out."""
    kind = record_format(spec, records.column_names, source)
    if kind == "conversational" and not getattr(tokenizer, "chat_template", None):
        raise PpsplitError(f"data.tokenizer: {source} is conversational ({spec.sft.messages_field!r}) and the "
                           "tokenizer has no chat template; allowed: a tokenizer whose tokenizer_config.json "
                           "(or chat_template.jinja) holds one, or prompt/completion records")
    return _in_tasks(records, _examples, (spec, kind, tokenizer, seq_len, source), processes, used)


RECORDS = 256  # records a tokenizing task takes


def _in_tasks(records, work, state: tuple, processes: int, used: dict | None) -> Iterator:
    """What ``work`` makes of each task of records, in order, example by example."""
    from ppsplit.data.pack import in_order

    def tasks():
        task, start = [], 0
        for i, record in enumerate(records):
            start = i if not task else start
            task.append(record)
            if len(task) == RECORDS:
                yield start, task
                task = []
        if task:
            yield start, task

    for examples in in_order(tasks(), work, state, processes, {} if used is None else used):
        yield from examples


def _examples(spec, kind, tokenizer, seq_len, source, task) -> list[tuple[np.ndarray, np.ndarray]]:
    start, records = task
    out = []
    for i, record in enumerate(records, start):
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


def pack(examples, seq_len: int, pad: int, packing: bool) -> dict:
    """Every example in rows (``RowPacker``), as whole arrays."""
    packer, rows = RowPacker(seq_len, pad, packing), []
    for tokens, scored in examples:
        rows += packer.add(tokens, scored)
    rows += packer.finish()
    return {key: np.stack([row[key] for row in rows]) for key in rows[0]}


class RowPacker:
    """Examples into rows of ``seq_len`` as they come: token ids, labels (the scored tokens, else
    ``IGNORE``) and, packed, position ids restarting at each example, or, unpacked, one example a
    row and an attention mask. Packed, the examples wait until ``BUFFER_TOKENS`` of them have
    come, then go longest first each into the open row it fills best (the least room left), else
    a new one; past ``OPEN_SLOTS`` token slots in open rows the fullest is done. So memory stays bounded and
    rows come out nearly as full as packing all examples at once would make them. ``add`` and
    ``finish`` return the rows done."""

    BUFFER_TOKENS = 1 << 21  # waiting examples' tokens
    OPEN_SLOTS = 1 << 19  # token slots in open rows

    def __init__(self, seq_len: int, pad: int, packing: bool):
        self.seq_len, self.pad, self.packing = seq_len, pad, packing
        self.open: dict[int, dict] = {}
        self.room: list[tuple[int, int]] = []  # (room left, row), sorted
        self.made, self.most_open = 0, max(64, self.OPEN_SLOTS // seq_len)
        self.waiting: list[tuple[np.ndarray, np.ndarray]] = []
        self.waiting_tokens = 0

    def add(self, tokens: np.ndarray, scored: np.ndarray) -> list[dict]:
        if not self.packing:
            return self._place(tokens, scored)
        self.waiting.append((tokens, scored))
        self.waiting_tokens += len(tokens)
        return self._drain() if self.waiting_tokens >= self.BUFFER_TOKENS else []

    def _drain(self) -> list[dict]:
        order = sorted(range(len(self.waiting)), key=lambda i: (-len(self.waiting[i][0]), i))
        done = [row for i in order for row in self._place(*self.waiting[i])]
        self.waiting, self.waiting_tokens = [], 0
        return done

    def _place(self, tokens: np.ndarray, scored: np.ndarray) -> list[dict]:
        n, done = len(tokens), []
        at = bisect.bisect_left(self.room, (n, -1)) if self.packing else len(self.room)
        if at < len(self.room):
            room, key = self.room.pop(at)
        else:
            room, key = self.seq_len, self.made
            self.open[key] = self._row()
            self.made += 1
        row, start = self.open[key], self.seq_len - room
        row["ids"][start:start + n] = tokens
        row["labels"][start:start + n] = np.where(scored, tokens, IGNORE)
        row["positions" if self.packing else "mask"][start:start + n] = np.arange(n) if self.packing else 1
        if self.packing and room > n:
            bisect.insort(self.room, (room - n, key))
        else:
            done.append(self._done(key, room - n))
        if len(self.room) > self.most_open:
            room, key = self.room.pop(0)
            done.append(self._done(key, room))
        return done

    def finish(self) -> list[dict]:
        rows = self._drain() if self.waiting else []
        rows += [self._done(key, room) for room, key in sorted(self.room, key=lambda r: r[1])]
        self.room = []
        return rows

    def _row(self) -> dict:
        extra = "positions" if self.packing else "mask"
        return {"ids": np.full(self.seq_len, self.pad, dtype=np.int32),
                "labels": np.full(self.seq_len, IGNORE, dtype=np.int32), extra: np.zeros(self.seq_len, dtype=np.int32)}

    def _done(self, key: int, room: int) -> dict:
        row = self.open.pop(key)
        if self.packing and room:
            row["positions"][self.seq_len - room:] = np.arange(room)  # the padding: its own, never scored
        return row


def seq2seq_examples(spec, records, tokenizer, seq_len: int, source: str, processes: int = 1,
                     used: dict | None = None) -> Iterator[tuple[list[int], list[int]]]:
    """Each prompt-completion record as (encoder ids, decoder labels), truncated or refused past
    ``seq_len`` (each side on its own), in ``processes`` processes as :func:`tokenize_examples`."""
    if record_format(spec, records.column_names, source) != "prompt_completion":
        raise PpsplitError(f"data.path: {source} is conversational; an encoder-decoder takes prompt/completion "
                           f"records ({spec.sft.prompt_field!r} to the encoder, {spec.sft.completion_field!r} to the "
                           "decoder); allowed: such records, or a causal LM")
    return _in_tasks(records, _seq2seq, (spec, tokenizer, seq_len, source), processes, used)


def _seq2seq(spec, tokenizer, seq_len, source, task) -> list[tuple[list[int], list[int]]]:
    start, records = task
    out = []
    for i, record in enumerate(records, start):
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


def seq2seq_row(head: list[int], tail: list[int], seq_len: int, pad: int, start: int) -> dict:
    """One example's row: the encoder's ids and mask, the decoder's labels and its inputs (the
    labels shifted right behind ``start``)."""
    ids, mask = np.full(seq_len, pad, dtype=np.int32), np.zeros(seq_len, dtype=np.int32)
    labels, decoder = np.full(seq_len, IGNORE, dtype=np.int32), np.full(seq_len, pad, dtype=np.int32)
    ids[:len(head)], mask[:len(head)] = head, 1
    labels[:len(tail)] = tail
    decoder[0], decoder[1:len(tail)] = start, tail[:-1]
    return {"ids": ids, "mask": mask, "labels": labels, "decoder": decoder}


def prepare_sft(spec, tokenizer, files: list[str], seq_len: int, seed: int, path: str, meta: dict,
                decoder_start: int | None = None, progress: bool = False) -> None:
    """Every record tokenized as it is read (in ``data.num_proc`` processes, a progress bar with
    ``progress``), held out or not (``ppsplit.data.order.held_out``, by example), made into rows
    and appended to the token store at ``path``."""
    import time

    from ppsplit.data.order import held_out
    from ppsplit.data.pack import num_proc, progress_bar
    from ppsplit.data.store import StoreWriter

    source = os.path.basename(files[0]) + (f" (and {len(files) - 1} more)" if len(files) > 1 else "")
    total = sum(os.path.getsize(f) for f in files)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    counts, scored, draws = {"train": 0, "val": 0}, 0, np.zeros(0, dtype=bool)
    started, used = time.perf_counter(), {}
    with StoreWriter(path) as out, progress_bar(total, progress) as bar:
        records = read_records(files, bar.update)
        if decoder_start is not None:  # an encoder-decoder
            examples = seq2seq_examples(spec, records, tokenizer, seq_len, source, num_proc(spec), used)
        else:
            examples = tokenize_examples(spec, records, tokenizer, seq_len, source, num_proc(spec), used)
            packers = {part: RowPacker(seq_len, pad, spec.sft.packing) for part in ("train", "val")}
        for n, example in enumerate(examples):
            if n % 4096 == 0:
                draws = held_out(n, 4096, seed, spec.val_fraction)
            part = "val" if draws[n % 4096] else "train"
            counts[part] += 1
            if decoder_start is not None:
                scored += len(example[1])
                _write_rows(out, part, [seq2seq_row(*example, seq_len, pad, decoder_start)])
            else:
                scored += int(example[1].sum())
                _write_rows(out, part, packers[part].add(*example))
        if decoder_start is None:
            for part, packer in packers.items():
                _write_rows(out, part, packer.finish())
        if not sum(counts.values()):
            raise PpsplitError(f"data.path: {source} holds no example with a token to score; allowed: records "
                               "with answers")
        if not counts["train"]:
            raise PpsplitError(f"data.val_fraction={spec.val_fraction:g}: {source} holds one example, and it is held "
                               "out; allowed: more examples, or data.val_fraction=0")
        keys = ("ids", "mask", "labels", "decoder") if decoder_start is not None else \
            ("ids", "labels", "positions" if spec.sft.packing else "mask")
        names = [part if key == "ids" else f"{part}_{key}" for part in ("train", "val") for key in keys]
        shapes = {name: (out.count(name) // seq_len, seq_len) for name in names}
        out.finish(shapes, {**meta, "documents": sum(counts.values()), "val_documents": counts["val"],
                            "format": record_format(spec, records.column_names, source), "scored_tokens": scored,
                            "corpus_bytes": total, "num_proc": used.get("processes", 1),
                            "tokenize_s": round(time.perf_counter() - started, 3)})


def _write_rows(out, part: str, rows: list[dict]) -> None:
    for row in rows:
        for key, values in row.items():
            out.append(part if key == "ids" else f"{part}_{key}", values)


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
