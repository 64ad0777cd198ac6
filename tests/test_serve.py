"""The OpenAI-compatible server end to end: the official `openai` client against a real
server on an ephemeral loopback port, serving the real SmolLM2, MiniLM and Whisper tiny.en.

Every answer is compared with the engine called directly with the same options.
"""

from __future__ import annotations

import base64
import json
import threading

import httpx
import numpy as np
import pytest

from tests.support.polling import wait_for
from tests.support.shared import shared_file

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

KEY = "test-key-123"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def served(**options):
    """The engine options a request with these fields runs with: OpenAI's sampling
    defaults for the fields it leaves out."""
    from workbench.server.schemas import OPENAI_SAMPLING

    return {**OPENAI_SAMPLING, **options}


@pytest.fixture(scope="module")
def server(engines):
    import workbench

    with workbench.serve(engines, port=0, api_key=KEY, max_concurrent=1, max_queue=32,
                         max_body_bytes=2 * 1024 * 1024) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0) as c:
        yield c


def _post(server, path: str, *, key: str | None = KEY, **kwargs) -> httpx.Response:
    headers = kwargs.pop("headers", {})
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(server.url + path, headers=headers, timeout=120, **kwargs)


def _assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def _still_serving(client) -> None:
    r = client.chat.completions.create(model="smollm2-135m", messages=QUESTION,
                                       temperature=0, max_tokens=4)
    assert r.choices[0].message.content


# -- the routes, against the engines ---------------------------------------------------------
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list()] == ["smollm2-135m", "minilm-l6",
                                                   "whisper-tiny.en"]
    assert client.models.retrieve("minilm-l6").id == "minilm-l6"
    health = httpx.get(server.url + "/health").json()  # open without the key
    assert health["status"] == "ok"


@pytest.mark.parametrize("options", [{"temperature": 0}, {"temperature": 0.9, "seed": 7},
                                     {"temperature": 0.7, "top_p": 0.8, "seed": 3,
                                      "presence_penalty": 0.5, "frequency_penalty": 0.3}])
def test_chat_equals_llm_chat(client, smollm2, options):
    r = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=24,
                                       **options)
    expected = smollm2.chat(QUESTION, **served(max_tokens=24, **options))
    assert r.choices[0].message.content == expected.text
    assert r.choices[0].finish_reason == expected.finish_reason
    assert r.usage.prompt_tokens == expected.usage.prompt_tokens
    assert r.usage.completion_tokens == expected.usage.completion_tokens
    assert r.object == "chat.completion" and r.model == "smollm2-135m"


def test_omitted_fields_take_openai_defaults(client, smollm2):
    """The Python API is greedy by default; the HTTP API follows OpenAI: an omitted
    temperature samples at 1 from the whole distribution, an omitted max_tokens lets the
    answer run to its end."""
    r = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=24,
                                       seed=5)
    expected = smollm2.chat(QUESTION, max_tokens=24, seed=5, temperature=1.0, top_p=1.0,
                            top_k=0, min_p=0.0)  # written out: OPENAI_SAMPLING
    assert r.choices[0].message.content == expected.text
    # the Python API's default is greedy: the HTTP answer sampled another
    assert expected.text != smollm2.chat(QUESTION, max_tokens=24, seed=5).text
    r = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, temperature=0)
    expected = smollm2.chat(QUESTION, max_tokens=smollm2.kv_cache_size)
    assert r.choices[0].message.content == expected.text and expected.finish_reason == "stop"


