"""Decoding strategies built on the engine, each a small function.

- `best_of_n`: sample n answers at once, keep the one the model finds least surprising.
- `stream_past_context`: generate beyond the context length by keeping the first few
  "sink" tokens and a sliding window of the most recent ones (StreamingLLM).
- `entropy_branching`: decode greedily, and where the model is unsure (high entropy)
  try the top alternatives a few tokens ahead on forked branches; keep the surest.

(Speculative decoding, drafting with a small model, is `generate(..., draft=)`: see
`speculative.py`.)
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from workbench.engine.explore.branch import Branch, BranchStore
from workbench.engine.explore.metrics import Perplexity, model_entropy
from workbench.engine.llm import LLM
from workbench.engine.options import GenerationOptions
from workbench.engine.results import Completion, TokenEvent


@dataclass(frozen=True)
class BestOfN:
    """The candidates of `best_of_n`, best first, with their perplexities."""

    candidates: list[Completion]
    perplexities: list[float]

    @property
    def best(self) -> Completion:
        return self.candidates[0]


BEST_OF_N_TEMPERATURE = 0.8  # best_of_n samples its candidates unless told otherwise


def best_of_n(model: LLM, prompt: str | Sequence[int] | Sequence[Mapping[str, Any]], n: int = 4,
              **options) -> BestOfN:
    """Sample `n` continuations of `prompt` (text, token ids, or chat messages) in one
    batch and rank them by perplexity (lowest first: the answer the model is surest of).

    Options are `generate_batch`'s (`cancel=` a flag included: once it is set the batch
    raises `Cancelled`); `seed=s` gives candidate i the seed s + i. The temperature
    defaults to BEST_OF_N_TEMPERATURE (0.8), not the API's greedy 0, at which every
    candidate would be the same.
    """
    if n < 1:
        raise ValueError("n must be >= 1")
    options.setdefault("logprobs", 0)
    if "options" not in options:
        options.setdefault("temperature", BEST_OF_N_TEMPERATURE)
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
    processors = options.pop("logits_processors", ())
    opts = GenerationOptions.of(options.pop("options", None), max_tokens=max_tokens, **options)
    seq = model._decoding(ids, None, opts, logits_processors=processors)
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
            token, events = seq.step(logits, room=seq.max_tokens)  # the window slides
            yield from events
            if token is None:
                return seq.finish_reason
            with model._forward_lock:
                logits = net.logits(net.hidden(np.asarray([token]), cache))[0]


@dataclass(frozen=True)
class BranchPoint:
    """Where `entropy_branching` forked: the position (in generated tokens), the entropy
    there (nats), and each alternative's token with the perplexity of its lookahead."""

    position: int
    entropy: float
    alternatives: list[tuple[int, float]]
    chosen: int


@dataclass(frozen=True)
class EntropyBranching:
    text: str
    token_ids: list[int]
    branch_points: list[BranchPoint]


def entropy_branching(model: LLM, prompt: str | Sequence[int], *, max_tokens: int = 64,
                      threshold: float = 2.0, k: int = 3, lookahead: int = 6) -> EntropyBranching:
    """Greedy decoding that looks ahead where the model hesitates.

    At each step whose next-token entropy exceeds `threshold` (nats), the `k` most
    likely tokens are each continued greedily for `lookahead` tokens on forked
    branches (all in one forward pass per step); the token whose branch has the
    lowest perplexity is kept, and decoding goes on from it.
    """
    ids, _ = model._prompt_ids(prompt, None, False)
    store = BranchStore(model, max_active=k + 1,
                        max_len=min(model.kv_cache_size, len(ids) + max_tokens + lookahead + 1))
    main = Branch.create(model, {"temperature": 0}, store=store)
    main.prefill(ids)
    out: list[int] = []
    points: list[BranchPoint] = []
    while len(out) < max_tokens and main.cache.offset < main.cache.max_len - lookahead - 1:
        h = model_entropy(main.logits)
        if h > threshold:
            alternatives = [int(t) for t in np.argsort(-main.logits)[:k]]
            scores = _lookahead(store, main, alternatives, lookahead)
            token = min(zip(scores, alternatives))[1]
            points.append(BranchPoint(len(out), h, list(zip(alternatives, scores)), token))
        else:
            token = int(np.argmax(main.logits))
        if model.is_stop_token(token):
            break
        main.commit(token)
        out.append(token)
    main.prune_subtree()
    return EntropyBranching(model.detokenize(out), out, points)


def _lookahead(store: BranchStore, main: Branch, alternatives: list[int], n: int
               ) -> list[float]:
    """Perplexity of each alternative followed by `n` greedy tokens (forks of `main`)."""
    branches = [main.fork() for _ in alternatives]
    try:
        store.commit(list(zip(branches, alternatives)))
        live = [b for b, t in zip(branches, alternatives) if not b.is_stop(t)]
        for _ in range(n):
            step = [(b, int(np.argmax(b.logits))) for b in live]
            step = [(b, t) for b, t in step if not b.is_stop(t)]
            if not step:
                break
            store.commit(step)
            live = [b for b, _ in step]
        return [b.perplexity for b in branches]
    finally:
        for b in branches:
            b.prune_subtree()
