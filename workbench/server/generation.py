"""Chat and text completions: the engine calls behind `/v1/chat/completions` and
`/v1/completions`, and the JSON answers and server-sent event streams built from them.

`n` choices (times the prompts of a text completion) run as one job: a non-streamed
answer takes the engine's batch method where it has one, a stream one call per choice,
read together so that the choices' tokens interleave. A stream that fails after its headers
are out reports the error as its last event, as OpenAI does.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse

from workbench.engine.cancel import Cancelled, check_cancel
from workbench.engine.results import TokenEvent, Usage
from workbench.server.jobs import JOB_DONE, ClientGone, Job, ServerState, engine_accepts, start_job
from workbench.server.schemas import (
    MAX_CHOICES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
)


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


def _run_choices(completions_for: Callable[[threading.Event], list[Any]]):
    """A `produce` for chat or text completions: start the engine's completions, then hand
    over ("ready", completions), one (index, event) per token, and ("end", index, finish
    reason, usage) per choice. Several choices are read each from a thread of its own, so
    their tokens come out interleaved as the engine makes them (a stream of `n` choices
    does not wait for all of them); one that fails stops the others. Raises `Cancelled`
    once `cancelled` is set (checked after every token)."""

    def produce(put, cancelled: threading.Event) -> None:
        completions = completions_for(cancelled)
        put(("ready", len(completions)))
        if len(completions) == 1:
            _read_choice(put, cancelled, None, 0, completions[0])
            return
        failed = threading.Event()
        errors: list[BaseException] = []

        def read(i: int, completion: Any) -> None:
            try:
                _read_choice(put, cancelled, failed, i, completion)
            except BaseException as exc:  # noqa: BLE001 - raised below, in the job's thread
                errors.append(exc)
                failed.set()

        readers = [threading.Thread(target=read, args=(i, c), daemon=True,
                                    name=f"workbench-serve-choice-{i}")
                   for i, c in enumerate(completions)]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        if errors:
            raise next((e for e in errors if not isinstance(e, Cancelled)), errors[0])

    return produce


def _read_choice(put, cancelled: threading.Event, failed: threading.Event | None, i: int,
                 completion: Any) -> None:
    """Hand over choice `i`'s events, then its end; stop early (without an end) once
    another choice has `failed`."""
    echo = getattr(completion, "prompt_text", "")
    if echo:  # the prompt, in front of the output (completions' `echo`)
        put((i, TokenEvent(None, echo, "")))
    try:
        for event in completion.iter_events():
            check_cancel(cancelled)
            if failed is not None and failed.is_set():
                return
            put((i, event))
    finally:
        completion.close()
    put(("end", i, completion.finish_reason, completion.usage))


class TextPieces:
    """What a duck-typed engine's `chat` / `generate` returned instead of a `Completion`:
    a string, a plain or async iterator of text pieces, or a coroutine giving either, read
    as a completion of one event per piece (no token ids, so no logprobs; usage counts
    pieces). An async iterator is run on an event loop of the reading thread's own."""

    prompt_text = ""
    finish_reason = "stop"

    def __init__(self, result: Any):
        self._result = result
        self._pieces = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def usage(self) -> Usage:
        return Usage(0, self._pieces)

    def iter_events(self) -> Iterator[TokenEvent]:
        for piece in self._read():
            if not isinstance(piece, str):
                raise TypeError(f"the engine gave a {type(piece).__name__} where a piece of "
                                "text was expected")
            self._pieces += 1
            yield TokenEvent(None, piece, piece)

    def _read(self) -> Iterator[Any]:
        result = self._result
        if inspect.isawaitable(result):
            result = self._run(result)
        if isinstance(result, str):
            yield result
        elif hasattr(result, "__aiter__"):
            it = result.__aiter__()
            while True:
                try:
                    yield self._run(it.__anext__())
                except StopAsyncIteration:
                    return
        else:
            yield from result

    def _run(self, awaitable: Any) -> Any:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(awaitable)

    def close(self) -> None:
        """Stop the engine's iterator (a generator's `close`, an async one's `aclose`)."""
        result = self._result
        try:
            if hasattr(result, "aclose"):
                self._run(result.aclose())
            elif hasattr(result, "close"):
                result.close()
        finally:
            if self._loop is not None:
                self._loop.close()
                self._loop = None