def test_continue_final_message_continues_the_assistant_text(client, smollm2):
    """vLLM's `continue_final_message`: the answer carries on the final assistant
    message (here one cut at max_tokens) instead of starting a new turn; a
    conversation that does not end with one gets a 400."""
    cut = smollm2.chat(QUESTION, max_tokens=3)
    so_far = [*QUESTION, {"role": "assistant", "content": cut.text}]
    r = client.chat.completions.create(model="smollm2-135m", messages=so_far, max_tokens=12,
                                       temperature=0,
                                       extra_body={"continue_final_message": True})
    expected = smollm2.chat(so_far, continue_final_message=True, max_tokens=12)
    assert r.choices[0].message.content == expected.text
    assert cut.text + expected.text == smollm2.chat(QUESTION, max_tokens=15).text
    with pytest.raises(openai.BadRequestError, match="end with an assistant message"):
        client.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=4,
                                       extra_body={"continue_final_message": True})


def test_chat_streaming_equals_llm_chat(client, smollm2):
    chunks = list(client.chat.completions.create(
        model="smollm2-135m", messages=QUESTION, max_tokens=30, seed=11, temperature=0.8,
        stream=True, stream_options={"include_usage": True}))
    expected = smollm2.chat(QUESTION, **served(max_tokens=30, seed=11, temperature=0.8))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices
              and c.choices[0].delta.content]
    assert len(pieces) > 3  # it streamed, not one blob
    assert "".join(pieces) == expected.text
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == expected.finish_reason and set(finish[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens \
        == expected.usage.completion_tokens


def test_chat_logprobs_are_the_models(client, smollm2):
    r = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=3)
    expected = [ev for ev in smollm2.chat(QUESTION, max_tokens=6, temperature=0,
                                          logprobs=3).events if ev.id is not None]
    content = r.choices[0].logprobs.content
    assert [t.token for t in content] == [ev.piece for ev in expected]
    np.testing.assert_allclose([t.logprob for t in content], [ev.logprob for ev in expected],
                               atol=1e-6)
    for t, ev in zip(content, expected):
        assert [a.token for a in t.top_logprobs] == [a.text for a in ev.top]
        assert bytes(t.bytes) == smollm2.tokenizer.token_bytes(ev.id)


def test_stop_logit_bias_and_n(client, smollm2):
    paris = smollm2.tokenize(" Paris", add_bos=False)[0]
    options = {"temperature": 0, "max_tokens": 16, "logit_bias": {paris: -100.0}}
    r = client.chat.completions.create(model="smollm2-135m", messages=QUESTION,
                                       **{**options, "logit_bias": {str(paris): -100.0}})
    text = r.choices[0].message.content
    assert text == smollm2.chat(QUESTION, **options).text and " Paris" not in text
    r = client.chat.completions.create(model="smollm2-135m", messages=QUESTION,
                                       temperature=0, max_tokens=16, stop=[" France"])
    assert r.choices[0].message.content == "The capital of"
    assert r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, n=3, seed=5,
                                       max_tokens=12)
    batch = smollm2.chat_batch([QUESTION] * 3, **served(seed=5, max_tokens=12))
    assert [c.message.content for c in r.choices] == [c.text for c in batch]
    assert [c.index for c in r.choices] == [0, 1, 2]


def test_a_stream_of_n_choices_interleaves_them(client, smollm2):
    """A streamed answer with n choices sends each choice's tokens as they are made, not
    one choice after the other once all are done: every choice has text before the first
    finishes. Each gets what a batch of n gives it (seed s + i); the prompt counts once."""
    chunks = list(client.chat.completions.create(
        model="smollm2-135m", messages=QUESTION, n=3, seed=5, max_tokens=12, stream=True,
        stream_options={"include_usage": True}))
    texts, first_finish = ["", "", ""], None
    for k, c in enumerate(chunks):
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason and first_finish is None:
                first_finish = k
    with_text = {ch.index for c in chunks[:first_finish] for ch in c.choices
                 if ch.delta.content}
    assert with_text == {0, 1, 2}
    batch = smollm2.chat_batch([QUESTION] * 3, **served(seed=5, max_tokens=12))
    assert texts == [c.text for c in batch]
    assert chunks[-1].usage.prompt_tokens == batch[0].usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == sum(c.usage.completion_tokens for c in batch)


