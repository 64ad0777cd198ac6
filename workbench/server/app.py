"""`create_app`: the OpenAI-compatible FastAPI app over one or more engines.

Engines are duck-typed: whatever has `.chat` answers `/v1/chat/completions`,
`.generate` answers `/v1/completions`, `.embed_batch` or `.embed` answers
`/v1/embeddings` and `.transcribe` answers `/v1/audio/transcriptions` — an
`LLM`, an `Encoder`, a `WhisperModel`, or a `RemoteEngine`.

This module holds the routes, the error handlers (every error is OpenAI-shaped:
`{"error": {"message", "type", "param", "code"}}`) and the embedding and audio
answers. The gate and the cancellable engine jobs are in `jobs`, the checks made
before a body is read in `gatekeeper`, chat and text completions in `generation`.
"""

from __future__ import annotations

import base64
import itertools
from collections.abc import Collection, Mapping, Sequence
from typing import Annotated, Any

import numpy as np
from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from workbench.engine.cancel import check_cancel
from workbench.engine.results import TooManyTokensError
from workbench.server import limits
from workbench.server.gatekeeper import Gatekeeper
from workbench.server.generation import answer_chat, answer_completion
from workbench.server.jobs import ClientGone, ServerState, as_api_error, engine_accepts, start_job
from workbench.server.schemas import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
)
from workbench.version import __version__

# texts per forward pass of an embedding request: the cancel flag is looked at between
# passes, and 8 texts of 256 tokens take a fraction of a second on a CPU
EMBED_BATCH = 8


