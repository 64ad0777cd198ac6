"""`Scheduler`: continuous batching of every generation of one model (an `LLM`).

One thread owns the model's KV pool and advances every running sequence together:

    step:  admit waiting requests into free slots (reusing cached prompt prefixes)
           sample one token for each sequence whose logits are ready
           one decode forward pass for all of them (one row per sequence)
           one verifying pass: the drafted sequences' newest tokens with their proposals
           one prefill pass: the next chunk of each prompt still being read

Requests come from any thread (`LLM.generate` / `chat`, `generate_batch`, the
server's engine calls), join at step boundaries and leave as soon as they finish
or their caller cancels or stops reading; each keeps its own `Decoding` (sampler,
grammar matcher, stop conditions, logprobs). Prompts are read in chunks between
decode steps, at most `PREFILL_BUDGET` prompt tokens per step while others are
decoding, so a long prompt delays the others' next token by one chunk, not by its
whole prefill. A speculative request (`Request.drafting`,
`workbench.engine.decoding.speculative`) feeds its newest token together with the tokens
its drafter proposes, and emits the proposals the model keeps plus one token of its own.

Slots keep what they cached after their request ends. A new prompt continues the
slot that shares the longest beginning with it (a conversation's next turn reuses
its history), or, when another slot shares at least `MIN_SHARED` tokens (a long
system prompt), forks it: the new sequence reads those positions from the other
slot (`KVCache.fork`), so they are held once however many sequences use them. A
slot is never overwritten where a live sequence still reads it. A request whose
prompt shares a beginning with a prompt still being read waits for that read to
finish instead of reading the same tokens again.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from workbench.engine.cancel import CancelFlag, Cancelled
from workbench.engine.decoding.generation_model import GenerationModel
from workbench.engine.decoding.sampling import DeviceSampler
from workbench.engine.decoding.sequence import Decoding
from workbench.engine.decoding.speculative import Drafting
from workbench.engine.results import TokenEvent
from workbench.engine.runtime.backend import BatchRow
from workbench.engine.runtime.cores import CoreShare, prompt_gil
from workbench.engine.runtime.kv_cache import ContextFullError, KVCache
from workbench.engine.runtime.prefix_cache import PrefixCache, common_prefix
from workbench.engine.runtime.profiling import span

DEFAULT_MAX_BATCH = 8  # sequences decoded together
SPARE_SLOTS = 2  # pool slots beyond max_batch: cached prompts that running sequences read
PREFILL_CHUNK = 512  # prompt tokens of one sequence per forward pass
# Prompt tokens per step while other sequences are decoding. Reading is compute-bound
# (~1.7 ms a token on 2 cores, whatever the batch), so a step of 512 stalls the streams
# ~0.9 s; 128 read an 8-request burst in 8 passes instead of 3 and, with 8 streaming
# clients, gave 5-8% fewer tokens/s and a later last first token (1.7-1.8 s against
# 1.4-1.6 s; bench/serve.py's mix)
PREFILL_BUDGET = 512
MIN_SHARED = 64  # a prompt forks another slot's cached beginning when it shares this much
# After a prefix cache, tails up to this long run token by token on the decode path, which
# beats one small prefill chunk (16 tokens after a 995-token prefix: 0.19 s against 0.40 s)
STEPWISE_TAIL = 16
# How long a step waits for a constrained sequence's grammar mask before it runs without
# it (`Scheduler._late_masks`): while others have work, as long as the last decode pass
# took and at least MASK_GRACE_S; with nothing else to do, MASK_IDLE_WAIT_S at a time.
MASK_GRACE_S = 0.005
MASK_IDLE_WAIT_S = 0.1
IDLE_EXIT_S = 5.0  # the thread ends after this long without work (and restarts on demand)
_DONE = object()  # a request's last queue item: its finish reason is on its Decoding


@dataclass(eq=False)
class Request:
    """One sequence to generate: its prompt, decoding state and where its events go."""

    ids: list[int]
    seq: Decoding
    prefix: PrefixCache | None = None
    cancel: CancelFlag | None = None
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cache: KVCache | None = None
    pending: list[int] = field(default_factory=list)  # prompt tokens still to read
    stepwise: bool = False  # read `pending` one token per decode step
    row: BatchRow | None = None  # logits after the last token read: the next sample is due
    drafting: Drafting | None = None  # speculative: each token fed comes with proposals
    gone: bool = False  # the caller stopped reading: free the slot
    forgotten: bool = False  # `forget` ran while it ran: its slot keeps nothing
    events: list[TokenEvent] = field(default_factory=list)  # collected by `run_all`

    @property
    def reading(self) -> bool:
        return bool(self.pending) and not self.stepwise


class Scheduler:
    """Runs every generation of `model` through one KV pool of `max_batch` running
    sequences (plus `SPARE_SLOTS` that keep cached prompts), one forward pass per step.
    `model` is used only through the `GenerationModel` protocol (an `LLM`, or a fake in
    the tests)."""

    def __init__(self, model: GenerationModel, max_batch: int = DEFAULT_MAX_BATCH):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.model = model
        self.max_batch = max_batch
        self._pool = None  # made on first use: n_slots caches of kv_cache_size positions
        self._caches: list[KVCache] = []
        self._owner: list[Request | None] = []
        self._last_used: list[int] = []
        self._clock = 0
        self._kept: KVCache | None = None  # the cache of the last request that finished
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._cond = threading.Condition()
        self._step_lock = threading.Lock()  # held by the thread through each step
        self._thread: threading.Thread | None = None
        self._closed = False
        self._cores: CoreShare | None = None  # the CPU's compute threads per step
        self.steps = 0  # steps run (each: at most one decode and one prefill pass)
        self._decode_s = 0.0  # how long the last decode pass took

    # -- the callers' side -------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Requests admitted or waiting for a place (0: the scheduler is idle)."""
        with self._cond:
            return len(self._waiting) + len(self._running)

    @property
    def kept(self) -> KVCache | None:
        """The cache of the last request that finished, while its slot is idle (None
        once another request has taken the slot, or before any finished)."""
        cache = self._kept
        if cache is None or self._owner[cache.slot] is not None \
                or self._caches[cache.slot] is not cache:
            return None
        return cache

    def submit(self, request: Request) -> None:
        """Queue `request`; it is admitted at the next step boundary with a free slot."""
        if len(request.ids) > self.model.kv_cache_size:
            raise ContextFullError(
                f"the KV cache holds {self.model.kv_cache_size} positions and "
                f"{len(request.ids)} were requested; load the model with a larger "
                "kv_cache_size")
        with self._cond:
            if self._closed:
                raise RuntimeError("this LLM has been closed")
            self._waiting.append(request)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name="workbench-scheduler")
                self._thread.start()
            self._cond.notify()

    def events(self, request: Request) -> Generator[TokenEvent, None, str]:
        """Submit `request` and yield its events as the thread produces them; return its
        finish reason. Closing the generator early frees its slot at the next step;
        `Cancelled` (its flag set) and any error of its own are raised here."""
        self.submit(request)
        try:
            while (event := self._next_event(request)) is not None:
                if request.cancel is not None and request.cancel.is_set():
                    raise Cancelled("cancelled")
                yield event
            return request.seq.finish_reason
        finally:
            self._let_go([request])

    def run_all(self, requests: list[Request]) -> None:
        """Submit every request and wait until all have finished, their events in
        `request.events`; the first error (`Cancelled` included) is raised and the
        others are dropped."""
        try:
            for r in requests:
                self.submit(r)
            for r in requests:
                while (event := self._next_event(r)) is not None:
                    r.events.append(event)
        finally:
            self._let_go(requests)

    @staticmethod
    def _next_event(request: Request) -> TokenEvent | None:
        """The request's next event as the thread hands it over (waiting for it); None
        once it has finished; its error, raised."""
        item = request.out.get()
        if isinstance(item, BaseException):
            raise item
        return None if item is _DONE else item

    def _let_go(self, requests: list[Request]) -> None:
        """The callers stopped reading: whatever of these is still running leaves at the
        next step."""
        for r in requests:
            r.gone = True
        with self._cond:
            self._cond.notify()

    @contextmanager
    def paused(self) -> Generator[None, None, None]:
        """Hold the thread between steps (to change a cached sequence from outside)."""
        with self._step_lock:
            yield

    def free_readers(self, cache: KVCache, start: int) -> None:
        """Give every other cache that reads positions >= `start` of `cache`'s slot its own
        copy, so that they may change (call while `paused`)."""
        for other in self._caches:
            if other is not cache and self._reads_from(other, cache.slot) > start:
                other.materialize()

    def kv_positions(self) -> tuple[int, int, int]:
        """(slots, positions running requests hold, positions idle slots keep); a pool not
        made yet has its slots and nothing held."""
        with self._cond:
            if self._pool is None:
                return self.max_batch + SPARE_SLOTS, 0, 0
            running = sum(c.offset for c, o in zip(self._caches, self._owner) if o is not None)
            cached = sum(c.offset for c, o in zip(self._caches, self._owner) if o is None)
            return len(self._caches), running, cached

    def forget(self) -> None:
        """Forget what the idle slots cached, and what the running requests' slots hold
        when they end (call while `paused`): a request still running, one whose caller
        stopped reading included, would otherwise leave its prompt behind for the next."""
        for cache, owner in zip(self._caches, self._owner):
            if owner is None:
                cache.reset()
        for r in self._running:
            r.forgotten = True

    def close(self) -> None:
        """End the thread; queued and running requests get `RuntimeError`."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(10)

    # -- the thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._closed and not self._waiting and not self._running:
                    self._cond.wait(IDLE_EXIT_S)
                if self._closed or (not self._waiting and not self._running):
                    self._thread = None
                    closing = self._closed
                    break
            with self._step_lock, span("step", cat="step"), prompt_gil():
                try:
                    self._use_cores()
                    self._step()
                except Exception as exc:  # noqa: BLE001 - a bug here must not hang callers
                    self._fail_all(exc)
        if closing:
            self._fail_all(RuntimeError("this LLM has been closed"))

    def _use_cores(self) -> None:
        """On the CPU, the compute threads of the next step: those the cores other work
        leaves free (`workbench.engine.runtime.cores`), set for this thread's parallel regions."""
        if self.model.backend is not None:
            return
        import numba

        if self._cores is None:
            self._cores = CoreShare(numba.config.NUMBA_NUM_THREADS)
        n = self._cores.next_step()
        if n != numba.get_num_threads():
            numba.set_num_threads(n)

    def _step(self) -> None:
        """Admit, sample, decode, read prompts: one step of every running sequence."""
        for r in list(self._running):
            if r.gone or (r.cancel is not None and r.cancel.is_set()):
                self._end(r, Cancelled("cancelled") if not r.gone else None)
        self._admit()
        feed: list[tuple[Request, int]] = []
        drafted: list[tuple[Request, list[int], list[Any]]] = []
        picked = self._pick_together()
        late = self._late_masks()
        for r in list(self._running):
            if r in late:  # keeps its logits (a copy: the next pass may reuse the array)
                xp = np if self.model.backend is None else self.model.backend.xp
                r.row = BatchRow(xp.array(r.row.get())[None], 0)
            elif r.stepwise and r.pending:  # a short tail read on the decode path
                token = r.pending.pop(0)
                if r.drafting is not None and not r.pending and self._propose(r, drafted):
                    continue
                feed.append((r, token))
            elif r.row is not None:
                room = r.cache.max_len - r.cache.offset
                try:
                    with span("token", cat="token", seq=id(r) & 0xFFFF) as args:
                        if r in picked:
                            token, evs = r.seq.take(*picked[r], room=room)
                        else:
                            token, evs = r.seq.step(r.row.get(), room=room,
                                                    on_device=self.model.backend is not None)
                        args["id"] = next((e.id for e in evs if e.id is not None), None)
                except Exception as exc:  # noqa: BLE001 - the caller's to see
                    self._end(r, exc)
                    continue
                r.row = None
                for ev in evs:
                    r.out.put(ev)
                if token is None:
                    self._end(r)
                elif r.drafting is None or not self._propose(r, drafted):
                    feed.append((r, token))
        if feed:
            self._guarded([r for r, _ in feed], lambda: self._decode(feed))
        if drafted:
            self._guarded([r for r, _, _ in drafted], lambda: self._verify(drafted))
        reading = [r for r in self._running if r.reading]
        if reading:
            self._guarded(reading, lambda: self._read(reading, bool(feed)))
        self.steps += 1

    def _pick_together(self) -> dict[Request, tuple[int, Any]]:
        """On a GPU, the next tokens of the sequences whose pick reads the logits alone
        (`Decoding.plain`: greedy or sampled, no grammar, penalties or logprobs), taken
        together with one copy to the host: each sequence's own pick would wait for the
        device once per sequence. {request: (token id, the id on the device)}."""
        if self.model.backend is None:
            return {}
        ready = [r for r in self._running if r.row is not None
                 and not (r.stepwise and r.pending) and r.seq.plain]
        if len(ready) < 2:
            return {}
        try:
            with span("sample", sequences=len(ready)):
                ids, on_device = DeviceSampler.pick_rows([r.seq.sampler for r in ready],
                                                         [r.row for r in ready])
        except Exception:  # noqa: BLE001 - each sequence's own pick then reports it
            return {}
        column = on_device[:, None]  # (k, 1): each sequence's id as a (1,) row
        return {r: (t, BatchRow(column, i)) for i, (r, t) in enumerate(zip(ready, ids))}

    def _late_masks(self) -> set[Request]:
        """The constrained sequences due a token whose grammar mask, computed on a worker
        thread since their last token (`GrammarMatcher.prefetch`), is not ready after the
        wait the others allow (see MASK_GRACE_S). They sit this step out, so that a
        grammar whose parser work blows up (up to the parser's item limit a mask) slows
        the other sequences by about half instead of stalling them."""
        due = [r for r in self._running if r.row is not None and not r.seq.mask_ready]
        if not due:
            return set()
        others = any(r.pending or (r.row is not None and r.seq.mask_ready)
                     for r in self._running)
        deadline = time.perf_counter() + (max(MASK_GRACE_S, self._decode_s) if others
                                          else MASK_IDLE_WAIT_S)
        return {r for r in due
                if not r.seq.matcher.wait(max(0.0, deadline - time.perf_counter()))}

    def _guarded(self, requests: list[Request], run) -> None:
        """Run a forward pass; if it fails, every request in it gets the error."""
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - the callers' to see
            for r in requests:
                r.cache.reset()
                self._end(r, exc)

    def _decode(self, feed: list[tuple[Request, int]]) -> None:
        """One token of each sequence in `feed` through the model, in one pass; the ones
        whose prompt is read get their next logits."""
        model = self.model
        tokens = np.asarray([t for _, t in feed])
        caches = [r.cache for r, _ in feed]
        start = time.perf_counter()
        with model.forward_lock, span("decode", tokens=len(feed)):
            rows = model.decode_step(tokens, caches, [r.seq.device_token for r, _ in feed])
        self._decode_s = time.perf_counter() - start
        for i, (r, _) in enumerate(feed):
            if not r.pending:
                r.row = BatchRow(rows, i)

    def _propose(self, r: Request, drafted: list) -> bool:
        """Draft what follows `r`'s newest token (the last of its history, about to be
        fed) into `drafted`; False when the drafter has nothing (then it is fed alone).
        A drafter's error ends `r` with it."""
        try:
            proposal, q = r.drafting.propose(r.seq, room=r.cache.max_len - len(r.seq.history))
        except Exception as exc:  # noqa: BLE001 - the caller's to see
            self._end(r, exc)
            return True
        if not proposal:
            r.drafting.counts.target_passes += 1  # a plain decode row
            return False
        drafted.append((r, proposal, q))
        return True

    def _verify(self, drafted: list[tuple[Request, list[int], list[Any]]]) -> None:
        """The drafted sequences' newest tokens with their proposals through the model, in
        one pass, then each one's round: the proposals it keeps and the target's own next
        token, emitted; the cache keeps what was kept, and the last token is fed next."""
        model = self.model
        chunks = [(np.asarray(r.seq.history[-1:] + proposal), r.cache)
                  for r, proposal, _ in drafted]
        with model.forward_lock, span("verify", tokens=sum(len(ids) for ids, _ in chunks),
                                     sequences=len(chunks)):
            hidden = model.hidden_batch(chunks)
            logits = [model.logits_out(h, on_device=False) for h in hidden]
        for (r, proposal, q), rows in zip(drafted, logits):  # rows: (k + 1, n_vocab)
            try:
                chosen = r.drafting.verify(r.seq, rows, proposal, q)
            except Exception as exc:  # noqa: BLE001 - the caller's to see
                self._end(r, exc)
                continue
            r.cache.trim(len(r.seq.history) + len(chosen) - 1)  # the fed and the kept
            for row, token in zip(rows, chosen):
                token, evs = r.seq.push(token, row,
                                        room=r.cache.max_len - len(r.seq.history))
                for ev in evs:
                    r.out.put(ev)
                if token is None:
                    self._end(r)
                    break
            else:  # the last chosen token is fed next step (with the next proposals)
                r.seq.device_token = None
                r.pending = r.seq.history[r.cache.offset :]  # (more if a ring started over)
                r.stepwise = len(r.pending) <= STEPWISE_TAIL

    def _read(self, reading: list[Request], decoding: bool) -> None:
        """The next chunk of each prompt being read: PREFILL_CHUNK tokens (or what is
        left) each and, while others decode, PREFILL_BUDGET in all (the earliest
        admitted first; the first always reads). A chunk is read whole or at a later
        step, never split to fill the budget: a prompt is cut into the same chunks
        whatever else runs, and so read to the same bits (batch invariance)."""
        model = self.model
        budget = PREFILL_BUDGET if decoding else PREFILL_CHUNK * len(reading)
        chunks = []
        for r in reading:
            n = min(len(r.pending), PREFILL_CHUNK)
            if chunks and n > budget:
                break
            chunks.append((r, r.pending[:n]))
            del r.pending[:n]
            budget -= n
        with model.forward_lock, span("prefill", tokens=sum(len(ids) for _, ids in chunks),
                                     sequences=len(chunks)):
            hidden = model.hidden_batch([(np.asarray(ids), r.cache) for r, ids in chunks])
            for (r, _), h in zip(chunks, hidden):
                if not r.pending:
                    r.row = BatchRow(model.logits_out(h[-1:], on_device=True), 0)

    # -- slots -------------------------------------------------------------------------------
    def _ensure_pool(self) -> None:
        if self._pool is not None:
            return
        n = self.max_batch + SPARE_SLOTS
        self._pool = self.model.new_pool(n)
        self._caches = self._pool.caches()
        self._owner = [None] * n
        self._last_used = [0] * n

    @staticmethod
    def _reads_from(cache: KVCache, slot: int) -> int:
        """How far `cache` reads positions of `slot` (0: not at all)."""
        if cache.slot == slot or not cache.shared_until:
            return 0
        hits = np.nonzero(cache.sources[: cache.shared_until] == slot)[0]
        return int(hits[-1]) + 1 if hits.size else 0

    def _pinned(self, slot: int) -> int:
        """Positions of `slot` that other caches read: it may be written from here on."""
        return max((self._reads_from(c, slot) for c in self._caches), default=0)

    def _admit(self) -> None:
        """Move waiting requests into slots while there is room (in order; a request that
        shares its beginning with a prompt still being read waits for it)."""
        if not self._waiting:
            return
        self._ensure_pool()
        deferred = []
        with self._cond:
            while self._waiting and len(self._running) < self.max_batch:
                r = self._waiting.popleft()
                if r.gone:
                    continue
                if r.cancel is not None and r.cancel.is_set():
                    r.out.put(Cancelled("cancelled"))
                    continue
                if self._shares_with_reading(r.ids):
                    deferred.append(r)
                    continue
                if not self._place(r):
                    self._waiting.appendleft(r)
                    break
                self._running.append(r)
            self._waiting.extendleft(reversed(deferred))

    def _shares_with_reading(self, ids: list[int]) -> bool:
        """Whether a prompt still being read shares at least MIN_SHARED tokens with `ids`
        beyond what it has read so far (then `ids` waits, to fork it once read)."""
        for r in self._running:
            if r.reading:
                n = common_prefix(r.ids, ids)
                if n >= MIN_SHARED and r.cache.offset < min(n, len(ids) - 1):
                    return True
        return False

    def _place(self, r: Request) -> bool:
        """Give `r` a slot and a cache holding as much of its prompt as can be reused;
        False when no slot is free."""
        ids, limit = r.ids, len(r.ids) - 1  # at least one token is read, for its logits
        match = [min(c.common_prefix(ids), limit) for c in self._caches]  # per slot
        idle = [s for s, o in enumerate(self._owner) if o is None]
        pinned = {s: self._pinned(s) for s in idle}
        # continue an idle slot in place, as far as it matches and no one reads beyond
        # (of equal matches: an empty slot, else the least recently used)
        in_place, reuse, best = None, 0, None
        for s in idle:
            key = (match[s], self._caches[s].offset == 0, -self._last_used[s])
            if match[s] >= pinned[s] and (best is None or key > best):
                in_place, reuse, best = s, match[s], key
        # or fork the slot that shares the most
        fork_from = max(range(len(match)), key=match.__getitem__)  # (the first of equals)
        shared = match[fork_from]
        if not shared:
            fork_from = None
        restore = 0
        if r.prefix is not None:
            restore = min(r.prefix.common_prefix(ids), limit)
        free = [s for s in idle if pinned[s] == 0 and s != fork_from]
        free.sort(key=lambda s: (self._caches[s].offset > 0, self._last_used[s]))
        if restore > max(reuse, shared) and free:
            slot = free[0]
            cache = self._caches[slot]
            cache.restore(r.prefix, restore)
            r.stepwise = cache.offset == restore and len(ids) - restore <= STEPWISE_TAIL
        elif in_place is not None and reuse + MIN_SHARED > shared:
            slot, cache = in_place, self._caches[in_place]
            cache.trim(reuse)
        elif free and shared >= MIN_SHARED:
            slot = free[0]
            cache = self._caches[fork_from].fork(slot)
            cache.trim(shared)
            self._caches[slot] = cache
        elif in_place is not None:  # (every unpinned idle slot is a candidate, at worst 0)
            slot, cache = in_place, self._caches[in_place]
            cache.trim(reuse)
        else:
            return False
        self._owner[slot] = r
        r.cache = cache
        r.pending = ids[cache.offset :]  # (a rotating cache may have started over)
        self.model.prefilled_tokens += len(r.pending)
        return True

    def _end(self, r: Request, error: BaseException | None = None) -> None:
        """Take `r` out of the batch: its slot keeps what it cached; its caller gets the
        end of its events (or `error`)."""
        if r in self._running:
            self._running.remove(r)
        slot = r.cache.slot
        if r.forgotten:
            r.cache.reset()
        self._owner[slot] = None
        self._clock += 1
        self._last_used[slot] = self._clock
        self._kept = r.cache
        r.out.put(error if error is not None else _DONE)

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            for r in list(self._running):
                self._end(r, error)
            while self._waiting:
                self._waiting.popleft().out.put(error)
