"""`create_app`: the OpenAI-compatible FastAPI app over one or more engines.

Engines are duck-typed: whatever has `.chat` answers `/v1/chat/completions`,
`.generate` answers `/v1/completions`, `.embed_batch` or `.embed` answers
`/v1/embeddings` and `.transcribe` answers `/v1/audio/transcriptions` — an
`LLM`, an `Encoder`, a `WhisperModel`, or a `RemoteEngine`.

Every engine call runs on a thread of its own and holds one of
`max_concurrent` slots from its start to its end; requests beyond those wait
in FIFO order in a queue of `max_queue`, and beyond that get 429. Each request
watches its connection from the moment its body is read: a client that
disconnects (waiting in the queue, while a non-streaming answer is computed or
mid-stream) sets the engine call's cancel flag, which the engines look at
between tokens, decode steps, batches of texts and audio windows, so the slot
comes free at once. A request past `request_timeout` is cancelled the same way
and answered 504. Every error is OpenAI-shaped:
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import inspect
import itertools
import json
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Annotated, Any

import numpy as np
from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException

from workbench import __version__
from workbench.engine.cancel import Cancelled, check_cancel
from workbench.engine.llm import TokenEvent
from workbench.serve import limits
from workbench.serve.schemas import (
    MAX_CHOICES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
)
from workbench.signals import Signal

# texts per forward pass of an embedding request: the cancel flag is looked at between
# passes, and 8 texts of 256 tokens take a fraction of a second on a CPU
EMBED_BATCH = 8
ENGINE_MAX_TOKENS = 512  # what `LLM.generate` writes when a request leaves max_tokens out
DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
_DONE = object()  # the job's thread finished
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
                 protect_docs: bool | None = None):
        if not engines:
            raise ValueError("serve at least one engine")
        if max_concurrent < 1 or max_queue < 0:
            raise ValueError("max_concurrent must be >= 1 and max_queue >= 0")
        check_api_key(api_key)
        if max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")
        if max_tokens_limit is not None and max_tokens_limit < 1:
            raise ValueError("max_tokens_limit must be >= 1 (or None for no limit)")
        for name, value in (("request_timeout", request_timeout),
                            ("body_timeout", body_timeout),
                            ("max_audio_seconds", max_audio_seconds)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 seconds (or None for no limit)")
        if protect_docs and api_key is None:
            raise ValueError("protect_docs puts the docs behind the api_key: set one")
        self.engines = dict(engines)
        self.api_key = api_key
        self.protect_docs = api_key is not None if protect_docs is None else protect_docs
        self.max_concurrent, self.max_queue = max_concurrent, max_queue
        self.max_body_bytes = max_body_bytes
        self.max_tokens_limit = max_tokens_limit
        self.request_timeout = request_timeout
        self.body_timeout = body_timeout
        self.max_audio_seconds = max_audio_seconds
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
        `_ClientGone` when `job`'s client leaves while it waits and a 504 `APIError` when
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
        512 tokens for an `LLM`) stays None unless the limit is lower."""
        limit = self.max_tokens_limit
        if limit is None:
            return max_tokens
        if max_tokens is None:
            return limit if limit < ENGINE_MAX_TOKENS else None
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
        return _ClientGone()

    async def next(self) -> Any:
        """The next item; `_DONE` at the end. Raises `_ClientGone` once the client has
        left, a 504 `APIError` past the deadline, the engine's error as an `APIError`."""
        item = await self.items.get()
        if item is _GONE or item is _EXPIRED:
            raise self.interruption()
        if isinstance(item, BaseException):
            raise _api_error(item)
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
            self._call_soon(self.items.put_nowait, _DONE)
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


class _ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def _api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (ValueError, TypeError)):
        return APIError(400, str(exc) or type(exc).__name__)
    return APIError(500, f"{type(exc).__name__}: {exc}", type="server_error")