def create_app(engines: Mapping[str, Any], *, api_key: str | None = None,
               max_concurrent: int = limits.MAX_CONCURRENT, max_queue: int = 64,
               max_body_bytes: int = limits.MAX_BODY_BYTES,
               max_tokens_limit: int | None = limits.MAX_TOKENS_LIMIT,
               request_timeout: float | None = limits.REQUEST_TIMEOUT,
               body_timeout: float | None = limits.BODY_TIMEOUT,
               max_audio_seconds: float | None = limits.MAX_AUDIO_SECONDS,
               max_embedding_tokens: int | None = limits.MAX_EMBEDDING_TOKENS,
               protect_docs: bool | None = None, cors_origins: Sequence[str] = (),
               allowed_hosts: Collection[str] | None = None,
               drafts: Mapping[str, Mapping[str, Any]] | None = None) -> FastAPI:
    """The FastAPI app serving `engines` ({model id: engine}) with OpenAI's API.

    api_key: when set, `/v1/*` routes need `Authorization: Bearer <api_key>`
        (printable ASCII; anything else raises ValueError).
    protect_docs: put `/docs`, `/redoc` and `/openapi.json` behind the key too, and
        answer `/health` without the key with `{"status": "ok"}` only (the model ids
        and the load need the key). Default: on when `api_key` is set.
    max_concurrent: engine calls running at once (default 8: an `LLM` decodes them
        together in one batch); max_queue: requests waiting for one (more get 429).
    max_body_bytes: larger request bodies get 413 (the rest of the body is read and
        dropped by the HTTP layer, so the client reads the error).
    body_timeout: seconds a client has to send its whole body (else 408).
    max_tokens_limit: the most tokens one request may generate per choice (larger
        `max_tokens` are lowered to it; default 4096, the default context); None: no cap.
    request_timeout: seconds from a request's body to the end of its answer; past it
        the engine call is cancelled and the client gets a 504 error (or an error
        event in a stream). None: no deadline.
    max_audio_seconds: longer uploads to `/v1/audio/*` get 400 (default one hour).
    max_embedding_tokens: the most tokens one `/v1/embeddings` request may hold, its
        texts counted as the model cuts them (default 300,000, OpenAI's limit); more
        gets 400 (`max_tokens_per_request`) before any forward pass. None: no limit.
    cors_origins: the web origins whose pages may call the API from a browser
        ("http://localhost:3000", or "*" for any); none by default, so a web page the
        user visits cannot drive the models: a browser's request from another origin
        gets 403, a form or an upload as much as JSON. Preflight requests are answered
        before the key is checked (browsers send them without it).
    allowed_hosts: where not None, a request whose `Host` header is neither a loopback
        name nor one of these gets 403 (`serve` passes `gatekeeper.allowed_hosts_for`
        its listening address: loopback names only on loopback); None: any host.
    drafts: {model id: {"draft": a draft LLM or "ngram", "draft_tokens": k}}: that
        model's chat and text completions decode speculatively (not those with a
        `response_format` or `grammar`, which speculation does not support).
    The state (gate, counters) is `app.state.workbench`.
    """
    state = ServerState(engines, api_key=api_key, max_concurrent=max_concurrent,
                        max_queue=max_queue, max_body_bytes=max_body_bytes,
                        max_tokens_limit=max_tokens_limit, request_timeout=request_timeout,
                        body_timeout=body_timeout, max_audio_seconds=max_audio_seconds,
                        max_embedding_tokens=max_embedding_tokens, protect_docs=protect_docs,
                        drafts=drafts)
    app = FastAPI(title="workbench", version=__version__,
                  description="An OpenAI-compatible API over local workbench engines.")
    app.state.workbench = state
    _install_errors(app)
    app.add_middleware(Gatekeeper, state=state, cors_origins=cors_origins,
                       allowed_hosts=allowed_hosts)
    if cors_origins:  # added last, so it runs first: preflights never meet the gate
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins),
                           allow_methods=["GET", "POST"], allow_headers=["*"])

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
        return await answer_chat(state, engine, body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        engine = state.engine(body.model, "generate", "text completions")
        return await answer_completion(state, engine, body, request)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        engine = state.engine(body.model, "embed_batch|embed", "embeddings")
        return await _embed(state, engine, body, request)

    for path, task, what in (("/v1/audio/transcriptions", "transcribe", "audio transcriptions"),
                             ("/v1/audio/translations", "translate", "audio translations")):
        app.post(path)(_audio_route(state, task, what))

    return app


def _audio_route(state: ServerState, task: str, what: str):
    """The endpoint of one audio route: OpenAI's multipart form, answered by `_transcribe`
    (a translation has no source `language` to set: it is ignored there)."""

    async def endpoint(
        request: Request,
        file: Annotated[UploadFile, File(description="the audio file")],
        model: Annotated[str, Form()],
        language: Annotated[str | None, Form()] = None,
        prompt: Annotated[str | None, Form()] = None,
        response_format: Annotated[str, Form()] = "json",
        temperature: Annotated[float, Form()] = 0.0,
    ) -> Response:
        engine = state.engine(model, "transcribe", what)
        return await _transcribe(state, engine, request, file, task,
                                 language if task == "transcribe" else None, prompt,
                                 response_format, temperature)

    endpoint.__name__ = {"transcribe": "transcriptions", "translate": "translations"}[task]
    return endpoint


# -- plumbing ---------------------------------------------------------------------------------
def _telling_error(errors: Sequence[Mapping[str, Any]]) -> tuple[Mapping[str, Any], str | None]:
    """The validation error to report, and the request field it is about (None: the body
    as a whole). A field that may take several shapes (`stop`: a string or a list) gets
    one error per shape; the one that says most is a broken bound (too many items, out
    of range) rather than a wrong type or a string that does not parse as one (100,000
    strings for `input` break its 2048-item bound, and fail as integers item by item),
    and the deepest of those (the list's item)."""
    if not errors:
        return {}, None

    def field(error: Mapping[str, Any]) -> str | None:
        loc = [p for p in error.get("loc", ()) if p not in ("body", "form")]
        return str(loc[0]) if loc else None  # deeper parts name union branches and indices

    param = field(errors[0])
    same = [e for e in errors if field(e) == param]
    bounds = [e for e in same if not str(e.get("type", "")).endswith(("_type", "_parsing"))]
    return max(bounds or same[:1], key=lambda e: len(e.get("loc", ()))), param


def _install_errors(app: FastAPI) -> None:
    """Every error leaves as OpenAI's error JSON."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        error, param = _telling_error(exc.errors())
        if error.get("type") == "json_invalid":
            message, param = "the request body is not valid JSON", None
        elif param is None:
            message = "the request body must be a JSON object"
        elif error.get("type") == "missing":
            message = f"missing required parameter: {param!r}"
        else:
            message = f"invalid value for {param!r}: {error.get('msg', 'invalid')}"
        return JSONResponse(APIError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = {408: "request_timeout", 413: "request_too_large"}.get(exc.status_code)
        return JSONResponse(APIError(exc.status_code, str(exc.detail), type=kind,
                                     code=code).body(),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ClientGone)
    async def gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(as_api_error(exc).body(), status_code=500)


def _model_card(state: ServerState, model: str) -> dict:
    return {"id": model, "object": "model", "created": state.created, "owned_by": "workbench"}


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

    limit = state.max_embedding_tokens

    def produce(put, cancelled) -> None:
        batch = getattr(engine, "embed_batch", None)
        if batch is not None and engine_accepts(batch, "cancel", by_name=True):
            bound = ({"max_total_tokens": limit} if limit is not None
                     and engine_accepts(batch, "max_total_tokens", by_name=True) else {})
            try:
                vectors = np.asarray(batch(texts, batch_size=EMBED_BATCH, cancel=cancelled,
                                           **bound), dtype=np.float32)
            except TooManyTokensError as exc:
                raise APIError(400, f"the input holds more than {limit} tokens (at least "
                               f"{exc.counted}); this server embeds at most {limit} per "
                               "request (max_embedding_tokens): send fewer or shorter texts",
                               param="input", code="max_tokens_per_request") from None
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

    job = await start_job(state, request, produce)
    vectors, n_tokens = await job.next()  # (n_texts, dim)
    # OpenAI's embeddings have unit length; an LLM's (raw hidden states) do not
    vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
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
        if engine_accepts(transcribe, "max_seconds") and state.max_audio_seconds is not None:
            options["max_seconds"] = state.max_audio_seconds
        if engine_accepts(transcribe, "cancel"):
            options["cancel"] = cancelled
        put(transcribe(data, **options))

    job = await start_job(state, request, produce)
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
