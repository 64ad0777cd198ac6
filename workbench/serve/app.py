"""`create_app`: the OpenAI-compatible FastAPI app over one or more engines.

Engines are duck-typed: whatever has `.chat` answers `/v1/chat/completions`,
`.generate` answers `/v1/completions`, `.embed_batch` or `.embed` answers
`/v1/embeddings` and `.transcribe` answers `/v1/audio/transcriptions` — an
`LLM`, an `Encoder`, a `WhisperModel`, or a `RemoteEngine`.

Every engine call runs on a thread of its own and holds one of
`max_concurrent` slots from its start to its end; requests beyond those wait
in FIFO order in a queue of `max_queue`, and beyond that get 429. A client
that disconnects (or a stream that is dropped) stops its generation after the
current token and frees the slot. Every error is OpenAI-shaped:
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
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
from workbench.engine.llm import TokenEvent
from workbench.serve.schemas import (
    MAX_CHOICES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
)
from workbench.signals import Signal

DEFAULT_MAX_BODY = 25 * 1024 * 1024  # bytes; OpenAI's limit for audio uploads
DRAIN_FACTOR = 4  # a refused body up to this many times the limit is read before the 413
_DONE = object()


class ServerState:
    """What the routes share: the engines, the gate, the limits and the live counters."""

    def __init__(self, engines: Mapping[str, Any], *, api_key: str | None, max_concurrent: int,
                 max_queue: int, max_body_bytes: int, max_tokens_limit: int | None):
        if not engines:
            raise ValueError("serve at least one engine")
        if max_concurrent < 1 or max_queue < 0:
            raise ValueError("max_concurrent must be >= 1 and max_queue >= 0")
        self.engines = dict(engines)
        self.api_key = api_key
        self.max_concurrent, self.max_queue = max_concurrent, max_queue
        self.max_body_bytes = max_body_bytes
        self.max_tokens_limit = max_tokens_limit
        self.created = int(time.time())
        self.requests: Signal[int] = Signal(0, name="requests")  # HTTP requests answered
        self.running: Signal[int] = Signal(0, name="running")  # engine calls under way
        self.queued: Signal[int] = Signal(0, name="queued")  # waiting for a slot
        self._waiters: deque[asyncio.Future] = deque()
        self._jobs: set[Job] = set()
        self._jobs_lock = threading.Lock()

    # -- the FIFO gate (used on the event loop's thread only) --------------------------------
    async def acquire(self, request: Request | None = None) -> None:
        """Take a slot, waiting in line; raises a 429 `APIError` when the line is full, and
        `_ClientGone` when `request`'s client leaves while it waits."""
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
            while not waiter.done():
                await asyncio.wait({waiter}, timeout=0.5)
                if not waiter.done() and request is not None \
                        and await request.is_disconnected():
                    waiter.cancel()
                    raise _ClientGone()
            waiter.result()
        except (asyncio.CancelledError, _ClientGone):
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
        """`max_tokens` (None: the engine's default) under the server's `max_tokens_limit`."""
        limit = self.max_tokens_limit
        if limit is None or max_tokens is None:
            return max_tokens if limit is None else limit
        return min(max_tokens, limit)


