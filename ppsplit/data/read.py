"""The documents of a local corpus, read as a stream: ``.txt`` files (a document per paragraph,
line or file), JSON lines and Parquet (a text field), in the order of ``data.path`` (globs
sorted). Nothing is read whole: text comes in chunks of ``CHUNK`` bytes, Parquet in record
batches, and a document longer than ``PIECE`` characters is cut into pieces of about that
size (at a whitespace where there is one), each a document of its own, so that neither the
reader nor the tokenizer ever holds a long document whole."""

from __future__ import annotations

import codecs
import glob
import json
import os
from typing import Callable, Iterator

from ppsplit.config.train_spec import DataSpec
from ppsplit.errors import PpsplitError

PIECE = 1 << 20  # characters: a longer document is cut into pieces of about this many
CHUNK = 1 << 22  # bytes read from a text file at a time
EXTENSIONS = {"text": ".txt", "jsonl": ".jsonl", "parquet": ".parquet"}


def files_of(spec: DataSpec) -> list[str]:
    """The data files, globs expanded, in order; a pattern that matches nothing is refused."""
    out = []
    for pattern in spec.path:
        matched = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        matched = [m for m in matched if os.path.isfile(m)]
        if not matched:
            raise PpsplitError(f"data.path={pattern!r}: no such file; allowed: existing files or globs "
                               f"({EXTENSIONS.get(spec.name, '.jsonl or .parquet')} files)")
        out += [os.path.abspath(m) for m in matched]
    if not out:
        raise PpsplitError(f"data={spec.name} needs data.path (a file, a glob or a list of them)")
    return list(dict.fromkeys(out))


def documents(spec: DataSpec, files: list[str], advance: Callable[[int], None]) -> Iterator[str]:
    """Every document with text (not only whitespace), in order; ``advance(n)`` is told of each
    ``n`` bytes of the files read."""
    for path in files:
        if spec.name == "text":
            parts = _text(path, spec.sample_by, advance)
        elif spec.name == "jsonl":
            parts = _jsonl(path, spec.field, advance)
        else:
            parts = _parquet(path, spec.field, advance)
        for doc in parts:
            yield from pieces(doc)


def pieces(doc: str) -> Iterator[str]:
    """``doc`` if it has text, cut into pieces of at most ``PIECE`` characters where it is longer."""
    while len(doc) > PIECE:
        cut = _cut(doc)
        if doc[:cut].strip():
            yield doc[:cut]
        doc = doc[cut:]
    if doc.strip():
        yield doc


def _cut(doc: str) -> int:
    """Where to cut a long document: before the last whitespace of its first ``PIECE``
    characters (byte-level tokenizers then cut the same way), else at ``PIECE``."""
    at = max(doc.rfind(" ", PIECE // 2, PIECE), doc.rfind("\n", PIECE // 2, PIECE))
    return at if at > 0 else PIECE


def _text(path: str, sample_by: str, advance) -> Iterator[str]:
    decoder = codecs.getincrementaldecoder("utf-8")()
    buffer = ""
    with open(path, "rb") as f:
        while True:
            raw = f.read(CHUNK)
            try:
                buffer += decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as err:
                raise PpsplitError(f"data.path: {path} does not read as text: {err}; allowed: UTF-8 text") from None
            advance(len(raw))
            if not raw:
                break
            if sample_by == "paragraph":
                *done, buffer = buffer.split("\n\n")
            elif sample_by == "line":
                # the last line waits for the next chunk: it may go on, or its "\r" be a "\r\n"
                *done, buffer = buffer.splitlines(keepends=True) or [""]
                done = [line.splitlines()[0] for line in done]
            else:
                done = []
            yield from done
            while len(buffer) > 2 * PIECE:  # a long document: its first pieces now, the rest later
                cut = _cut(buffer)
                yield buffer[:cut]
                buffer = buffer[cut:]
    yield from buffer.splitlines() if sample_by == "line" else [buffer]


def _jsonl(path: str, field: str, advance) -> Iterator[str]:
    first = True
    for _, record in json_records(path, advance):
        if first and field not in record:
            raise PpsplitError(f"data.field={field!r} is not in {os.path.basename(path)}'s records; "
                               f"allowed: {', '.join(record)}")
        first = False
        value = record.get(field)
        if isinstance(value, str):
            yield value


def json_records(path: str, advance=lambda n: None) -> Iterator[tuple[int, dict]]:
    """The JSON objects of a JSON-lines file, a line at a time, with their line numbers."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            advance(len(line))
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise PpsplitError(f"data.path: {path} does not read as jsonl: line {number}: {err}; "
                                   "allowed: a JSON object per line") from None
            if not isinstance(record, dict):
                raise PpsplitError(f"data.path: {path} does not read as jsonl: line {number} is not a JSON object")
            yield number, record


def parquet_file(path: str):
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several kinds
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PpsplitError(f"data.path: {path} does not read as parquet: {text}") from None


def parquet_records(path: str, columns: list[str] | None = None, advance=lambda n: None,
                    table=None) -> Iterator[dict]:
    """The rows of a Parquet file (``table``: it, opened already), a record batch at a time."""
    table = table or parquet_file(path)
    size, rows = os.path.getsize(path), max(1, table.metadata.num_rows)
    for batch in table.iter_batches(batch_size=1024, columns=columns):
        advance(size * batch.num_rows // rows)
        yield from batch.to_pylist()


def _parquet(path: str, field: str, advance) -> Iterator[str]:
    table = parquet_file(path)
    names = table.schema_arrow.names
    if field not in names:
        raise PpsplitError(f"data.field={field!r} is not in {os.path.basename(path)}'s records; "
                           f"allowed: {', '.join(names)}")
    for record in parquet_records(path, [field], advance, table):
        value = record[field]
        if isinstance(value, str):
            yield value


class Records:
    """The records of JSON-lines or Parquet files, in order, read as they are iterated
    (``advance`` gets the bytes read); ``column_names``: the first record's fields."""

    def __init__(self, files: list[str], advance=lambda n: None):
        self.files, self.advance = files, advance
        if files[0].endswith(".parquet"):
            self.column_names = parquet_file(files[0]).schema_arrow.names
        else:
            first = next((r for _, r in json_records(files[0])), None)
            if first is None:
                raise PpsplitError(f"data.path: {files[0]} holds no record; allowed: a JSON object per line")
            self.column_names = list(first)

    def __iter__(self) -> Iterator[dict]:
        for path in self.files:
            if path.endswith(".parquet"):
                yield from parquet_records(path, advance=self.advance)
            else:
                yield from (record for _, record in json_records(path, self.advance))