def _accepts(fn: Callable, name: str, *, by_name: bool = False) -> bool:
    """Whether `fn` takes the keyword `name` (engines are duck-typed: a `RemoteEngine`
    or a user's engine may not take `cancel=`); `by_name`: only where it names it, not
    through `**kwargs`."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or (not by_name
                              and any(p.kind is p.VAR_KEYWORD for p in params.values()))


async def _start(state: ServerState, request: Request, produce) -> Job:
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


def create_app(engines: Mapping[str, Any], *, api_key: str | None = None,
               max_concurrent: int = 1, max_queue: int = 64,
               max_body_bytes: int = limits.MAX_BODY_BYTES,
               max_tokens_limit: int | None = limits.MAX_TOKENS_LIMIT,
               request_timeout: float | None = limits.REQUEST_TIMEOUT,
               body_timeout: float | None = limits.BODY_TIMEOUT,
               max_audio_seconds: float | None = limits.MAX_AUDIO_SECONDS,
               protect_docs: bool | None = None) -> FastAPI:
    """The FastAPI app serving `engines` ({model id: engine}) with OpenAI's API.

    api_key: when set, `/v1/*` routes need `Authorization: Bearer <api_key>`
        (printable ASCII; anything else raises ValueError).
    protect_docs: put `/docs`, `/redoc` and `/openapi.json` behind the key too, and
        answer `/health` without the key with `{"status": "ok"}` only (the model ids
        and the load need the key). Default: on when `api_key` is set.
    max_concurrent: engine calls running at once; max_queue: requests waiting
        for one (more get 429).
    max_body_bytes: larger request bodies get 413 (the rest of the body is read and
        dropped by the HTTP layer, so the client reads the error).
    body_timeout: seconds a client has to send its whole body (else 408).
    max_tokens_limit: the most tokens one request may generate per choice (larger
        `max_tokens` are lowered to it; default 4096, the default context); None: no cap.
    request_timeout: seconds from a request's body to the end of its answer; past it
        the engine call is cancelled and the client gets a 504 error (or an error
        event in a stream). None: no deadline.
    max_audio_seconds: longer uploads to `/v1/audio/*` get 400 (default one hour).
    The state (gate, counters) is `app.state.workbench`.
    """
    state = ServerState(engines, api_key=api_key, max_concurrent=max_concurrent,
                        max_queue=max_queue, max_body_bytes=max_body_bytes,
                        max_tokens_limit=max_tokens_limit, request_timeout=request_timeout,
                        body_timeout=body_timeout, max_audio_seconds=max_audio_seconds,
                        protect_docs=protect_docs)
    app = FastAPI(title="workbench", version=__version__,
                  description="An OpenAI-compatible API over local workbench engines.")
    app.state.workbench = state
    _install_errors(app)
    app.add_middleware(_Gatekeeper, state=state)

    @app.get("/health")
    async def health(request: Request) -> dict:
        if state.protect_docs and not state.authorized(
                request.headers.get("authorization", "").encode("latin-1")):
            return {"status": "ok"}
        return {"status": "ok", "models": list(state.engines),
                "running": state.running.peek(), "queued": state.queued.peek()}

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [_model_card(state, m) for m in state.engines]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict:
        if model not in state.engines:
            raise APIError(404, f"the model {model!r} does not exist", param="model",
                           code="model_not_found")
        return _model_card(state, model)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        engine = state.engine(body.model, "chat", "chat completions")
        return await _chat(state, engine, body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        engine = state.engine(body.model, "generate", "text completions")
        return await _complete(state, engine, body, request)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        engine = state.engine(body.model, "embed_batch|embed", "embeddings")
        return await _embed(state, engine, body, request)

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(
        request: Request,
        file: Annotated[UploadFile, File(description="the audio file")],
        model: Annotated[str, Form()],
        language: Annotated[str | None, Form()] = None,
        prompt: Annotated[str | None, Form()] = None,
        response_format: Annotated[str, Form()] = "json",
        temperature: Annotated[float, Form()] = 0.0,
    ) -> Response:
        engine = state.engine(model, "transcribe", "audio transcriptions")
        return await _transcribe(state, engine, request, file, "transcribe", language, prompt,
                                 response_format, temperature)

    @app.post("/v1/audio/translations")
    async def translations(
        request: Request,
        file: Annotated[UploadFile, File(description="the audio file")],
        model: Annotated[str, Form()],
        prompt: Annotated[str | None, Form()] = None,
        response_format: Annotated[str, Form()] = "json",
        temperature: Annotated[float, Form()] = 0.0,
    ) -> Response:
        engine = state.engine(model, "transcribe", "audio translations")
        return await _transcribe(state, engine, request, file, "translate", None, prompt,
                                 response_format, temperature)

    return app


# -- plumbing ---------------------------------------------------------------------------------
def _install_errors(app: FastAPI) -> None:
    """Every error leaves as OpenAI's error JSON."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [p for p in first.get("loc", ()) if p not in ("body", "form")]
        param = str(loc[0]) if loc else None  # the request field (deeper parts name union
        # branches and list indices, not fields a client knows)
        if first.get("type") == "json_invalid":
            message, param = "the request body is not valid JSON", None
        elif first.get("type") == "missing":
            message = f"missing required parameter: {param!r}"
        else:
            message = f"invalid value for {param!r}: {first.get('msg', 'invalid')}"
        return JSONResponse(APIError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = {408: "request_timeout", 413: "request_too_large"}.get(exc.status_code)
        return JSONResponse(APIError(exc.status_code, str(exc.detail), type=kind,
                                     code=code).body(),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(_ClientGone)
    async def gone(request: Request, exc: _ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(_api_error(exc).body(), status_code=500)


class _Gatekeeper:
    """ASGI middleware, before any body is read: the API key (401) for `/v1/*` (and the
    docs with `protect_docs`); the body size (413, by Content-Length up front or while a
    body without one streams in) and the time to send it (408); the count of answered
    requests.

    A refused body is not read: the error goes out at once and the HTTP layer (uvicorn)
    drops the rest of the body as it arrives, so a client still sending reads the error
    when it is done instead of a reset connection."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = self.state
        try:
            headers = dict(scope["headers"])
            if state.needs_key(scope["path"]) \
                    and not state.authorized(headers.get(b"authorization", b"")):
                return await _send_error(send, APIError(
                    401, "incorrect or missing API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key"))
            limit = state.max_body_bytes
            too_large = APIError(413, f"the request body exceeds the server's limit of "
                                 f"{limit} bytes (max_body_bytes)", code="request_too_large")
            length = headers.get(b"content-length")
            if length is not None:
                if not length.isdigit():
                    return await _send_error(send, APIError(400, "bad Content-Length header"))
                if int(length) > limit:
                    return await _send_error(send, too_large)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + state.body_timeout if state.body_timeout else None
            received, complete = 0, False

            async def limited():
                nonlocal received, complete
                if complete:  # the body is in: what remains is the disconnect
                    return await receive()
                try:
                    if deadline is None:
                        message = await receive()
                    else:
                        message = await asyncio.wait_for(receive(), deadline - loop.time())
                except asyncio.TimeoutError:  # raised inside the route: FastAPI passes it on
                    raise HTTPException(408, f"the request body did not arrive within the "
                                        f"server's body_timeout of {state.body_timeout:g} s",
                                        headers={"Connection": "close"}) from None
                complete = message["type"] != "http.request" or not message.get("more_body")
                received += len(message.get("body", b""))
                if received > limit:
                    raise HTTPException(413, too_large.message)
                return message

            await self.app(scope, limited, send)
        finally:
            state.requests.set(state.requests.peek() + 1)


async def _send_error(send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _model_card(state: ServerState, model: str) -> dict:
    return {"id": model, "object": "model", "created": state.created, "owned_by": "workbench"}


def _chunk(meta: dict, kind: str, choices: list, include_usage: bool,
           usage: dict | None) -> str:
    """One streamed chunk's JSON; with `include_usage` every chunk carries `usage` (null
    until the last)."""
    data = {**meta, "object": kind, "choices": choices, "system_fingerprint": None}
    if include_usage:
        data["usage"] = usage
    return json.dumps(data, ensure_ascii=False)


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


# -- generation -------------------------------------------------------------------------------
def _run_choices(completions_for: Callable[[threading.Event], list[Any]]):
    """A `produce` for chat or text completions: start the engine's completions, then hand
    over ("ready", completions), one (index, event) per token, and ("end", index, finish
    reason, usage) per choice. A choice streams as it is generated; `n` choices of an
    engine with a batch path arrive already finished. Raises `Cancelled` once `cancelled`
    is set (checked after every token)."""

    def produce(put, cancelled: threading.Event) -> None:
        completions = completions_for(cancelled)
        put(("ready", len(completions)))
        for i, completion in enumerate(completions):
            echo = getattr(completion, "prompt_text", "")
            if echo:  # the prompt, in front of the output (completions' `echo`)
                put((i, TokenEvent(None, echo, "")))
            try:
                for event in completion.iter_events():
                    check_cancel(cancelled)
                    put((i, event))
            finally:
                completion.close()
            put(("end", i, completion.finish_reason, completion.usage))

    return produce


def _choices(engine: Any, method: str, batch_method: str, inputs: list[Any], n: int,
             options: dict) -> Callable[[threading.Event], list[Any]]:
    """Start `n` completions of each input: the engine's batch method when it has one
    (seed s gives choice i the seed s + i, as the batch does; `cancel=` stops it between
    decode steps), else one call each (a single one gets `cancel=` where it names it,
    which also stops its prefill between chunks)."""

    def start(cancelled: threading.Event) -> list[Any]:
        if len(inputs) * n == 1:
            call = getattr(engine, method)
            extra = {"cancel": cancelled} if _accepts(call, "cancel", by_name=True) else {}
            return [call(inputs[0], **options, **extra)]
        repeated = [x for x in inputs for _ in range(n)]
        if hasattr(engine, batch_method):
            batch = getattr(engine, batch_method)
            extra = {"cancel": cancelled} if _accepts(batch, "cancel") else {}
            return batch(repeated, **options, **extra)
        seed = options.pop("seed", None)
        completions = []
        for i, x in enumerate(repeated):
            check_cancel(cancelled)
            completions.append(getattr(engine, method)(
                x, seed=None if seed is None else seed + i, **options))
        return completions

    return start


def _token_bytes(engine: Any, event: Any) -> list[int]:
    tok = getattr(engine, "tokenizer", None)
    if event.id is not None and event.id >= 0 and hasattr(tok, "token_bytes"):
        return list(tok.token_bytes(event.id))
    return list(event.piece.encode())


def _alt_bytes(engine: Any, alt: Any) -> list[int]:
    tok = getattr(engine, "tokenizer", None)
    if alt.id is not None and alt.id >= 0 and hasattr(tok, "token_bytes"):
        return list(tok.token_bytes(alt.id))
    return list(alt.text.encode())


def _chat_logprob(engine: Any, event: Any) -> dict:
    """One token of a chat completion's `logprobs.content`."""
    return {"token": event.piece, "logprob": event.logprob, "bytes": _token_bytes(engine, event),
            "top_logprobs": [{"token": a.text, "logprob": a.logprob,
                              "bytes": _alt_bytes(engine, a)} for a in event.top or ()]}


async def _chat(state: ServerState, engine: Any, body: ChatCompletionRequest,
                request: Request) -> Response:
    if body.tools:
        raise APIError(400, "tools (function calling) are not supported by this server",
                       param="tools", code="unsupported_parameter")
    messages = [m.as_dict() for m in body.messages]
    options = body.sampling()
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    max_tokens = state.limit_tokens(max_tokens)
    if max_tokens is not None:
        options["max_tokens"] = max_tokens
    if body.logprobs:
        options["logprobs"] = body.top_logprobs or 0
    elif body.top_logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        if "grammar" in options:
            raise APIError(400, "pass either grammar or response_format, not both",
                           param="response_format")
        if fmt.type == "json_object":
            options["schema"] = {"type": "object"}
        else:
            if fmt.json_schema is None:
                raise APIError(400, "response_format json_schema needs a json_schema",
                               param="response_format.json_schema")
            options["schema"] = fmt.json_schema.schema_
            from workbench.engine.llm import with_schema_instruction

            messages = with_schema_instruction(messages, fmt.json_schema.schema_)
    start = _choices(engine, "chat", "chat_batch", [messages], body.n, options)
    job = await _start(state, request, _run_choices(start))
    meta = {"id": _id("chatcmpl"), "created": int(time.time()), "model": body.model}
    first = await job.next()  # the engine accepted the request (or not)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    if body.stream:
        return EventSourceResponse(_chat_stream(engine, job, meta, body.n, include_usage),
                                   ping=15)
    return await _chat_response(engine, job, meta, first[1], body.logprobs)


async def _chat_response(engine: Any, job: Job, meta: dict, n: int, logprobs: bool
                         ) -> Response:
    texts = [[] for _ in range(n)]
    tokens = [[] for _ in range(n)]
    reasons, usages = ["stop"] * n, [None] * n
    while (item := await job.next()) is not _DONE:
        if item[0] == "end":
            _, i, reasons[i], usages[i] = item
        else:
            i, event = item
            texts[i].append(event.text)
            if logprobs and event.logprob is not None:
                tokens[i].append(_chat_logprob(engine, event))
    choices = [{"index": i, "message": {"role": "assistant", "content": "".join(texts[i]),
                                        "refusal": None},
                "logprobs": {"content": tokens[i], "refusal": None} if logprobs else None,
                "finish_reason": reasons[i]} for i in range(n)]
    prompt = usages[0].prompt_tokens if usages[0] else 0
    generated = sum(u.completion_tokens for u in usages if u)
    return JSONResponse({**meta, "object": "chat.completion", "choices": choices,
                         "usage": _usage(prompt, generated), "system_fingerprint": None})


async def _chat_stream(engine: Any, job: Job, meta: dict, n: int, include_usage: bool
                       ) -> AsyncIterator[str]:
    def chunk(choices: list, usage: dict | None = None) -> str:
        return _chunk(meta, "chat.completion.chunk", choices, include_usage, usage)

    prompt = generated = 0
    try:
        for i in range(n):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
        while (item := await job.next()) is not _DONE:
            if item[0] == "end":
                _, i, reason, usage = item
                prompt = usage.prompt_tokens
                generated += usage.completion_tokens
                yield chunk([{"index": i, "delta": {}, "logprobs": None,
                              "finish_reason": reason}])
                continue
            i, event = item
            lp = None
            if event.logprob is not None:
                lp = {"content": [_chat_logprob(engine, event)], "refusal": None}
            if event.text or lp:
                yield chunk([{"index": i, "delta": {"content": event.text}, "logprobs": lp,
                              "finish_reason": None}])
        if include_usage:
            yield chunk([], _usage(prompt, generated))
        yield "[DONE]"
    except APIError as exc:  # the headers are out: report it in the stream, as OpenAI does
        yield json.dumps(exc.body())
    except _ClientGone:
        return
    finally:
        job.cancel()  # the client went away (or we are done): stop generating


async def _complete(state: ServerState, engine: Any, body: CompletionRequest,
                    request: Request) -> Response:
    if body.suffix:
        raise APIError(400, "suffix (insertion) is not supported", param="suffix",
                       code="unsupported_parameter")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of other than n is not supported", param="best_of",
                       code="unsupported_parameter")
    if body.echo and body.logprobs is not None:
        raise APIError(400, "logprobs of echoed prompt tokens are not supported; drop echo "
                       "or logprobs", param="echo", code="unsupported_parameter")
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if len(prompts) * body.n > MAX_CHOICES:
        raise APIError(400, f"at most {MAX_CHOICES} choices per request (prompts times n)",
                       param="n")
    options = body.sampling()
    max_tokens = state.limit_tokens(body.max_tokens)
    if max_tokens is not None:
        options["max_tokens"] = max_tokens
    if body.logprobs is not None:
        options["logprobs"] = body.logprobs
    if body.echo:
        options["include_prompt"] = True
    start = _choices(engine, "generate", "generate_batch", prompts, body.n, options)
    job = await _start(state, request, _run_choices(start))
    meta = {"id": _id("cmpl"), "created": int(time.time()), "model": body.model}
    ready = await job.next()
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventSourceResponse(_text_stream(job, meta, include_usage),
                                   ping=15)
    return await _text_response(job, meta, ready[1], body.logprobs is not None)


def _legacy_logprobs(events: list[Any], offset: int) -> dict:
    """Completions' old logprobs form: parallel lists, text offsets from `offset`."""
    tokens, lps, tops, offsets = [], [], [], []
    for event in events:
        tokens.append(event.piece)
        lps.append(event.logprob)
        tops.append({a.text: a.logprob for a in event.top or ()})
        offsets.append(offset)
        offset += len(event.piece)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}