def test_completions_equal_llm_generate(client, smollm2):
    prompt = "The capital of France is"
    r = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=12,
                                  temperature=0.8, seed=2, logprobs=2)
    expected = smollm2.generate(prompt, **served(max_tokens=12, temperature=0.8, seed=2,
                                                 logprobs=2))
    assert r.choices[0].text == expected.text
    assert r.choices[0].logprobs.tokens == [ev.piece for ev in expected.events if ev.id]
    for token, lp, top in zip(r.choices[0].logprobs.tokens, r.choices[0].logprobs.token_logprobs,
                              r.choices[0].logprobs.top_logprobs):
        assert top[token] == lp and len(top) <= 3  # the 2 best and the sampled one (OpenAI)
    r = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=5,
                                  temperature=0, echo=True)
    assert r.choices[0].text == prompt + smollm2.generate(prompt, max_tokens=5,
                                                          temperature=0).text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2-135m", prompt=prompt, max_tokens=12, temperature=0, stream=True)
        if c.choices)
    assert streamed == smollm2.generate(prompt, max_tokens=12, temperature=0).text
    # several prompts: one choice each, in order
    r = client.completions.create(model="smollm2-135m", prompt=[prompt, "One, two,"],
                                  max_tokens=4, temperature=0)
    assert [c.text for c in r.choices] == [smollm2.generate(p, max_tokens=4,
                                                            temperature=0).text
                                           for p in (prompt, "One, two,")]


