"""Choosing the next token: logits processors, then a sampler.

The chain follows llama.cpp's default order: logit bias -> repetition penalty
-> (grammar mask) -> top-k -> top-p -> min-p -> temperature -> draw.
`temperature == 0` is greedy argmax (ties go to the lowest id, as llama.cpp's
argmax does).

The host sampler sorts about what the filters keep: top-k sorts its k, top-p as many of
the most likely tokens as its nucleus needs (`_nucleus`: 256, then 8x more, the whole
vocabulary only for a nucleus past 16k tokens), and without either the draw goes
through the candidates in vocabulary order, which gives the same distribution. Sorting
Qwen's 152k logits took 16 ms a token on this project's CPU, about as long as
Qwen2.5-0.5B's whole decode step. The device sampler sorts the vocabulary only for
top-k or top-p.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from workbench.engine.options import SamplingParams  # noqa: F401  (its home; kept importable here)
from workbench.engine.runtime.backend import row_array, stack_rows


class Sampler:
    """Stateful sampler for one sequence (owns the random generator)."""

    def __init__(self, params: SamplingParams, n_vocab: int):
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        bias = np.zeros(n_vocab, dtype=np.float32)
        for tok, b in params.logit_bias.items():
            tok = int(tok)
            if not 0 <= tok < n_vocab:
                raise ValueError(f"logit_bias names token {tok}, outside the vocabulary "
                                 f"[0, {n_vocab})")
            bias[tok] = b
        self._bias = bias if params.logit_bias else None

    @property
    def plain(self) -> bool:
        """Whether the pick depends on the logits plus the bias alone (no penalties, which
        read the history): then several sequences' picks can be taken together."""
        p = self.params
        return p.repeat_penalty == 1.0 and not (p.presence_penalty or p.frequency_penalty)

    def reseed(self, seed: int) -> None:
        """Start a fresh random state from `seed`, as a sampler made with
        `SamplingParams(seed=seed)` would (`params.seed` says so from now on)."""
        self.params = dataclasses.replace(self.params, seed=seed)
        self.rng = np.random.default_rng(seed)

    def process(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """Apply logit bias and the repetition, presence and frequency penalties (over the
        last `repeat_last_n` tokens of `history`, as llama.cpp does); returns a new
        (n_vocab,) array."""
        p = self.params
        out = logits.astype(np.float32, copy=True)
        if self._bias is not None:
            out += self._bias
        penalize = p.repeat_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
        if penalize and p.repeat_last_n != 0 and len(history):
            recent = history[-p.repeat_last_n :] if p.repeat_last_n > 0 else history
            ids, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
            vals = out[ids]
            if p.repeat_penalty != 1.0:
                with np.errstate(divide="ignore", over="ignore"):  # extreme penalties: +-inf
                    vals = np.where(vals > 0, vals / p.repeat_penalty,
                                    vals * p.repeat_penalty)
            out[ids] = vals - counts * p.frequency_penalty - p.presence_penalty
        return out

    def sample(self, logits: np.ndarray, history: Sequence[int] = (),
               allowed: np.ndarray | None = None) -> int:
        """Pick the next token id from raw logits (n_vocab,).

        `allowed` (bool, n_vocab) is a grammar's mask: the other tokens are removed
        after the bias and penalty and before top-k, so every filter and the
        temperature act on the allowed tokens only.
        """
        ids, probs = self._candidates(logits, history, allowed)
        if self.params.temperature == 0:
            return int(ids[0])
        return int(ids[draw(probs, self.rng)])

    def probabilities(self, logits: np.ndarray, history: Sequence[int] = (),
                      allowed: np.ndarray | None = None) -> np.ndarray:
        """The distribution `sample` draws from, after every transform (bias, penalties,
        mask, top-k, top-p, min-p, temperature): float64 (n_vocab,), summing to 1;
        one-hot on the argmax at temperature 0. Speculative decoding compares the
        target's and the draft's with it."""
        ids, probs = self._candidates(logits, history, allowed)
        out = np.zeros(logits.shape[0], dtype=np.float64)
        out[ids] = probs
        return out

    def _candidates(self, logits: np.ndarray, history: Sequence[int],
                    allowed: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """The tokens that may be drawn and their probabilities: most likely first after
        top-k or top-p, else in vocabulary order (one token with probability 1 at
        temperature 0)."""
        p = self.params
        logits = self.process(logits, history)
        if allowed is not None:
            if not allowed.any():
                raise ValueError("the grammar allows no token here")
            logits[~allowed] = -np.inf
        if p.temperature == 0:
            best = int(np.argmax(logits))
            if logits[best] == -np.inf:
                raise ValueError(_nothing_left(allowed))
            return np.array([best]), np.ones(1)
        n = logits.shape[0]
        if 0 < p.top_k < n:  # the k most likely, sorted
            ids = np.argpartition(-logits, p.top_k - 1)[: p.top_k]
            ids = ids[np.isfinite(logits[ids])]
            if not len(ids):
                raise ValueError(_nothing_left(allowed))
            ids = ids[np.argsort(-logits[ids], kind="stable")]
            vals = logits[ids].astype(np.float64)
            probs = _softmax(vals)
            if p.top_p < 1.0:
                keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
                ids, vals, probs = ids[:keep], vals[:keep], probs[:keep]
        else:
            finite = np.isfinite(logits)
            if finite.all():  # (no mask, no -inf bias: the common case, without a copy)
                ids, vals = _every_id(n), logits.astype(np.float64)
            else:
                ids = np.flatnonzero(finite)
                if not len(ids):
                    raise ValueError(_nothing_left(allowed))
                vals = logits[ids].astype(np.float64)
            if p.top_p < 1.0:  # the nucleus, sorted
                ids, vals, probs = _nucleus(ids, vals, p.top_p)
            elif p.min_p > 0.0:  # in vocabulary order; e: probability over the best one's
                keep = np.exp(vals - vals.max()) >= p.min_p
                keep[np.argmax(vals)] = True
                return ids[keep], _softmax(vals[keep] / p.temperature)
            else:  # in vocabulary order, in place (each 1 MB temporary cost ~0.2 ms)
                vals /= p.temperature
                vals -= vals.max()
                np.exp(vals, out=vals)
                vals /= vals.sum()
                return ids, vals
        if p.min_p > 0.0:  # most likely first: a prefix
            keep = max(1, int(np.sum(probs >= p.min_p * probs[0])))
            ids, vals = ids[:keep], vals[:keep]
        return ids, _softmax(vals / p.temperature)


def draw(weights: np.ndarray, rng: np.random.Generator) -> int:
    """An index into `weights` (non-negative, not all 0) drawn in proportion to them, from
    one uniform number of `rng`: the arithmetic of `rng.choice(len(weights), p=weights)`
    (the same index for the same state), without its checks over the whole array."""
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    return min(int(cdf.searchsorted(rng.random(), side="right")), len(weights) - 1)


@functools.lru_cache(maxsize=4)
def _every_id(n: int) -> np.ndarray:
    """0 .. n - 1 (read-only): the candidates where every token may be drawn."""
    ids = np.arange(n)
    ids.flags.writeable = False
    return ids


def _nucleus(ids: np.ndarray, vals: np.ndarray, top_p: float,
             first: int = 256) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What top-p keeps of the candidates `ids` (increasing) with logits `vals` (float64,
    finite): the shortest prefix, most likely first (ties: the lower id first), whose
    probability reaches `top_p`, as (ids, logits, probabilities over every candidate).
    Sorts the `first` most likely (found by a partition), and eight times more while the
    prefix runs up to the least likely of them (tokens past it may tie with it), rather
    than the whole vocabulary."""
    total = np.exp(vals - vals.max()).sum()
    m = first
    while m < len(ids):
        part = np.argpartition(-vals, m - 1)[:m]  # the m most likely, in no order
        part = part[np.lexsort((part, -vals[part]))]  # by logit, then id
        top = vals[part]
        probs = np.exp(top - top[0]) / total
        keep = int(np.searchsorted(np.cumsum(probs), top_p) + 1)
        if keep < m and top[keep - 1] > top[-1]:
            return ids[part[:keep]], top[:keep], probs[:keep]
        m *= 8
    order = np.argsort(-vals, kind="stable")
    probs = _softmax(vals[order])
    keep = int(np.searchsorted(np.cumsum(probs), top_p) + 1)
    return ids[order[:keep]], vals[order[:keep]], probs[:keep]


def _nothing_left(allowed: np.ndarray | None) -> str:
    where = " the grammar allows" if allowed is not None else ""
    return (f"no token can be sampled: every token{where} has a logit of -inf after "
            f"logit_bias and the penalties")


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities (float32) of a logits vector."""
    x = logits.astype(np.float64)
    m = x.max()
    return (x - m - np.log(np.exp(x - m).sum())).astype(np.float32)


def entropy(logprobs: np.ndarray) -> float:
    """Shannon entropy in nats of a distribution given as log-probabilities."""
    p = np.exp(logprobs.astype(np.float64))
    return float(-(p * np.where(p > 0, logprobs, 0.0)).sum())


class DeviceSampler(Sampler):
    """`Sampler` on a GPU backend's logits: the same chain on device arrays, so that only
    the chosen token id crosses to the host (`sample_device`). The random draw is one
    uniform number from the host generator, seeded as the host sampler's; the token
    follows the same distribution as `Sampler.sample`'s, though not the same stream."""

    def __init__(self, params: SamplingParams, n_vocab: int, backend):
        super().__init__(params, n_vocab)
        self.backend = backend
        self._dev_bias = None if self._bias is None else backend.asarray(self._bias)

    def sample_device(self, logits, history: Sequence[int] = (),
                      allowed: np.ndarray | None = None):
        """Pick the next token from device logits (n_vocab,); returns (token id, the same
        id as a device array of shape (1,)) after copying one integer to the host.

        The history and the grammar mask go to the device only when penalties or a
        grammar ask for them."""
        be, p = self.backend, self.params
        xp = be.xp
        penalize = p.repeat_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
        # a copy only where the penalties write into it (float32 logits are read as they
        # are: one launch less a token)
        x = logits if logits.dtype == xp.float32 and not penalize else logits.astype(xp.float32)
        if self._dev_bias is not None:
            x = x + self._dev_bias
        if penalize and p.repeat_last_n != 0 and len(history):
            recent = history[-p.repeat_last_n :] if p.repeat_last_n > 0 else history
            ids, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
            d_ids = be.asarray(ids.astype(np.int32))
            vals = x[d_ids]
            if p.repeat_penalty != 1.0:
                vals = xp.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
            vals = vals - be.asarray(counts.astype(np.float32)) * p.frequency_penalty \
                - p.presence_penalty
            x[d_ids] = vals
        if allowed is not None:
            if not allowed.any():
                raise ValueError("the grammar allows no token here")
            x = xp.where(be.asarray(allowed), x, -np.inf)
        if p.temperature == 0:
            token = xp.argmax(x, axis=0).reshape(1)
        else:
            token = self._draw(x)
        return int(be.to_host(token)[0]), token

    @staticmethod
    def pick_rows(samplers: Sequence[DeviceSampler], rows: Sequence) -> tuple[list[int], Any]:
        """The picks of several `plain` samplers on one backend, greedy or sampled, from
        their device logits `rows` (each (n_vocab,), or a `BatchRow` of a step's logits),
        with one copy to the host for all of them instead of one each (and, where any
        samples, one copy up of the rows' parameters and random numbers). Each sampler
        draws from its own generator as `sample_device` does. Rows 0 .. k-1 of one step,
        in order and without a logit bias, are picked from the step's logits as they are
        (no stack). Returns the token ids, and the same ids on the device, (len(rows),)."""
        be = samplers[0].backend
        xp = be.xp
        if all(s._dev_bias is None for s in samplers):
            x = stack_rows(xp, list(rows))  # (k, n_vocab)
        else:
            x = xp.stack([row if s._dev_bias is None else row + s._dev_bias
                          for s, row in zip(samplers, map(row_array, rows))])
        ids = xp.argmax(x, axis=1)  # (k,): ties go to the lowest id, as in sample_device
        if any(s.params.temperature != 0 for s in samplers):
            ids = DeviceSampler._draw_rows(samplers, x, ids)
        return [int(t) for t in be.to_host(ids)], ids

    @staticmethod
    def _draw_rows(samplers: Sequence[DeviceSampler], x, greedy_ids):
        """`_draw` for every row of x (k, n_vocab) at once, each row with its sampler's
        top-k, top-p, min-p and temperature; the greedy rows keep `greedy_ids` (k,).
        Sorted (every row) only where a row has top-k or top-p."""
        be = samplers[0].backend
        xp = be.xp
        n_vocab = x.shape[1]
        top_k = [s.params.top_k if 0 < s.params.top_k < n_vocab else n_vocab for s in samplers]
        width = max(top_k)
        ranked = width < n_vocab or any(s.params.top_p < 1.0 for s in samplers)
        # per row: top-k, top-p, min-p, temperature (1 where greedy), the uniform draw,
        # whether greedy; the greedy rows draw nothing from their generators
        table = be.asarray(np.array([
            (k, s.params.top_p, s.params.min_p, s.params.temperature or 1.0,
             s.rng.random() if s.params.temperature else 0.0, s.params.temperature == 0)
            for k, s in zip(top_k, samplers)], dtype=np.float32))  # (k, 6)
        top_k, top_p, min_p, temperature, u, greedy = (table[:, i : i + 1] for i in range(6))
        if ranked:
            order = xp.argsort(-x, axis=1)[:, :width]  # (k, width): descending logits
            vals = xp.take_along_axis(x, order, axis=1)
            place = xp.arange(width)[None, :]  # (1, width)
            vals = xp.where(place < top_k, vals, -np.inf)
        else:  # vocabulary order, as the host sampler draws without top-k or top-p
            vals = x
        if ranked or any(s.params.min_p > 0.0 for s in samplers):
            probs = be.softmax(vals, axis=-1)  # -inf (masked, past top-k) entries get 0
            keep = probs >= min_p * probs.max(axis=1, keepdims=True)
            if ranked:
                before = xp.cumsum(probs, axis=1) - probs
                keep = keep & ((before < top_p) | (top_p >= 1.0))  # the prefix reaching top_p
                keep = (keep & xp.isfinite(vals)) | (place == 0)  # the best token stays
            vals = xp.where(keep, vals, -np.inf)
        w = be.softmax(vals / temperature, axis=-1)  # (masked entries: -inf, weight 0)
        cdf = xp.cumsum(w, axis=1)  # (k, width)
        i = xp.minimum((cdf <= u * cdf[:, -1:]).astype(xp.int32).sum(axis=1), vals.shape[1] - 1)
        drawn = xp.take_along_axis(order, i[:, None], axis=1)[:, 0] if ranked else i  # (k,)
        return xp.where(greedy[:, 0] > 0, greedy_ids, drawn.astype(greedy_ids.dtype))

    def _draw(self, x):
        """top-k -> top-p -> min-p -> temperature -> draw, on the device; sorted only
        for top-k or top-p, else in vocabulary order as the host sampler draws (the same
        seed then picks the same tokens on both, but where rounding parts them)."""
        be, p = self.backend, self.params
        xp = be.xp
        n = x.shape[0]
        ranked = 0 < p.top_k < n or p.top_p < 1.0
        if ranked:
            order = xp.argsort(-x)  # descending logits
            if 0 < p.top_k < n:
                order = order[: p.top_k]
            vals = x[order]
        else:
            vals = x
        if ranked or p.min_p > 0.0:
            probs = be.softmax(vals)  # -inf (masked) entries get 0
            keep = xp.isfinite(vals)
            if p.top_p < 1.0:  # the smallest prefix whose mass reaches top_p
                before = xp.cumsum(probs) - probs
                keep = keep & (before < p.top_p)
            if p.min_p > 0.0:
                keep = keep & (probs >= p.min_p * probs.max())
            if ranked:
                keep = keep | (xp.arange(vals.shape[0]) == 0)  # the best token always stays
            vals = xp.where(keep, vals, -np.inf)
        w = be.softmax(vals / p.temperature)  # (masked entries: -inf, weight 0)
        cdf = xp.cumsum(w)
        u = float(self.rng.random()) * cdf[-1]
        i = xp.minimum((cdf <= u).astype(xp.int32).sum(), vals.shape[0] - 1).reshape(1)
        # (1,): indexed on the device, no copy to the host
        return order[i] if ranked else i.astype(xp.int64)
