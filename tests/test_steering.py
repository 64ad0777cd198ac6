"""Metrics against float64 NumPy, logits processors, `kv_remove` and `is_stop_token`."""

from __future__ import annotations

import math

import numpy as np
import pytest

from workbench.engine.explore.metrics import Perplexity, model_entropy, model_surprisal


def _reference_logp(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    e = np.exp(x - x.max())
    return np.log(e / e.sum())


@pytest.mark.parametrize("seed", range(5))
def test_entropy_and_surprisal_equal_float64_numpy(seed):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal(49152) * rng.uniform(0.5, 8)).astype(np.float32)
    logp = _reference_logp(logits)
    p = np.exp(logp)
    h = float(-(p * logp).sum())
    assert model_entropy(logits) == pytest.approx(h, rel=1e-12, abs=1e-12)
    assert model_entropy(logits, base="bits") == pytest.approx(h / math.log(2), rel=1e-12)
    for token in rng.integers(0, logits.size, 5):
        assert model_surprisal(int(token), logits) == pytest.approx(-logp[token], rel=1e-12)
        assert model_surprisal(int(token), logits, base="bits") \
            == pytest.approx(-logp[token] / math.log(2), rel=1e-12)
    certain = np.full(10, -np.inf, np.float32)
    certain[3] = 0.0
    assert model_entropy(certain) == 0.0 and model_surprisal(3, certain) == 0.0
    assert model_entropy(np.zeros(8, np.float32), base="bits") == pytest.approx(3.0)
    with pytest.raises(ValueError, match="base"):
        model_entropy(logits, base="decibans")
    with pytest.raises(ValueError, match="outside"):
        model_surprisal(logits.size, logits)


def test_perplexity_tracker():
    ppl = Perplexity()
    assert ppl.get() == 1.0
    for lp in (-0.5, -1.0, -2.0):
        ppl.add(lp)
    assert ppl.get() == pytest.approx(math.exp(3.5 / 3))
    fork = ppl.clone()
    fork.add(-3.0)
    assert ppl.count == 3 and fork.count == 4
    assert fork.get() == pytest.approx(math.exp(6.5 / 4))
    with pytest.raises(ValueError):
        ppl.add(0.5)


def test_perplexity_from_surprisals_and_reset():
    """lloyal's tracker: surprisals in, the same perplexity as from log-probabilities;
    `reset` starts over."""
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((5, 50)).astype(np.float32)
    tokens = rng.integers(0, 50, 5)
    by_surprisal, by_logprob = Perplexity(), Perplexity()
    for row, token in zip(logits, tokens):
        s = model_surprisal(int(token), row)
        by_surprisal.add_surprisal(s)
        by_logprob.add(-s)
    assert by_surprisal.get() == pytest.approx(by_logprob.get())
    assert by_surprisal.get() > 1.0
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="surprisal"):
            by_surprisal.add_surprisal(bad)
    assert by_surprisal.count == 5
    by_surprisal.reset()
    assert by_surprisal.count == 0 and by_surprisal.get() == 1.0
    by_surprisal.add_surprisal(math.log(4.0))
    assert by_surprisal.get() == pytest.approx(4.0)


@pytest.mark.slow
def test_event_entropy_matches_model_entropy(smollm2):
    ids = smollm2.tokenize("The capital of France is")
    cache = smollm2.new_cache()
    logits = smollm2.forward(ids, cache)[-1]
    ev = smollm2.generate(ids, max_tokens=1, temperature=0, logprobs=1).events[0]
    assert ev.entropy == pytest.approx(model_entropy(logits), abs=1e-4)
    assert -ev.logprob == pytest.approx(model_surprisal(ev.id, logits), abs=1e-4)


@pytest.mark.slow
def test_a_logits_processor_that_bans_a_token_bans_it(smollm2):
    text = smollm2.generate("The", max_tokens=200, temperature=1.0, seed=0,
                            top_k=0, top_p=1.0, min_p=0.0)
    counts = np.bincount(text.token_ids, minlength=smollm2.config.n_vocab)
    banned = int(np.argmax(counts))  # the token sampled most often without the ban
    assert counts[banned] >= 3
    seen = []

    def ban(ids: np.ndarray, logits: np.ndarray) -> np.ndarray:
        seen.append(len(ids))
        logits[banned] = -np.inf
        return logits

    c = smollm2.generate("The", max_tokens=200, temperature=1.0, seed=0, top_k=0,
                         top_p=1.0, min_p=0.0, logits_processors=[ban],
                         stop_tokens=[])
    assert banned not in c.token_ids
    assert len(seen) == len(c.events) or len(seen) == len(c.token_ids) + 1
    assert seen[0] == len(smollm2.tokenize("The"))  # ids: the prompt and the output so far
    # in the batch path too, and a processor returning the wrong shape is an error
    for completion in smollm2.generate_batch(["The", "A"], max_tokens=50, temperature=1.0,
                                             seed=1, logits_processors=[ban]):
        assert banned not in completion.token_ids
    with pytest.raises(ValueError, match="shape"):
        smollm2.generate("The", max_tokens=2, logits_processors=[lambda ids, x: x[:10]]).wait()
    with pytest.raises(TypeError, match="functions"):
        smollm2.generate("The", logits_processors=["not a function"])


