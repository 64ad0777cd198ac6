"""`GenerationModel`: what the scheduler (`workbench.engine.decoding.scheduler`) and speculative
decoding (`workbench.engine.decoding.speculative`) use of a model, and all they use. `LLM`
provides it; a test drives the scheduler with a fake one.

The calls that run the network (`hidden`, `hidden_batch`, `decode_step`, `logits_out`)
do not lock: their caller holds `forward_lock` around them, one forward pass at a time
per model. `prefill` takes the lock itself, chunk by chunk.

KV slots: `new_pool(n)` allocates `n` slots of `kv_cache_size` positions; the pool's
caches (`KVCache`) are freed (`trim`, `reset`) and forked (`fork`) by whoever holds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import numpy as np

from workbench.engine.cancel import CancelFlag
from workbench.engine.runtime.kv_cache import KVCache, KVPool


@runtime_checkable
class GenerationModel(Protocol):
    """A decoder model as the scheduler and speculative decoding see it."""

    kv_cache_size: int  # positions each sequence may hold
    backend: Any  # None on the CPU; on a GPU the logits can stay on the device
    prefilled_tokens: int  # prompt tokens run through the model so far (callers count)
    config: Any  # the family's config: `n_vocab` is read
    tokenizer: Any  # (speculative decoding checks that two models share a vocabulary)

    @property
    def forward_lock(self) -> AbstractContextManager:
        """Held around every forward pass (one at a time per model)."""
        ...

    def marked_busy(self) -> AbstractContextManager:
        """Held while a generation runs: the model's `busy` signal is True meanwhile."""
        ...

    def new_pool(self, n_slots: int) -> KVPool:
        """KV room for `n_slots` sequences of `kv_cache_size` positions."""
        ...

    def new_cache(self, max_len: int | None = None) -> KVCache:
        """One sequence's KV cache of its own (default length `kv_cache_size`)."""
        ...

    def hidden(self, ids: np.ndarray, cache: KVCache) -> Any:
        """A chunk of one prompt through the model: hidden states (T, D), `ids` appended
        to `cache`."""
        ...

    def hidden_batch(self, chunks: Sequence[tuple[np.ndarray, KVCache]]) -> list[Any]:
        """Several prompts' chunks in one pass: their hidden states, in order."""
        ...

    def decode_step(self, tokens: np.ndarray, caches: Sequence[KVCache],
                    device_tokens: Sequence[Any]) -> Any:
        """One token of each sequence (`tokens` (N,), one per cache): the logits rows
        (N, n_vocab) after them, one array, on the device where there is a backend
        (`device_tokens`: the same ids where the sampler left them on the device, each a
        (1,) array or a `BatchRow` of one; None where only the host has it)."""
        ...

    def logits_out(self, hidden: Any, on_device: bool) -> Any:
        """Logits (T, n_vocab) of hidden states (T, D): NumPy, or a device array with
        `on_device` on a GPU."""
        ...

    def prefill(self, ids: Sequence[int], cache: KVCache, on_device: bool = False,
                cancel: CancelFlag | None = None) -> Any:
        """`ids` through the model in chunks (taking `forward_lock` for each; `cancel`
        looked at between them): the logits (n_vocab,) after the last one."""
        ...