class Job:
    """One engine call on a thread of its own, holding a gate slot until it returns.

    `produce(put, cancelled)` runs on the thread; it hands items to the route
    with `put` and should stop soon after `cancelled` is set. An exception it
    raises reaches the route as an `APIError` (400 for a `ValueError` or
    `TypeError`: the request asked for something the engine refuses).
    """

    def __init__(self, state: ServerState, produce: Callable[[Callable, threading.Event], None]):
        self.state = state
        self.produce = produce
        self.loop = asyncio.get_running_loop()
        self.items: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()

    def start(self) -> None:
        """Start on a slot the caller has acquired (released when the thread ends)."""
        with self.state._jobs_lock:
            self.state._jobs.add(self)
        threading.Thread(target=self._run, name="workbench-serve-job", daemon=True).start()

    def cancel(self) -> None:
        self.cancelled.set()

    async def next(self) -> Any:
        """The next item; `_DONE` at the end."""
        item = await self.items.get()
        if isinstance(item, BaseException):
            raise _api_error(item)
        return item

    async def next_or_disconnect(self, request: Request) -> Any:
        """`next`, cancelling the job if the client goes away while it waits."""
        while True:
            try:
                return await asyncio.wait_for(self.next(), 0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.cancel()
                    raise _ClientGone() from None

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
        except Exception as exc:  # noqa: BLE001 - reported to the route
            self._call_soon(self.items.put_nowait, exc)
        finally:
            self._call_soon(self._finished)

    def _finished(self) -> None:
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


async def _start(state: ServerState, request: Request, produce) -> Job:
    """Wait for a slot (429 when the line is full) and start `produce` on it."""
    await state.acquire(request)
    job = Job(state, produce)
    try:
        job.start()
    except BaseException:
        state.release()
        raise
    return job


def create_app(engines: Mapping[str, Any], *, api_key: str | None = None,
               max_concurrent: int = 1, max_queue: int = 64,
               max_body_bytes: int = DEFAULT_MAX_BODY,
               max_tokens_limit: int | None = None) -> FastAPI:
    """The FastAPI app serving `engines` ({model id: engine}) with OpenAI's API.

    api_key: when set, `/v1/*` routes need `Authorization: Bearer <api_key>`.
    max_concurrent: engine calls running at once; max_queue: requests waiting
    for one (more get 429). max_body_bytes: larger request bodies get 413.
    max_tokens_limit: the most tokens one request may generate (per choice).
    The state (gate, counters) is `app.state.workbench`.
    """
    state = ServerState(engines, api_key=api_key, max_concurrent=max_concurrent,
                        max_queue=max_queue, max_body_bytes=max_body_bytes,
                        max_tokens_limit=max_tokens_limit)
    app = FastAPI(title="workbench", version=__version__,
                  description="An OpenAI-compatible API over local workbench engines.")
    app.state.workbench = state
    _install_errors(app)
    app.add_middleware(_Gatekeeper, state=state)

    @app.get("/health")
    async def health() -> dict:
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
        return JSONResponse(APIError(exc.status_code, str(exc.detail), type=kind).body(),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(_ClientGone)
    async def gone(request: Request, exc: _ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(_api_error(exc).body(), status_code=500)


class _Gatekeeper:
    """ASGI middleware, before any body is read: the API key for `/v1/*` (401), the body
    size (413, by Content-Length up front or while a body without one streams in); and
    the count of answered requests."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            headers = dict(scope["headers"])
            if not self._authorized(scope["path"], headers.get(b"authorization", b"")):
                return await _send_error(send, APIError(
                    401, "incorrect or missing API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key"))
            limit = self.state.max_body_bytes
            too_large = APIError(413, f"the request body exceeds {limit} bytes",
                                 code="request_too_large")
            length = headers.get(b"content-length")
            if length is not None:
                if not length.isdigit():
                    return await _send_error(send, APIError(400, "bad Content-Length header"))
                if int(length) > limit:
                    if int(length) <= DRAIN_FACTOR * limit:
                        await _drain(receive, DRAIN_FACTOR * limit)
                    return await _send_error(send, too_large)
            received = 0

            async def limited():
                nonlocal received
                message = await receive()
                received += len(message.get("body", b""))
                if received > limit:  # raised inside the route: FastAPI passes it through
                    if message.get("more_body"):
                        await _drain(receive, DRAIN_FACTOR * limit - received)
                    raise HTTPException(413, too_large.message)
                return message

            await self.app(scope, limited, send)
        finally:
            self.state.requests.set(self.state.requests.peek() + 1)

    def _authorized(self, path: str, header: bytes) -> bool:
        key = self.state.api_key
        if key is None or not path.startswith("/v1/"):
            return True
        scheme, _, given = header.decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                                  key.encode())


async def _drain(receive, most: int) -> None:
    """Read and drop the rest of a refused request body (up to `most` bytes), so that a
    client still sending it reads the error instead of a broken connection."""
    while most > 0:
        message = await receive()
        most -= len(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body"):
            return


async def _send_error(send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
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
def _run_choices(completions_for: Callable[[], list[Any]]):
    """A `produce` for chat or text completions: start the engine's completions, then hand
    over ("ready", completions), one (index, event) per token, and ("end", index, finish
    reason, usage) per choice. A choice streams as it is generated; `n` choices of an
    engine with a batch path arrive already finished."""

    def produce(put, cancelled: threading.Event) -> None:
        completions = completions_for()
        put(("ready", len(completions)))
        for i, completion in enumerate(completions):
            echo = getattr(completion, "prompt_text", "")
            if echo:  # the prompt, in front of the output (completions' `echo`)
                put((i, TokenEvent(None, echo, "")))
            for event in completion.iter_events():
                if cancelled.is_set():
                    break
                put((i, event))
            completion.close()
            put(("end", i, completion.finish_reason, completion.usage))
            if cancelled.is_set():
                return

    return produce


def _choices(engine: Any, method: str, batch_method: str, inputs: list[Any], n: int,
             options: dict) -> Callable[[], list[Any]]:
    """Start `n` completions of each input: the engine's batch method when it has one
    (seed s gives choice i the seed s + i, as the batch does), else one call each."""

    def start() -> list[Any]:
        if len(inputs) * n == 1:
            return [getattr(engine, method)(inputs[0], **options)]
        repeated = [x for x in inputs for _ in range(n)]
        if hasattr(engine, batch_method):
            return getattr(engine, batch_method)(repeated, **options)
        seed = options.pop("seed", None)
        return [getattr(engine, method)(x, seed=None if seed is None else seed + i, **options)
                for i, x in enumerate(repeated)]

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
    first = await job.next_or_disconnect(request)  # the engine accepted the request (or not)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    if body.stream:
        return EventSourceResponse(_chat_stream(engine, job, meta, body.n, include_usage),
                                   ping=15)
    return await _chat_response(engine, job, request, meta, first[1], body.logprobs)


async def _chat_response(engine: Any, job: Job, request: Request, meta: dict, n: int,
                         logprobs: bool) -> Response:
    texts = [[] for _ in range(n)]
    tokens = [[] for _ in range(n)]
    reasons, usages = ["stop"] * n, [None] * n
    while (item := await job.next_or_disconnect(request)) is not _DONE:
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
    ready = await job.next_or_disconnect(request)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventSourceResponse(_text_stream(job, meta, include_usage),
                                   ping=15)
    return await _text_response(job, request, meta, ready[1], body.logprobs is not None)


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


async def _text_response(job: Job, request: Request, meta: dict, n: int,
                         logprobs: bool) -> Response:
    texts = [[] for _ in range(n)]
    events = [[] for _ in range(n)]
    reasons, usages = ["stop"] * n, [None] * n
    while (item := await job.next_or_disconnect(request)) is not _DONE:
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
        if hasattr(engine, "embed_batch"):
            vectors = np.asarray(engine.embed_batch(texts), dtype=np.float32)
        else:
            vectors = np.stack([np.asarray(engine.embed(t), np.float32) for t in texts])
        n_tokens = 0
        if hasattr(engine, "tokenize"):
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # truncation was already reported
                n_tokens = sum(len(engine.tokenize(t)) for t in texts)
        put((vectors, n_tokens))

    job = await _start(state, request, produce)
    vectors, n_tokens = await job.next_or_disconnect(request)
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
        from workbench.engine.audio import SAMPLE_RATE, load_audio

        pcm = load_audio(data)  # raises AudioError (a ValueError: 400) for non-audio
        transcript = engine.transcribe(pcm, **options)
        put((transcript, len(pcm) / SAMPLE_RATE))

    job = await _start(state, request, produce)
    transcript, duration = await job.next_or_disconnect(request)
    text = str(transcript)
    segments = list(getattr(transcript, "segments", []))
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
