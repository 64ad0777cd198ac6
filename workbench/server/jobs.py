"""The request gate and the engine jobs behind every route of the server.

A request gets a slot from `ServerState`'s gate: `max_concurrent` engine calls run at
once, requests beyond those wait in FIFO order in a queue of `max_queue`, and beyond
that get 429. Its engine call is a `Job`: `produce(put, cancelled)` runs on a thread of
its own, holds the slot from its start to its end and hands its items to the route
through an asyncio queue.

A job is cancelled by setting its `cancelled` flag, which it passes on as the engine's
`cancel=`; the engines look at it between tokens, decode steps, batches of texts and
audio windows, so the slot comes free at once. The flag is set when the client
disconnects (the job watches the connection from the moment the body is read: waiting
in the queue, while a non-streaming answer is computed or mid-stream), when the request
runs past `request_timeout` (the client gets 504) and, through `cancel_all`, when the
server stops (503).
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import Request

from workbench.engine.cancel import Cancelled
from workbench.engine.options import DEFAULTS
from workbench.engine.runtime.kv_cache import ContextFullError
from workbench.server import limits
from workbench.server.schemas import APIError
from workbench.signals import Signal

DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
JOB_DONE = object()  # the job's thread finished
_GONE = object()  # the client disconnected
_EXPIRED = object()  # the request ran past request_timeout


def check_api_key(api_key: str | None) -> None:
    """Raise ValueError for a key no client could send: HTTP headers carry ASCII."""
    if api_key is None:
        return
    if not isinstance(api_key, str) or not api_key or not api_key.isascii() \
            or not api_key.isprintable() or api_key != api_key.strip():
        raise ValueError("api_key must be a non-empty string of printable ASCII characters "
                         "without surrounding spaces (HTTP headers carry it as ASCII, so any "
                         "other key could never authenticate)")


class ServerState:
    """What the routes share: the engines, the gate, the limits and the live counters."""

    def __init__(self, engines: Mapping[str, Any], *, api_key: str | None, max_concurrent: int,
                 max_queue: int, max_body_bytes: int, max_tokens_limit: int | None,
                 request_timeout: float | None = limits.REQUEST_TIMEOUT,
                 body_timeout: float | None = limits.BODY_TIMEOUT,
                 max_audio_seconds: float | None = limits.MAX_AUDIO_SECONDS,
                 max_embedding_tokens: int | None = limits.MAX_EMBEDDING_TOKENS,
                 protect_docs: bool | None = None,
                 drafts: Mapping[str, Mapping[str, Any]] | None = None):
        if not engines:
            raise ValueError("serve at least one engine")
        for name in drafts or {}:
            if name not in engines or not callable(getattr(engines[name], "generate", None)):
                raise ValueError(f"a draft is given for {name!r}, which is not a served "
                                 "language model")
        if max_concurrent < 1 or max_queue < 0:
            raise ValueError("max_concurrent must be >= 1 and max_queue >= 0")
        check_api_key(api_key)
        if max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")
        for name, count in (("max_tokens_limit", max_tokens_limit),
                            ("max_embedding_tokens", max_embedding_tokens)):
            if count is not None and count < 1:
                raise ValueError(f"{name} must be >= 1 (or None for no limit)")
        for name, value in (("request_timeout", request_timeout),
                            ("body_timeout", body_timeout),
                            ("max_audio_seconds", max_audio_seconds)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 seconds (or None for no limit)")
        if protect_docs and api_key is None:
            raise ValueError("protect_docs puts the docs behind the api_key: set one")
        self.engines = dict(engines)
        # model id -> the speculative options its generations take (draft, draft_tokens)
        self.drafts = {name: dict(options) for name, options in (drafts or {}).items()}
        self.api_key = api_key
        self.protect_docs = api_key is not None if protect_docs is None else protect_docs
        self.max_concurrent, self.max_queue = max_concurrent, max_queue
        self.max_body_bytes = max_body_bytes
        self.max_tokens_limit = max_tokens_limit
        self.request_timeout = request_timeout
        self.body_timeout = body_timeout
        self.max_audio_seconds = max_audio_seconds
        self.max_embedding_tokens = max_embedding_tokens
        self.created = int(time.time())
        self.requests: Signal[int] = Signal(0, name="requests")  # HTTP requests answered
        self.running: Signal[int] = Signal(0, name="running")  # engine calls under way
        self.queued: Signal[int] = Signal(0, name="queued")  # waiting for a slot
        self._waiters: deque[asyncio.Future] = deque()
        self._jobs: set[Job] = set()
        self._jobs_lock = threading.Lock()

    # -- the API key -------------------------------------------------------------------------
    def needs_key(self, path: str) -> bool:
        """Whether `path` is behind the API key: `/v1/*`, and the docs with `protect_docs`."""
        return self.api_key is not None and (
            path.startswith("/v1/") or (self.protect_docs and path in DOCS_PATHS))

    def authorized(self, header: bytes) -> bool:
        """Whether an `Authorization` header value carries the API key (or none is set)."""
        if self.api_key is None:
            return True
        scheme, _, given = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(),
                                                                  self.api_key.encode())

    # -- the FIFO gate (used on the event loop's thread only) --------------------------------
    async def acquire(self, job: Job) -> None:
        """Take a slot, waiting in line; raises a 429 `APIError` when the line is full,
        `ClientGone` when `job`'s client leaves while it waits and a 504 `APIError` when
        its deadline passes."""
        if self.running.peek() < self.max_concurrent and not self._waiters:
            self.running.set(self.running.peek() + 1)
            return
        if len(self._waiters) >= self.max_queue:
            raise APIError(429, f"the server is busy: {self.max_concurrent} running and "
                           f"{len(self._waiters)} queued; retry later", type="requests",
                           code="rate_limit_exceeded", headers={"Retry-After": "1"})
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self.queued.set(len(self._waiters))
        try:
            interrupt = asyncio.ensure_future(job.interrupted.wait())
            try:
                await asyncio.wait({waiter, interrupt}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                interrupt.cancel()
            if not waiter.done():
                waiter.cancel()
                raise job.interruption()
            waiter.result()
        except BaseException:
            if waiter.done() and not waiter.cancelled():  # the slot came as we left
                self.release()
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise
        finally:
            self.queued.set(len(self._waiters))

    def release(self) -> None:
        """Give a slot to the first in line, or back to the pool."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on; `running` stays
                return
        self.running.set(self.running.peek() - 1)

    def cancel_all(self) -> None:
        """Stop every running engine call (the server is stopping)."""
        with self._jobs_lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.cancel()

    # -- engines ------------------------------------------------------------------------------
    def engine(self, model: str, method: str, route: str) -> Any:
        """The engine serving `model` that has `method` (alternatives joined by `|`);
        404 for an unknown model, 400 for one that cannot answer `route`."""
        engine = self.engines.get(model)
        if engine is None:
            raise APIError(404, f"the model {model!r} does not exist; this server has "
                           f"{', '.join(map(repr, self.engines))}", param="model",
                           code="model_not_found")
        if not any(hasattr(engine, m) for m in method.split("|")):
            raise APIError(400, f"the model {model!r} does not support {route}",
                           param="model", code="model_not_supported")
        return engine

    def limit_tokens(self, max_tokens: int | None) -> int | None:
        """`max_tokens` under the server's `max_tokens_limit`; None (the engine's default,
        `GenerationOptions.max_tokens`) stays None unless the limit is lower."""
        limit = self.max_tokens_limit
        if limit is None:
            return max_tokens
        if max_tokens is None:
            return limit if limit < DEFAULTS.max_tokens else None
        return min(max_tokens, limit)


