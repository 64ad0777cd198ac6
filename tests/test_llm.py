"""The LLM API on the real default model: streaming, stops, sampling options, events."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"  # greedy: " Paris.\n\nThe ..." (see test_llamacpp_reference)
GREEDY = dict(temperature=0)


def test_stream_pieces_make_the_text(smollm2):
    c = smollm2.generate(PROMPT, max_tokens=12, **GREEDY)
    pieces = list(c)
    assert "".join(pieces) == c.text
    assert c.text.startswith(" Paris.\n\nThe ")
    assert c.finish_reason == "length"
    assert c.usage.prompt_tokens == 5 and c.usage.completion_tokens == 12
    assert c.usage.total_tokens == 17
    assert c.token_ids == [e.id for e in c.events]
    assert smollm2.detokenize(c.token_ids) == c.text


def test_stop_strings_and_tokens(smollm2):
    c = smollm2.generate(PROMPT, max_tokens=20, stop=["."], **GREEDY)
    assert c.text == " Paris" and c.finish_reason == "stop"
    # a stop string spanning several tokens is cut as a whole, nothing of it leaks
    c = smollm2.generate(PROMPT, max_tokens=20, stop="\n\nThe", **GREEDY)
    assert list(c) and c.text == " Paris." and c.finish_reason == "stop"
    dot = smollm2.tokenize(".")[0]
    c = smollm2.generate(PROMPT, max_tokens=20, stop_tokens=[dot], **GREEDY)
    assert c.text == " Paris" and c.finish_reason == "stop"


def test_chat_stops_at_end_of_turn(smollm2):
    c = smollm2.chat([{"role": "system", "content": "You are a terse assistant."},
                      {"role": "user", "content": "Name three fruits."}], **GREEDY)
    assert c.finish_reason == "stop"
    assert "<|im_end|>" not in c.text and c.text.endswith(".")


def test_continue_final_message_carries_on_a_cut_answer(smollm2):
    """An answer cut at max_tokens, continued with `continue_final_message`, goes on
    exactly as the uncut greedy answer does (the same tokens, in chat and chat_batch);
    a conversation that does not end with an assistant's text is refused."""
    messages = [{"role": "user", "content": "Tell me about Paris in three sentences."}]
    cut = smollm2.chat(messages, max_tokens=12)
    assert cut.finish_reason == "length"
    so_far = [*messages, {"role": "assistant", "content": cut.text}]
    prompt = smollm2.continued_prompt(so_far)
    assert prompt.endswith(cut.text) and "<|im_end|>" not in prompt[-len(cut.text) - 1:]
    more = smollm2.chat(so_far, continue_final_message=True, max_tokens=20)
    whole = smollm2.chat(messages, max_tokens=32)
    assert cut.token_ids + more.token_ids == whole.token_ids
    assert cut.text + more.text == whole.text
    batch = smollm2.chat_batch([so_far], continue_final_message=True, max_tokens=20)
    assert batch[0].token_ids == more.token_ids
    with pytest.raises(ValueError, match="end with an assistant message"):
        smollm2.chat(messages, continue_final_message=True)
    with pytest.raises(ValueError, match="text to continue"):
        smollm2.chat([*messages, {"role": "assistant", "content": " "}],
                     continue_final_message=True)
    trimmed = "{% for m in messages %}[{{ m.role }}] {{ m.content | upper }}\n{% endfor %}"
    with pytest.raises(ValueError, match="does not show the final assistant message"):
        smollm2.chat(so_far, continue_final_message=True, chat_template=trimmed)


def test_include_prompt(smollm2):
    c = smollm2.generate(PROMPT, max_tokens=3, include_prompt=True, **GREEDY)
    assert c.text.startswith(PROMPT + " Paris")


def test_include_prompt_streams_prompt_first(smollm2):
    pieces = list(smollm2.generate(PROMPT, max_tokens=2, include_prompt=True, **GREEDY))
    assert pieces[0] == PROMPT


