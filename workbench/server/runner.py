"""`serve`: run the OpenAI-compatible app with uvicorn, in a background thread (from a
notebook) or in the foreground (from the CLI)."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from workbench.engine.lifecycle import Closeable

DEFAULT_PORT = 11434
_running: dict[tuple[str, int], Server] = {}  # background servers of this process, by address


class Server(Closeable):
    """A server started by `serve`: `.url` (its root), `.base_url` (`.url` + "/v1", what
    OpenAI clients take), `.stop()`; a context manager that stops it on exit.

    `.requests`, `.running` and `.queued` are signals (answered requests, engine calls
    under way, requests waiting for a slot); `.models` the served model ids;
    `.max_connections` the connections it keeps open at most (fitted under the
    process's file-descriptor limit).
    """

    def __init__(self, app: Any, sock: socket.socket, *, log_level: str, access_log: bool,
                 max_connections: int, header_timeout: float | None):
        import uvicorn

        from workbench.server.connections import ACCEPT_BACKLOG, UvicornServer, protocol_class

        self.app = app
        self.state = app.state.workbench
        self._socket = sock
        host, port = sock.getsockname()[:2]
        self.host, self.port = host, port
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{port}"
        self.base_url = f"{self.url}/v1"
        self.max_connections = max_connections
        config = uvicorn.Config(app, log_level=log_level, access_log=access_log,
                                timeout_graceful_shutdown=3, lifespan="off",
                                http=protocol_class(max_connections, header_timeout),
                                backlog=ACCEPT_BACKLOG)
        self._server = UvicornServer(config)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def models(self) -> list[str]:
        return list(self.state.engines)

    @property
    def requests(self):
        return self.state.requests

    @property
    def running(self):
        return self.state.running

    @property
    def queued(self):
        return self.state.queued

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, timeout: float = 30.0) -> Server:
        """Serve on a daemon thread; returns once the server accepts connections."""
        self._thread = threading.Thread(target=self._run, name="workbench-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start: {self._error!r}")
            time.sleep(0.01)
        _running[(self.host, self.port)] = self
        return self

    def serve_forever(self) -> None:
        """Serve on this thread until Ctrl-C (uvicorn handles the signals), then raise
        KeyboardInterrupt. uvicorn raises the signal again once it has shut down, but
        asyncio may take that as cancelling a loop that has already ended and return
        normally: a Ctrl-C always ends here as one."""
        try:
            self._server.run(sockets=[self._socket])
        finally:
            self._socket.close()
        if self._server.should_exit:
            raise KeyboardInterrupt

    def stop(self, timeout: float = 10.0) -> None:
        """Stop generating, close the connections and the socket; wait for the thread."""
        self.state.cancel_all()
        self._server.should_exit = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._socket.close()
        if _running.get((self.host, self.port)) is self:
            del _running[(self.host, self.port)]

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._socket])
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._error = exc

    def close(self) -> None:
        """`stop()`, for `with serve(...) as server:`."""
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_running else "stopped"
        return f"<workbench Server {state} at {self.url}: {', '.join(self.models)}>"


_DEFAULT = object()  # "the app's default" for options whose None means "no limit"


def serve(engine: Any | Mapping[str, Any], *, model_id: str | None = None,
          host: str = "127.0.0.1", port: int = DEFAULT_PORT, api_key: str | None = None,
          max_concurrent: int | None = None, max_queue: int = 64, max_body_bytes: int | None = None,
          max_tokens_limit: int | None = _DEFAULT, request_timeout: float | None = _DEFAULT,
          body_timeout: float | None = _DEFAULT, max_audio_seconds: float | None = _DEFAULT,
          max_embedding_tokens: int | None = _DEFAULT, protect_docs: bool | None = None,
          cors_origins: Sequence[str] = (), allowed_hosts: Sequence[str] | None = None,
          max_connections: int | None = None, header_timeout: float | None = _DEFAULT,
          draft: Any = None, draft_tokens: int | None = None,
          background: bool = True, log_level: str | None = None) -> Server:
    """Serve `engine` with OpenAI's HTTP API (chat, completions, embeddings, transcription).

        >>> server = workbench.serve(m, port=0)          # a free port
        >>> client = openai.OpenAI(base_url=server.base_url, api_key="-")
        >>> server.stop()

    engine: an `LLM`, `Encoder`, `WhisperModel` or `RemoteEngine` (anything with
        `.chat`, `.generate`, `.embed` or `.transcribe`; a `chat` or `generate` may
        return a `Completion`, a string, or a plain or async iterator of text), or a mapping
        {model id: engine} to serve several (a mapping whose values are not engines,
        such as options written as a dict, raises TypeError: options are keywords).
    model_id: the id clients name in `model` (one engine); default: the registry
        alias of its file, or the file name without extension.
    host, port: where to listen (port 0 picks a free one; see `.url`).
    api_key: when set, `/v1/*` requests need `Authorization: Bearer <api_key>`
        (printable ASCII, else ValueError).
    protect_docs: also put `/docs`, `/redoc` and `/openapi.json` behind the key, and
        show `/health`'s model ids and load only with it (default: on with a key).
    max_concurrent: engine calls at once (default 8); an `LLM` decodes them together,
        one forward pass per token for all (up to its `max_batch`), so concurrent
        clients share the model instead of taking turns. Up to `max_queue` more
        requests wait in order, beyond that they get 429.
    max_body_bytes: the largest request body (default 25 MiB; more gets 413).
    body_timeout: seconds a client has to send its body (default 120; slower: 408).
    max_tokens_limit: the most tokens one request may generate per choice (default
        4096, the default context; larger `max_tokens` are lowered to it).
    request_timeout: seconds a request may take from its body to its answer's end
        (default 600); past it the engine call is cancelled and the client gets a
        504 error (an error event in a stream).
    max_audio_seconds: the longest audio upload transcribed (default one hour;
        longer gets 400).
    max_embedding_tokens: the most tokens one embeddings request may hold in all
        (default 300,000, OpenAI's limit; more gets 400 before any work). The
        defaults are in `workbench.server.limits`.
    None for any of the last five means no limit. A client that disconnects stops
    its engine call within a token, a batch of texts or an audio window.
    cors_origins: web origins whose pages may call the API from a browser (e.g.
        ["http://localhost:3000"], or ["*"]); none by default: a request a web page
        makes from another origin (its browser's `Origin` and `Sec-Fetch-Site` say so)
        gets 403, forms and uploads included. Clients that are not browsers (the
        `openai` client, curl) send neither header and are not affected.
    allowed_hosts: the names, besides localhost and the loopback addresses, that a
        request's `Host` header may give. By default a server listening on loopback
        answers to loopback names only (403 otherwise): a web page that points its own
        name at 127.0.0.1 (DNS rebinding) counts as the server's origin, and its
        requests name its own host. A server listening on other interfaces answers to
        any name by default (set an API key there); ["*"] allows any anywhere.
    max_connections: connections open at once (default 1024, lowered to fit the
        process's file-descriptor limit; more than fits raises ValueError). Past it
        the connection that has waited longest for its request's headers is closed,
        or, when all are busy with requests, the new one gets 503.
    header_timeout: seconds a connection has to send a request's headers (default
        10; slower: 408 and closed), so half-open connections cannot pile up; None:
        no limit.
    draft: speculative decoding for the served language model, as llama.cpp's server
        takes a draft model: a smaller `LLM` with its vocabulary, or "ngram" (prompt
        lookup); for several engines, a mapping {model id: draft}. Its chat and text
        completions then check `draft_tokens` proposals (default: `generate`'s) per
        target pass (greedy answers are the same tokens; constrained ones run without
        it). A request's own `draft` field is refused.
    background: serve on a daemon thread and return the running `Server` (stop it
        with `.stop()` or a `with` block); False serves until Ctrl-C.
    A server this process started on the same host and port is stopped first, so
    re-running a notebook cell just restarts it.
    """
    from workbench.server import limits
    from workbench.server.app import create_app
    from workbench.server.connections import connection_cap
    from workbench.server.gatekeeper import allowed_hosts_for

    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535 (0 picks a free one), got {port}")
    if max_connections is not None and max_connections < 1:
        raise ValueError(f"max_connections must be at least 1, got {max_connections}")
    if header_timeout is _DEFAULT:
        header_timeout = limits.HEADER_TIMEOUT
    if header_timeout is not None and not header_timeout > 0:
        raise ValueError(f"header_timeout must be positive or None, got {header_timeout!r}")
    cap = connection_cap(max_connections or limits.MAX_CONNECTIONS)
    if max_connections is not None and cap < max_connections:
        raise ValueError(f"max_connections={max_connections} needs more file descriptors "
                         f"than this process may open: at most {cap} fit; raise the limit "
                         "(`ulimit -n` in the shell that starts Python) or ask for fewer")

    engines = _engines(engine) if isinstance(engine, Mapping) else {
        model_id or default_model_id(engine): engine}
    drafts = _drafts(engines, draft, draft_tokens)
    chosen = {name: value for name, value in (
        ("max_tokens_limit", max_tokens_limit), ("request_timeout", request_timeout),
        ("body_timeout", body_timeout), ("max_audio_seconds", max_audio_seconds),
        ("max_embedding_tokens", max_embedding_tokens))
        if value is not _DEFAULT}
    app = create_app(engines, api_key=api_key,
                     max_concurrent=(limits.MAX_CONCURRENT if max_concurrent is None
                                     else max_concurrent),
                     max_queue=max_queue, max_body_bytes=max_body_bytes or limits.MAX_BODY_BYTES,
                     protect_docs=protect_docs, cors_origins=cors_origins,
                     allowed_hosts=allowed_hosts_for(host, allowed_hosts), drafts=drafts,
                     **chosen)
    old = _running.get((host, port))
    if old is not None:
        old.stop()
    try:
        sock = socket.create_server((host, port), reuse_port=False)
    except OSError as exc:
        raise OSError(f"cannot listen on {host}:{port} ({exc.strerror}); pass another port "
                      "(0 picks a free one)") from None
    server = Server(app, sock, log_level=log_level or ("warning" if background else "info"),
                    access_log=not background, max_connections=cap,
                    header_timeout=header_timeout)
    if not background:
        server.serve_forever()
        return server
    return server.start()


_ENGINE_METHODS = ("chat", "generate", "embed", "embed_batch", "transcribe")


def _engines(mapping: Mapping[Any, Any]) -> dict[str, Any]:
    """{model id: engine} from `serve`'s mapping; a TypeError for a mapping of options (a
    seed-style `serve({"port": 8080, ...})`), which would otherwise serve models named
    after its keys."""
    for key, value in mapping.items():
        if not isinstance(key, str) or not any(callable(getattr(value, name, None))
                                               for name in _ENGINE_METHODS):
            raise TypeError(
                f"serve() takes an engine or a mapping {{model id: engine}}; the value of "
                f"{key!r} is a {type(value).__name__}, not an engine. Options are keyword "
                "arguments: serve(engine, model_id=..., host=..., port=..., api_key=..., "
                "max_concurrent=..., ...)")
    return dict(mapping)


def _drafts(engines: Mapping[str, Any], draft: Any, draft_tokens: int | None
            ) -> dict[str, dict[str, Any]]:
    """{model id: speculative options} from `serve`'s `draft` (one served engine's draft,
    or a mapping {model id: draft}), each checked as `generate(..., draft=)` checks it."""
    from workbench.engine.decoding import speculative
    from workbench.engine.llm import LLM

    if draft is None:
        return {}
    if draft_tokens is None:
        draft_tokens = speculative.DRAFT_TOKENS
    if not isinstance(draft, Mapping):
        if len(engines) != 1:
            raise ValueError("with several engines, draft= maps model ids to drafts: "
                             "{model id: draft}")
        draft = {next(iter(engines)): draft}
    drafts = {}
    for name, one in draft.items():
        target = engines.get(name)
        if not isinstance(target, LLM):
            raise ValueError(f"draft= names {name!r}, which is not a served local LLM")
        speculative.check_draft(target, one, draft_tokens, [0])
        drafts[name] = {"draft": one, "draft_tokens": draft_tokens}
    return drafts


def default_model_id(engine: Any) -> str:
    """The registry alias of the engine's file when it is a cached alias, else the file's
    name without extension (or the engine's own `model` for a `RemoteEngine`)."""
    from workbench import registry

    if isinstance(getattr(engine, "model", None), str):
        return engine.model
    path = getattr(engine, "path", None)
    if path is None:
        return type(engine).__name__.lower()
    for alias in registry.MODELS:
        cached = registry.cached_path(alias)
        if cached is not None and os.path.realpath(cached) == os.path.realpath(path):
            return alias
    return os.path.splitext(os.path.basename(path))[0]
