"""The scheduler (`workbench.engine.decoding.scheduler`) driven by a fake model through the
`GenerationModel` protocol, with no weights: which slot each request gets, whose tokens
reach whom, what a finished or cancelled request leaves behind.

The fake model's "network" is a rule: after token t comes t + 1 (within the letters of
its vocabulary), read from the sequence's own KV cache, so a request that received
another's logits would show it in its tokens.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext

import numpy as np
import pytest

from workbench.engine.cancel import Cancelled
from workbench.engine.decoding.generation_model import GenerationModel
from workbench.engine.decoding.scheduler import PREFILL_CHUNK, Request, Scheduler
from workbench.engine.decoding.sequence import Decoding
from workbench.engine.options import GenerationOptions
from workbench.engine.runtime.kv_cache import KVPool
from workbench.engine.text.tokenizers import load_tokenizer

LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]


def _tokenizer():
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *LETTERS]
    types = [2, 3, 3, *[6] * 256, *[1] * len(LETTERS)]
    return load_tokenizer({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
        "tokenizer.ggml.scores": np.zeros(len(tokens), dtype=np.float32),
        "tokenizer.ggml.add_space_prefix": False})


class FakeConfig:
    def __init__(self, n_vocab: int):
        self.n_vocab = n_vocab


class FakeModel:
    """`GenerationModel` without a network: the logits after token t pick t + 1 (the
    letters wrap around). It records the batches it was given."""

    def __init__(self, kv_cache_size: int = 64):
        self.tokenizer = _tokenizer()
        self.config = FakeConfig(len(self.tokenizer.tokens))
        self.first = self.tokenizer.tokens.index("a")
        self.kv_cache_size = kv_cache_size
        self.backend = None
        self.prefilled_tokens = 0
        self.forward_lock = threading.Lock()
        self.decode_batches: list[list[int]] = []  # the slots of each decode step
        self.prefill_chunks: list[tuple[int, int]] = []  # (slot, tokens) of each chunk
        self.pools: list[KVPool] = []
        self.step_gate = threading.Semaphore(10_000)  # a test may hold the decode steps

    def marked_busy(self):
        return nullcontext()

    def new_pool(self, n_slots: int) -> KVPool:
        pool = KVPool(1, n_slots, 1, 2, self.kv_cache_size)
        self.pools.append(pool)
        return pool

    def new_cache(self, max_len=None):
        return KVPool(1, 1, 1, 2, max_len or self.kv_cache_size).cache(0)

    def _after(self, token: int) -> int:
        return self.first + (token - self.first + 1) % len(LETTERS)

    def _row(self, token: int) -> np.ndarray:
        row = np.zeros(self.config.n_vocab, np.float32)
        row[self._after(token)] = 10.0
        return row

    def hidden(self, ids, cache):
        cache.check_room(len(ids))
        cache.advance(ids)
        return np.asarray(ids)[:, None]  # the "hidden state" of a position: its token

    def hidden_batch(self, chunks):
        for ids, cache in chunks:
            self.prefill_chunks.append((cache.slot, len(ids)))
        return [self.hidden(ids, cache) for ids, cache in chunks]

    def decode_step(self, tokens, caches, device_tokens):
        self.step_gate.acquire()
        self.decode_batches.append([c.slot for c in caches])
        for t, cache in zip(tokens, caches):
            self.hidden(np.asarray([t]), cache)
        return np.stack([self._row(int(t)) for t in tokens])

    def logits_out(self, hidden, on_device):
        return np.stack([self._row(int(h[0])) for h in hidden])

    def prefill(self, ids, cache, on_device=False, cancel=None):
        return self.logits_out(self.hidden(np.asarray(ids), cache)[-1:], on_device)[0]


def _ids(model: FakeModel, text: str) -> list[int]:
    return [model.tokenizer.tokens.index(c) for c in text]


def _request(model: FakeModel, text: str, max_tokens: int, cancel=None) -> Request:
    ids = _ids(model, text)
    options = GenerationOptions(temperature=0, max_tokens=max_tokens, stop_tokens=[])
    seq = Decoding.start(model.tokenizer, ids, options, model.config.n_vocab)
    return Request(ids, seq, cancel=cancel)


def _text(model: FakeModel, request: Request) -> str:
    return "".join(model.tokenizer.tokens[e.id] for e in request.events if e.id is not None)


def _run_together(scheduler: Scheduler, requests: list[Request]) -> None:
    """`run_all`, but every request is waiting before the first step (on a busy machine
    the thread could otherwise finish one before the next is submitted)."""
    with scheduler.paused():
        for r in requests:
            scheduler.submit(r)
    for r in requests:
        while (event := scheduler._next_event(r)) is not None:
            r.events.append(event)


def test_the_fake_model_provides_the_protocol():
    assert isinstance(FakeModel(), GenerationModel)


def test_each_request_gets_the_tokens_of_its_own_sequence_decoded_together():
    model = FakeModel()
    scheduler = Scheduler(model, max_batch=4)
    requests = [_request(model, p, 5) for p in ("abc", "klm", "wxy")]
    _run_together(scheduler, requests)
    assert [_text(model, r) for r in requests] == ["defgh", "nopqr", "zabcd"]
    assert max(len(b) for b in model.decode_batches) == 3  # one pass for all three
    assert model.prefilled_tokens == 9
    # each finished in its own slot, kept for reuse, none still owned
    assert len({r.cache.slot for r in requests}) == 3
    assert scheduler._owner == [None] * len(scheduler._owner)
    scheduler.close()


def test_a_full_batch_makes_requests_wait_for_a_freed_slot():
    model = FakeModel()
    scheduler = Scheduler(model, max_batch=1)
    requests = [_request(model, p, 3) for p in ("abc", "pqr")]
    scheduler.run_all(requests)
    assert [_text(model, r) for r in requests] == ["def", "stu"]
    assert all(len(b) == 1 for b in model.decode_batches)  # never two at once
    assert scheduler._owner == [None] * len(scheduler._owner)
    scheduler.close()


def test_a_prompt_continues_the_slot_that_cached_its_beginning():
    model = FakeModel()
    scheduler = Scheduler(model, max_batch=2)
    first = _request(model, "abcdefgh", 2)
    scheduler.run_all([first])
    read = model.prefilled_tokens
    # the next turn: the first prompt, its answer and more
    second = _request(model, "abcdefgh" + _text(model, first) + "xy", 2)
    scheduler.run_all([second])
    assert second.cache.slot == first.cache.slot
    assert model.prefilled_tokens - read == 3  # only "x", "y" and the answer's last token
    assert _text(model, second) == "za"
    scheduler.close()


def test_a_long_prompt_is_read_in_chunks():
    model = FakeModel(kv_cache_size=2 * PREFILL_CHUNK + 8)
    scheduler = Scheduler(model)
    text = "".join(LETTERS[i % 26] for i in range(PREFILL_CHUNK + 10))
    request = _request(model, text, 1)
    scheduler.run_all([request])
    assert [n for _, n in model.prefill_chunks] == [PREFILL_CHUNK, 10]
    assert _text(model, request) == LETTERS[(PREFILL_CHUNK + 10) % 26]
    scheduler.close()


def test_cancelling_a_request_frees_its_slot_for_the_next():
    model = FakeModel()
    scheduler = Scheduler(model, max_batch=1)
    model.step_gate = threading.Semaphore(0)  # the first decode step waits
    cancel = threading.Event()
    running = _request(model, "abc", 40, cancel=cancel)
    events = scheduler.events(running)
    first = next(events)  # sampled from the prompt's logits, before any decode step
    assert model.tokenizer.tokens[first.id] == "d"
    slot = running.cache.slot
    assert scheduler._owner[slot] is running
    cancel.set()
    model.step_gate.release(10_000)
    with pytest.raises(Cancelled):
        list(events)
    waiting = _request(model, "mno", 2)
    scheduler.run_all([waiting])  # admitted: the cancelled request gave its place back
    assert _text(model, waiting) == "pq"
    assert scheduler._owner == [None] * len(scheduler._owner)
    assert running.seq.n_generated < 40
    scheduler.close()


def test_a_caller_that_stops_reading_frees_its_slot():
    model = FakeModel()
    scheduler = Scheduler(model, max_batch=1)
    model.step_gate = threading.Semaphore(0)
    abandoned = _request(model, "abc", 40)
    events = scheduler.events(abandoned)
    next(events)
    events.close()  # the caller walks away
    model.step_gate.release(10_000)
    after = _request(model, "ghi", 2)
    scheduler.run_all([after])
    assert _text(model, after) == "jk"
    assert abandoned.seq.n_generated < 40
    scheduler.close()


def test_a_closed_scheduler_refuses_new_requests():
    model = FakeModel()
    scheduler = Scheduler(model)
    scheduler.close()
    with pytest.raises(RuntimeError, match="closed"):
        scheduler.submit(_request(model, "abc", 2))
