"""The order of a corpus's stream, drawn from ``seed`` without holding anything the size of
the corpus: which documents are held out, and which block each training sample reads.

- Documents (in file order, pieces counted as documents) are taken in windows of ``WINDOW``:
  window ``w`` holds out ``round(WINDOW * f * (w + 1)) - round(WINDOW * f * w)`` of its own
  (``f``: ``data.val_fraction``), those whose draws from ``(seed, index)`` are the smallest, the
  corpus's first document always among them. So after every whole window the held-out count is
  ``f`` of the documents, rounded, spread over the whole corpus, and a small corpus still has a
  held-out side.
- Sample ``i`` of the training stream is block ``order_e(i mod n)`` of epoch ``e = i // n``,
  where ``order_e`` is a bijection of ``[0, n)`` keyed by ``(seed, e)``: a four-round Feistel
  network on the fewest even number of bits that covers ``n``, applied again to any value
  past ``n`` (cycle walking) until it lands inside. Each epoch reads every block once, in an
  order of its own, and a rank computes the blocks of its batch alone.
"""

from __future__ import annotations

import numpy as np

_GOLDEN, _MIX = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9)


def mix(values: np.ndarray, key: int) -> np.ndarray:
    """A keyed 64-bit hash of each value (splitmix64's finaliser on ``value ^ key``)."""
    v = (values.astype(np.uint64) ^ np.uint64(key & (2**64 - 1))) * _GOLDEN
    v ^= v >> np.uint64(30)
    v *= _MIX
    v ^= v >> np.uint64(27)
    return v


WINDOW = 20


def held_out(first: int, count: int, seed: int, fraction: float) -> np.ndarray:
    """Whether documents ``first`` .. ``first + count - 1`` are held out (module docstring)."""
    if fraction <= 0 or count == 0:
        return np.zeros(count, dtype=bool)
    w0, w1 = first // WINDOW, (first + count - 1) // WINDOW + 1
    index = np.arange(w0 * WINDOW, w1 * WINDOW, dtype=np.uint64)
    draw = mix(index, _key(seed, -1, 0)).reshape(-1, WINDOW)
    if w0 == 0:
        draw[0, 0] = 0  # the first document: the smallest draw of its window
    rank = np.argsort(np.argsort(draw, axis=1, kind="stable"), axis=1)
    edges = np.round(WINDOW * fraction * np.arange(w0, w1 + 1))
    held = rank < (edges[1:] - edges[:-1])[:, None]
    return held.reshape(-1)[first - w0 * WINDOW:first - w0 * WINDOW + count]


class BlockOrder:
    """The training stream's blocks: ``blocks(samples)`` maps sample indices to block rows."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self.half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)  # 2 * half bits cover [0, n)

    def blocks(self, samples: np.ndarray) -> np.ndarray:
        samples = np.asarray(samples, dtype=np.int64)
        out = np.empty(len(samples), dtype=np.int64)
        epochs = samples // self.n
        for epoch in np.unique(epochs):
            at = epochs == epoch
            out[at] = self._permute(samples[at] % self.n, int(epoch))
        return out

    def _permute(self, x: np.ndarray, epoch: int) -> np.ndarray:
        keys = [_key(self.seed, epoch, r) for r in range(4)]
        y = self._feistel(x.astype(np.uint64), keys)
        outside = y >= self.n
        while outside.any():  # cycle walking: the bijection of [0, 4^half) stays one on [0, n)
            y[outside] = self._feistel(y[outside], keys)
            outside = y >= self.n
        return y.astype(np.int64)

    def _feistel(self, x: np.ndarray, keys: list[int]) -> np.ndarray:
        half, mask = np.uint64(self.half), np.uint64((1 << self.half) - 1)
        left, right = x >> half, x & mask
        for key in keys:
            left, right = right, left ^ (mix(right, key) & mask)
        return (left << half) | right


def _key(seed: int, epoch: int, round_: int) -> int:
    return int(mix(np.array([round_ + 4 * (epoch + 1)], dtype=np.uint64), int(seed) * 0x100000001B3 + 12345)[0])