def _remove_example(m) -> tuple[list[int], int, int]:
    ids = m.tokenize("My cat is called Tom. My dog is called Rex. I love my pets. "
                     "The name of my cat is")
    drop = m.tokenize(" My dog is called Rex.", add_bos=False)
    start = len(m.tokenize("My cat is called Tom."))
    end = start + len(drop)
    assert ids[start:end] == drop
    return ids, start, end


@pytest.mark.slow
def test_kv_remove_equals_a_fresh_run_on_the_remaining_tokens(smollm2):
    ids, start, end = _remove_example(smollm2)
    remaining = ids[:start] + ids[end:]
    smollm2.reset()
    smollm2.generate(ids, max_tokens=4, temperature=0).wait()  # the kept sequence
    smollm2.kv_remove(start, end)
    before = smollm2.prefilled_tokens
    kept = smollm2.generate(remaining, max_tokens=12, temperature=0, logprobs=5)
    kept.wait()
    assert smollm2.prefilled_tokens - before == 1  # it continued the cache
    smollm2.reset()
    fresh = smollm2.generate(remaining, max_tokens=12, temperature=0, logprobs=5)
    assert kept.token_ids == fresh.token_ids
    np.testing.assert_allclose([e.logprob for e in kept.events if e.id is not None],
                               [e.logprob for e in fresh.events if e.id is not None],
                               atol=1e-3)
    with pytest.raises(ValueError, match="cannot remove"):
        smollm2.kv_remove(5, 10_000)


@pytest.mark.slow
def test_kv_remove_without_recompute_shifts_positions(smollm2):
    """The cheap shift moves the tail's keys to their new positions: in the first layer
    (which sees only the token and its position) they equal a fresh run's."""
    ids, start, end = _remove_example(smollm2)
    remaining = ids[:start] + ids[end:]
    smollm2.reset()
    smollm2.generate(ids, max_tokens=1, temperature=0).wait()
    smollm2.kv_remove(start, end, recompute=False)
    shifted = smollm2._cache
    assert shifted.tokens == remaining and shifted.offset == len(remaining)
    fresh = smollm2.new_cache()
    smollm2.forward(remaining, fresh)
    n = len(remaining)
    for name in ("keys", "values"):  # layer 0: (n_kv_head, n, head_dim)
        np.testing.assert_allclose(getattr(shifted.pool, name)[0, shifted.slot, :, :n],
                                   getattr(fresh.pool, name)[0, fresh.slot, :, :n], atol=2e-3)
    smollm2.reset()


@pytest.mark.slow
def test_is_stop_token(smollm2):
    end_of_turn = smollm2.tokenize("<|im_end|>", add_bos=False)
    assert len(end_of_turn) == 1 and smollm2.is_stop_token(end_of_turn[0])
    assert not smollm2.is_stop_token(smollm2.tokenize("Paris", add_bos=False)[0])


def test_validate_chat_template():
    from workbench.engine.text.chat_template import ChatTemplateError, validate_chat_template

    text = validate_chat_template("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n"
                                  "{% endfor %}{% if add_generation_prompt %}[assistant]"
                                  "{% endif %}")
    assert text == "[user] Hello!\n[assistant] Hi! How can I help?\n[user] What is 2 + 2?\n" \
        "[assistant]"
    with pytest.raises(ChatTemplateError, match="line 2"):
        validate_chat_template("{% for m in messages %}\n{{ m.content }")
    with pytest.raises(ChatTemplateError):
        validate_chat_template("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError, match="no system"):
        validate_chat_template("{{ raise_exception('no system messages') }}")


@pytest.mark.slow
def test_chat_template_override(smollm2):
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    messages = [{"role": "user", "content": "Say hi."}]
    c = smollm2.chat(messages, chat_template=plain, temperature=0, max_tokens=6)
    expected = smollm2.generate("user: Say hi.\nassistant:", temperature=0, max_tokens=6)
    assert c.prompt_ids == expected.prompt_ids and c.text == expected.text
    batch = smollm2.chat_batch([messages], chat_template=plain, temperature=0, max_tokens=6)
    assert batch[0].text == expected.text
