"""Samplers and logits processors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from workbench.engine.decoding.sampling import Sampler, SamplingParams, entropy, log_softmax


def _draws(params: SamplingParams, logits: np.ndarray, n: int = 400) -> set[int]:
    s = Sampler(params, len(logits))
    return {s.sample(logits) for _ in range(n)}


LOGITS = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05], dtype=np.float32))


def test_greedy_is_argmax_with_lowest_id_on_ties():
    s = Sampler(SamplingParams(temperature=0), 4)
    assert s.sample(np.array([1.0, 3.0, 3.0, 2.0], dtype=np.float32)) == 1


def test_top_k_keeps_k_best():
    assert _draws(SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0), LOGITS) == {0, 1}


def test_top_p_keeps_smallest_set_reaching_p():
    # cumulative 0.5, 0.7, 0.85: p=0.7 keeps the first two, p=0.71 the first three
    p = dict(temperature=1.0, top_k=0, min_p=0.0)
    assert _draws(SamplingParams(top_p=0.7, **p), LOGITS) == {0, 1}
    assert _draws(SamplingParams(top_p=0.71, **p), LOGITS) == {0, 1, 2}


def test_min_p_drops_unlikely_tokens():
    # 0.5 * 0.25 = 0.125: the tokens with p 0.5, 0.2 and 0.15 stay
    draws = _draws(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.25), LOGITS)
    assert draws == {0, 1, 2}


def test_low_temperature_concentrates():
    draws = _draws(SamplingParams(temperature=0.05, top_k=0, top_p=1.0, min_p=0.0), LOGITS, 200)
    assert draws == {0}


def test_seed_reproduces_draws():
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=123)
    a = [Sampler(p, 5).sample(LOGITS) for _ in range(1)]
    s1, s2 = Sampler(p, 5), Sampler(p, 5)
    assert [s1.sample(LOGITS) for _ in range(50)] == [s2.sample(LOGITS) for _ in range(50)]
    assert a[0] in range(5)


def test_logit_bias_and_repeat_penalty():
    s = Sampler(SamplingParams(temperature=0, logit_bias={4: 100.0}), 5)
    assert s.sample(LOGITS) == 4
    logits = np.array([2.0, 1.9, -1.0], dtype=np.float32)
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=1.5), 3)
    out = s.process(logits, history=[0, 2])
    assert out[0] == pytest.approx(2.0 / 1.5) and out[2] == pytest.approx(-1.5)
    assert s.sample(logits, history=[0]) == 1
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Sampler(SamplingParams(logit_bias={7: 1.0}), 5)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0.0), dict(top_k=-2),
                                 dict(min_p=1.5), dict(repeat_penalty=0)])
def test_bad_params(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_log_softmax_and_entropy():
    lp = log_softmax(np.zeros(8, dtype=np.float32))
    assert np.allclose(np.exp(lp), 1 / 8)
    assert entropy(lp) == pytest.approx(np.log(8), rel=1e-6)
    assert entropy(log_softmax(np.array([0.0, -1e9], dtype=np.float32))) == pytest.approx(0.0)


def test_probabilities_are_what_sample_draws_from():
    """`probabilities` (which speculative decoding compares) is the distribution `sample`
    draws from: the filters' survivors, renormalized at the temperature, penalties
    applied; a chi-square test over many draws accepts it."""
    from tests.support.chi_square import chi_square_p

    logits = np.log(np.array([0.3, 0.25, 0.2, 0.1, 0.08, 0.05, 0.02], dtype=np.float32))
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1,
                            repeat_penalty=1.3, seed=11)
    history = [1, 1, 4]
    s = Sampler(params, len(logits))
    probs = s.probabilities(logits, history)
    assert probs.dtype == np.float64 and abs(probs.sum() - 1.0) < 1e-12
    assert probs[5] == probs[6] == 0.0  # cut by top_k
    # token 1 penalized by the repetition: less likely than token 2 now
    assert probs[1] < probs[2]
    counts = np.bincount([s.sample(logits, history) for _ in range(4000)],
                         minlength=len(logits))
    assert chi_square_p(counts, probs) > 1e-3
    uniform = np.where(probs > 0, 1.0, 0.0) / (probs > 0).sum()
    assert chi_square_p(counts, uniform) < 1e-6  # the test can tell them apart
    greedy = Sampler(SamplingParams(temperature=0), len(logits))
    assert greedy.probabilities(logits).tolist() == [1.0] + [0.0] * 6


def _sorted_definition(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The filters as llama.cpp's chain defines them, on the whole vocabulary sorted by
    descending logit (ties: the lower id first): top-k, the top-p prefix, the min-p prefix,
    then the temperature -> float64 (n_vocab,)."""
    ids = np.flatnonzero(np.isfinite(logits))
    ids = ids[np.argsort(-logits[ids], kind="stable")]
    if 0 < p.top_k < len(logits):
        ids = ids[: p.top_k]
    vals = logits[ids].astype(np.float64)
    probs = np.exp(vals - vals.max()) / np.exp(vals - vals.max()).sum()
    keep = len(ids)
    if p.top_p < 1.0:
        keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
    if p.min_p > 0.0:
        keep = min(keep, max(1, int(np.sum(probs >= p.min_p * probs[0]))))
    scaled = vals[:keep] / p.temperature
    out = np.zeros(len(logits))
    out[ids[:keep]] = np.exp(scaled - scaled.max()) / np.exp(scaled - scaled.max()).sum()
    return out


