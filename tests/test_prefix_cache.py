"""Prefix caches on the real SmolLM2: same output with and without, the prefill skipped,
and files that round-trip exactly and refuse what is not theirs."""

from __future__ import annotations

import os

import numpy as np
import pytest

from workbench.engine.runtime.prefix_cache import PrefixCache

pytestmark = pytest.mark.slow

# a system prompt of about 1,000 tokens
SYSTEM = " ".join(f"Rule {i}: answer politely and briefly." for i in range(100))
CHAT = [{"role": "system", "content": SYSTEM}]
QUESTIONS = ["What is the capital of France?", "Name a fruit."]


@pytest.fixture(scope="module")
def pc(smollm2) -> PrefixCache:
    return smollm2.prefix_chat(CHAT)


def _conversation(question: str) -> list[dict]:
    return CHAT + [{"role": "user", "content": question}]


def test_same_output_and_the_prefill_skipped(smollm2, pc):
    assert 900 <= len(pc) <= 1100
    for question in QUESTIONS:
        smollm2.reset()  # no automatic reuse: only the prefix may help
        before = smollm2.prefilled_tokens
        plain = smollm2.chat(_conversation(question), temperature=0, max_tokens=24).text
        full = smollm2.prefilled_tokens - before
        smollm2.reset()
        before = smollm2.prefilled_tokens
        cached = smollm2.chat(_conversation(question), temperature=0, max_tokens=24,
                              prefix=pc).text
        with_prefix = smollm2.prefilled_tokens - before
        assert cached == plain
        assert with_prefix < 0.1 * full, (with_prefix, full)
    # batched sequences copy it into each slot
    batch = smollm2.chat_batch([_conversation(q) for q in QUESTIONS], temperature=0,
                               max_tokens=12, prefix=pc)
    smollm2.reset()
    assert [c.text for c in batch] == [smollm2.chat(_conversation(q), temperature=0,
                                                    max_tokens=12).text for q in QUESTIONS]


def test_a_prompt_that_leaves_the_prefix_early_uses_what_it_shares(smollm2):
    pc = smollm2.prefix("The capital of France is Paris. The capital of Italy is Rome.")
    prompt = "The capital of France is Paris. The capital of Spain is"
    smollm2.reset()
    before = smollm2.prefilled_tokens
    cached = smollm2.generate(prompt, temperature=0, max_tokens=4, prefix=pc).text
    shared = pc.common_prefix(smollm2.tokenize(prompt))
    assert smollm2.prefilled_tokens - before == len(smollm2.tokenize(prompt)) - shared
    smollm2.reset()
    assert cached == smollm2.generate(prompt, temperature=0, max_tokens=4).text


def _next_logprobs(m, prefix) -> np.ndarray:
    m.reset()
    c = m.chat(_conversation(QUESTIONS[0]), temperature=0, max_tokens=1, logprobs=8,
               prefix=prefix)
    return np.array([a.logprob for a in c.events[0].top])


def test_save_and_load_round_trip(smollm2, pc, tmp_path):
    path = pc.save(tmp_path / "system.wbprefix")
    assert [p.name for p in tmp_path.iterdir()] == ["system.wbprefix"]  # no temporary left
    loaded = smollm2.load_prefix(path)
    assert loaded.tokens == pc.tokens
    assert np.array_equal(loaded.keys, pc.keys) and np.array_equal(loaded.values, pc.values)
    np.testing.assert_array_equal(_next_logprobs(smollm2, loaded), _next_logprobs(smollm2, pc))
    # another LLM object on the same file takes it too
    from workbench import LLM

    with LLM(smollm2._gguf) as again:
        assert again.load_prefix(path).tokens == pc.tokens


def test_files_that_are_not_this_models_are_refused(smollm2, pc, tmp_path):
    foreign = PrefixCache(pc.tokens, pc.keys, pc.values, model_sha256="0" * 64)
    with pytest.raises(ValueError, match="another model file"):
        smollm2.load_prefix(foreign.save(tmp_path / "foreign.wbprefix"))
    with pytest.raises(ValueError, match="made by this model"):
        smollm2.chat(_conversation("hi"), prefix=foreign)
    path = pc.save(tmp_path / "whole.wbprefix")
    data = path.read_bytes()
    (tmp_path / "cut.wbprefix").write_bytes(data[:-100])
    with pytest.raises(ValueError, match="truncated"):
        smollm2.load_prefix(tmp_path / "cut.wbprefix")
    (tmp_path / "junk.wbprefix").write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(ValueError, match="not a workbench prefix cache"):
        smollm2.load_prefix(tmp_path / "junk.wbprefix")
    (tmp_path / "header.wbprefix").write_bytes(data[:8] + data[8:16] + b"{broken")
    with pytest.raises(ValueError, match="header is damaged"):
        smollm2.load_prefix(tmp_path / "header.wbprefix")


def test_a_failed_save_leaves_the_old_file_whole(smollm2, pc, tmp_path, monkeypatch):
    path = pc.save(tmp_path / "p.wbprefix")
    before = path.read_bytes()
    small = smollm2.prefix("Hello")

    def crash(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        small.save(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["p.wbprefix"]
