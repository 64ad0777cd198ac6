"""Speculative decoding: a small draft model proposes tokens, the target model checks them
all in one forward pass, and every token the target would not have chosen is replaced
by its own choice. Greedy output is exactly the target's alone; what changes is how
many target passes it takes.

    >>> r = speculative_generate(big, small, "The capital of France is", max_tokens=64)
    >>> r.text, r.acceptance_rate, r.target_passes
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from workbench.engine.kv_cache import KVCache


@dataclass(frozen=True)
class SpeculativeResult:
    """What `speculative_generate` produced and how well the draft guessed."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (an end token) or "length"
    drafted: int  # tokens the draft proposed
    accepted: int  # of those, the ones the target agreed with
    target_passes: int  # forward passes of the target after the prompt

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def speculative_generate(target, draft, prompt: str | Sequence[int], *, max_tokens: int = 256,
                         draft_tokens: int = 4) -> SpeculativeResult:
    """Greedy decoding of `target` (an `LLM`) sped up by `draft` (a smaller `LLM` with the
    same vocabulary): each round the draft proposes `draft_tokens` tokens greedily, the
    target scores the last token and all proposals in one pass, keeps the proposals up
    to the first it disagrees with and adds its own next token. The output equals
    `target.generate(prompt, temperature=0, max_tokens=max_tokens)`'s tokens.
    """
    if draft_tokens < 1 or max_tokens < 0:
        raise ValueError("draft_tokens must be >= 1 and max_tokens >= 0")
    _check_vocabulary(target, draft)
    ids, _ = target._prompt_ids(prompt, None, False)
    t_model, d_model = target._require_model(), draft._require_model()
    room = min(target.kv_cache_size, draft.kv_cache_size)
    t_cache, d_cache = t_model.new_cache(room), d_model.new_cache(room)
    with target._busy, draft._busy:
        for model, llm, cache in ((t_model, target, t_cache), (d_model, draft, d_cache)):
            if len(ids) > 1:
                with llm._forward_lock:
                    model.hidden(np.asarray(ids[:-1]), cache)
        last = ids[-1]  # emitted (or prompt) token that neither model has seen yet
        out: list[int] = []
        drafted = accepted = passes = 0
        reason = "length"
        while len(out) < max_tokens:
            k = min(draft_tokens, max_tokens - len(out), room - t_cache.offset - 1)
            if k < 1:
                break
            proposal = _draft(draft, d_model, d_cache, last, k)
            base = t_cache.offset
            with target._forward_lock:  # (k + 1, n_vocab): after `last`, then each proposal
                logits = t_model.forward(np.asarray([last] + proposal), t_cache)
            passes += 1
            choices = logits.argmax(axis=-1)
            n = 0
            while n < k and proposal[n] == choices[n]:
                n += 1
            drafted += k
            accepted += n
            new = proposal[:n] + [int(choices[n])]
            t_cache.trim(base + 1 + n)  # keep `last` and the accepted proposals
            d_cache.trim(base + 1 + n)
            for token in new:
                if target.is_stop_token(token):
                    return _result(target, out, "stop", drafted, accepted, passes)
                out.append(token)
                if len(out) == max_tokens:
                    break
            last = new[-1]
        return _result(target, out, reason, drafted, accepted, passes)


def _draft(draft, model, cache: KVCache, last: int, k: int) -> list[int]:
    """`k` greedy tokens of the draft after `last` (all fed, so its cache holds them)."""
    tokens = []
    token = last
    for _ in range(k):
        with draft._forward_lock:
            logits = model.logits(model.hidden(np.asarray([token]), cache))[0]
        token = int(np.argmax(logits))
        tokens.append(token)
    with draft._forward_lock:  # the last proposal too, in case the target accepts it
        model.hidden(np.asarray([token]), cache)
    return tokens


def _check_vocabulary(target, draft) -> None:
    t, d = target.tokenizer, draft.tokenizer
    same = (target.config.n_vocab == draft.config.n_vocab
            and all(t.token_bytes(i) == d.token_bytes(i) for i in range(target.config.n_vocab)))
    if not same:
        raise ValueError(f"the draft model {draft.path.name} has another vocabulary than "
                         f"{target.path.name}; speculative decoding needs the same tokens")


def _result(target, out: list[int], reason: str, drafted: int, accepted: int,
            passes: int) -> SpeculativeResult:
    return SpeculativeResult(target.detokenize(out), out, reason, drafted, accepted, passes)
