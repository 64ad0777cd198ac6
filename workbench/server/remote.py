"""`RemoteEngine`: the engine surface (`chat`, `generate`, `embed`, `transcribe`, `busy`,
`device`) over any OpenAI-compatible server — ours, vLLM, llama.cpp's, Ollama — so the
notebook cells drive a server unchanged.

    >>> m = RemoteEngine("http://127.0.0.1:8000/v1", "smollm2-135m")
    >>> ChatCell(m)

Calls go through the official `openai` client. Text streams token by token.
The API does not return token ids: events have `id=None` (alternatives -1),
`Completion.token_ids` stays empty, and `usage` is the server's count.
"""

from __future__ import annotations

import io
import os
from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from workbench.engine.lifecycle import Closeable
from workbench.engine.options import DEFAULTS
from workbench.engine.results import Alternative, Completion, Segment, TokenEvent, Transcript, Usage
from workbench.signals import BusyCounter, Signal

# our names -> the request fields beyond OpenAI's that llama.cpp's and our server read
_EXTRA_OPTIONS = {"top_k": "top_k", "min_p": "min_p", "repeat_penalty": "repeat_penalty",
                  "continue_final_message": "continue_final_message"}
_OPENAI_OPTIONS = ("max_tokens", "temperature", "top_p", "seed", "stop", "presence_penalty",
                   "frequency_penalty")


class RemoteCompletion(Completion):
    """A `Completion` streamed from a server: `usage` is the server's count."""

    def __init__(self, events: Iterator[TokenEvent]):
        super().__init__(events, [])
        self.server_usage: Usage | None = None

    @property
    def usage(self) -> Usage:
        self.wait()
        if self.server_usage is not None:
            return self.server_usage
        return Usage(0, sum(1 for ev in self._events if ev.piece))


