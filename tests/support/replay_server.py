"""A loopback HTTP server that answers recorded requests with the responses a peer's
server gave them: the test gate's stand-in for llama-cpp-python's server
(tests/test_remote.py replays the golden `remote-llama-cpp-server`).

An `Exchange` is one request (method, path, JSON body) and the response the server sent
(status, content type, body). A streamed body (server-sent events) is kept as the
server's events and replayed one event per write, `chunk_delay` seconds apart, so a
client that stops reading mid-stream cuts a stream still running, as with the live
server. A request that was never recorded gets a 500 naming it and is listed in
`ReplayServer.unmatched`: a test whose requests changed fails, never passes on answers
recorded for other requests.

With `upstream=` the same server is the recording proxy the golden's producer uses
(tests/goldens/make_remote.py): a request not yet recorded is sent on to the live
server, its whole response read and kept in `ReplayServer.exchanges`, then replayed.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

EVENT_STREAM = "text/event-stream"
# one server-sent event: everything up to and including the blank line that ends it
_EVENT = re.compile(rb".*?(?:\r\n\r\n|\n\n|\r\r)|.+\Z", re.DOTALL)


@dataclass(frozen=True)
class Exchange:
    """One recorded request and the response the server sent to it.

    body: the request's JSON body (None for a request without one). chunks: the
    response body as sent, one server-sent event per chunk for an event stream, else
    one chunk."""

    method: str
    path: str
    body: Any
    status: int
    content_type: str
    chunks: tuple[bytes, ...]

    def answers(self, method: str, path: str, body: Any) -> bool:
        return (self.method, self.path, self.body) == (method, path, body)

    @property
    def streamed(self) -> bool:
        return self.content_type.startswith(EVENT_STREAM)


def split_events(body: bytes) -> list[bytes]:
    """A server-sent event stream's events, each with the blank line that ends it
    (`b"".join` of them is `body` again)."""
    return [m.group() for m in _EVENT.finditer(body)]


def to_records(exchanges: list[Exchange]) -> tuple[list[dict], dict[str, bytes]]:
    """The exchanges as a golden stores them: JSON records of the requests and
    responses, and the response bodies as files (`NN-method-path.sse` or `.json`), byte
    for byte as the server sent them."""
    records, files = [], {}
    for i, ex in enumerate(exchanges):
        ext = "sse" if ex.streamed else "json"
        name = f"{i:02d}-{ex.method.lower()}{ex.path.replace('/', '-')}.{ext}"
        files[name] = b"".join(ex.chunks)
        records.append({"request": {"method": ex.method, "path": ex.path, "body": ex.body},
                        "response": {"status": ex.status, "content_type": ex.content_type,
                                     "file": name, "chunks": len(ex.chunks)}})
    return records, files


def from_records(records: list[dict], read) -> list[Exchange]:
    """The exchanges of `to_records`' records; `read(file name)` gives a body's bytes."""
    exchanges = []
    for record in records:
        request, response = record["request"], record["response"]
        data = read(response["file"])
        streamed = response["content_type"].startswith(EVENT_STREAM)
        chunks = tuple(split_events(data)) if streamed else (data,)
        assert len(chunks) == response["chunks"], \
            f"{response['file']}: {len(chunks)} events stored, {response['chunks']} recorded"
        exchanges.append(Exchange(request["method"], request["path"], request["body"],
                                  response["status"], response["content_type"], chunks))
    return exchanges


@contextmanager
def serving(app, *, name: str = "the server", timeout: float = 60.0) -> Iterator[str]:
    """Run the ASGI `app` with uvicorn on a free loopback port, in a daemon thread;
    yields its root URL ("http://127.0.0.1:PORT") and stops it on exit."""
    import uvicorn

    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.05)
    try:
        assert server.started, f"{name} did not start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


class ReplayServer:
    """Serves `exchanges` on a loopback port while entered (`with ReplayServer(...) as
    server: server.base_url`).

    chunk_delay: seconds between the events of a replayed stream. upstream: the root URL
    of a live server to record from (requests not yet recorded go there).
    """

    def __init__(self, exchanges: list[Exchange], *, chunk_delay: float = 0.01,
                 upstream: str | None = None):
        self.exchanges = list(exchanges)
        self.chunk_delay = chunk_delay
        self.upstream = upstream
        self.unmatched: list[str] = []  # "METHOD path body" of each request not recorded
        self.base_url = ""
        self._lock = threading.Lock()
        self._stack = ExitStack()

    def __enter__(self) -> ReplayServer:
        from starlette.applications import Starlette
        from starlette.routing import Route

        app = Starlette(routes=[Route("/{path:path}", self._answer,
                                      methods=["GET", "POST", "PUT", "PATCH", "DELETE"])])
        self.base_url = self._stack.enter_context(serving(app, name="the replay server"))
        return self

    def __exit__(self, *exc_info) -> None:
        self._stack.close()

    def find(self, method: str, path: str, body: Any) -> Exchange | None:
        """The recorded exchange for this request, if any."""
        with self._lock:
            return next((ex for ex in self.exchanges if ex.answers(method, path, body)), None)

    async def _answer(self, request):
        from starlette.concurrency import run_in_threadpool
        from starlette.responses import JSONResponse, Response, StreamingResponse

        raw = await request.body()
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        exchange = self.find(request.method, path, body)
        if exchange is None and self.upstream is not None and not isinstance(body, str):
            exchange = await run_in_threadpool(self._record, request.method, path, body)
        if exchange is None:
            what = f"{request.method} {path} {json.dumps(body, sort_keys=True)}"
            self.unmatched.append(what)
            return JSONResponse({"error": {
                "message": f"the replay server has no recorded answer for {what}: the "
                           "requests changed since the golden was recorded (regenerate it "
                           "with `python -m tests.goldens remote`)",
                "type": "replay_error"}}, status_code=500)
        headers = {"content-type": exchange.content_type}
        if not exchange.streamed:
            return Response(b"".join(exchange.chunks), exchange.status, headers)
        return StreamingResponse(self._replay(exchange.chunks), exchange.status, headers)

    async def _replay(self, chunks: tuple[bytes, ...]):
        for i, chunk in enumerate(chunks):
            if i:
                await asyncio.sleep(self.chunk_delay)
            yield chunk

    def _record(self, method: str, path: str, body: Any) -> Exchange:
        """Send a request to the live server, read all of its response, keep it."""
        import httpx

        content = None if body is None else json.dumps(body).encode()
        headers = {} if body is None else {"content-type": "application/json"}
        with httpx.Client(base_url=self.upstream, timeout=600) as client:
            r = client.request(method, path, content=content, headers=headers)
        content_type = r.headers.get("content-type", "")
        chunks = split_events(r.content) if content_type.startswith(EVENT_STREAM) \
            else [r.content]
        exchange = Exchange(method, path, body, r.status_code, content_type, tuple(chunks))
        with self._lock:
            self.exchanges.append(exchange)
        return exchange
