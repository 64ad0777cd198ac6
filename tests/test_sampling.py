"""Samplers and logits processors."""

from __future__ import annotations

import numpy as np
import pytest

from workbench.engine.sampling import Sampler, SamplingParams, entropy, log_softmax


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