class RemoteEngine(Closeable):
    """A model on an OpenAI-compatible server, with the local engines' methods.

    base_url: the API root, e.g. "http://127.0.0.1:11434/v1" (a `Server`'s `.base_url`).
    model: the model id to ask for. api_key: sent as a bearer token (servers without
    keys take any). timeout: seconds per request.
    """

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None,
                 timeout: float = 600.0):
        import openai

        self.base_url = base_url.rstrip("/")
        self.model = model
        self.client = openai.OpenAI(base_url=self.base_url, api_key=api_key or "none",
                                    timeout=timeout, max_retries=0)
        self.device: Signal[str] = Signal("remote", name="device")
        self.busy: Signal[bool] = Signal(False, name="busy")  # True while a request runs
        self._busy = BusyCounter(self.busy)

    def __repr__(self) -> str:
        return f"RemoteEngine({self.base_url!r}, {self.model!r})"

    def close(self) -> None:
        self.client.close()

    def models(self) -> list[str]:
        """The model ids the server offers."""
        with self._busy, _errors(self.base_url):
            return [m.id for m in self.client.models.list()]

    # -- text ---------------------------------------------------------------------------------
    def chat(self, messages: Sequence[Mapping[str, Any]], **options) -> RemoteCompletion:
        """Answer a conversation (streamed). Options are `LLM.chat`'s: `max_tokens`,
        `temperature`, `top_p`, `top_k`, `min_p`, `repeat_penalty`, `seed`, `stop`,
        `logprobs` (k alternatives), `logit_bias`, `presence_penalty`,
        `frequency_penalty`, and `schema` (JSON Schema or pydantic class, sent as
        `response_format`) or `grammar` (GBNF text, for servers that read it)."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
        body = _request_options(options)
        body["messages"] = [dict(m) for m in messages]
        return self._stream(self.client.chat.completions.create, body, chat=True)

    def generate(self, prompt: str | Sequence[int], **options) -> RemoteCompletion:
        """Continue `prompt` without a chat template (streamed); options as `chat`'s, plus
        `include_prompt` (the server's `echo`)."""
        echo = bool(options.pop("include_prompt", False))
        if options.pop("schema", None) is not None:
            raise TypeError("schema works with chat; for generate pass a GBNF grammar")
        body = _request_options(options, chat=False)
        body["prompt"] = prompt if isinstance(prompt, str) else [int(i) for i in prompt]
        if echo:
            body["echo"] = True
        return self._stream(self.client.completions.create, body, chat=False)

    def _stream(self, create, body: dict, *, chat: bool) -> RemoteCompletion:
        body["model"] = self.model
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        holder: list[RemoteCompletion] = []

        def events() -> Generator[TokenEvent, None, str]:
            with self._busy:
                with _errors(self.base_url):
                    stream = create(**body)
                reason = "stop"
                try:
                    for chunk in stream:
                        if chunk.usage is not None:
                            u = chunk.usage
                            holder[0].server_usage = Usage(u.prompt_tokens,
                                                           u.completion_tokens)
                        for choice in chunk.choices:
                            if choice.finish_reason:
                                reason = choice.finish_reason
                            yield from _chunk_events(choice, chat)
                finally:
                    stream.close()  # a dropped stream tells the server to stop
                return reason

        completion = RemoteCompletion(events())
        holder.append(completion)
        return completion

    # -- embeddings -----------------------------------------------------------------------------
    def embed(self, text: str, *, normalize: bool = True, **_) -> np.ndarray:
        """One vector for `text`: float32 of shape (dim,)."""
        return self.embed_batch([text], normalize=normalize)[0]

    def embed_batch(self, texts: Sequence[str], *, batch_size: int = 32, normalize: bool = True,
                    **_) -> np.ndarray:
        """Vectors for many texts, `batch_size` per request: float32 (len(texts), dim).
        (Pooling is the server's.)"""
        if isinstance(texts, str):
            raise TypeError("embed_batch takes a list of texts; use embed for one text")
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        texts = list(texts)
        rows = []
        with self._busy:
            for start in range(0, len(texts), batch_size):
                with _errors(self.base_url):
                    r = self.client.embeddings.create(model=self.model,
                                                      input=texts[start : start + batch_size],
                                                      encoding_format="float")
                rows.extend(d.embedding for d in sorted(r.data, key=lambda d: d.index))
        out = np.asarray(rows, dtype=np.float32).reshape(len(texts), -1)
        if normalize:
            out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return out

    # -- speech ---------------------------------------------------------------------------------
    def transcribe(self, audio: str | os.PathLike | bytes | np.ndarray, *,
                   language: str | None = "en", task: str = "transcribe", beam_size: int = 1,
                   timestamps: bool = False, **_) -> Transcript:
        """Transcribe `audio` (a path, encoded bytes, or 16 kHz mono float32 samples) on the
        server; the `Transcript` has the server's segments and language."""
        if beam_size != 1:
            raise ValueError("a remote server decodes with its own settings: beam_size "
                             "must be 1")
        if task not in ("transcribe", "translate"):
            raise ValueError(f"task must be 'transcribe' or 'translate', not {task!r}")
        upload = _audio_upload(audio)
        with self._busy, _errors(self.base_url):
            if task == "translate":
                r = self.client.audio.translations.create(
                    model=self.model, file=upload, response_format="verbose_json")
            else:
                extra = {} if language in (None, "auto") else {"language": language}
                r = self.client.audio.transcriptions.create(
                    model=self.model, file=upload, response_format="verbose_json", **extra)
        segments = [Segment(float(s.start), float(s.end), s.text, tuple(s.tokens or ()))
                    for s in (r.segments or [])]
        if not timestamps and segments:
            segments = [Segment(segments[0].start, segments[-1].end, r.text)]
        return Transcript(r.text, language=r.language or language or "", segments=segments,
                          duration=float(getattr(r, "duration", None) or 0.0))


def _request_options(options: dict, *, chat: bool = True) -> dict:
    """The request fields for `LLM.chat`-style options (`options=` a `GenerationOptions`,
    whose fields off their defaults count as passed, and keywords, which win); unknown
    options are a TypeError. The Python API's `temperature` and `max_tokens` defaults
    are always sent, so a remote model is greedy by default like a local one (a server
    fills in OpenAI's defaults, which sample)."""
    options = dict(options)
    given = options.pop("options", None)
    if given is not None:
        options = {**given.changed(), **options}
    options = {"temperature": DEFAULTS.temperature, "max_tokens": DEFAULTS.max_tokens,
               **options}
    body: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for name in _OPENAI_OPTIONS:
        value = options.pop(name, None)
        if value is not None:
            body[name] = value
    for name, field in _EXTRA_OPTIONS.items():
        value = options.pop(name, None)
        if value is not None:
            extra[field] = value
    bias = options.pop("logit_bias", None)
    if bias:
        body["logit_bias"] = {str(int(k)): float(v) for k, v in bias.items()}
    k = options.pop("logprobs", None)
    if k is not None and chat:
        body["logprobs"] = True
        body["top_logprobs"] = int(k)
    elif k is not None:  # completions take the number of alternatives
        body["logprobs"] = int(k)
    schema = options.pop("schema", None)
    grammar = options.pop("grammar", None)
    if schema is not None and grammar is not None:
        raise ValueError("pass either grammar or schema, not both")
    if getattr(grammar, "kind", None) == "json_schema":  # a compiled schema (the JSON cell's)
        schema, grammar = grammar, None
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "response", "schema": _schema_dict(schema), "strict": True}}
    if grammar is not None:
        extra["grammar"] = getattr(grammar, "source", grammar)
        if getattr(grammar, "kind", "gbnf") != "gbnf":
            raise ValueError("a remote server takes GBNF grammars and JSON Schemas, not "
                             f"{grammar.kind} grammars")
    if options.pop("stop_tokens", None) is not None:
        raise TypeError("stop_tokens (token ids) are not part of the OpenAI API; use stop")
    if options:
        raise TypeError(f"unsupported option(s) for a remote model: {', '.join(options)}")
    if extra:
        body["extra_body"] = extra
    return body


