"""A corpus tokenized and packed into the token store as it streams by: the documents are
read in order (``ppsplit.data.read``), tokenized in ``data.num_proc`` processes a batch of
about ``BATCH_CHARS`` characters at a time (at most two batches a process in flight, so the
driver's memory does not grow with the corpus), split between the training and the held-out
side (``ppsplit.data.order.held_out``), each document followed by the separator token, and
appended to the store's flat token files. A progress bar shows the bytes read, MB/s and the
time left."""

from __future__ import annotations

import collections
import itertools
import multiprocessing
import os
import signal
import time
from typing import Iterator

import numpy as np

from ppsplit.config.train_spec import DataSpec
from ppsplit.data.order import held_out
from ppsplit.data.read import documents
from ppsplit.data.store import StoreWriter
from ppsplit.errors import PpsplitError

BATCH_CHARS = 1 << 20  # characters of text a tokenizing task takes


def pack_corpus(spec: DataSpec, files: list[str], tokenizer, separator: int, seq_len: int, seed: int,
                path: str, progress: bool, meta: dict) -> None:
    """Tokenize and pack ``files`` into the store at ``path`` (module docstring); refuses a
    corpus with no text or too little for a block on either side."""
    dtype = np.dtype(np.uint16 if len(tokenizer) <= 1 << 16 else np.int32)
    total = sum(os.path.getsize(f) for f in files)
    docs = held = 0
    started, used = time.perf_counter(), {}
    with StoreWriter(path) as out, progress_bar(total, progress) as bar:
        texts = documents(spec, files, bar.update)
        for ids, lengths in tokenized(_batches(texts), tokenizer, num_proc(spec), dtype, used):
            side = held_out(docs, len(lengths), seed, spec.val_fraction)
            ends = np.cumsum(lengths)
            joined = np.insert(ids, ends, np.array(separator, dtype=dtype))  # a separator after each document
            val = np.repeat(side, lengths + 1)
            out.append("train", joined[~val])
            out.append("val", joined[val])
            docs, held = docs + len(lengths), held + int(side.sum())
        blocks = {name: out.count(name) // seq_len for name in ("train", "val")}
        _refuse_short(spec, files, docs, held, blocks, out.count("train") + out.count("val"), seq_len)
        out.finish({name: (n, seq_len) for name, n in blocks.items()},
                   {**meta, "documents": docs, "val_documents": held, "corpus_bytes": total,
                    "num_proc": used["processes"], "tokenize_s": round(time.perf_counter() - started, 3)})


def _refuse_short(spec, files, docs, held, blocks, tokens, seq_len) -> None:
    if not docs:
        raise PpsplitError(f"data.path: {', '.join(os.path.basename(f) for f in files[:3])} hold no text "
                           f"(no non-empty {spec.field!r}); allowed: a corpus with text")
    if not blocks["train"]:
        why = " (data.val_fraction holds the first document out)" if held == docs else ""
        raise PpsplitError(f"data.path: the corpus ({tokens} tokens in {docs} documents, {docs - held} for training"
                           f"{why}) fills no training block of seq_len={seq_len}; allowed: more text, "
                           "or a smaller seq_len")
    if spec.val_fraction > 0 and not blocks["val"]:
        raise PpsplitError(f"data.val_fraction={spec.val_fraction}: the held-out documents ({held} of {docs}) fill "
                           f"no block of seq_len={seq_len}; allowed: a larger fraction, a smaller seq_len, or 0")


def num_proc(spec: DataSpec) -> int:
    return spec.num_proc or len(os.sched_getaffinity(0))


def _batches(texts: Iterator[str]) -> Iterator[list[str]]:
    batch, size = [], 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def tokenized(batches: Iterator[list[str]], tokenizer, processes: int, dtype: np.dtype,
              used: dict) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Each batch's token ids (flat) and its documents' lengths, in order (:func:`in_order`)."""
    return in_order(batches, _encode, (tokenizer, dtype), processes, used)


def in_order(batches: Iterator, work, state: tuple, processes: int, used: dict) -> Iterator:
    """``work(*state, batch)`` of each batch, in order: in this process when there is one batch
    or one process, else in a pool of forked ones, each on one core (``used["processes"]``:
    which), at most two batches a process in flight. An error in a batch is raised here, and
    ends the pool."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # a process, a core; forking then stays quiet
    try:
        first = list(itertools.islice(batches, 2))
        used["processes"] = 1 if len(first) < 2 else processes
        if used["processes"] == 1:
            for batch in itertools.chain(first, batches):
                yield work(*state, batch)
            return
        yield from _in_pool(itertools.chain(first, batches), work, state, processes)
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


_STOPS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2}


def _in_pool(batches, work, state, processes):
    # the stop signals wait while the pool forks: a worker takes its own handlers before any arrives
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
    try:
        pool = multiprocessing.get_context("fork").Pool(processes, _start_worker, (work, state))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    done = False
    try:
        window = collections.deque()
        for batch in batches:
            window.append(pool.apply_async(_in_worker, (batch,)))
            if len(window) >= 2 * processes:
                yield window.popleft().get()
        while window:
            yield window.popleft().get()
        done = True
    finally:
        pool.close() if done else pool.terminate()  # an error or a stop ends the workers at once
        pool.join()


def _encode(tokenizer, dtype, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    if getattr(tokenizer, "is_fast", False):  # the Rust tokenizer itself: the same ids, a third faster
        ids = [e.ids for e in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]
    else:
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    return np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum())), lengths


_WORKER: dict = {}


def _start_worker(work, state) -> None:
    """A pool process (forked: ``work`` and ``state`` are its own copies, never pickled): ends
    with the driver, leaves Ctrl-C to it, dies of a stop signal."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    for sig in _STOPS:
        signal.signal(sig, signal.SIG_IGN if sig == signal.SIGINT else signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)
    _WORKER.update(work=work, state=state)


def _in_worker(batch):
    return _WORKER["work"](*_WORKER["state"], batch)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *_):
        pass


def progress_bar(total: int, progress: bool):
    if not progress:
        return _NoBar()
    from tqdm.auto import tqdm

    # shown after two seconds (a small corpus, or a refusal on its first record, prints none) and
    # cleared at the end: the job says what it took
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc="tokenizing", mininterval=1.0,
                delay=2.0, leave=False)
