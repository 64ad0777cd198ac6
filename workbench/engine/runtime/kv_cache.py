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

Sliding-window layers (Gemma 3's local layers, Mistral, Phi-3) see only the
last `window` positions. When the context is longer than `window + RING_SLACK`,
those layers keep a rotating cache: position p lives at index p % ring, ring =
window + RING_SLACK, so a long generation commits no more memory for them
than the ring (their later indices are never touched, hence never committed).
Such a cache holds positions [ring_floor, offset) of those layers; stepping
back further than that (`trim`) starts the sequence over, as llama.cpp does.

`LayerKVCache` is one layer of one sequence, the view the prefill path uses.
A sequence's first positions are copied out as a `PrefixCache`
(`workbench.engine.runtime.prefix_cache`) and restored from one.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from workbench.engine.runtime.prefix_cache import PrefixCache, common_prefix


class ContextFullError(ValueError):
    """More positions were fed than the KV cache holds."""


# Positions a rotating sliding-window cache keeps beyond its window, so that a sequence
# can step back a little (rejected draft tokens, a regenerated reply) without a new prefill.
RING_SLACK = 256


class KVPool:
    """Keys and values of all layers for `n_slots` sequences of up to `max_len` positions."""

    def __init__(self, n_layer: int, n_slots: int, n_kv_head: int, head_dim: int,
                 max_len: int, window: int = 0, local: np.ndarray | None = None):
        """`window`: the sliding window of the layers flagged in `local` (n_layer,) bool
        (all layers when None); 0 for none."""
        if n_slots < 1 or max_len < 1:
            raise ValueError("a KV pool needs at least one slot and one position")
        shape = (n_layer, n_slots, n_kv_head, max_len, head_dim)
        self.keys = _lazy_zeros(shape)
        self.values = _lazy_zeros(shape)
        self.window = int(window)
        if not window:
            self.local = np.zeros(n_layer, bool)
        else:
            self.local = np.ones(n_layer, bool) if local is None else np.asarray(local, bool)
        ring = self.window + RING_SLACK if self.window else 0
        self.ring = ring if ring < max_len else 0  # 0: every position at its own index

    @property
    def n_slots(self) -> int:
        return self.keys.shape[1]

    @property
    def max_len(self) -> int:
        return self.keys.shape[3]

    def caches(self) -> list[KVCache]:
        """One `KVCache` per slot."""
        return [self.cache(s) for s in range(self.n_slots)]

    def cache(self, slot: int) -> KVCache:
        """A cache on slot `slot` (empty; whatever the slot held is overwritten as it fills)."""
        return KVCache(self, slot)


class LayerKVCache:
    """Keys and values of one layer of one sequence: views (n_kv_head, max_len, head_dim)."""

    def __init__(self, seq: KVCache, layer: int):
        self.seq = seq
        self.layer = layer
        self.keys = seq.pool.keys[layer, seq.slot]
        self.values = seq.pool.values[layer, seq.slot]

    def update_and_fetch_window(self, k: np.ndarray, v: np.ndarray, window: int
                                ) -> tuple[np.ndarray, np.ndarray, int]:
        """`update_and_fetch` for a sliding-window layer: write k, v (n_kv_head, T, head_dim)
        at the next positions; return the keys and values of positions [lo, offset + T),
        each (n_kv_head, offset + T - lo, head_dim), and lo = max(0, offset - window + 1):
        all that the T new queries may see (each masks what lies outside its window)."""
        seq = self.seq
        start = seq.offset
        end = seq.check_room(k.shape[1])
        lo = max(0, start - window + 1)
        ring = seq.pool.ring
        if not ring:
            keys, values = self.update_and_fetch(k, v)
            return keys[:, lo:], values[:, lo:], lo
        before = np.arange(lo, start) % ring  # read before the new positions overwrite them
        keys = np.concatenate([self.keys[:, before], k], axis=1)
        values = np.concatenate([self.values[:, before], v], axis=1)
        keep = min(k.shape[1], ring)  # of a chunk longer than the ring, its last positions
        at = np.arange(end - keep, end) % ring
        self.keys[:, at] = k[:, k.shape[1] - keep :]
        self.values[:, at] = v[:, v.shape[1] - keep :]
        return keys, values, lo

    def update_and_fetch(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write k, v of shape (n_kv_head, T, head_dim) at the sequence's next positions;
        return all keys and values up to them, each (n_kv_head, offset + T, head_dim).

        The sequence's `offset` is advanced by the caller once every layer is written."""
        start = self.seq.offset
        end = self.seq.check_room(k.shape[1])
        self.keys[:, start:end] = k
        self.values[:, start:end] = v
        if self.seq.shared_until:  # a fork: its first positions live in other slots
            return self.seq.gather(self.layer, end)
        return self.keys[:, :end], self.values[:, :end]


class KVCache:
    """The cached keys and values of one sequence (all layers): one slot of a `KVPool`."""

    def __init__(self, pool: KVPool, slot: int):
        self.pool = pool
        self.slot = slot
        self.offset = 0  # number of cached positions (the position the next token takes)
        self.tokens: list[int] = []  # the token ids whose keys and values are cached
        self.layers = [LayerKVCache(self, i) for i in range(pool.keys.shape[0])]
        # A fork reads positions [0, shared_until) from the slots in `sources` (its
        # parent's, or theirs) instead of copying them; its own positions follow.
        self.shared_until = 0
        self.sources = np.full(pool.max_len, slot, dtype=np.int64)  # slot of each position
        # with a rotating cache: the first position its sliding-window layers still hold
        self.ring_floor = 0

    def advance(self, tokens) -> None:
        """Count `tokens`, whose keys and values every layer has just written, as cached."""
        self.tokens.extend(int(t) for t in tokens)
        self.offset += len(tokens)
        if self.pool.ring:
            self.ring_floor = max(self.ring_floor, self.offset - self.pool.ring)

    def _ringed(self) -> np.ndarray:
        """Indices of the layers kept in a rotating cache (none without one)."""
        return np.nonzero(self.pool.local)[0] if self.pool.ring else np.zeros(0, np.int64)

    def fork(self, slot: int) -> KVCache:
        """A cache in `slot` of the same pool that shares every position cached so far
        (nothing is copied but the rotating caches of sliding-window layers, at most
        `ring` positions each; the caller must keep this cache's first `offset` positions
        as they are while the fork lives)."""
        child = KVCache(self.pool, slot)
        child.sources[: self.offset] = self.sources[: self.offset]
        child.shared_until = self.offset
        child.offset = self.offset
        child.tokens = list(self.tokens)
        # the parent goes on writing its rings: the fork needs its own copy of what they hold
        ringed = self._ringed()
        if ringed.size:
            at = np.arange(self.ring_floor, self.offset) % self.pool.ring
            for layer in ringed:
                keys, values = self.pool.keys[layer], self.pool.values[layer]
                keys[slot][:, at] = keys[self.slot][:, at]
                values[slot][:, at] = values[self.slot][:, at]
        child.ring_floor = self.ring_floor
        return child

    def gather(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of positions [0, end) of one layer, each (n_kv_head, end,
        head_dim), read from the slots that hold them (a copy)."""
        where = self.sources[:end]
        at = np.arange(end)
        # advanced indices on axes 0 and 2 come first: (end, n_kv_head, head_dim)
        keys = self.pool.keys[layer][where, :, at].transpose(1, 0, 2)
        values = self.pool.values[layer][where, :, at].transpose(1, 0, 2)
        return keys, values

    def materialize(self) -> None:
        """Copy the shared positions into this cache's own slot; it then needs no other."""
        n = self.shared_until
        if not n:
            return
        ringed = set(self._ringed().tolist())
        for layer in range(self.pool.keys.shape[0]):
            if layer in ringed:  # already its own
                continue
            keys, values = self.gather(layer, n)
            self.pool.keys[layer, self.slot, :, :n] = keys
            self.pool.values[layer, self.slot, :, :n] = values
        self.sources[:n] = self.slot
        self.shared_until = 0

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
        """Forget all but the first `n` positions (nothing is copied).

        A rotating sliding-window cache that no longer holds the window before `n`
        forgets everything instead (read `offset` after the call)."""
        n = max(0, min(n, self.offset))
        if self.pool.ring and max(0, n - self.pool.window + 1) < self.ring_floor:
            n = 0
        if n == 0:
            self.ring_floor = 0
        self.offset = n
        del self.tokens[self.offset :]
        if self.offset < self.shared_until:  # positions written from here on are its own
            self.sources[self.offset : self.shared_until] = self.slot
            self.shared_until = self.offset

    def check_span(self, start: int, end: int) -> None:
        """`ValueError` unless positions [start, end) are cached."""
        if not 0 <= start <= end <= self.offset:
            raise ValueError(f"cannot remove positions [{start}, {end}) of {self.offset} cached")

    def cut(self, start: int, end: int) -> list[int]:
        """Drop positions [start, end) by trimming back to `start`; return the tokens to run
        again so the cache holds the rest: those after `end`, and those before `start` when
        a rotating sliding-window cache had to start over."""
        self.check_span(start, end)
        remaining = self.tokens[:start] + self.tokens[end:]
        self.trim(start)
        return remaining[self.offset :]

    def reset(self) -> None:
        """Forget everything."""
        self.trim(0)

    def snapshot(self, model_sha256: str) -> PrefixCache:
        """A copy of every cached position as a `PrefixCache` (of rotating sliding-window
        layers, the positions from `ring_floor` on; the earlier ones are zeros)."""
        n = self.offset
        if self.shared_until:
            pairs = [self.gather(layer, n) for layer in range(self.pool.keys.shape[0])]
            keys = np.stack([k for k, _ in pairs])  # (L, H, n, d)
            values = np.stack([v for _, v in pairs])
        else:
            keys = np.array(self.pool.keys[:, self.slot, :, :n])  # (L, H, n, d)
            values = np.array(self.pool.values[:, self.slot, :, :n])
        floor, ringed = self.ring_floor, self._ringed()
        if ringed.size:  # unroll the rings into position order
            at = np.arange(floor, n) % self.pool.ring
            for layer in ringed:
                keys[layer], values[layer] = 0.0, 0.0
                keys[layer, :, floor:] = self.pool.keys[layer, self.slot][:, at]
                values[layer, :, floor:] = self.pool.values[layer, self.slot][:, at]
        return PrefixCache(list(self.tokens), keys, values, model_sha256,
                           local_from=floor if ringed.size else 0)

    def restore(self, prefix: PrefixCache, n: int) -> None:
        """Make the first `n` positions those of `prefix` (a copy, no forward pass).

        When the prefix lacks the sliding window before `n` (it was cut from a
        rotating cache), nothing is restored and the cache is left empty."""
        if prefix.keys.shape[0] != self.pool.keys.shape[0] \
                or prefix.keys.shape[1] != self.pool.keys.shape[2] \
                or prefix.keys.shape[3] != self.pool.keys.shape[4]:
            raise ValueError("the prefix cache was made by a model of another shape")
        self.trim(0)
        self.check_room(n)
        window, ring = self.pool.window, self.pool.ring
        if window and max(0, n - window + 1) < prefix.local_from:
            return
        ringed = self._ringed()
        plain = np.setdiff1d(np.arange(self.pool.keys.shape[0]), ringed)
        self.pool.keys[plain, self.slot, :, :n] = prefix.keys[plain, :, :n]
        self.pool.values[plain, self.slot, :, :n] = prefix.values[plain, :, :n]
        if ringed.size:
            lo = max(prefix.local_from, n - ring)
            at = np.arange(lo, n) % ring
            for layer in ringed:
                self.pool.keys[layer, self.slot][:, at] = prefix.keys[layer, :, lo:n]
                self.pool.values[layer, self.slot][:, at] = prefix.values[layer, :, lo:n]
            self.ring_floor = lo
        self.offset = n
        self.tokens[:] = prefix.tokens[:n]

    def common_prefix(self, ids: list[int]) -> int:
        """Length of the longest common prefix of the cached tokens and `ids`."""
        return common_prefix(self.tokens, ids)


class DeviceKVPool:
    """`KVPool` on a GPU backend: per layer, keys and values of shape
    (n_slots, n_kv_head, max_len, head_dim) float32 device arrays, written in place.

    Sliding-window layers keep every position here (they mask what lies outside
    their window), so a device cache never rotates.
    """

    window, ring = 0, 0

    def __init__(self, backend: Any, n_layer: int, n_slots: int, n_kv_head: int,
                 head_dim: int, max_len: int):
        if n_slots < 1 or max_len < 1:
            raise ValueError("a KV pool needs at least one slot and one position")
        self.backend = backend
        shape = (n_slots, n_kv_head, max_len, head_dim)
        self.keys = [backend.zeros(shape) for _ in range(n_layer)]
        self.values = [backend.zeros(shape) for _ in range(n_layer)]
        self.shape = (n_layer,) + shape  # as `KVPool.keys.shape`
        self.local = np.zeros(n_layer, bool)
        self.recordings: Any = None  # its recorded decode steps (llama_device.py)

    @property
    def n_slots(self) -> int:
        return self.shape[1]

    @property
    def max_len(self) -> int:
        return self.shape[3]

    def caches(self) -> list[DeviceKVCache]:
        """One `DeviceKVCache` per slot."""
        return [self.cache(s) for s in range(self.n_slots)]

    def cache(self, slot: int) -> DeviceKVCache:
        """A cache on slot `slot`."""
        return DeviceKVCache(self, slot)


class DeviceKVCache(KVCache):
    """One sequence of a `DeviceKVPool`. A fork copies its parent's positions into its
    own slot (a device copy, nothing crosses to the host)."""

    def __init__(self, pool: DeviceKVPool, slot: int):
        self.pool, self.slot = pool, slot
        self.offset = 0
        self.tokens: list[int] = []
        self.shared_until = 0
        self.sources = np.full(pool.max_len, slot, dtype=np.int64)
        self.ring_floor = 0

    def fork(self, slot: int) -> DeviceKVCache:
        child = DeviceKVCache(self.pool, slot)
        n = self.offset
        for keys, values in zip(self.pool.keys, self.pool.values):
            keys[slot, :, :n] = keys[self.slot, :, :n]
            values[slot, :, :n] = values[self.slot, :, :n]
        child.offset, child.tokens = n, list(self.tokens)
        return child

    def materialize(self) -> None:
        """Nothing to do: a device cache never shares positions."""

    def snapshot(self, model_sha256: str) -> PrefixCache:
        n, be = self.offset, self.pool.backend
        keys = np.stack([be.to_host(k[self.slot, :, :n]) for k in self.pool.keys])
        values = np.stack([be.to_host(v[self.slot, :, :n]) for v in self.pool.values])
        return PrefixCache(list(self.tokens), keys, values, model_sha256)  # (L, H, n, d) x2

    def restore(self, prefix: PrefixCache, n: int) -> None:
        shape = self.pool.shape
        if prefix.keys.shape[0] != shape[0] or prefix.keys.shape[1] != shape[2] \
                or prefix.keys.shape[3] != shape[4]:
            raise ValueError("the prefix cache was made by a model of another shape")
        self.trim(0)
        self.check_room(n)
        be = self.pool.backend
        for i, (keys, values) in enumerate(zip(self.pool.keys, self.pool.values)):
            keys[self.slot, :, :n] = be.asarray(np.ascontiguousarray(prefix.keys[i, :, :n]))
            values[self.slot, :, :n] = be.asarray(np.ascontiguousarray(prefix.values[i, :, :n]))
        self.offset = n
        self.tokens[:] = prefix.tokens[:n]


def _lazy_zeros(shape: tuple[int, ...]) -> np.ndarray:
    """A float32 array of zeros whose pages are committed one 4 KiB page at a time as
    they are written (an anonymous map without transparent huge pages)."""
    count = int(np.prod(shape))
    buf = mmap.mmap(-1, max(4 * count, 1))
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype=np.float32, count=count).reshape(shape)
