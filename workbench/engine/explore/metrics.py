"""How sure a model was: entropy of its next-token distribution, surprisal of the token
that came, and the perplexity of a sequence.

    >>> ev = m.generate("The capital of France is", logprobs=1).events[0]
    >>> model_surprisal(token, logits, base="bits")   # -log2 p(token)
    >>> ppl = Perplexity(); ppl.add(ev.logprob); ppl.get()

All values are computed in float64 from the raw logits (before sampling
filters), in nats unless `base="bits"`.
"""

from __future__ import annotations

import math

import numpy as np

_BASES = {"nats": 1.0, "bits": 1.0 / math.log(2.0)}


def _scale(base: str) -> float:
    try:
        return _BASES[base]
    except KeyError:
        raise ValueError(f"base must be 'nats' or 'bits', not {base!r}") from None


def _log_probs(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    if x.size == 0:
        raise ValueError("logits are empty")
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def model_entropy(logits: np.ndarray, base: str = "nats") -> float:
    """Shannon entropy of softmax(`logits`) (n_vocab,): 0 when one token is certain,
    log(n_vocab) when all are equally likely."""
    logp = _log_probs(logits)
    p = np.exp(logp)
    return float(-(p * np.where(p > 0, logp, 0.0)).sum() * _scale(base))


def model_surprisal(token: int, logits: np.ndarray, base: str = "nats") -> float:
    """-log p(`token`) under softmax(`logits`): how unexpected the token was."""
    logp = _log_probs(logits)
    if not 0 <= int(token) < logp.size:
        raise ValueError(f"token {token} is outside the vocabulary [0, {logp.size})")
    return float(-logp[int(token)] * _scale(base))


class Perplexity:
    """Running perplexity of a sequence: exp(mean surprisal in nats) of the tokens added.

    `add(logprob)` takes a token's log-probability (natural log, as
    `TokenEvent.logprob`), `add_surprisal(s)` its surprisal instead (-log p in
    nats, as `model_surprisal` gives: lloyal's `addSurprisal`); `get()` is 1.0
    for a certain sequence and grows as the model is surprised; `clone()` copies
    it (for a branch) and `reset()` starts it over.
    """

    def __init__(self) -> None:
        self.total = 0.0  # sum of surprisals, nats
        self.count = 0

    def add(self, logprob: float) -> None:
        """Count a token by its log-probability (natural log, <= 0)."""
        if not logprob <= 0.0:  # also refuses NaN
            raise ValueError(f"a log-probability must be <= 0, got {logprob}")
        self.total -= float(logprob)
        self.count += 1

    def add_surprisal(self, surprisal: float) -> None:
        """Count a token by its surprisal, -log p in nats (>= 0; `model_surprisal(...,
        base="bits")` values must be multiplied by ln 2 first)."""
        if not surprisal >= 0.0 or math.isinf(surprisal):  # also refuses NaN
            raise ValueError(f"a surprisal must be a finite number >= 0, got {surprisal}")
        self.total += float(surprisal)
        self.count += 1

    def reset(self) -> None:
        """Forget every token counted so far (`get()` is 1.0 again)."""
        self.total, self.count = 0.0, 0

    def get(self) -> float:
        """The perplexity so far (1.0 before any token)."""
        return math.exp(self.total / self.count) if self.count else 1.0

    def clone(self) -> Perplexity:
        other = Perplexity()
        other.total, other.count = self.total, self.count
        return other

    def __repr__(self) -> str:
        return f"<Perplexity {self.get():.3f} over {self.count} tokens>"