class Job:
    """One request's engine call on a thread of its own, holding a gate slot from its
    start to its end.

    `produce(put, cancelled)` runs on the thread; it hands items to the route with
    `put` and passes `cancelled` (a `threading.Event`) on as the engine's `cancel=`.
    The flag is set when the client disconnects (a task waits for `http.disconnect` on
    the request's receive channel from the job's creation on), when the request runs
    past `request_timeout`, or when the server stops; the engine then raises
    `Cancelled`, which ends the thread quietly. Another exception reaches the route as
    an `APIError` (400 for a `ValueError` or `TypeError`: the request asked for
    something the engine refuses).
    """

    def __init__(self, state: ServerState, request: Request,
                 produce: Callable[[Callable, threading.Event], None]):
        self.state = state
        self.produce = produce
        self.loop = asyncio.get_running_loop()
        self.items: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.interrupted = asyncio.Event()  # the client left or the deadline passed
        self.expired = False
        self._watcher = self.loop.create_task(self._watch(request.receive))
        timeout = state.request_timeout
        self._timer = self.loop.call_later(timeout, self._expire) if timeout else None

    def start(self) -> None:
        """Start on a slot the caller has acquired (released when the thread ends)."""
        with self.state._jobs_lock:
            self.state._jobs.add(self)
        threading.Thread(target=self._run, name="workbench-serve-job", daemon=True).start()

    def cancel(self) -> None:
        """Set the engine call's cancel flag; the engine stops at its next look at it."""
        self.cancelled.set()

    def close(self) -> None:
        """Stop watching the client and the clock (the job has ended or never started)."""
        self._watcher.cancel()
        if self._timer is not None:
            self._timer.cancel()

    def interruption(self) -> BaseException:
        """What the route raises once `interrupted` is set."""
        if self.expired:
            return APIError(504, f"the request ran past the server's request_timeout of "
                            f"{self.state.request_timeout:g} s and was stopped; ask for less "
                            "(max_tokens, fewer inputs, shorter audio)", type="server_error",
                            code="timeout")
        return ClientGone()

    async def next(self) -> Any:
        """The next item; `JOB_DONE` at the end. Raises `ClientGone` once the client has
        left, a 504 `APIError` past the deadline, the engine's error as an `APIError`."""
        item = await self.items.get()
        if item is _GONE or item is _EXPIRED:
            raise self.interruption()
        if isinstance(item, BaseException):
            raise as_api_error(item)
        return item

    async def _watch(self, receive: Callable) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._interrupt(_GONE)

    def _expire(self) -> None:
        self.expired = True
        self._interrupt(_EXPIRED)

    def _interrupt(self, why: object) -> None:
        if self.interrupted.is_set():
            return
        self.cancelled.set()
        self.interrupted.set()
        self.items.put_nowait(why)  # wakes the route at once, even mid-call

    def _call_soon(self, fn: Callable, *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server has stopped
            pass

    def _run(self) -> None:
        try:
            self.produce(lambda item: self._call_soon(self.items.put_nowait, item),
                         self.cancelled)
            self._call_soon(self.items.put_nowait, JOB_DONE)
        except Cancelled:  # the route knows why unless the server is stopping
            self._call_soon(self.items.put_nowait, APIError(
                503, "the request was cancelled: the server is stopping",
                type="server_error"))
        except Exception as exc:  # noqa: BLE001 - reported to the route
            self._call_soon(self.items.put_nowait, exc)
        finally:
            self._call_soon(self._finished)

    def _finished(self) -> None:
        self.close()
        with self.state._jobs_lock:
            self.state._jobs.discard(self)
        self.state.release()


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def as_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextFullError):  # OpenAI's code for a prompt past the context
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, (ValueError, TypeError)):
        return APIError(400, str(exc) or type(exc).__name__)
    return APIError(500, f"{type(exc).__name__}: {exc}", type="server_error")


def engine_accepts(fn: Callable, name: str, *, by_name: bool = False) -> bool:
    """Whether `fn` takes the keyword `name` (engines are duck-typed: a `RemoteEngine`
    or a user's engine may not take `cancel=`); `by_name`: only where it names it, not
    through `**kwargs`."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or (not by_name
                              and any(p.kind is p.VAR_KEYWORD for p in params.values()))


async def start_job(state: ServerState, request: Request, produce) -> Job:
    """Wait for a slot (429 when the line is full) and start `produce` on it."""
    job = Job(state, request, produce)
    try:
        await state.acquire(job)
    except BaseException:
        job.close()
        raise
    try:
        job.start()
    except BaseException:
        job.close()
        state.release()
        raise
    return job
