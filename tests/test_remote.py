"""`RemoteEngine` drives the notebook cells unchanged: `ChatCell` and `SimilarityCell`
against our own server and against llama-cpp-python's server on the same GGUF files, with
the answers compared with the local engines. llama-cpp-python's server is its recorded
answers (the golden `remote-llama-cpp-server`), replayed by tests/support/replay_server.py;
`python -m pytest -m peers` checks that the live server still gives them."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from tests import goldens
from tests.support.replay_server import ReplayServer, from_records
from tests.support.shared import shared_file

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.",
             "A man is riding a horse.", "A monkey is playing drums."]
QUESTION = "What is the capital of France?"
STORY = "Tell me a long story about a dragon."


@pytest.fixture(scope="module")
def ours(smollm2, minilm):
    import workbench

    with workbench.serve({"smollm2-135m": smollm2, "minilm-l6": minilm}, port=0) as server:
        yield server.base_url


@pytest.fixture(scope="module")
def llama_cpp_server(smollm2, minilm):
    """llama-cpp-python's server, replayed: the answers `llama_cpp.server` gave to these
    tests' requests on the same two GGUF files (the golden `remote-llama-cpp-server`,
    recorded by tests/goldens/make_remote.py), served on a loopback port of its own with
    streams sent event by event. A request it has no answer for fails the test."""
    golden = goldens.load("remote-llama-cpp-server")
    for alias, model in (("smollm2-135m", smollm2), ("minilm-l6", minilm)):
        recorded = golden.inputs["models"][alias]["sha256"]
        assert goldens.digest(model.path) == recorded, \
            f"{model.path} is not the file llama.cpp's server answered from (sha256 " \
            f"{recorded}): regenerate `python -m tests.goldens remote-llama-cpp-server`"
    exchanges = from_records(golden.outputs["exchanges"],
                             lambda name: golden.file(name).read_bytes())
    with ReplayServer(exchanges) as server:
        yield server.base_url + "/v1"
    assert not server.unmatched, "requests the golden holds no answer for: " \
        + "; ".join(server.unmatched)


@pytest.fixture(params=["ours", "llama_cpp_server"])
def base_url(request):
    return request.getfixturevalue(request.param)


def test_chat_cell_over_a_remote_engine(request, base_url, smollm2):
    from workbench import RemoteEngine
    from workbench.widgets import ChatCell

    remote = RemoteEngine(base_url, "smollm2-135m")
    # llama.cpp's server penalizes repeats by default (1.1): ask for none, like the local call
    cell = ChatCell(remote, temperature=0, max_tokens=24, repeat_penalty=1.0)
    cell.send(QUESTION)
    assert cell.wait(timeout=120)
    assert cell.error == ""
    messages = cell.messages
    # the cell shows the server's answer: ask the server directly with the official client
    with openai.OpenAI(base_url=base_url, api_key="none", max_retries=0) as client:
        direct = client.chat.completions.create(
            model="smollm2-135m", messages=messages[:2], temperature=0, top_p=0.95,
            max_tokens=24, extra_body={"repeat_penalty": 1.0})
    assert messages[2]["content"] == direct.choices[0].message.content
    assert f"{direct.usage.completion_tokens} generated" in cell.stats
    if request.node.callspec.id == "ours":  # and ours is the local engine's
        assert cell.last_usage["prompt_tokens"] == direct.usage.prompt_tokens
        assert messages[2]["content"] == smollm2.chat(messages[:2], temperature=0,
                                                      max_tokens=24).text
    else:  # llama-cpp-python's server sends no usage in a stream: the prompt count is unknown
        assert cell.last_usage["prompt_tokens"] == 0
    assert not cell.generating and remote.busy.get() is False

    # Stop mid-stream: the cell keeps what arrived, the server is free for the next answer
    cell.max_tokens = 300
    cell.send(STORY)
    deadline = time.monotonic() + 60
    while not cell.log[-1].get("streaming") and time.monotonic() < deadline:
        time.sleep(0.01)
    cell.stop()
    assert cell.wait(timeout=60)
    assert cell.last_usage["finish_reason"] == "stopped"
    cell.max_tokens = 24
    cell.regenerate()
    assert cell.wait(timeout=120) and cell.error == ""
    cell.close()
    remote.close()


def test_similarity_cell_over_a_remote_engine(request, base_url, minilm):
    from workbench import RemoteEngine
    from workbench.widgets import SimilarityCell

    remote = RemoteEngine(base_url, "minilm-l6")
    cell = SimilarityCell(remote, SENTENCES)
    assert cell.wait(timeout=120)
    # llama.cpp's BERT (its own kernels) agrees with ours to about 1e-4 in cosine
    atol = 1e-5 if request.node.callspec.id == "ours" else 5e-4
    np.testing.assert_allclose(cell.matrix, minilm.similarity(SENTENCES, SENTENCES),
                               atol=atol)
    assert "4 sentences embedded" in cell.status.value
    cell.close()
    remote.close()


def test_remote_engine_surface_against_our_server(ours, smollm2):
    from workbench import RemoteEngine, WhisperModel, serve

    remote = RemoteEngine(ours, "smollm2-135m")
    assert remote.models() == ["smollm2-135m", "minilm-l6"]
    c = remote.generate("The capital of France is", max_tokens=8, temperature=0, logprobs=2)
    local = smollm2.generate("The capital of France is", max_tokens=8, temperature=0,
                             logprobs=2)
    assert c.text == local.text and c.finish_reason == local.finish_reason
    assert [ev.piece for ev in c.events] == [ev.piece for ev in local.events if ev.id]
    np.testing.assert_allclose([ev.logprob for ev in c.events],
                               [ev.logprob for ev in local.events if ev.id], atol=1e-4)
    schema = {"type": "object", "properties": {"answer": {"type": "string"}},
              "required": ["answer"]}
    c = remote.chat([{"role": "user", "content": QUESTION}], schema=schema, temperature=0,
                    max_tokens=80)
    assert c.finish_reason == "stop", c.text
    assert "answer" in json.loads(c.text)
    # the JSON cell hands a compiled schema over as its grammar: it goes as the schema
    from workbench.widgets import JSONCell

    cell = JSONCell(remote, schema, prompt=QUESTION, max_tokens=80)
    cell.run()
    cell.wait()
    assert cell.error == "" and cell.validity == "valid", (cell.error, cell.text)
    assert cell.text == c.text
    with pytest.raises(ValueError, match="max_tokens"):
        remote.chat([{"role": "user", "content": "hi"}], max_tokens=-5).wait()
    with pytest.raises(TypeError, match="unsupported option"):
        remote.chat([{"role": "user", "content": "hi"}], temprature=0)

    # speech: our server in front of WhisperModel, the transcript as the model's
    jfk = shared_file("data", "whisper", "jfk.wav")
    with WhisperModel.load("whisper-tiny.en") as whisper, \
            serve(whisper, model_id="w", port=0) as server:
        t = RemoteEngine(server.base_url, "w").transcribe(jfk, timestamps=True)
        expected = whisper.transcribe(jfk, timestamps=True)
        assert str(t) == str(expected) and t.language == "en"
        assert [(s.start, s.end) for s in t.segments] \
            == [(s.start, s.end) for s in expected.segments]


def test_a_server_that_is_gone_is_said_in_words():
    """A remote engine whose server is not running (a serve cell stopped, a port nobody
    listens on): the chat cell says the server is not answering, where, and what to do,
    not the client's bare "Connection error."."""
    import socket

    from workbench import RemoteEngine
    from workbench.widgets import ChatCell

    with socket.socket() as s:  # a port that was free a moment ago, and nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    remote = RemoteEngine(url, "smollm2-135m")
    with pytest.raises(ConnectionError, match=rf"the server at {url} is not answering .*Start"):
        remote.chat([{"role": "user", "content": "Hi"}]).wait()
    cell = ChatCell(remote, max_tokens=4)
    cell.send("Hi")
    assert cell.wait(timeout=60)
    assert cell.error.startswith(f"ConnectionError: the server at {url} is not answering")
    cell.close()
    remote.close()
