"""Key/value caches for decoder self-attention.

A `KVPool` preallocates the keys and values of every layer for `n_slots`
sequences of up to `max_len` positions:

    keys, values: (n_layer, n_slots, n_kv_head, max_len, head_dim) float32

A `KVCache` is one sequence: one slot of a pool, its filled length `offset`
and the token ids cached so far. Sequences of one pool can be decoded together
in a single forward pass (`LlamaModel.decode`), each at its own position.
Writes go in place, so decoding allocates nothing per step. The buffers are
anonymous memory maps that the OS fills with zero pages as they are first
written, with transparent huge pages turned off: a 4096-position pool costs
memory only as far as it is filled. (`np.zeros` would ask for huge pages, and
writing position 0 of every layer and head would then commit the whole pool:
measured +177 MB for SmolLM2 at 4096 positions.)

`LayerKVCache` is one layer of one sequence, the view the prefill path uses.
"""

from __future__ import annotations

import mmap

import numpy as np


class ContextFullError(ValueError):
    """More positions were fed than the KV cache holds."""


class KVPool:
    """Keys and values of all layers for `n_slots` sequences of up to `max_len` positions."""

    def __init__(self, n_layer: int, n_slots: int, n_kv_head: int, head_dim: int,
                 max_len: int):
        if n_slots < 1 or max_len < 1:
            raise ValueError("a KV pool needs at least one slot and one position")
        shape = (n_layer, n_slots, n_kv_head, max_len, head_dim)
        self.keys = _lazy_zeros(shape)
        self.values = _lazy_zeros(shape)

    @property
    def n_slots(self) -> int:
        return self.keys.shape[1]

    @property
    def max_len(self) -> int:
        return self.keys.shape[3]

    def caches(self) -> list[KVCache]:
        """One `KVCache` per slot."""
        return [KVCache(self, s) for s in range(self.n_slots)]


class LayerKVCache:
    """Keys and values of one layer of one sequence: views (n_kv_head, max_len, head_dim)."""

    def __init__(self, seq: KVCache, layer: int):
        self.seq = seq
        self.keys = seq.pool.keys[layer, seq.slot]
        self.values = seq.pool.values[layer, seq.slot]

    def update_and_fetch(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write k, v of shape (n_kv_head, T, head_dim) at the sequence's next positions;
        return all keys and values up to them, each (n_kv_head, offset + T, head_dim).

        The sequence's `offset` is advanced by the caller once every layer is written."""
        start = self.seq.offset
        end = self.seq.check_room(k.shape[1])
        self.keys[:, start:end] = k
        self.values[:, start:end] = v
        return self.keys[:, :end], self.values[:, :end]


class KVCache:
    """The cached keys and values of one sequence (all layers): one slot of a `KVPool`."""

    def __init__(self, pool: KVPool, slot: int):
        self.pool = pool
        self.slot = slot
        self.offset = 0  # number of cached positions (the position the next token takes)
        self.tokens: list[int] = []  # the token ids whose keys and values are cached
        self.layers = [LayerKVCache(self, i) for i in range(pool.keys.shape[0])]

    @property
    def max_len(self) -> int:
        return self.pool.max_len

    def check_room(self, n: int) -> int:
        """The end position after `n` more tokens; `ContextFullError` if they do not fit."""
        end = self.offset + n
        if end > self.max_len:
            raise ContextFullError(
                f"the KV cache holds {self.max_len} positions and {end} were requested; "
                "load the model with a larger kv_cache_size"
            )
        return end

    def trim(self, n: int) -> None:
        """Forget all but the first `n` positions (nothing is copied)."""
        self.offset = max(0, min(n, self.offset))
        del self.tokens[self.offset :]

    def reset(self) -> None:
        """Forget everything."""
        self.trim(0)

    def common_prefix(self, ids: list[int]) -> int:
        """Length of the longest common prefix of the cached tokens and `ids`."""
        n = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            n += 1
        return n


def _lazy_zeros(shape: tuple[int, ...]) -> np.ndarray:
    """A float32 array of zeros whose pages are committed one 4 KiB page at a time as
    they are written (an anonymous map without transparent huge pages)."""
    count = int(np.prod(shape))
    buf = mmap.mmap(-1, max(4 * count, 1))
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype=np.float32, count=count).reshape(shape)