async def _text_response(job: Job, meta: dict, n: int, logprobs: bool) -> Response:
    texts = [[] for _ in range(n)]
    events = [[] for _ in range(n)]
    reasons, usages = ["stop"] * n, [None] * n
    while (item := await job.next()) is not _DONE:
        if item[0] == "end":
            _, i, reasons[i], usages[i] = item
        else:
            i, event = item
            texts[i].append(event.text)
            if event.id is not None and event.logprob is not None:
                events[i].append(event)
    choices = []
    for i in range(n):
        choices.append({"index": i, "text": "".join(texts[i]),
                        "logprobs": _legacy_logprobs(events[i], 0) if logprobs else None,
                        "finish_reason": reasons[i]})
    prompt = sum(u.prompt_tokens for u in usages if u)
    generated = sum(u.completion_tokens for u in usages if u)
    return JSONResponse({**meta, "object": "text_completion", "choices": choices,
                         "usage": _usage(prompt, generated), "system_fingerprint": None})


async def _text_stream(job: Job, meta: dict, include_usage: bool) -> AsyncIterator[str]:
    def chunk(choices: list, usage: dict | None = None) -> str:
        return _chunk(meta, "text_completion", choices, include_usage, usage)

    prompt = generated = 0
    offsets: dict[int, int] = {}
    try:
        while (item := await job.next()) is not _DONE:
            if item[0] == "end":
                _, i, reason, usage = item
                prompt += usage.prompt_tokens
                generated += usage.completion_tokens
                yield chunk([{"index": i, "text": "", "logprobs": None,
                              "finish_reason": reason}])
                continue
            i, event = item
            lp = None
            if event.id is not None and event.logprob is not None:
                lp = _legacy_logprobs([event], offsets.get(i, 0))
            offsets[i] = offsets.get(i, 0) + len(event.text)
            if event.text or lp:
                yield chunk([{"index": i, "text": event.text, "logprobs": lp,
                              "finish_reason": None}])
        if include_usage:
            yield chunk([], _usage(prompt, generated))
        yield "[DONE]"
    except APIError as exc:
        yield json.dumps(exc.body())
    except _ClientGone:
        return
    finally:
        job.cancel()