def _schema_dict(schema: Any) -> dict:
    if hasattr(schema, "model_json_schema"):  # a pydantic model class
        return schema.model_json_schema()
    if getattr(schema, "kind", None) == "json_schema":  # a Grammar
        return schema.schema
    if isinstance(schema, str):
        import json

        return json.loads(schema)
    return dict(schema)


def _chunk_events(choice: Any, chat: bool) -> Iterator[TokenEvent]:
    """The events of one streamed choice: one per token the server reports logprobs for,
    else one for the chunk's text."""
    if chat:
        text = choice.delta.content or ""
        entries = list(choice.logprobs.content or []) if choice.logprobs else []
        tokens = [(e.token, e.logprob, tuple(Alternative(-1, a.token, a.logprob)
                                            for a in e.top_logprobs or ())) for e in entries]
    else:
        text = choice.text or ""
        lp = choice.logprobs
        tokens = []
        if lp is not None and lp.tokens:
            tops = lp.top_logprobs or [None] * len(lp.tokens)
            tokens = [(t, lps, tuple(Alternative(-1, s, v) for s, v in (top or {}).items()))
                      for t, lps, top in zip(lp.tokens, lp.token_logprobs, tops)]
    if not tokens:
        if text:
            yield TokenEvent(None, text, text)
        return
    for j, (piece, logprob, top) in enumerate(tokens):
        last = j == len(tokens) - 1
        yield TokenEvent(None, text if last else "", piece, logprob, top)


def _audio_upload(audio: str | os.PathLike | bytes | np.ndarray) -> tuple[str, bytes]:
    """(file name, bytes) for an upload; samples are sent as a 16 kHz WAV."""
    if isinstance(audio, np.ndarray):
        import soundfile

        buf = io.BytesIO()
        soundfile.write(buf, np.asarray(audio, dtype=np.float32), 16000, format="WAV",
                        subtype="FLOAT")
        return "audio.wav", buf.getvalue()
    if isinstance(audio, (bytes, bytearray)):
        return "audio", bytes(audio)
    path = os.fspath(audio)
    with open(path, "rb") as f:
        return os.path.basename(path), f.read()


class _errors:
    """Turn the server's 4xx answers into ValueError (what the local engines raise for a
    bad request), keeping the message, and a server that cannot be reached into a
    ConnectionError that says so in words."""

    def __init__(self, base_url: str):
        self.base_url = base_url

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        import openai

        if isinstance(exc, openai.APIStatusError) and 400 <= exc.status_code < 500 \
                and exc.status_code not in (401, 403, 429):
            raise ValueError(f"the server refused the request ({exc.status_code}): "
                             f"{_message(exc)}") from exc
        if isinstance(exc, openai.APIConnectionError):  # refused, reset or timed out
            raise ConnectionError(
                f"the server at {self.base_url} is not answering ({_message(exc).rstrip('.')}): "
                "is it running? A serve cell's Start button starts it again") from exc
        return False


def _message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
    return str(exc)
