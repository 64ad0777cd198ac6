"""Key/value caches for decoder self-attention: explicit per-layer objects.

Each layer owns preallocated key and value buffers for `max_len` positions;
`update_and_fetch` writes the new positions in place and returns views of
everything cached so far, so decoding allocates nothing per step. (The buffers
come from `np.zeros`, whose pages the OS maps lazily: a 4096-position cache
costs memory only as far as it is filled.)
"""

from __future__ import annotations

import numpy as np


class ContextFullError(ValueError):
    """More positions were fed than the KV cache holds."""


class LayerKVCache:
    """Keys and values of one attention layer.

    Buffers are (n_kv_head, max_len, head_dim) float32; `offset` positions are filled.
    """

    def __init__(self, n_kv_head: int, head_dim: int, max_len: int, dtype=np.float32):
        self.keys = np.zeros((n_kv_head, max_len, head_dim), dtype=dtype)
        self.values = np.zeros((n_kv_head, max_len, head_dim), dtype=dtype)
        self.offset = 0

    @property
    def max_len(self) -> int:
        return self.keys.shape[1]

    def update_and_fetch(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Append k, v of shape (n_kv_head, T, head_dim); return all keys and values so far,
        each (n_kv_head, offset + T, head_dim)."""
        T = k.shape[1]
        end = self.offset + T
        if end > self.max_len:
            raise ContextFullError(
                f"the KV cache holds {self.max_len} positions and {end} were requested; "
                "load the model with a larger kv_cache_size"
            )
        self.keys[:, self.offset : end] = k
        self.values[:, self.offset : end] = v
        self.offset = end
        return self.keys[:, :end], self.values[:, :end]


class KVCache:
    """The caches of every layer of one sequence, moving together."""

    def __init__(self, n_layer: int, n_kv_head: int, head_dim: int, max_len: int):
        self.layers = [LayerKVCache(n_kv_head, head_dim, max_len) for _ in range(n_layer)]
        self.tokens: list[int] = []  # the token ids whose keys and values are cached

    @property
    def offset(self) -> int:
        """Number of cached positions (the position the next token takes)."""
        return self.layers[0].offset if self.layers else len(self.tokens)

    @property
    def max_len(self) -> int:
        return self.layers[0].max_len

    def trim(self, n: int) -> None:
        """Forget all but the first `n` positions (nothing is copied)."""
        n = max(0, min(n, self.offset))
        for layer in self.layers:
            layer.offset = n
        del self.tokens[n:]

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