# -- embeddings and audio ---------------------------------------------------------------------
async def _embed(state: ServerState, engine: Any, body: EmbeddingRequest,
                 request: Request) -> Response:
    texts = [body.input] if isinstance(body.input, str) else list(body.input)
    if any(not isinstance(t, str) for t in texts):
        raise APIError(400, "token-id input is not supported: send text (with LangChain's "
                       "OpenAIEmbeddings, set check_embedding_ctx_length=False)",
                       param="input", code="unsupported_parameter")
    if any(not t for t in texts):
        raise APIError(400, "input texts must not be empty", param="input")

    def produce(put, cancelled) -> None:
        batch = getattr(engine, "embed_batch", None)
        if batch is not None and _accepts(batch, "cancel", by_name=True):
            vectors = np.asarray(batch(texts, batch_size=EMBED_BATCH, cancel=cancelled),
                                 dtype=np.float32)
        elif batch is not None:  # (a RemoteEngine: its server batches)
            vectors = np.asarray(batch(texts), dtype=np.float32)
        else:  # one text at a time, to look at the flag in between
            rows = []
            for text in texts:
                check_cancel(cancelled)
                rows.append(np.asarray(engine.embed(text), np.float32))
            vectors = np.stack(rows)
        n_tokens = 0
        if hasattr(engine, "tokenize"):
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # truncation was already reported
                n_tokens = sum(len(engine.tokenize(t)) for t in texts)
        put((vectors, n_tokens))

    job = await _start(state, request, produce)
    vectors, n_tokens = await job.next()
    if body.dimensions is not None and body.dimensions != vectors.shape[1]:
        raise APIError(400, f"this model's embeddings have {vectors.shape[1]} dimensions; "
                       "it cannot shorten them", param="dimensions")
    data = []
    for i, v in enumerate(vectors):
        if body.encoding_format == "base64":
            value: Any = base64.b64encode(v.astype("<f4").tobytes()).decode()
        else:
            value = v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": value})
    return JSONResponse({"object": "list", "data": data, "model": body.model,
                         "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})


TRANSCRIPT_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")


async def _transcribe(state: ServerState, engine: Any, request: Request, file: UploadFile,
                      task: str, language: str | None, prompt: str | None,
                      response_format: str, temperature: float) -> Response:
    if response_format not in TRANSCRIPT_FORMATS:
        raise APIError(400, f"response_format must be one of {', '.join(TRANSCRIPT_FORMATS)}",
                       param="response_format")
    if prompt:
        raise APIError(400, "prompt (initial prompt) is not supported", param="prompt",
                       code="unsupported_parameter")
    if temperature != 0:
        raise APIError(400, "only temperature 0 (greedy decoding) is supported",
                       param="temperature", code="unsupported_parameter")
    data = await file.read()
    if not data:
        raise APIError(400, "the uploaded file is empty", param="file")
    options: dict[str, Any] = {"task": task, "timestamps": response_format != "json"
                               and response_format != "text"}
    if language:
        options["language"] = language

    def produce(put, cancelled) -> None:
        # the engine decodes the upload itself, refusing non-audio and audio longer than
        # max_seconds (AudioError, a ValueError: 400) before decoding it all
        transcribe = engine.transcribe
        if _accepts(transcribe, "max_seconds") and state.max_audio_seconds is not None:
            options["max_seconds"] = state.max_audio_seconds
        if _accepts(transcribe, "cancel"):
            options["cancel"] = cancelled
        put(transcribe(data, **options))

    job = await _start(state, request, produce)
    transcript = await job.next()
    text = str(transcript)
    segments = list(getattr(transcript, "segments", []))
    duration = getattr(transcript, "duration", 0.0) or (segments[-1].end if segments else 0.0)
    if response_format == "json":
        return JSONResponse({"text": text})
    if response_format == "text":
        return PlainTextResponse(text + "\n")
    if response_format == "verbose_json":
        return JSONResponse({
            "task": task, "language": getattr(transcript, "language", language or ""),
            "duration": duration, "text": text,
            "segments": [{"id": i, "seek": 0, "start": s.start, "end": s.end, "text": s.text,
                          "tokens": list(s.tokens), "temperature": 0.0}
                         for i, s in enumerate(segments)]})
    return PlainTextResponse(_subtitles(segments, response_format),
                             media_type="text/vtt" if response_format == "vtt"
                             else "application/x-subrip")


def _subtitles(segments: list[Any], kind: str) -> str:
    """SubRip or WebVTT text of timed segments."""

    def stamp(t: float) -> str:
        ms = int(round(t * 1000))
        h, ms = divmod(ms, 3_600_000)
        m, ms = divmod(ms, 60_000)
        s, ms = divmod(ms, 1000)
        return f"{h:02d}:{m:02d}:{s:02d}{',' if kind == 'srt' else '.'}{ms:03d}"

    blocks = ["WEBVTT\n"] if kind == "vtt" else []
    for i, seg in zip(itertools.count(1), segments):
        head = f"{i}\n" if kind == "srt" else ""
        blocks.append(f"{head}{stamp(seg.start)} --> {stamp(seg.end)}\n{seg.text.strip()}\n")
    return "\n".join(blocks)