@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0], ids=["flat", "spread", "peaked"])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_filters_on_a_large_vocabulary_equal_their_sorted_definition(scale, ties,
                                                                    monkeypatch):
    """`Sampler` never sorts a whole 50k vocabulary: top-p sorts as much of its nucleus as
    it needs (256 tokens, then 8x more), and without top-k or top-p the candidates stay in
    vocabulary order. Its distribution equals the filters applied to the fully sorted
    vocabulary, nucleus edges falling in a run of tied logits and masked (-inf) tokens
    included. (A flat distribution's nucleus holds most of the vocabulary: the partial
    sorts give way to a whole one.) Top-k with ties at its k-th logit keeps any of the
    tied tokens, as llama.cpp's does, so top-k runs on distinct logits only."""
    rng = np.random.default_rng(7)
    n = 50_000
    logits = (rng.standard_normal(n) * scale).astype(np.float32)
    if ties:  # runs of equal logits, across every nucleus edge
        logits = np.round(logits * 4 / scale) * np.float32(scale / 4)
    masked = logits.copy()
    masked[rng.random(n) < 0.2] = -np.inf
    for params, x in itertools.product(
            [dict(), dict(top_p=0.95), dict(top_p=0.5), dict(top_p=0.999), dict(min_p=0.05),
             dict(top_p=0.9, min_p=0.2)]
            + ([] if ties else [dict(top_k=40), dict(top_k=40, top_p=0.9, min_p=0.05)]),
            [logits, masked]):
        p = SamplingParams(temperature=0.7, **params)
        sorted_sizes = _sorts_seen(monkeypatch)
        got = Sampler(p, n).probabilities(x)
        monkeypatch.undo()
        want = _sorted_definition(x, p)
        assert np.array_equal(got > 0, want > 0), params
        assert np.abs(got - want).max() < 1e-12, params
        if "top_k" not in params and "top_p" not in params:
            assert sorted_sizes == [], params  # vocabulary order
        elif scale == 4.0:  # a peaked distribution: its nucleus, never the vocabulary
            assert max(sorted_sizes) < np.isfinite(x).sum(), params


def _sorts_seen(monkeypatch) -> list[int]:
    """From now on, the size of every array NumPy sorts (argsort, sort, lexsort)."""
    sizes: list[int] = []

    def counting(sort):
        def counted(a, *args, **kwargs):
            sizes.append(int(np.shape(a)[-1]))
            return sort(a, *args, **kwargs)
        return counted

    for name in ("argsort", "sort", "lexsort"):
        monkeypatch.setattr(np, name, counting(getattr(np, name)))
    return sizes


def test_draw_picks_what_rng_choice_picks():
    """`draw` is `rng.choice(len(w), p=w)`'s arithmetic without its whole-array checks:
    the same index from the same generator state, draw after draw."""
    from workbench.engine.decoding.sampling import draw

    w = np.random.default_rng(3).random(5000) ** 4
    w /= w.sum()
    a, b = np.random.default_rng(9), np.random.default_rng(9)
    assert [draw(w, a) for _ in range(500)] == [int(b.choice(len(w), p=w)) for _ in range(500)]


def test_a_nucleus_inside_a_run_of_ties_keeps_the_lowest_ids():
    """The 300 most likely tokens share one logit and top-p keeps 100 of them: the 100
    lowest ids, as a stable sort of the whole vocabulary has it, even though the first
    partial sort (256 tokens) holds an arbitrary 256 of the 300."""
    rng = np.random.default_rng(5)
    n = 20_000
    logits = (rng.standard_normal(n) - 8).astype(np.float32)
    tied = rng.choice(n, 300, replace=False)
    logits[tied] = 5.0
    p = SamplingParams(temperature=1.0, top_p=0.3)
    got = Sampler(p, n).probabilities(logits)
    assert np.flatnonzero(got).tolist() == sorted(tied.tolist())[: (got > 0).sum()]
    assert np.abs(got - _sorted_definition(logits, p)).max() < 1e-12
