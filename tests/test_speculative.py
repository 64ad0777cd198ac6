"""Speculative decoding: `generate(..., draft=)`.

Tiny random-weight llama models (tests/support/tiny_llama.py, 269-token vocabulary): the
target, and as draft a copy whose matrices carry extra noise (same vocabulary, a
different distribution, so the draft's proposals are both kept and rejected); built with
transformers once and stored as the golden `tiny-llama-speculative`
(tests/goldens/make_tiny_llama.py).
- The sampled output's joint distribution over the first three tokens equals the
  target sampler's, computed exactly from the target's logits (chi-square over 3000
  seeds, with 2 proposals per round: kept proposals, corrections at either position
  and bonus tokens all occur); the same statistic rejects draws from the draft alone
  and from the target at another temperature.
- The same in a batch (`generate_batch(draft=)`), whose proposals are verified together.
- Greedy output is the target's own, token for token (penalties, stops, logprobs, a
  short context, prefix caches, batches, the CuPy backend's code on NumPy).
- Refusals: another vocabulary, bad draft_tokens, grammar, logits processors.
Real models (slow): SmolLM2 Q4_1 drafts for SmolLM2 re-quantized to Q8_0.
"""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest

from tests import goldens
from tests.goldens.make_tiny_llama import SPECULATIVE
from tests.support.chi_square import chi_square_p
from tests.support.devices import open_llm
from tests.support.tiny_llama import PROMPT
from workbench.engine.cancel import Cancelled
from workbench.engine.decoding.sampling import Sampler
from workbench.engine.formats.convert import requantize_gguf
from workbench.engine.options import GenerationOptions
from workbench.engine.runtime.kv_cache import ContextFullError

SAMPLED = dict(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0, repeat_penalty=1.5)
N_DRAWS = 3000
N_TOKENS = 3
END = -1  # stands for an end token in an outcome shorter than N_TOKENS


@pytest.fixture(scope="module")
def tiny_paths():
    """GGUF paths (the golden's files): the target, a noisy copy as draft, and a copy with
    two tokens swapped in its vocabulary."""
    golden = goldens.load(SPECULATIVE)
    return {name: golden.file(f"{name}.gguf") for name in ("target", "draft", "other_vocab")}


@pytest.fixture(scope="module")
def tiny(tiny_paths):
    from workbench import LLM

    with LLM.load(tiny_paths["target"], kv_cache_size=64) as target, \
            LLM.load(tiny_paths["draft"], kv_cache_size=64) as draft:
        yield target, draft


def _outcome(completion) -> tuple[int, ...]:
    """The first N_TOKENS tokens (or fewer, then END)."""
    ids = tuple(completion.token_ids[:N_TOKENS])
    return ids if len(ids) == N_TOKENS else ids + (END,)


def _exact_joint(llm, prompt: list[int], options: dict) -> dict[tuple[int, ...], float]:
    """The probability of each outcome (first N_TOKENS tokens, or fewer then END) when
    `llm` samples with `options`, enumerated from its logits and the sampler's chain."""
    sampler = Sampler(GenerationOptions(**options).sampling(), llm.config.n_vocab)
    joint: dict[tuple[int, ...], float] = {}

    def extend(prefix: tuple[int, ...], prob: float) -> None:
        history = prompt + list(prefix)
        logits = llm.forward(history, llm.new_cache())[-1]
        p = sampler.probabilities(logits, history)
        for token in np.flatnonzero(p):
            outcome, q = prefix + (int(token),), prob * float(p[token])
            if llm.is_stop_token(int(token)):
                joint[prefix + (END,)] = joint.get(prefix + (END,), 0.0) + q
            elif len(outcome) == N_TOKENS:
                joint[outcome] = q
            else:
                extend(outcome, q)

    extend((), 1.0)
    return joint


def _p_value(counts: Counter, joint: dict) -> float:
    cells = sorted(set(joint) | set(counts))
    return chi_square_p(np.array([counts[c] for c in cells]),
                        np.array([joint.get(c, 0.0) for c in cells]))


