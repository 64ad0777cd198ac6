"""Speculative decoding: a small draft model proposes a few tokens, the target model scores
them all in one forward pass, and an acceptance rule keeps as many as it can while the
output follows the target's own distribution exactly.

    >>> c = big.generate("The capital of France is", draft=small, temperature=0)
    >>> c.text, c.usage.acceptance_rate

Each round, with `last` the newest token and `k` the number of proposals:

    draft:   x_1 ~ q_1, x_2 ~ q_2, ..., x_k ~ q_k      (one small pass each)
    target:  p_1 .. p_{k+1} = its logits after last, x_1, ..., x_k   (one pass)
    keep x_j with probability min(1, p_j(x_j) / q_j(x_j)), in order; at the first
    rejected x_j emit a token from norm(max(0, p_j - q_j)) and end the round;
    if all k are kept, emit a bonus token from p_{k+1}.

p and q are the target's and the draft's *processed* distributions (the one sampler
chain, `Sampler.probabilities`: bias, penalties, top-k/p, min-p, temperature), so the
emitted tokens are distributed exactly as the target's sampler would draw them
(Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling"). At
temperature 0 both are one-hot and the rule reduces to: keep proposals up to the first
one the target's argmax disagrees with, then emit the target's argmax. Greedy output is
the target's own token for token; sampled output with a seed is repeatable.

With `draft="ngram"` (prompt lookup) no second model runs: the proposals are the tokens
that followed the latest earlier occurrence of the output's last few tokens in the
prompt and output so far (the longest such n-gram, `LOOKUP_NGRAM` tokens down to 1),
and q is one-hot on each, so the same rule keeps a proposal with probability p(x)
(greedy: when it is the target's argmax). Editing and extraction tasks, whose output
copies long stretches of the prompt, then need far fewer target passes.

The generation runs in the caller's thread on KV caches of its own (not the
scheduler's slots), taking each model's forward lock per pass, so it interleaves with
the scheduler's batches of either model without touching their caches.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Generator, Sequence
from typing import Any

import numpy as np

from workbench.engine.cancel import CancelFlag, check_cancel
from workbench.engine.decoding.generation_model import GenerationModel
from workbench.engine.decoding.sampling import Sampler
from workbench.engine.decoding.sequence import Decoding
from workbench.engine.results import DraftCounts, TokenEvent
from workbench.engine.runtime.kv_cache import ContextFullError
from workbench.engine.runtime.prefix_cache import PrefixCache

DRAFT_TOKENS = 4  # proposals per round: the default of `generate(..., draft_tokens=)`
LOOKUP = "ngram"  # `draft=` for prompt-lookup drafting (no draft model)
LOOKUP_NGRAM = 3  # the longest n-gram prompt lookup matches (then shorter ones)


def check_draft(target: GenerationModel, draft: Any, draft_tokens: Any,
                prompt_ids: list[int], *,
                grammar: Any = None, logits_processors: Sequence[Any] = ()) -> None:
    """Refuse, with a `ValueError` naming the fix, what speculative decoding with `draft`
    cannot do: another kind of draft, another vocabulary, `draft_tokens` < 1, a grammar
    or schema, logits processors; a prompt longer than either context is a
    `ContextFullError`."""
    if isinstance(draft, str) and draft != LOOKUP:
        raise ValueError(f"draft must be an LLM or {LOOKUP!r} (prompt lookup), got {draft!r}")
    if not isinstance(draft, (GenerationModel, str)):
        raise TypeError(f"draft must be an LLM (a smaller model with the same vocabulary) or "
                        f"{LOOKUP!r} (prompt lookup), not {type(draft).__name__}")
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or draft_tokens < 1:
        raise ValueError(f"draft_tokens must be an int >= 1, got {draft_tokens!r}")
    if grammar is not None:
        raise ValueError("speculative decoding (draft=) does not support grammar= or schema=; "
                         "generate without a draft for constrained output")
    if logits_processors:
        raise ValueError("speculative decoding (draft=) does not support logits_processors; "
                         "generate without a draft to use them")
    if draft == LOOKUP:
        if len(prompt_ids) >= target.kv_cache_size:
            raise ContextFullError(f"the prompt has {len(prompt_ids)} tokens and the context "
                                   f"holds {target.kv_cache_size}")
        return
    _check_vocabulary(target, draft)
    room = min(target.kv_cache_size, draft.kv_cache_size)
    if len(prompt_ids) >= room:
        raise ContextFullError(
            f"the prompt has {len(prompt_ids)} tokens and the smaller context of the target "
            f"and the draft holds {room}; load both with a larger kv_cache_size")


def speculative_events(target: GenerationModel, draft: GenerationModel | str,
                       prompt_ids: list[int], seq: Decoding,
                       draft_tokens: int, counts: DraftCounts, *,
                       prefix: PrefixCache | None = None, cancel: CancelFlag | None = None
                       ) -> Generator[TokenEvent, None, str]:
    """Yield the events of `seq` (a `Decoding` of `target`, checked by `check_draft`)
    generated speculatively with `draft` (a model, or `LOOKUP`) proposing up to
    `draft_tokens` tokens per round; `counts` is updated after every round. Returns the
    finish reason.

    `prefix` (the target's `PrefixCache`) spares the target's prefill of the prompt
    tokens it holds. `cancel` is looked at between prefill chunks and rounds."""
    if seq.max_tokens == 0:
        return "length"
    lookup = draft == LOOKUP
    limit = target.kv_cache_size if lookup else min(target.kv_cache_size,
                                                    draft.kv_cache_size)
    size = min(limit, len(prompt_ids) + seq.max_tokens)  # the most positions ever fed
    t_cache = target.new_cache(size)
    sampler = seq.sampler  # the target's: its transforms and its random generator
    drafter = (_Lookup(target.config.n_vocab) if lookup
               else _DraftModel(draft, size, Sampler(sampler.params, draft.config.n_vocab)))
    with contextlib.ExitStack() as held:
        held.enter_context(target.marked_busy())
        if not lookup:
            held.enter_context(draft.marked_busy())
        if prefix is not None:
            t_cache.restore(prefix, min(prefix.common_prefix(prompt_ids),
                                        len(prompt_ids) - 1))
        rest = prompt_ids[t_cache.offset : -1]  # the last one is fed with the proposals
        if rest:
            target.prefill(rest, t_cache, cancel=cancel)
        target.prefilled_tokens += len(rest) + 1
        drafter.prefill(prompt_ids, cancel)
        while True:
            check_cancel(cancel)
            history = list(seq.history)  # prompt and output: the caches hold a prefix
            k = min(draft_tokens, seq.max_tokens - seq.n_generated - 1,
                    size - len(history))
            proposal, q = drafter.propose(history, k, sampler.rng)
            k = len(proposal)  # prompt lookup may find fewer (or none)
            feed = history[t_cache.offset :] + proposal
            with target.forward_lock:  # (k + 1, n_vocab): after `last`, each proposal
                hidden = target.hidden(np.asarray(feed), t_cache)
                logits = target.logits_out(hidden, on_device=False)[-(k + 1) :]
            chosen = _verify(sampler, logits, history, proposal, q, sampler.rng)
            counts.target_passes += 1
            counts.drafted += k
            counts.accepted += len(chosen) - 1
            keep = len(history) + len(chosen) - 1  # the prompt, output, kept proposals
            t_cache.trim(keep)
            drafter.trim(keep)
            for row, token in zip(logits, chosen):
                position = len(seq.history)
                token, events = seq.push(token, row, room=limit - position)
                yield from events
                if token is None:
                    return seq.finish_reason or "stop"


class _DraftModel:
    """Proposals sampled from a draft model, on a KV cache of its own."""

    def __init__(self, draft: GenerationModel, size: int, sampler: Sampler):
        self.draft, self.sampler = draft, sampler
        self.cache = draft.new_cache(size)

    def prefill(self, prompt_ids: list[int], cancel: CancelFlag | None) -> None:
        rest = prompt_ids[:-1]  # the last one is fed with the first proposal
        if rest:
            self.draft.prefill(rest, self.cache, cancel=cancel)
        self.draft.prefilled_tokens += len(rest) + 1

    def propose(self, history: list[int], k: int, rng: np.random.Generator
                ) -> tuple[list[int], list[np.ndarray]]:
        """`k` tokens the draft samples after `history` (whose first `cache.offset` tokens
        its cache holds) and the distributions q (n_vocab,) they were drawn from. The
        cache then holds everything but the last proposal."""
        draft, cache = self.draft, self.cache
        proposal: list[int] = []
        dists: list[np.ndarray] = []
        feed = history[cache.offset :]
        for _ in range(k):
            with draft.forward_lock:
                logits = draft.logits_out(draft.hidden(np.asarray(feed), cache)[-1:],
                                          on_device=False)[0]
            q = self.sampler.probabilities(logits, history + proposal)
            token = _draw(q, rng)
            proposal.append(token)
            dists.append(q)
            feed = [token]
        return proposal, dists

    def trim(self, keep: int) -> None:
        self.cache.trim(min(self.cache.offset, keep))


class _Lookup:
    """Prompt lookup: proposals copied from what followed the latest earlier occurrence of
    the history's last n tokens (n = LOOKUP_NGRAM down to 1), each with a one-hot q."""

    def __init__(self, n_vocab: int):
        self.n_vocab = n_vocab

    def prefill(self, prompt_ids: list[int], cancel: CancelFlag | None) -> None:
        pass  # nothing to read: the history is the draft

    def propose(self, history: list[int], k: int, rng: np.random.Generator
                ) -> tuple[list[int], list[np.ndarray]]:
        proposal = lookup_proposal(history, k)
        dists = []
        for token in proposal:
            q = np.zeros(self.n_vocab)
            q[token] = 1.0
            dists.append(q)
        return proposal, dists

    def trim(self, keep: int) -> None:
        pass


def lookup_proposal(history: Sequence[int], k: int, ngram: int = LOOKUP_NGRAM) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the last n tokens of
    `history`, for the longest n <= `ngram` that occurs earlier; [] when none does."""
    if k < 1:
        return []
    seq = np.asarray(history, dtype=np.int64)
    total = len(seq)
    for n in range(min(ngram, total - 1), 0, -1):
        tail = seq[total - n :]
        # windows[i] = seq[i : i + n], for the starts i of matches that end before the tail
        windows = np.lib.stride_tricks.sliding_window_view(seq[: total - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # what followed the latest match
            return [int(t) for t in seq[start : start + k]]
    return []


def _verify(sampler: Sampler, logits: np.ndarray, history: list[int], proposal: list[int],
            q: list[np.ndarray], rng: np.random.Generator) -> list[int]:
    """The tokens of one round: the proposals the target keeps, then its correction (at
    the first rejection) or a bonus token (all kept). `logits` (k + 1, n_vocab) are the
    target's after `history` and each proposal."""
    out: list[int] = []
    for j, x in enumerate(proposal):
        p = sampler.probabilities(logits[j], history + out)
        if rng.random() * q[j][x] < p[x]:  # kept with probability min(1, p(x) / q(x))
            out.append(x)
            continue
        residual = np.maximum(p - q[j], 0.0)
        out.append(_draw(residual if residual.sum() > 0 else p, rng))
        return out
    out.append(_draw(sampler.probabilities(logits[len(proposal)], history + out), rng))
    return out


def _draw(weights: np.ndarray, rng: np.random.Generator) -> int:
    """A token id drawn in proportion to `weights` (n_vocab,), non-negative, not all 0."""
    ids = np.flatnonzero(weights)
    cdf = np.cumsum(weights[ids])
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return int(ids[min(i, len(ids) - 1)])


def _check_vocabulary(target: GenerationModel, draft: GenerationModel) -> None:
    if draft in _SAME_VOCABULARY.get(target, ()):
        return
    t, d = target.tokenizer, draft.tokenizer
    same = (target.config.n_vocab == draft.config.n_vocab
            and all(t.token_bytes(i) == d.token_bytes(i) for i in range(target.config.n_vocab)))
    if not same:
        raise ValueError(f"the draft model {draft.path.name} has another vocabulary than "
                         f"{target.path.name}; speculative decoding needs the same tokens")
    _SAME_VOCABULARY.setdefault(target, weakref.WeakSet()).add(draft)


# target -> the drafts whose vocabulary was found the same (compared once per pair)
_SAME_VOCABULARY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
