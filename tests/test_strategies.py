"""Decoding strategies on the real SmolLM2: best-of-n by perplexity, and generation past
the context length with attention sinks."""

from __future__ import annotations

import math
import re

import pytest

from workbench.engine.explore.strategies import best_of_n, stream_past_context
from workbench.engine.runtime.kv_cache import ContextFullError

pytestmark = pytest.mark.slow


def test_best_of_n_ranks_by_perplexity(smollm2):
    messages = [{"role": "user", "content": "Name a fruit."}]
    r = best_of_n(smollm2, messages, n=4, seed=1, max_tokens=16)
    assert len(r.candidates) == 4 and r.best is r.candidates[0]
    assert r.perplexities == sorted(r.perplexities)
    for c, ppl in zip(r.candidates, r.perplexities):
        logprobs = [ev.logprob for ev in c.events if ev.id is not None]
        assert ppl == pytest.approx(math.exp(-sum(logprobs) / len(logprobs)))
    assert len({c.text for c in r.candidates}) > 1  # they were sampled, not copies
    greedy = best_of_n(smollm2, "The capital of France is", n=2, temperature=0, max_tokens=6)
    assert greedy.best.text == smollm2.generate("The capital of France is", temperature=0,
                                                max_tokens=6).text


def test_stream_past_context_keeps_counting(smollm2):
    prompt = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"
    with pytest.raises(ContextFullError):  # a plain cache of 96 positions is full at once
        cache = smollm2.new_cache(96)
        smollm2.forward(list(range(100, 197)), cache)
    c = stream_past_context(smollm2, prompt, max_tokens=300, window=96, temperature=0)
    assert len(c.token_ids) == 300 and c.finish_reason == "length"
    numbers = [int(x) for x in re.findall(r"\d+", prompt + c.text)]
    assert numbers[-1] > 60  # far past what 96 positions hold
    assert numbers == list(range(1, len(numbers) + 1))  # still counting, one by one
    # before the first shift it is plain greedy generation
    plain = smollm2.generate(prompt, temperature=0, max_tokens=60)
    assert c.token_ids[:60] == plain.token_ids
    with pytest.raises(ValueError, match="window"):
        stream_past_context(smollm2, prompt * 20, max_tokens=5, window=96)


def test_entropy_branching(smollm2):
    from workbench.engine.explore.strategies import entropy_branching

    prompt = smollm2.tokenize(smollm2.apply_chat_template(
        [{"role": "user", "content": "Tell me a fun fact about octopuses."}]), add_bos=False)
    never = entropy_branching(smollm2, prompt, max_tokens=20, threshold=float("inf"))
    assert never.branch_points == []
    assert never.token_ids == smollm2.generate(prompt, temperature=0, max_tokens=20).token_ids
    r = entropy_branching(smollm2, prompt, max_tokens=20, threshold=1.5, k=3, lookahead=4)
    assert r.branch_points and len(r.token_ids) == 20
    for point in r.branch_points:
        assert point.entropy > 1.5
        assert point.chosen == min((s, t) for t, s in point.alternatives)[1]
        assert r.token_ids[point.position] == point.chosen
    # a lookahead's perplexity is the model's on that continuation, from a fresh run
    point = r.branch_points[0]
    history = prompt + r.token_ids[: point.position]
    token, ppl = point.alternatives[0]
    smollm2.reset()
    first = smollm2.generate(history, temperature=0, max_tokens=1, logprobs=3).events[0]
    lp_token = next(a.logprob for a in first.top if a.id == token)
    ahead = smollm2.generate(history + [token], temperature=0, max_tokens=4, logprobs=0)
    lps = [lp_token] + [e.logprob for e in ahead.events if e.id is not None]
    assert ppl == pytest.approx(math.exp(-sum(lps) / len(lps)), rel=1e-3)