def test_sampled_output_follows_the_targets_distribution(tiny):
    target, draft = tiny
    prompt = PROMPT[:6]
    joint = _exact_joint(target, prompt, SAMPLED)
    assert abs(sum(joint.values()) - 1.0) < 1e-9
    counts: Counter = Counter()
    drafted = accepted = 0
    for seed in range(N_DRAWS):  # (the first token comes from the prompt's pass, so
        # N_TOKENS + 1 lets the second round draft 2: corrections at either position)
        c = target.generate(prompt, draft=draft, draft_tokens=2, seed=seed,
                            max_tokens=N_TOKENS + 1, **SAMPLED)
        counts[_outcome(c)] += 1
        drafted += c.usage.drafted_tokens
        accepted += c.usage.accepted_tokens
    assert set(counts) <= set(joint), "an outcome the target cannot produce"
    # both paths of the rule ran many times: kept proposals and rejections
    assert 0.2 < accepted / drafted < 0.8, (accepted, drafted)
    assert _p_value(counts, joint) > 1e-3
    # the test can fail: the draft's own draws, and the target's at another temperature
    alone = Counter(_outcome(draft.generate(prompt, seed=s, max_tokens=N_TOKENS, **SAMPLED))
                    for s in range(N_DRAWS))
    assert _p_value(alone, joint) < 1e-6
    colder = dict(SAMPLED, temperature=0.6)
    cold = Counter(_outcome(target.generate(prompt, seed=s, max_tokens=N_TOKENS, **colder))
                   for s in range(N_DRAWS))
    assert _p_value(cold, joint) < 1e-6


def test_sampled_output_in_a_batch_follows_the_targets_distribution(tiny, monkeypatch):
    """`generate_batch(draft=)`: every sequence drafts, the batch's proposals are checked
    together in one pass per step, and each sequence's first tokens still follow the
    target sampler's joint distribution."""
    from workbench.engine.decoding.scheduler import Scheduler

    target, draft = tiny
    prompt = PROMPT[:6]
    joint = _exact_joint(target, prompt, SAMPLED)
    together = []  # sequences per verifying pass
    verify = Scheduler._verify
    monkeypatch.setattr(Scheduler, "_verify",
                        lambda self, drafted: (together.append(len(drafted)),
                                               verify(self, drafted)))
    batch = target.generate_batch([prompt] * N_DRAWS, draft=draft, draft_tokens=2,
                                  seed=list(range(N_DRAWS)), max_tokens=N_TOKENS + 1,
                                  **SAMPLED)
    counts = Counter(_outcome(c) for c in batch)
    drafted = sum(c.usage.drafted_tokens for c in batch)
    accepted = sum(c.usage.accepted_tokens for c in batch)
    assert set(counts) <= set(joint), "an outcome the target cannot produce"
    assert 0.2 < accepted / drafted < 0.8, (accepted, drafted)
    assert max(together) == target.max_batch  # verified inside the batch
    assert _p_value(counts, joint) > 1e-3


def test_greedy_batches_are_the_targets_own(tiny):
    """Greedy `generate_batch` / `chat_batch` with a draft model or prompt lookup give
    each sequence's tokens without a draft, with its own counts."""
    target, draft = tiny
    prompts = [PROMPT[:6], PROMPT[2:9], PROMPT[:6] + PROMPT[:6], PROMPT[5:8]] * 3
    want = target.generate_batch(prompts, temperature=0, max_tokens=20)
    for d in (draft, "ngram"):
        got = target.generate_batch(prompts, temperature=0, max_tokens=20, draft=d,
                                    draft_tokens=3)
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
        assert sum(c.usage.drafted_tokens for c in got) > 0
        assert all(c.draft_counts is not None for c in got)
    conversations = [[{"role": "user", "content": text}] for text in ("hi", "hello there")]
    want = target.chat_batch(conversations, temperature=0, max_tokens=12)
    got = target.chat_batch(conversations, temperature=0, max_tokens=12, draft=draft)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    with pytest.raises(ValueError, match="grammar"):
        target.generate_batch(prompts, draft=draft, grammar='root ::= "a"')
    assert target.generate_batch(prompts[:2], draft=draft, max_tokens=0)[0].token_ids == []