def test_chat_include_prompt_echoes_the_rendered_prompt(smollm2):
    messages = [{"role": "user", "content": "Name three fruits."}]
    rendered = smollm2.apply_chat_template(messages, add_generation_prompt=True)
    assert "<|im_start|>assistant" in rendered
    c = smollm2.chat(messages, max_tokens=4, include_prompt=True)
    pieces = list(c)
    assert pieces[0] == rendered and c.text == rendered + smollm2.chat(messages, max_tokens=4).text
    batch = smollm2.chat_batch([messages], max_tokens=4, include_prompt=True)
    assert batch[0].text == c.text


def test_default_is_greedy(smollm2):
    """temperature=0 by default: the output is the argmax path, whatever the seed."""
    default = smollm2.generate(PROMPT, max_tokens=12)
    assert default.token_ids == smollm2.generate(PROMPT, max_tokens=12, seed=3).token_ids
    model = smollm2.model
    ids = smollm2.tokenize(PROMPT) + default.token_ids
    logits = model.forward(np.array(ids[:-1]), model.new_cache())  # (T - 1, n_vocab)
    n = len(smollm2.tokenize(PROMPT))
    assert list(logits[n - 1:].argmax(-1)) == default.token_ids


def test_empty_stop_tokens_turn_the_end_tokens_off(smollm2):
    messages = [{"role": "user", "content": "Name three fruits."}]
    ended = smollm2.chat(messages)
    assert ended.finish_reason == "stop"
    n = len(ended.token_ids)
    on = smollm2.chat(messages, stop_tokens=[], max_tokens=n + 6)
    assert on.finish_reason == "length" and len(on.token_ids) == n + 6
    assert on.token_ids[:n] == ended.token_ids and on.token_ids[n] in smollm2.tokenizer.eot_ids
    # a list replaces the end tokens: the end of turn no longer ends the answer, the
    # listed tokens do
    unused = next(t for t in range(100, 1000) if t not in on.token_ids)
    assert smollm2.chat(messages, stop_tokens=[unused], max_tokens=n + 6).token_ids \
        == on.token_ids
    second = ended.token_ids[1]
    cut = smollm2.chat(messages, stop_tokens=[second])
    assert cut.finish_reason == "stop" and cut.token_ids == ended.token_ids[:1]
    with pytest.raises(ValueError, match="stop_tokens"):
        smollm2.generate(PROMPT, stop_tokens=[], grammar='root ::= "yes" | "no"')


