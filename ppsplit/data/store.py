"""The token store: a prepared corpus on disk, and how ranks read it.

``packed-KEY/`` in ``data.cache_dir`` holds, for a corpus:

- ``train.bin`` and ``val.bin``: each side's token ids, flat, in the order packed (``uint16``
  where the tokenizer's ids fit, else ``int32``); block ``r`` is tokens ``r * seq_len`` to
  ``(r + 1) * seq_len``, and the tail short of a block is no sample;
- for ``data=sft``, each side's rows (``int32``, ``rows x seq_len``): the token ids, the labels
  (the answer mask applied) and the position ids, attention mask or decoder inputs;
- ``meta.json``: the format, each array's dtype and shape, and where the corpus came from.

It is written in a folder of its own (``packed-KEY.partial-PID``) and renamed when whole, so
an interrupted preparation leaves nothing a later run would read. Ranks memory-map the
arrays: a batch reads its own rows and nothing else.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

FORMAT = 3  # 1: a single .npz, read whole; 2: data=sft split by a permutation (neither read: the key differs)


class StoreWriter:
    """Arrays appended in pieces, then ``finish``ed into the store; on an error (or a signal's
    exception) the partial folder is removed."""

    def __init__(self, path: str):
        self.path, self.partial = path, f"{path}.partial-{os.getpid()}"
        shutil.rmtree(self.partial, ignore_errors=True)  # a dead run's, whose pid this one reuses
        os.makedirs(self.partial)
        self.files, self.dtypes, self.counts = {}, {}, {}

    def append(self, name: str, values: np.ndarray) -> None:
        if name not in self.files:
            self.files[name] = open(os.path.join(self.partial, f"{name}.bin"), "wb")
            self.dtypes[name], self.counts[name] = values.dtype, 0
        assert values.dtype == self.dtypes[name], (name, values.dtype)
        self.files[name].write(np.ascontiguousarray(values).tobytes())
        self.counts[name] += values.size

    def count(self, name: str) -> int:
        return self.counts.get(name, 0)

    def finish(self, shapes: dict[str, tuple[int, ...]], meta: dict) -> None:
        """Every array with its shape (a flat one's rows may leave a tail out), and the meta."""
        self._close()
        arrays = {name: {"dtype": np.dtype(self.dtypes.get(name, np.int32)).name, "shape": list(shape)}
                  for name, shape in shapes.items()}
        with open(os.path.join(self.partial, "meta.json"), "w") as f:
            json.dump({"format": FORMAT, "arrays": arrays, **meta}, f, indent=1)
        try:
            os.rename(self.partial, self.path)
        except OSError:  # another run prepared the same corpus first: its store is the same
            shutil.rmtree(self.partial, ignore_errors=True)

    def _close(self):
        for f in self.files.values():
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        if kind is not None:
            self._close()
            shutil.rmtree(self.partial, ignore_errors=True)


def size_of(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


def describe(path: str) -> str:
    """What the store holds, in words: its size against the corpus's, and how fast it was made."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    out = f"{meta['documents']} documents" if "documents" in meta else f"{meta.get('examples', '?')} examples"
    store = f"a {size_of(path) / 1e6:.1f} MB store"
    if "corpus_bytes" not in meta:
        return f"{out}, {store}"
    rate = meta["corpus_bytes"] / 1e6 / max(meta["tokenize_s"], 1e-6)
    return (f"{out}, {meta['corpus_bytes'] / 1e6:.1f} MB of text in {store}, tokenized at {rate:.1f} MB/s "
            f"in {meta['num_proc']} process{'es' if meta['num_proc'] > 1 else ''}")


def open_store(path: str) -> tuple[dict[str, np.ndarray], dict]:
    """The store's arrays, memory-mapped (read only), and its meta."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    arrays = {}
    for name, a in meta.pop("arrays").items():
        shape = tuple(a["shape"])
        if not np.prod(shape):
            arrays[name] = np.zeros(shape, dtype=a["dtype"])  # an empty file cannot be mapped
        else:
            arrays[name] = np.memmap(os.path.join(path, f"{name}.bin"), dtype=a["dtype"], mode="r", shape=shape)
    return arrays, meta