def test_null_fields_seeds_usage_and_offsets(server, client, smollm2):
    """OpenAI's nullable fields take their defaults when sent as null; seed -1 samples
    with a random seed (llama.cpp); a text completion's usage counts each prompt once
    however many choices it has; text offsets count the characters sent, the same
    streamed or not, where tokens hold parts of a UTF-8 character."""
    r = _post(server, "/v1/chat/completions", json={
        "model": "smollm2-135m", "messages": QUESTION, "temperature": 0, "max_tokens": 6,
        "n": None, "stream": None, "logprobs": None, "seed": None, "stop": None})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == \
        smollm2.chat(QUESTION, temperature=0, max_tokens=6).text
    r = _post(server, "/v1/completions", json={"model": "smollm2-135m", "prompt": "Hi",
                                               "max_tokens": None, "echo": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 16  # the default
    r = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, seed=-1,
                                       max_tokens=4)
    assert r.choices[0].message.content
    prompts = ["Hello", "The capital of France is"]
    r = client.completions.create(model="smollm2-135m", prompt=prompts, n=3, max_tokens=2)
    once = sum(len(smollm2.tokenize(p)) for p in prompts)
    assert r.usage.prompt_tokens == once and len(r.choices) == 6
    streamed = list(client.completions.create(model="smollm2-135m", prompt=prompts, n=3,
                                              max_tokens=2, stream=True,
                                              stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens == once
    chinese = {"model": "smollm2-135m", "prompt": "Chinese: 你好世界. Again: 你好",
               "max_tokens": 10, "temperature": 0, "logprobs": 1}
    whole = client.completions.create(**chinese).choices[0]
    offsets = []
    for c in client.completions.create(**chinese, stream=True):
        if c.choices and c.choices[0].logprobs:
            offsets += c.choices[0].logprobs.text_offset
    assert whole.logprobs.text_offset == offsets
    assert offsets[-1] <= len(whole.text) and any(ord(ch) > 0x2000 for ch in whole.text)


def test_json_schema_response_format(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="smollm2-135m", max_tokens=80, temperature=0,
        messages=[{"role": "user", "content": "Describe Paris."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city",
                                                                "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    # too few tokens for the model's answer: closed at the budget, still valid
    r = client.chat.completions.create(
        model="smollm2-135m", max_tokens=10, temperature=0,
        messages=[{"role": "user", "content": "Describe Paris at length."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city",
                                                                "schema": schema}})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens <= 10
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(
        model="smollm2-135m", max_tokens=80, temperature=0, response_format={
            "type": "json_object"},
        messages=[{"role": "user", "content": 'Reply with a JSON object that has the key '
                   '"answer": what is 2 + 2?'}])
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_embeddings_equal_encoder(server, client, engines):
    enc = engines["minilm-l6"]
    texts = ["A man is eating food.", "A monkey is playing drums."]
    r = client.embeddings.create(model="minilm-l6", input=texts)  # the client asks for base64
    got = np.array([d.embedding for d in r.data], dtype=np.float32)
    np.testing.assert_allclose(got, enc.embed_batch(texts), atol=1e-6)
    assert r.usage.prompt_tokens == sum(len(enc.tokenize(t)) for t in texts)
    r = client.embeddings.create(model="minilm-l6", input=texts[0], encoding_format="float")
    np.testing.assert_allclose(r.data[0].embedding, enc.embed(texts[0]), atol=1e-6)
    raw = _post(server, "/v1/embeddings",
                json={"model": "minilm-l6", "input": texts[0], "encoding_format": "base64"})
    vec = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(vec, enc.embed(texts[0]), atol=1e-6)
    # a decoder embeds too (its last hidden state, at unit length as OpenAI's are)
    r = client.embeddings.create(model="smollm2-135m", input="Hello", encoding_format="float")
    np.testing.assert_allclose(r.data[0].embedding,
                               engines["smollm2-135m"].embed("Hello", normalize=True), atol=1e-5)


def test_transcription_equals_whisper_model(client, engines):
    whisper = engines["whisper-tiny.en"]
    jfk = shared_file("data", "whisper", "jfk.wav")
    expected = whisper.transcribe(jfk)
    with open(jfk, "rb") as f:
        r = client.audio.transcriptions.create(model="whisper-tiny.en", file=f)
    assert r.text == str(expected)
    with open(jfk, "rb") as f:
        r = client.audio.transcriptions.create(model="whisper-tiny.en", file=f,
                                               response_format="verbose_json")
    timed = whisper.transcribe(jfk, timestamps=True)
    assert r.text == str(timed) and r.language == "en"
    assert [(s.start, s.end, s.text) for s in r.segments] \
        == [(s.start, s.end, s.text) for s in timed.segments]
    assert r.duration == pytest.approx(11.0, abs=0.01)
    with open(jfk, "rb") as f:
        text = client.audio.transcriptions.create(model="whisper-tiny.en", file=f,
                                                  response_format="text")
    assert text.strip() == str(expected)
    with open(jfk, "rb") as f:
        srt = client.audio.transcriptions.create(model="whisper-tiny.en", file=f,
                                                 response_format="srt")
    assert srt.startswith("1\n00:00:00,000 --> ") and timed.segments[0].text.strip() in srt


# -- bad requests -------------------------------------------------------------------------------
BAD_JSON = [
    ("malformed JSON", b'{"model": "smollm2-135m", "messages": [', 400, None),
    ("missing messages", {"model": "smollm2-135m"}, 400, "messages"),
    ("messages not a list", {"model": "smollm2-135m", "messages": "hi"}, 400, "messages"),
    ("temperature a word", {"model": "smollm2-135m", "messages": QUESTION,
                            "temperature": "hot"}, 400, "temperature"),
    ("negative max_tokens", {"model": "smollm2-135m", "messages": QUESTION,
                             "max_tokens": -1}, 400, "max_tokens"),
    ("a role that does not exist", {"model": "smollm2-135m",
                                    "messages": [{"role": "wizard", "content": "x"}]}, 400,
     None),
    ("bad logit_bias key", {"model": "smollm2-135m", "messages": QUESTION,
                            "logit_bias": {"paris": 5}}, 400, "logit_bias"),
    ("logit_bias outside the vocabulary", {"model": "smollm2-135m", "messages": QUESTION,
                                           "logit_bias": {"99999999": 5}}, 400, None),
    ("unknown model", {"model": "gpt-4o", "messages": QUESTION}, 404, "model"),
    ("chat with an encoder", {"model": "minilm-l6", "messages": QUESTION}, 400, "model"),
    ("unsupported schema keyword", {"model": "smollm2-135m", "messages": QUESTION,
                                    "response_format": {"type": "json_schema", "json_schema": {
                                        "name": "x", "schema": {"type": "string",
                                                                "format": "no-such-format",
                                                                "$dynamicRef": "#x"}}}},
     400, None),
    ("bad GBNF", {"model": "smollm2-135m", "messages": QUESTION, "grammar": "root ::= ("},
     400, None),
    ("max_tokens too few for any answer of the schema", {
        "model": "smollm2-135m", "messages": QUESTION, "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"city": {"type": "string"}},
            "required": ["city"]}}}}, 400, None),
    ("tools", {"model": "smollm2-135m", "messages": QUESTION,
               "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("a seed below -1", {"model": "smollm2-135m", "messages": QUESTION, "seed": -2}, 400,
     "seed"),
    ("a body that is a list", [{"model": "smollm2-135m"}], 400, None),
]


@pytest.mark.parametrize("body, message", [
    ({"stop": [str(i) for i in range(17)]}, "at most 16 items"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "'text'"),
    (None, "must be a JSON object"),
])
def test_errors_say_what_is_wrong(server, body, message):
    """A field that takes several shapes reports the broken bound, not the first shape's
    type error ("Input should be a valid string" for 17 stop strings); a body that is not
    an object says so rather than naming a field None."""
    json_body = None if body is None else {"model": "smollm2-135m", "messages": QUESTION,
                                           **body}
    r = _post(server, "/v1/chat/completions", json=json_body)
    assert message in _assert_openai_error(r, 400)["message"]


@pytest.mark.parametrize("body,status,param", [b[1:] for b in BAD_JSON],
                         ids=[b[0] for b in BAD_JSON])
def test_bad_chat_requests_get_openai_errors(server, client, body, status, param):
    if isinstance(body, bytes):
        r = _post(server, "/v1/chat/completions", content=body,
                  headers={"Content-Type": "application/json"})
    else:
        r = _post(server, "/v1/chat/completions", json=body)
    _assert_openai_error(r, status, param=param)
    _still_serving(client)


def test_bad_embedding_and_completion_requests(server, client):
    _assert_openai_error(_post(server, "/v1/embeddings", json={"model": "minilm-l6",
                                                             "input": [1, 2, 3]}), 400, "input")
    _assert_openai_error(_post(server, "/v1/embeddings", json={"model": "minilm-l6",
                                                             "input": 5}), 400, "input")
    _assert_openai_error(_post(server, "/v1/embeddings", json={
        "model": "minilm-l6", "input": "x", "dimensions": 3}), 400, "dimensions")
    _assert_openai_error(_post(server, "/v1/completions", json={
        "model": "smollm2-135m", "prompt": "x", "suffix": "y"}), 400, "suffix")
    for prompt in ("x" * 40000, "x " * 5000):  # past the context: refused before and
        # after tokenizing
        error = _assert_openai_error(_post(server, "/v1/completions", json={
            "model": "smollm2-135m", "prompt": prompt}), 400)
        assert error["code"] == "context_length_exceeded"
    _assert_openai_error(_post(server, "/v1/nothing-here", json={}), 404)
    _still_serving(client)


def test_web_origins_are_opt_in(server, smollm2):
    """A browser page may call the API only from the origins the server names: its
    preflight (sent without the key) is answered, and the answers carry the origin;
    the default server names none."""
    import workbench

    preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(server.base_url + "/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers
    with workbench.serve(smollm2, port=0, api_key=KEY,
                         cors_origins=["http://localhost:3000"]) as web:
        r = httpx.options(web.base_url + "/chat/completions", headers=preflight)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = _post(web, "/v1/chat/completions", headers={"Origin": "http://localhost:3000"},
                  json={"model": "smollm2-135m", "messages": QUESTION, "max_tokens": 2})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
        r = httpx.options(web.base_url + "/chat/completions",
                          headers={**preflight, "Origin": "https://evil.example"})
        assert r.headers.get("access-control-allow-origin") != "https://evil.example"


def test_api_key_is_required(server, client):
    for key in (None, "wrong-key", KEY + "x"):
        r = _post(server, "/v1/chat/completions", key=key,
                  json={"model": "smollm2-135m", "messages": QUESTION})
        assert _assert_openai_error(r, 401)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="nope", max_retries=0).models.list()
    _still_serving(client)


def test_oversized_bodies_get_413(server, client):
    big = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "x" * 3_000_000}]}
    _assert_openai_error(_post(server, "/v1/chat/completions", json=big), 413)

    def chunks():  # no Content-Length: the limit applies while the body streams in
        yield b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"y" * 100_000
        yield b'"}]}'

    r = _post(server, "/v1/chat/completions", content=chunks(),
              headers={"Content-Type": "application/json"})
    _assert_openai_error(r, 413)
    _still_serving(client)


def test_non_audio_upload_gets_400(server, client):
    for name, data in (("notes.txt", b"these are not audio samples " * 50),
                       ("empty.wav", b""), ("fake.wav", b"RIFF\x00\x00\x00\x00WAVEjunk")):
        r = _post(server, "/v1/audio/transcriptions", data={"model": "whisper-tiny.en"},
                  files={"file": (name, data)})
        _assert_openai_error(r, 400)
    r = _post(server, "/v1/audio/transcriptions", data={"model": "whisper-tiny.en"})
    _assert_openai_error(r, 400, param="file")
    r = _post(server, "/v1/audio/transcriptions", files={"file": ("a.wav", b"x")})
    _assert_openai_error(r, 400, param="model")
    jfk = shared_file("data", "whisper", "jfk.wav").read_bytes()
    r = _post(server, "/v1/audio/transcriptions", files={"file": ("jfk.wav", jfk)},
              data={"model": "whisper-tiny.en", "response_format": "mp4"})
    _assert_openai_error(r, 400, param="response_format")
    _still_serving(client)


# -- disconnects and load ----------------------------------------------------------------------
def test_disconnect_stops_generation(server, client, engines):
    llm = engines["smollm2-135m"]
    stream = client.chat.completions.create(
        model="smollm2-135m", stream=True, max_tokens=500, temperature=0.8, seed=1,
        messages=[{"role": "user", "content": "Write a very long story about a dragon."}])
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    assert wait_for(lambda: server.running.peek() == 0 and not llm.busy.peek(), 10)
    _still_serving(client)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_load_with_queue_and_cancellations(engines):
    """200 requests from 16 clients, a third streaming and a sixth dropped mid-stream, with
    one slot and a queue of 8: each completes with the right text or gets 429, never 5xx;
    afterwards threads and memory are back where they were."""
    import workbench

    llm = engines["smollm2-135m"]
    prompts = [[{"role": "user", "content": f"Say the number {i}."}] for i in range(4)]
    expected = [llm.chat(p, temperature=0, max_tokens=6).text for p in prompts]
    outcomes: list[tuple[str, int]] = []
    lock = threading.Lock()

    with workbench.serve(llm, model_id="m", port=0, max_concurrent=1, max_queue=8) as server:
        http = httpx.Client(base_url=server.url, timeout=120)

        def one(i: int) -> None:
            body = {"model": "m", "messages": prompts[i % 4], "temperature": 0,
                    "max_tokens": 6}
            kind = ("cancel" if i % 6 == 0 else "stream" if i % 3 == 0 else "sync")
            if kind == "sync":
                r = http.post("/v1/chat/completions", json=body)
                ok = r.status_code == 200 and r.json()["choices"][0]["message"]["content"] \
                    == expected[i % 4]
                status = r.status_code
            else:
                with http.stream("POST", "/v1/chat/completions",
                                 json={**body, "stream": True}) as r:
                    status = r.status_code
                    if status != 200:
                        r.read()
                        ok = False
                    elif kind == "cancel":
                        for _ in r.iter_lines():
                            break  # leave after the first line: the server must let go
                        ok = True
                    else:
                        text = []
                        for line in r.iter_lines():
                            if line.startswith("data: ") and line != "data: [DONE]":
                                choice = json.loads(line[6:])["choices"][0]
                                text.append(choice["delta"].get("content") or "")
                        ok = "".join(text) == expected[i % 4]
            with lock:
                outcomes.append((kind if ok else "wrong", status))

        def client_thread(start: int) -> None:
            for i in range(start, 200, 16):
                one(i)

        # warm up, then take the baseline
        for i in range(16):
            one(i)
        assert wait_for(lambda: server.running.peek() == 0, 10)
        outcomes.clear()
        threads_before, rss_before = threading.active_count(), _rss()

        clients = [threading.Thread(target=client_thread, args=(k,)) for k in range(16)]
        for t in clients:
            t.start()
        for t in clients:
            t.join(600)
        http.close()
        statuses = [s for _, s in outcomes]
        assert len(outcomes) == 200
        assert all(s in (200, 429) for s in statuses), sorted(set(statuses))
        assert not [o for o in outcomes if o[0] == "wrong" and o[1] == 200]
        assert statuses.count(200) >= 30 and statuses.count(429) >= 1  # both happened
        assert wait_for(lambda: server.running.peek() == 0 and server.queued.peek() == 0, 20)
        assert wait_for(lambda: threading.active_count() <= threads_before, 20), \
            [t.name for t in threading.enumerate()]
        assert _rss() - rss_before < 64 * 1024 * 1024
    assert not llm.busy.peek()


def test_a_client_leaving_the_queue_frees_its_place(engines):
    import workbench

    llm = engines["smollm2-135m"]
    long = {"model": "m", "max_tokens": 400, "temperature": 0.8, "seed": 1, "stream": True,
            "messages": [{"role": "user", "content": "Write a long story about a dragon."}]}
    with workbench.serve(llm, model_id="m", port=0, max_concurrent=1, max_queue=1) as server:
        with httpx.Client(base_url=server.url, timeout=120) as http, \
                http.stream("POST", "/v1/chat/completions", json=long) as running:
            lines = running.iter_lines()
            next(lines)  # the slot is taken
            # a second request waits in the queue; its client gives up after 1 s
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(server.url + "/v1/chat/completions", timeout=1.0,
                           json={"model": "m", "messages": QUESTION, "max_tokens": 4})
            assert wait_for(lambda: server.queued.peek() == 0, 5)  # its place is free
            assert server.running.peek() == 1
            # so the next request queues (rather than getting 429) ...
            answers: list[httpx.Response] = []
            waiting = threading.Thread(target=lambda: answers.append(httpx.post(
                server.url + "/v1/chat/completions", timeout=120,
                json={"model": "m", "messages": QUESTION, "max_tokens": 4,
                      "temperature": 0})))
            waiting.start()
            assert wait_for(lambda: server.queued.peek() == 1, 5)
        # ... and is answered once the stream is dropped and its generation stops
        waiting.join(60)
        assert answers and answers[0].status_code == 200, answers
        assert answers[0].json()["choices"][0]["message"]["content"] \
            == llm.chat(QUESTION, max_tokens=4, temperature=0).text
        assert wait_for(lambda: server.running.peek() == 0 and not llm.busy.peek(), 10)


class Echo:
    """A duck-typed engine whose methods return text, not `Completion`s: `chat` a plain
    iterator of pieces, `generate` an async generator, `chat_batch` a list of strings."""

    def __init__(self):
        self.closed = threading.Event()

    def chat(self, messages, **options):
        return iter(["You said: ", messages[-1]["content"]])

    def chat_batch(self, conversations, **options):
        return [f"#{i}" for i, _ in enumerate(conversations)]

    def generate(self, prompt, **options):
        async def pieces():
            try:
                for word in prompt.split():
                    yield word.upper() + " "
            finally:
                self.closed.set()
        return pieces()


def test_an_engine_returning_plain_or_async_iterators_of_text_is_served():
    import workbench

    engine = Echo()
    with workbench.serve({"echo": engine}, port=0) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="-")
        said = [{"role": "user", "content": "hello"}]
        answer = client.chat.completions.create(model="echo", messages=said)
        assert answer.choices[0].message.content == "You said: hello"
        assert answer.choices[0].finish_reason == "stop"
        assert answer.usage.completion_tokens == 2
        stream = client.chat.completions.create(model="echo", messages=said, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
            "You said: hello"
        batch = client.chat.completions.create(model="echo", messages=said, n=2)
        assert [c.message.content for c in batch.choices] == ["#0", "#1"]
        text = client.completions.create(model="echo", prompt="a b c")
        assert text.choices[0].text == "A B C " and engine.closed.is_set()
        streamed = client.completions.create(model="echo", prompt="x y", stream=True)
        assert "".join(c.choices[0].text for c in streamed) == "X Y "


def test_a_draft_field_is_refused_not_ignored():
    """A request cannot choose a draft model (the server's is started with it): a `draft`
    field is a 400."""
    import workbench

    with workbench.serve({"echo": Echo()}, port=0) as s:
        for route, body in (("chat/completions", {"messages": [{"role": "user",
                                                                 "content": "hi"}]}),
                            ("completions", {"prompt": "hi"})):
            for field in ({"draft": "small"}, {"draft_tokens": 4}):
                r = httpx.post(f"{s.base_url}/{route}", json={"model": "echo", **body,
                                                               **field})
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert error["param"] == next(iter(field))
                assert "cannot choose a draft model" in error["message"]



def test_a_served_model_with_a_draft_answers_as_without(smollm2):
    """`serve(m, draft="ngram")`, as llama.cpp's server takes a draft: greedy chat and
    completion answers (n = 2 too) are the ones the model gives alone; a schema-
    constrained answer runs without the draft; a bad draft is refused at start."""
    import workbench

    question = [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps "
                 "over the lazy dog, the quick brown fox jumps over the lazy dog."}]
    with workbench.serve(smollm2, model_id="m", port=0, draft="ngram", draft_tokens=3) as s:
        assert s.state.drafts == {"m": {"draft": "ngram", "draft_tokens": 3}}
        client = openai.OpenAI(base_url=s.base_url, api_key="-", max_retries=0)
        r = client.chat.completions.create(model="m", messages=question, max_tokens=30,
                                           temperature=0, n=2)
        alone = smollm2.chat(question, max_tokens=30)
        assert [c.message.content for c in r.choices] == [alone.text] * 2
        r = client.completions.create(model="m", prompt="1, 2, 3, 4,", max_tokens=12,
                                      temperature=0)
        assert r.choices[0].text == smollm2.generate("1, 2, 3, 4,", max_tokens=12).text
        schema = {"type": "object", "properties": {"a": {"type": "integer"}},
                  "required": ["a"]}
        r = client.chat.completions.create(
            model="m", messages=question, max_tokens=12, temperature=0,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "a", "schema": schema}})
        assert "a" in json.loads(r.choices[0].message.content)
    with pytest.raises(ValueError, match="draft must be an LLM"):
        workbench.serve(smollm2, port=0, draft="small")
    with pytest.raises(ValueError, match="maps model ids"):
        workbench.serve({"a": smollm2, "b": smollm2}, port=0, draft="ngram")