def test_seed_reproduces_sampled_text(smollm2):
    opts = dict(max_tokens=16, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    a = smollm2.generate(PROMPT, seed=7, **opts).text
    b = smollm2.generate(PROMPT, seed=7, **opts).text
    assert a == b
    others = {smollm2.generate(PROMPT, seed=s, **opts).text for s in (1, 2, 3)}
    assert len(others | {a}) > 1


def test_logprobs_alternatives_and_entropy(smollm2):
    c = smollm2.generate(PROMPT, max_tokens=4, logprobs=5, **GREEDY)
    for ev in c.events:
        assert len(ev.top) == 5
        assert ev.top[0].id == ev.id and ev.top[0].logprob == pytest.approx(ev.logprob)
        assert all(a.logprob >= b.logprob for a, b in zip(ev.top, ev.top[1:]))
        assert ev.logprob <= 0 and ev.entropy >= 0
    assert c.events[0].piece == " Paris"
    # the reported distribution is the model's: compare with a forward pass
    ids = smollm2.tokenize(PROMPT)
    logits = smollm2.forward(ids, smollm2.new_cache())[-1].astype(np.float64)
    logp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    assert c.events[0].logprob == pytest.approx(logp[c.events[0].id], abs=1e-4)


def test_logit_bias_forces_a_token(smollm2):
    london = smollm2.tokenize(" London")[0]
    c = smollm2.generate(PROMPT, max_tokens=1, logit_bias={london: 100.0}, **GREEDY)
    assert c.token_ids == [london]


def test_repeat_penalty_changes_a_repetitive_greedy_run(smollm2):
    plain = smollm2.generate(PROMPT, max_tokens=40, **GREEDY).text
    penalized = smollm2.generate(PROMPT, max_tokens=40, repeat_penalty=1.5, **GREEDY).text
    assert plain != penalized


def test_prefix_reuse_gives_the_same_answer(smollm2):
    msgs = [{"role": "system", "content": "You are helpful and concise."},
            {"role": "user", "content": "What is the capital of France?"}]
    first = smollm2.chat(msgs, **GREEDY).text
    again = smollm2.chat(msgs, **GREEDY).text  # reuses the cached prompt
    longer = smollm2.chat(msgs + [{"role": "assistant", "content": first},
                                  {"role": "user", "content": "And of Italy?"}], **GREEDY).text
    assert first == again and longer


def test_interleaved_generations_do_not_disturb_each_other(smollm2):
    want = smollm2.generate(PROMPT, max_tokens=8, **GREEDY).text
    a = iter(smollm2.generate(PROMPT, max_tokens=8, **GREEDY))
    first = next(a)
    b = smollm2.generate("Once upon a time", max_tokens=8, **GREEDY).text
    assert first + "".join(a) == want and b


def test_threads_share_a_model(smollm2):
    want = smollm2.generate(PROMPT, max_tokens=6, **GREEDY).text
    out = []
    threads = [threading.Thread(target=lambda: out.append(
        smollm2.generate(PROMPT, max_tokens=6, **GREEDY).text)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == [want] * 3


def test_async_iteration(smollm2):
    async def collect():
        return [p async for p in smollm2.generate(PROMPT, max_tokens=5, **GREEDY)]

    pieces = asyncio.run(collect())
    assert "".join(pieces).startswith(" Paris.")


def test_tokenize_detokenize(smollm2):
    ids = smollm2.tokenize("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # special tokens parsed, no BOS added
    assert smollm2.tokenize("<|im_start|>", special=False) != [1]
    assert smollm2.detokenize(ids) == "<|im_start|>user\nHi<|im_end|>"


def test_embed_is_the_last_hidden_state(smollm2):
    """By default the raw last hidden state (parabun's `embed`); `normalize=True` scales
    it to unit length."""
    raw = smollm2.embed("Hello world")
    assert raw.shape == (576,) and raw.dtype == np.float32
    model = smollm2.model
    hidden = model.hidden(np.array(smollm2.tokenize("Hello world")), model.new_cache())[-1]
    assert np.allclose(raw, hidden, atol=1e-5)
    assert abs(np.linalg.norm(raw) - 1.0) > 0.1
    unit = smollm2.embed("Hello world", normalize=True)
    assert np.linalg.norm(unit) == pytest.approx(1.0, abs=1e-5)
    assert np.allclose(unit, raw / np.linalg.norm(raw), atol=1e-6)
    assert np.allclose(smollm2.embed_batch(["Hello world"])[0], raw, atol=1e-6)


def test_bad_requests(smollm2):
    with pytest.raises(ValueError, match="empty"):
        smollm2.generate("")
    with pytest.raises(ValueError, match="max_tokens"):
        smollm2.generate(PROMPT, max_tokens=-1)
    with pytest.raises(ValueError, match="temperature"):
        smollm2.generate(PROMPT, temperature=-0.5)
    with pytest.raises(ValueError, match="token ids"):
        smollm2.generate([10**9])
    with pytest.raises(ValueError, match="kv_cache_size"):
        smollm2.generate("word " * 5000)
    with pytest.raises(TypeError, match="messages"):
        smollm2.chat("just a string")
    for prompt in (123, None, [1.5, 2]):
        with pytest.raises(TypeError, match="text or a sequence of token ids"):
            smollm2.generate(prompt)
    with pytest.raises(TypeError, match="list of seeds is for generate_batch"):
        smollm2.generate(PROMPT, seed=[1, 2])
    with pytest.raises(ValueError, match="temperature must be finite"):
        smollm2.generate(PROMPT, temperature=float("nan"))
    c = smollm2.generate(PROMPT, max_tokens=0)
    assert c.text == "" and c.finish_reason == "length"


def test_context_full_stops_with_length():
    from workbench import LLM

    with LLM.load("smollm2-135m", kv_cache_size=12) as m:
        c = m.generate(PROMPT, max_tokens=100, **GREEDY)
        assert c.finish_reason == "length" and len(c.token_ids) == 12 - 5 + 1
    with pytest.raises(RuntimeError, match="closed"):
        m.generate(PROMPT).wait()


def test_busy_and_device_signals(smollm2):
    assert smollm2.device.get() == "cpu"
    seen = []
    unsubscribe = smollm2.busy.subscribe(seen.append)
    c = smollm2.generate(PROMPT, max_tokens=3, **GREEDY)
    assert not smollm2.busy.get()  # nothing runs until the completion is iterated
    it = iter(c)
    next(it)
    assert smollm2.busy.get()
    rest = list(it)
    assert not smollm2.busy.get() and rest is not None
    # a stopped stream frees the model too
    it = iter(smollm2.generate(PROMPT, max_tokens=50, **GREEDY))
    next(it)
    it.close()
    assert not smollm2.busy.get()
    unsubscribe()
    assert seen == [True, False, True, False]


def test_busy_false_after_an_exception_in_generation(smollm2, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("sampler exploded")

    smollm2.reset()  # the prompt must be read, and reading it fails
    c = smollm2.generate(PROMPT, max_tokens=3, **GREEDY)
    monkeypatch.setattr(smollm2, "_logits", broken)
    with pytest.raises(RuntimeError, match="exploded"):
        c.wait()
    assert not smollm2.busy.get()
    monkeypatch.undo()  # the model still serves the next call
    assert c.prompt_ids and smollm2.generate(PROMPT, max_tokens=3, **GREEDY).token_ids


def test_busy_across_three_threads(smollm2):
    started, release = threading.Barrier(4), threading.Event()

    def work():
        c = iter(smollm2.generate(PROMPT, max_tokens=4, **GREEDY))
        next(c)
        started.wait()
        release.wait()
        list(c)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    started.wait()
    assert smollm2.busy.get()
    release.set()
    for t in threads:
        t.join()
    assert not smollm2.busy.get()


# -- several sequences at once -------------------------------------------------------------

BATCH_PROMPTS = [PROMPT, "Once upon a time", "def fibonacci(n):", "1, 2, 3,", PROMPT]


def test_generate_batch_equals_generate(smollm2):
    """Greedy batched decoding gives each prompt exactly the tokens it gets alone, whatever
    its length and its neighbours; stop strings end sequences at different steps."""
    for opts in (dict(max_tokens=12), dict(max_tokens=30, stop=["."]),
                 dict(max_tokens=6, logprobs=2, include_prompt=True)):
        alone = [smollm2.generate(p, **opts, **GREEDY) for p in BATCH_PROMPTS]
        batch = smollm2.generate_batch(BATCH_PROMPTS, **opts, **GREEDY)
        assert [c.token_ids for c in batch] == [c.token_ids for c in alone]
        assert [c.text for c in batch] == [c.text for c in alone]
        assert [c.finish_reason for c in batch] == [c.finish_reason for c in alone]
        assert [c.usage for c in batch] == [c.usage for c in alone]
        if "logprobs" in opts:
            for a, b in zip(alone, batch):
                for ea, eb in zip(a.events, b.events):
                    assert [t.id for t in ea.top] == [t.id for t in eb.top]
                    assert ea.logprob == pytest.approx(eb.logprob, abs=1e-4)
    reasons = {c.finish_reason for c in smollm2.generate_batch(BATCH_PROMPTS, max_tokens=30,
                                                                 stop=["."], **GREEDY)}
    assert reasons == {"stop", "length"}  # some sequences ended early, others ran on


def test_generate_batch_seeds(smollm2):
    """seed=s gives sequence i the sampling of `generate(seed=s + i)`."""
    opts = dict(max_tokens=10, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    batch = smollm2.generate_batch([PROMPT] * 3, seed=11, **opts)
    assert [c.text for c in batch] == [smollm2.generate(PROMPT, seed=11 + i, **opts).text
                                       for i in range(3)]
    assert len({c.text for c in batch}) > 1
    explicit = smollm2.generate_batch([PROMPT] * 2, seed=[5, 5], **opts)
    assert explicit[0].text == explicit[1].text


def test_chat_batch_equals_chat(smollm2):
    convs = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "system", "content": "Answer in one word."},
              {"role": "user", "content": "Name a colour."}]]
    batch = smollm2.chat_batch(convs, max_tokens=16, **GREEDY)
    assert [c.text for c in batch] == [smollm2.chat(m, max_tokens=16, **GREEDY).text
                                       for m in convs]


def test_generate_batch_requests(smollm2):
    assert smollm2.generate_batch([]) == []
    out = smollm2.generate_batch([PROMPT, "Hi"], max_tokens=0)
    assert [(c.text, c.finish_reason) for c in out] == [("", "length")] * 2
    with pytest.raises(ValueError, match="empty"):
        smollm2.generate_batch([PROMPT, ""])
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        smollm2.generate_batch([PROMPT] * 3, seed=[1, 2])
    with pytest.raises(ValueError, match="max_tokens"):
        smollm2.generate_batch([PROMPT], max_tokens=-1)
    with pytest.raises(TypeError, match="messages"):
        smollm2.chat_batch(["just a string"])
    with pytest.raises(TypeError, match="list of prompts; for one prompt use generate"):
        smollm2.generate_batch("one prompt, not five characters")


def test_generate_batch_context_full():
    from workbench import LLM

    with LLM.load("smollm2-135m", kv_cache_size=12) as m:
        a, b = m.generate_batch([PROMPT, "Once upon a time there"], max_tokens=100, **GREEDY)
        assert a.finish_reason == b.finish_reason == "length"
        assert len(a.token_ids) == 12 - 5 + 1
        assert a.token_ids == m.generate(PROMPT, max_tokens=100, **GREEDY).token_ids


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"])
def test_fused_decode_equals_kernel_by_kernel(name):
    """`decode_stack` (all layers in one compiled call) against the per-kernel Python loop:
    1 and 5 sequences at their own positions, the second batch with a forked sequence
    that reads its prefix from its parent's slot. Qwen's Q4_K_M mixes formats inside a
    layer (Q/K in Q5_0, V in Q6_K), so its fused projections run part by part; Gemma 3
    has its post-norms, GeGLU, and local layers with their own RoPE table."""
    from workbench import LLM

    with LLM.load(name) as m:
        model = m.model
        assert model.fused_decode, "every matrix of these files has a packed-block kernel"
        parts_per_layer = np.diff(model._stack.first)
        prompts = [np.asarray(m.tokenize(p)) for p in BATCH_PROMPTS[:4]]
        results = {}
        for fused in (True, False):
            model.fused_decode = fused
            pool = model.new_pool(5, 64)
            caches = pool.caches()
            for ids, cache in zip(prompts, caches):
                model.hidden(ids, cache)
            caches[4] = caches[0].fork(4)
            one = model.decode(np.array([42]), [caches[1]])
            many = model.decode(np.array([7, 8, 9, 10, 11]), caches)
            results[fused] = (one, many, pool.keys.copy())
        model.fused_decode = True
        for got, want in zip(results[True], results[False]):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
        if name.startswith("qwen"):
            assert parts_per_layer.max() > 1, "expected a projection with mixed formats"
        if name.startswith("gemma"):
            assert model._stack.gelu and model._stack.post_ffn_norm.shape[1]
            assert model._stack.cos.shape[0] == 2 and model._stack.windows.min() == 0


def test_decode_many_equals_decode_one(smollm2):
    """`LlamaModel.decode` of several sequences at different positions: the same logits
    as decoding each sequence alone (the batched path only changes the matmul shapes)."""
    model = smollm2.model
    prompts = [smollm2.tokenize(p) for p in BATCH_PROMPTS[:4]]
    pool = model.new_pool(4, 64)
    caches = pool.caches()
    singles = []
    for ids, cache in zip(prompts, caches):
        model.hidden(np.asarray(ids), cache)
        alone = model.new_cache(64)
        model.hidden(np.asarray(ids), alone)
        singles.append(model.logits(model.hidden(np.asarray([42]), alone))[0])
    many = model.logits(model.decode(np.full(4, 42), caches))
    for row, one in zip(many, singles):
        np.testing.assert_allclose(row, one, rtol=0, atol=1e-4 * np.abs(one).max())
    assert [c.offset for c in caches] == [len(p) + 1 for p in prompts]
    with pytest.raises(ValueError, match="one KVPool"):
        model.decode(np.array([1, 2]), [caches[0], model.new_cache(8)])
    with pytest.raises(ValueError, match="own KV-pool slot"):
        model.decode(np.array([1, 2]), [caches[0], caches[0]])
