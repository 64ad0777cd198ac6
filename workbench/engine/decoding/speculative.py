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

A speculative sequence runs in the target's batch like any other
(`workbench.engine.decoding.scheduler`): in the step where it would feed its newest token,
it feeds that token and its proposals as one chunk (the step's drafted chunks go through
the target together, in one pass after the decode rows), and the round's tokens come out
of that chunk's logits. So `generate`,
`generate_batch` and the server's requests with a draft share the target's KV slots, its
prefix reuse and its passes. A draft model proposes on a KV cache of its own, taking its
forward lock per pass, so it may serve batches of its own meanwhile.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from workbench.engine.decoding.generation_model import GenerationModel
from workbench.engine.decoding.sampling import Sampler, draw
from workbench.engine.decoding.sequence import Decoding
from workbench.engine.results import DraftCounts
from workbench.engine.runtime.kv_cache import ContextFullError, KVCache

DRAFT_TOKENS = 4  # proposals per round: the default of `generate(..., draft_tokens=)`
LOOKUP = "ngram"  # `draft=` for prompt-lookup drafting (no draft model)
LOOKUP_NGRAM = 3  # the longest n-gram prompt lookup matches (then shorter ones)


def check_draft_tokens(draft_tokens: Any) -> None:
    """Refuse a `draft_tokens` that is not an int >= 1 (`ValueError`)."""
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or draft_tokens < 1:
        raise ValueError(f"draft_tokens must be an int >= 1, got {draft_tokens!r}")


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
    check_draft_tokens(draft_tokens)
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


class Drafting:
    """One sequence's speculative decoding, run by the scheduler
    (`workbench.engine.decoding.scheduler`) inside its batch: before the sequence's next
    token is fed, `propose` drafts up to `tokens` more; the scheduler feeds them together
    in one pass of the target, and `verify` picks the round's tokens from the k + 1
    logits rows that pass returns. `counts` is updated every round."""

    def __init__(self, target: GenerationModel, draft: GenerationModel | str, tokens: int,
                 seq: Decoding, prompt_len: int):
        self.tokens = tokens
        self.counts = DraftCounts()
        if draft == LOOKUP:
            self.drafter: _DraftModel | _Lookup = _Lookup(target.config.n_vocab)
        else:
            size = min(draft.kv_cache_size, prompt_len + seq.max_tokens)
            self.drafter = _DraftModel(draft, size,
                                       Sampler(seq.sampler.params, draft.config.n_vocab))
        self.draft = draft  # the model, or LOOKUP

    def propose(self, seq: Decoding, room: int) -> tuple[list[int], list[np.ndarray]]:
        """Proposals to follow `seq.history` (whose last token is about to be fed with
        them) and the distributions q (n_vocab,) they were drawn from; `room`: the
        positions the target's cache has after that token. [] where nothing is left to
        draft or the drafter finds nothing."""
        # the pass gives a token of its own after the kept ones: the last one to write
        # needs no proposal
        k = min(self.tokens, seq.max_tokens - seq.n_generated - 1, room,
                self.drafter.room(len(seq.history)))
        if k < 1:
            return [], []
        return self.drafter.propose(seq.history, k, seq.sampler.rng)

    def verify(self, seq: Decoding, logits: np.ndarray, proposal: list[int],
               q: list[np.ndarray]) -> list[int]:
        """The round's tokens: the proposals the target keeps, then its correction or a
        bonus token. `logits` (k + 1, n_vocab): the target's after the fed token and after
        each proposal. The drafter forgets what it read beyond the kept ones."""
        history = seq.history
        chosen = _verify(seq.sampler, logits, history, proposal, q, seq.sampler.rng)
        self.counts.target_passes += 1
        self.counts.drafted += len(proposal)
        self.counts.accepted += len(chosen) - 1
        self.drafter.trim(len(history) + len(chosen) - 1)
        return chosen


class _DraftModel:
    """Proposals sampled from a draft model, on a KV cache of its own."""

    def __init__(self, draft: GenerationModel, size: int, sampler: Sampler):
        self.draft, self.size, self.sampler = draft, size, sampler
        self.cache: KVCache | None = None  # made at the first proposal

    def room(self, n_history: int) -> int:
        """Proposals the draft's cache can take after a history of `n_history` tokens."""
        return self.size - n_history + 1

    def propose(self, history: list[int], k: int, rng: np.random.Generator
                ) -> tuple[list[int], list[np.ndarray]]:
        """`k` tokens the draft samples after `history` (whose first `cache.offset` tokens
        its cache holds) and the distributions q (n_vocab,) they were drawn from. The
        cache then holds everything but the last proposal."""
        draft = self.draft
        if self.cache is None:
            self.cache = draft.new_cache(self.size)
        cache = self.cache
        proposal: list[int] = []
        dists: list[np.ndarray] = []
        feed = history[cache.offset :]
        if len(feed) > 1:  # the prompt (or what a rotating cache forgot), in chunks
            draft.prefill(feed[:-1], cache)
            draft.prefilled_tokens += len(feed) - 1
            feed = feed[-1:]
        for _ in range(k):
            with draft.forward_lock:
                logits = draft.logits_out(draft.hidden(np.asarray(feed), cache)[-1:],
                                          on_device=False)[0]
            q = self.sampler.probabilities(logits, history + proposal)
            token = draw(q, rng)
            proposal.append(token)
            dists.append(q)
            feed = [token]
        return proposal, dists

    def trim(self, keep: int) -> None:
        if self.cache is not None:
            self.cache.trim(min(self.cache.offset, keep))


class _Lookup:
    """Prompt lookup: proposals copied from what followed the latest earlier occurrence of
    the history's last n tokens (n = LOOKUP_NGRAM down to 1), each with a one-hot q."""

    def __init__(self, n_vocab: int):
        self.n_vocab = n_vocab

    def room(self, n_history: int) -> int:
        return n_history  # (no cache: as many as are asked for)

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
        out.append(draw(residual if residual.sum() > 0 else p, rng))
        return out
    out.append(draw(sampler.probabilities(logits[len(proposal)], history + out), rng))
    return out


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