def as_completion(result: Any) -> Any:
    """`result` as the server reads a completion: a `Completion` (anything with
    `iter_events`) as it is, anything else through `TextPieces`."""
    return result if hasattr(result, "iter_events") else TextPieces(result)


def _with_draft(state: ServerState, model: str, options: dict) -> None:
    """Add the served model's draft (`serve(..., draft=)`) to a generation's `options`,
    unless it is constrained (speculation takes no grammar)."""
    drafted = state.drafts.get(model)
    if drafted and "schema" not in options and "grammar" not in options:
        options.update(drafted)


def _choices(engine: Any, method: str, batch_method: str, inputs: list[Any], n: int,
             options: dict, stream: bool) -> Callable[[threading.Event], list[Any]]:
    """Start `n` completions of each input: one call each (choice i gets seed s + i, as a
    batch gives it; each call gets `cancel=` where it names it, which also stops its
    prefill between chunks), except a non-streamed answer from an engine with a batch
    method, which takes that (`cancel=` stops it between decode steps). Calls to a
    local `LLM` return at once and generate while they are read, together in its
    batch."""

    def start(cancelled: threading.Event) -> list[Any]:
        repeated = [x for x in inputs for _ in range(n)]
        if len(repeated) > 1 and not stream and hasattr(engine, batch_method):
            batch = getattr(engine, batch_method)
            extra = {"cancel": cancelled} if engine_accepts(batch, "cancel") else {}
            return [as_completion(c) for c in batch(repeated, **options, **extra)]
        call = getattr(engine, method)
        extra = {"cancel": cancelled} if engine_accepts(call, "cancel", by_name=True) else {}
        seed = options.pop("seed", None)
        completions = []
        for i, x in enumerate(repeated):
            check_cancel(cancelled)
            seeded = {} if seed is None else {"seed": seed + i}
            completions.append(as_completion(call(x, **options, **seeded, **extra)))
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


async def answer_chat(state: ServerState, engine: Any, body: ChatCompletionRequest,
                request: Request) -> Response:
    if body.tools:
        raise APIError(400, "tools (function calling) are not supported by this server",
                       param="tools", code="unsupported_parameter")
    messages = [m.as_dict() for m in body.messages]
    options = body.sampling()
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    if max_tokens is None:  # OpenAI's default: until the context is full
        max_tokens = getattr(engine, "kv_cache_size", None)
    max_tokens = state.limit_tokens(max_tokens)
    if max_tokens is not None:
        options["max_tokens"] = max_tokens
    if body.logprobs:
        options["logprobs"] = body.top_logprobs or 0
    elif body.top_logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if body.continue_final_message:
        options["continue_final_message"] = True
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
            from workbench.engine.decoding.structured import with_schema_instruction

            messages = with_schema_instruction(messages, fmt.json_schema.schema_)
    _with_draft(state, body.model, options)
    start = _choices(engine, "chat", "chat_batch", [messages], body.n, options, body.stream)
    job = await start_job(state, request, _run_choices(start))
    meta = {"id": _id("chatcmpl"), "created": int(time.time()), "model": body.model}
    first = await job.next()  # the engine accepted the request (or not)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    if body.stream:
        return EventSourceResponse(_chat_stream(engine, job, meta, body.n, include_usage),
                                   ping=15)
    return await _chat_response(engine, job, meta, first[1], body.logprobs)


