"""The server under concurrent load with its defaults: requests from many clients decode
together in the engine's batch (`workbench.engine.decoding.scheduler`), each gets the answer it
gets alone, and clients that leave mid-stream free their places and their memory.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.support.polling import wait_for

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")

QUESTIONS = ["Name a fruit.", "What is 2 + 2?", "Write a haiku about the sea.",
             "Who wrote Hamlet?", "List three colours.", "Say hello in French.",
             "What is the capital of Japan?", "Describe a cat in one sentence."]
MAX_TOKENS = 32


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _messages(i: int) -> list[dict]:
    return [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]


def _stream(http: httpx.Client, i: int, leave_after: int | None) -> tuple[int, str]:
    """One streamed chat completion: (status, text); with `leave_after`, the client hangs
    up after that many chunks."""
    body = {"model": "m", "messages": _messages(i), "temperature": 0,
            "max_tokens": MAX_TOKENS, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.text
        text, chunks = [], 0
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                return 500, json.dumps(data)
            text.append(data["choices"][0]["delta"].get("content") or "")
            chunks += 1
            if leave_after is not None and chunks == leave_after:
                break  # hang up mid-stream
        return 200, "".join(text)


def test_sixteen_clients_with_a_third_hanging_up(smollm2):
    """16 streaming clients at once, 5 of them (30%) hanging up after 3 chunks: every
    other client gets the text the model gives alone, nobody gets a 5xx, and afterwards
    nothing runs, the model is idle and the process holds no more memory than after a
    first round of the same load (within 10%)."""
    import workbench

    llm = smollm2
    expected = [llm.chat(_messages(i), temperature=0, max_tokens=MAX_TOKENS).text
                for i in range(len(QUESTIONS))]
    leaving = {1, 4, 7, 10, 13}

    with workbench.serve(llm, model_id="m", port=0, max_queue=32) as server:
        def round_() -> list[tuple[int, int, str]]:
            results: list[tuple[int, int, str]] = []
            lock = threading.Lock()

            def client(i: int) -> None:
                with httpx.Client(base_url=server.url, timeout=120) as http:
                    status, text = _stream(http, i, 3 if i in leaving else None)
                with lock:
                    results.append((i, status, text))

            threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            assert wait_for(lambda: server.running.peek() == 0 and not llm.busy.peek(), 20)
            return sorted(results)

        round_()  # warm: the pool's slots and the server's buffers are allocated
        rss_before = _rss()
        results = round_()
        rss_after = _rss()

    assert len(results) == 16
    assert all(status == 200 for _, status, _ in results), results
    for i, _, text in results:
        if i not in leaving:
            assert text == expected[i % len(QUESTIONS)], (i, text)
    assert abs(rss_after - rss_before) < 0.1 * rss_before, (rss_before, rss_after)
    scheduler = llm._scheduler
    with scheduler.paused():
        assert not scheduler._running and not scheduler._waiting
    assert not llm.busy.peek()


def test_clients_are_served_together(smollm2):
    """Eight clients at once with the default settings: their generations share decode
    steps (far fewer steps than tokens), and `n` choices join the batch too."""
    import workbench

    llm = smollm2
    with workbench.serve(llm, model_id="m", port=0) as server, \
            openai.OpenAI(base_url=server.base_url, api_key="-", max_retries=0) as client:
        steps = llm._scheduler.steps
        answers: list = [None] * 8

        def ask(i: int) -> None:
            answers[i] = client.chat.completions.create(
                model="m", messages=_messages(i), temperature=0, max_tokens=MAX_TOKENS)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        tokens = sum(a.usage.completion_tokens for a in answers)
        assert llm._scheduler.steps - steps < tokens / 2, (llm._scheduler.steps - steps, tokens)
        for i, a in enumerate(answers):
            assert a.choices[0].message.content == \
                llm.chat(_messages(i), temperature=0, max_tokens=MAX_TOKENS).text
        steps = llm._scheduler.steps
        many = client.chat.completions.create(model="m", messages=_messages(2), n=4,
                                              temperature=0.9, seed=5, max_tokens=16)
        assert len(many.choices) == 4
        assert llm._scheduler.steps - steps < many.usage.completion_tokens
