"""Decoding strategies built on the engine, each a small function.

- `best_of_n`: sample n answers at once, keep the one the model finds least surprising.
- `stream_past_context`: generate beyond the context length by keeping the first few
  "sink" tokens and a sliding window of the most recent ones (StreamingLLM).

(`speculative_generate`, drafting with a small model, is in `speculative.py`.)
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from workbench.engine.llm import LLM, Completion, TokenEvent
from workbench.engine.metrics import Perplexity


@dataclass(frozen=True)
class BestOfN:
    """The candidates of `best_of_n`, best first, with their perplexities."""

    candidates: list[Completion]
    perplexities: list[float]

    @property
    def best(self) -> Completion:
        return self.candidates[0]


def best_of_n(model: LLM, prompt: str | Sequence[int] | Sequence[Mapping[str, Any]], n: int = 4,
              **options) -> BestOfN:
    """Sample `n` continuations of `prompt` (text, token ids, or chat messages) in one
    batch and rank them by perplexity (lowest first: the answer the model is surest of).

    Options are `generate_batch`'s; the default temperature is 0.8 and `seed=s` gives
    candidate i the seed s + i.
    """
    if n < 1:
        raise ValueError("n must be >= 1")
    options.setdefault("logprobs", 0)
    if _is_chat(prompt):
        completions = model.chat_batch([prompt] * n, **options)
    else:
        completions = model.generate_batch([prompt] * n, **options)
    scored = []
    for c in completions:
        ppl = Perplexity()
        for ev in c.events:
            if ev.id is not None:
                ppl.add(ev.logprob)
        scored.append((ppl.get(), c))
    scored.sort(key=lambda pair: pair[0])
    return BestOfN([c for _, c in scored], [p for p, _ in scored])


def _is_chat(prompt: Any) -> bool:
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and bool(prompt) \
        and isinstance(prompt[0], Mapping)


def stream_past_context(model: LLM, prompt: str | Sequence[int], *, max_tokens: int,
                        window: int | None = None, sink: int = 4, discard: int | None = None,
                        **options) -> Completion:
    """Generate up to `max_tokens` tokens, more than the context holds.

    The KV cache holds `window` positions (default: the model's `kv_cache_size`).
    When it is full, `discard` positions after the first `sink` ones (default: half
    of the rest) are dropped and the later ones moved back, their keys re-rotated
    (`LLM.kv_remove(..., recompute=False)`): the model keeps seeing the start of the
    text, which anchors its attention, and the most recent tokens. Options are
    `generate`'s sampling and stop options.
    """
    window = window or model.kv_cache_size
    discard = discard or max(1, (window - sink) // 2)
    if not 0 <= sink < window or not 0 < discard <= window - sink:
        raise ValueError(f"need 0 <= sink < window and 0 < discard <= window - sink "
                         f"(sink={sink}, discard={discard}, window={window})")
    ids, text = model._prompt_ids(prompt, options.pop("add_bos", None),
                                  options.pop("include_prompt", False))
    if len(ids) >= window:
        raise ValueError(f"the prompt ({len(ids)} tokens) must be shorter than the window "
                         f"({window})")
    seed = options.pop("seed", None)
    seq = model._decoding(ids, None, seed, max_tokens=max_tokens, **options)
    return Completion(_stream(model, ids, seq, window, sink, discard), ids, text)


def _stream(model: LLM, ids: list[int], seq, window: int, sink: int, discard: int
            ) -> Generator[TokenEvent, None, str]:
    net = model._require_model()
    cache = net.new_cache(window)
    with model._busy:
        logits = model._prefill(ids, cache)
        while True:
            if cache.offset == cache.max_len:  # full: forget the oldest after the sinks
                net.kv_remove(cache, sink, sink + discard)
            token, events = seq.step(logits, room=True)
            yield from events
            if token is None:
                return seq.finish_reason
            with model._forward_lock:
                logits = net.logits(net.hidden(np.asarray([token]), cache))[0]