def test_same_seed_same_text(tiny):
    target, draft = tiny
    runs = [target.generate(PROMPT[:6], draft=draft, seed=5, max_tokens=24, **SAMPLED)
            for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids and len(runs[0].token_ids) > 0
    assert runs[0].usage == runs[1].usage


@pytest.mark.parametrize("draft_tokens", [1, 3, 6])
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_greedy_output_is_the_targets_own(tiny, draft_tokens, penalty):
    target, draft = tiny
    alone = target.generate(PROMPT[:8], temperature=0, repeat_penalty=penalty, max_tokens=30)
    for d in (draft, target):  # a noisy draft, and one that always agrees
        c = target.generate(PROMPT[:8], temperature=0, repeat_penalty=penalty, max_tokens=30,
                            draft=d, draft_tokens=draft_tokens)
        assert c.token_ids == alone.token_ids
        assert c.text == alone.text and c.finish_reason == alone.finish_reason
        u = c.usage
        assert (u.prompt_tokens, u.completion_tokens) == (8, 30)
        assert u.drafted_tokens > 0 and 0 <= u.accepted_tokens <= u.drafted_tokens
        assert c.draft_counts.target_passes * (draft_tokens + 1) >= 30
    # a draft that is the target keeps every proposal: one pass per draft_tokens + 1
    assert u.acceptance_rate == 1.0
    assert c.draft_counts.target_passes == -(-30 // (draft_tokens + 1))
    assert alone.usage.acceptance_rate is None and alone.usage.drafted_tokens is None
    # the repr shows the counts that apply: the draft's only with a draft
    assert repr(alone.usage) == "Usage(prompt_tokens=8, completion_tokens=30)"
    assert repr(u) == (f"Usage(prompt_tokens=8, completion_tokens=30, "
                       f"drafted_tokens={u.drafted_tokens}, accepted_tokens={u.accepted_tokens})")


def test_stops_logprobs_and_streaming_match_plain_generation(tiny):
    target, draft = tiny
    alone = target.generate(PROMPT[:6], temperature=0, max_tokens=20)
    cut = alone.text[4:6]  # a stop string from inside the greedy output
    for kwargs in (dict(stop=cut), dict(stop_tokens=[alone.token_ids[7]]),
                   dict(max_tokens=1), dict(max_tokens=0), dict(include_prompt=True)):
        args = dict(dict(temperature=0, max_tokens=20), **kwargs)
        want = target.generate(PROMPT[:6], **args)
        got = target.generate(PROMPT[:6], draft=draft, **args)
        assert list(got) == list(want), kwargs  # the streamed pieces
        assert (got.token_ids, got.text, got.finish_reason) == \
            (want.token_ids, want.text, want.finish_reason), kwargs
    want = target.generate(PROMPT[:6], temperature=0, max_tokens=10, logprobs=3).events
    got = target.generate(PROMPT[:6], temperature=0, max_tokens=10, logprobs=3,
                          draft=draft).events
    assert [e.id for e in got] == [e.id for e in want]
    for a, b in zip(got, want):  # one pass over k + 1 tokens against one token at a time
        if a.id is None:  # text held back to the end (an incomplete UTF-8 character)
            continue
        assert [t.id for t in a.top] == [t.id for t in b.top]
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert a.entropy == pytest.approx(b.entropy, abs=1e-4)


def test_chat_passes_the_draft_on(tiny):
    target, draft = tiny
    messages = [{"role": "user", "content": "hi"}]
    want = target.chat(messages, temperature=0, max_tokens=12)
    got = target.chat(messages, temperature=0, max_tokens=12, draft=draft, draft_tokens=2)
    assert got.token_ids == want.token_ids and got.usage.drafted_tokens > 0


def test_a_full_context_and_a_prefix_cache(tiny_paths, tiny):
    from workbench import LLM

    target, draft = tiny
    with LLM.load(tiny_paths["target"], kv_cache_size=12) as short:
        want = short.generate(PROMPT[:6], temperature=0, max_tokens=30)
        got = short.generate(PROMPT[:6], temperature=0, max_tokens=30, draft=draft)
        assert want.finish_reason == "length" and len(want.token_ids) < 30
        assert got.token_ids == want.token_ids and got.finish_reason == "length"
        with pytest.raises(ContextFullError, match="kv_cache_size"):
            target.generate(PROMPT[:13], draft=short)  # the draft's context is the pair's
    prefix = target.prefix(PROMPT[:5])
    want = target.generate(PROMPT[:9], temperature=0, max_tokens=15)
    got = target.generate(PROMPT[:9], temperature=0, max_tokens=15, draft=draft,
                          prefix=prefix)
    assert got.token_ids == want.token_ids


def test_runs_beside_the_scheduler_and_cancels(tiny):
    target, draft = tiny
    solo = target.generate(PROMPT[:6], temperature=0, max_tokens=25).token_ids
    solo_spec = target.generate(PROMPT[2:9], temperature=0, max_tokens=25).token_ids
    plain = target.generate(PROMPT[:6], temperature=0, max_tokens=25)  # in the batch
    stream = plain.iter_events()
    first = [next(stream).id for _ in range(3)]
    spec = target.generate(PROMPT[2:9], temperature=0, max_tokens=25, draft=draft)
    assert spec.token_ids == solo_spec
    assert first + [e.id for e in stream] == solo
    flag = threading.Event()
    c = target.generate(PROMPT[:6], max_tokens=40, draft=draft, cancel=flag)
    it = iter(c)
    next(it)
    flag.set()
    with pytest.raises(Cancelled):
        list(it)


def test_on_the_cuda_backend_code(tiny_paths, tiny):
    target, _ = tiny
    want = target.generate(PROMPT[:6], temperature=0, max_tokens=12).token_ids
    t = open_llm(tiny_paths["target"], "cuda-on-numpy", kv_cache_size=64)
    d = open_llm(tiny_paths["draft"], "cuda-on-numpy", kv_cache_size=64)
    try:
        got = t.generate(PROMPT[:6], temperature=0, max_tokens=12, draft=d, draft_tokens=3)
        assert got.token_ids == want
    finally:
        t.close()
        d.close()


def test_refusals(tiny_paths, tiny):
    from workbench import LLM

    target, draft = tiny
    with LLM.load(tiny_paths["other_vocab"], kv_cache_size=64) as other:
        with pytest.raises(ValueError, match="another vocabulary"):
            target.generate(PROMPT[:6], draft=other)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="draft_tokens"):
            target.generate(PROMPT[:6], draft=draft, draft_tokens=bad)
    with pytest.raises(ValueError, match="draft must be an LLM or 'ngram'"):
        target.generate(PROMPT[:6], draft="small.gguf")
    with pytest.raises(TypeError, match="draft must be an LLM"):
        target.generate(PROMPT[:6], draft=3)
    with pytest.raises(ValueError, match="grammar"):
        target.generate(PROMPT[:6], draft=draft, grammar='root ::= "a"')
    with pytest.raises(ValueError, match="grammar"):
        target.generate(PROMPT[:6], draft=draft, schema={"type": "integer"})
    with pytest.raises(ValueError, match="logits_processors"):
        target.generate(PROMPT[:6], draft=draft, logits_processors=[lambda ids, x: x])


# -- prompt lookup (draft="ngram") -----------------------------------------------------------

def test_prompt_lookup_proposes_what_followed_the_latest_match():
    from workbench.engine.decoding.speculative import lookup_proposal

    assert lookup_proposal([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]
    assert lookup_proposal([1, 2, 3, 4, 1, 2, 3], 9) == [4, 1, 2, 3]
    # the longest n-gram wins over a later, shorter match; the latest of equals wins
    assert lookup_proposal([7, 8, 5, 0, 8, 6, 9, 7, 8], 2) == [5, 0]
    assert lookup_proposal([4, 1, 5, 1, 6, 1], 1) == [6]
    assert lookup_proposal([1, 2, 3], 4) == [] and lookup_proposal([3], 4) == []
    assert lookup_proposal([1, 2, 1], 0) == []


REPEATING = PROMPT[:6] + PROMPT[:6] + PROMPT[:3]  # an answer that copies its prompt pays


@pytest.mark.parametrize("draft_tokens", [1, 4])
def test_prompt_lookup_greedy_output_is_the_targets_own(tiny, draft_tokens):
    target, _ = tiny
    for prompt in (REPEATING, PROMPT[:8]):
        alone = target.generate(prompt, temperature=0, max_tokens=30)
        got = target.generate(prompt, temperature=0, max_tokens=30, draft="ngram",
                              draft_tokens=draft_tokens)
        assert got.token_ids == alone.token_ids and got.text == alone.text
        assert got.usage.drafted_tokens > 0
        # each pass of the target gives one token of its own besides the kept proposals;
        # the first token comes from the prompt's pass
        assert got.draft_counts.target_passes + got.usage.accepted_tokens == 29


def test_prompt_lookup_sampled_output_follows_the_targets_distribution(tiny):
    """One-hot proposals under the same acceptance rule: the joint of the first three
    tokens is the target sampler's (kept and rejected proposals both occur)."""
    target, _ = tiny
    sampled = dict(SAMPLED, repeat_penalty=1.0)  # the copied tokens are not penalised
    # a prompt that holds the target's own continuation of its start, then that start
    # again: the lookup proposes what the target tends to write
    echo = PROMPT[:6] + target.generate(PROMPT[:6], temperature=0, max_tokens=6).token_ids
    echo += PROMPT[:6]
    joint = _exact_joint(target, echo, sampled)
    counts: Counter = Counter()
    drafted = accepted = 0
    for seed in range(N_DRAWS):
        c = target.generate(echo, draft="ngram", draft_tokens=2, seed=seed,
                            max_tokens=N_TOKENS, **sampled)
        counts[_outcome(c)] += 1
        drafted += c.usage.drafted_tokens
        accepted += c.usage.accepted_tokens
    assert set(counts) <= set(joint), "an outcome the target cannot produce"
    assert 0 < accepted < drafted, (accepted, drafted)
    assert _p_value(counts, joint) > 1e-3


# -- real models ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def target_q8(smollm2, tmp_path_factory):
    from workbench import LLM

    path = requantize_gguf(smollm2.path, tmp_path_factory.mktemp("q8") / "smollm2-q8_0.gguf",
                           "q8_0")
    with LLM.load(path) as m:
        yield m


@pytest.mark.slow
@pytest.mark.parametrize("question,draft_tokens", [
    ("Write three sentences about the sea.", 4),
    ("List the planets of the solar system.", 6),
    ("What is 12 times 7?", 1),
])
def test_smollm2_greedy_output_is_the_targets_own(target_q8, smollm2, question, draft_tokens):
    messages = [{"role": "user", "content": question}]
    alone = target_q8.chat(messages, temperature=0, max_tokens=48)
    c = target_q8.chat(messages, temperature=0, max_tokens=48, draft=smollm2,
                       draft_tokens=draft_tokens)
    assert c.token_ids == alone.token_ids
    assert c.text == alone.text and c.finish_reason == alone.finish_reason
    # the same model at lower precision agrees most of the time: fewer target passes
    assert 0.5 < c.usage.acceptance_rate <= 1.0, c.usage
    assert c.draft_counts.target_passes < len(c.token_ids)


@pytest.mark.slow
def test_smollm2_sampled_and_refused_vocabulary(target_q8, smollm2, qwen):
    c = target_q8.generate("The capital of France is", draft=smollm2, seed=3, max_tokens=32)
    assert 0.0 < c.usage.acceptance_rate <= 1.0 and len(c.token_ids) > 0
    assert c.token_ids == target_q8.generate("The capital of France is", draft=smollm2,
                                             seed=3, max_tokens=32).token_ids
    with pytest.raises(ValueError, match="another vocabulary"):
        target_q8.generate("Hi", draft=qwen)


@pytest.mark.slow
def test_requantized_file_keeps_metadata_and_values(target_q8, smollm2, tmp_path):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    src, dst = GGUFReader(smollm2.path), GGUFReader(target_q8.path)
    assert {f.name: f.contents() for f in src.fields.values() if not f.name.startswith("GGUF.")} \
        == {f.name: f.contents() for f in dst.fields.values() if not f.name.startswith("GGUF.")}
    for a, b in zip(src.tensors, dst.tensors):
        assert a.name == b.name
        x, y = dequantize(a.data, a.tensor_type), dequantize(b.data, b.tensor_type)
        assert x.shape == y.shape
        # Q8_0 keeps each Q4_1 value to within half a step of its block's scale
        assert abs(x - y).max() <= abs(x).max() / 127 + 1e-6, a.name
    with pytest.raises(ValueError, match="qtype"):
        requantize_gguf(smollm2.path, tmp_path / "x.gguf", "q3_weird")