async def _gather(job: Job, n: int) -> tuple[list[str], list[list[Any]], list[str], list[Any]]:
    """A non-streamed answer's `n` choices: each one's text, its token events that carry a
    logprob, its finish reason and its usage (None where it never ended)."""
    texts: list[list[str]] = [[] for _ in range(n)]
    scored: list[list[Any]] = [[] for _ in range(n)]
    reasons, usages = ["stop"] * n, [None] * n
    while (item := await job.next()) is not JOB_DONE:
        if item[0] == "end":
            _, i, reasons[i], usages[i] = item
        else:
            i, event = item
            texts[i].append(event.text)
            if event.logprob is not None:
                scored[i].append(event)
    return ["".join(t) for t in texts], scored, reasons, usages


async def _chat_response(engine: Any, job: Job, meta: dict, n: int, logprobs: bool
                         ) -> Response:
    texts, scored, reasons, usages = await _gather(job, n)
    tokens = [[_chat_logprob(engine, e) for e in events] if logprobs else []
              for events in scored]
    choices = [{"index": i, "message": {"role": "assistant", "content": texts[i],
                                        "refusal": None},
                "logprobs": {"content": tokens[i], "refusal": None} if logprobs else None,
                "finish_reason": reasons[i]} for i in range(n)]
    prompt = next((u.prompt_tokens for u in usages if u), 0)
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
        while (item := await job.next()) is not JOB_DONE:
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
    except ClientGone:
        return
    finally:
        job.cancel()  # the client went away (or we are done): stop generating


async def answer_completion(state: ServerState, engine: Any, body: CompletionRequest,
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
    _with_draft(state, body.model, options)
    start = _choices(engine, "generate", "generate_batch", prompts, body.n, options,
                     body.stream)
    job = await start_job(state, request, _run_choices(start))
    meta = {"id": _id("cmpl"), "created": int(time.time()), "model": body.model}
    ready = await job.next()
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventSourceResponse(_text_stream(job, meta, body.n, include_usage),
                                   ping=15)
    return await _text_response(job, meta, ready[1], body.n, body.logprobs is not None)


def _legacy_logprobs(events: list[Any], offset: int) -> dict:
    """Completions' old logprobs form: parallel lists, text offsets from `offset` (in
    characters of the text as sent: a piece that is part of a UTF-8 character has none
    of its own)."""
    tokens, lps, tops, offsets = [], [], [], []
    for event in events:
        tokens.append(event.piece)
        lps.append(event.logprob)
        # the k best, and the sampled token where it is not among them (OpenAI: up to
        # logprobs + 1 entries)
        tops.append({a.text: a.logprob for a in event.top or ()} | {event.piece: event.logprob})
        offsets.append(offset)
        offset += len(event.text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}


async def _text_response(job: Job, meta: dict, count: int, n: int, logprobs: bool
                         ) -> Response:
    """`count` choices, `n` per prompt (choice i answers prompt i // n)."""
    texts, scored, reasons, usages = await _gather(job, count)
    choices = []
    for i in range(count):
        events = [e for e in scored[i] if e.id is not None]
        choices.append({"index": i, "text": texts[i],
                        "logprobs": _legacy_logprobs(events, 0) if logprobs else None,
                        "finish_reason": reasons[i]})
    prompt = sum({i // n: u.prompt_tokens for i, u in enumerate(usages) if u}.values())
    generated = sum(u.completion_tokens for u in usages if u)
    return JSONResponse({**meta, "object": "text_completion", "choices": choices,
                         "usage": _usage(prompt, generated), "system_fingerprint": None})


async def _text_stream(job: Job, meta: dict, n: int, include_usage: bool
                       ) -> AsyncIterator[str]:
    def chunk(choices: list, usage: dict | None = None) -> str:
        return _chunk(meta, "text_completion", choices, include_usage, usage)

    generated = 0
    prompts: dict[int, int] = {}  # each prompt's tokens, counted once for its n choices
    offsets: dict[int, int] = {}
    try:
        while (item := await job.next()) is not JOB_DONE:
            if item[0] == "end":
                _, i, reason, usage = item
                prompts[i // n] = usage.prompt_tokens
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
            yield chunk([], _usage(sum(prompts.values()), generated))
        yield "[DONE]"
    except APIError as exc:
        yield json.dumps(exc.body())
    except ClientGone:
        return
    finally:
        job.cancel()

