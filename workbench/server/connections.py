"""The server's HTTP connections before their requests: how many may be open, how long a
client may take to send a request's headers, and how often running out of file
descriptors is logged.

uvicorn's h11 protocol waits for a new connection's first request for ever (its
keep-alive timer only starts after a response), and its `limit_concurrency` looks at
requests, not at connections that never finish their headers. So a thousand sockets
that send half a request hold a thousand file descriptors; past the process's limit
`accept()` fails and every other client waits, while asyncio logs each failure (up to
`backlog` lines a time). Here:

- a connection must send its request's headers within `header_timeout` of opening (or
  of its previous answer, on a kept-alive connection), else it gets 408 and is closed;
- at most `max_connections` are open, kept below the file-descriptor limit; one past
  it closes the connection that has waited longest for its headers (a half-open one),
  or, when every connection is busy with a request, gets 503 itself;
- "accept() out of system resource" is logged at most once per `ACCEPT_LOG_EVERY`
  seconds, with the count of those left out.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    import resource
except ImportError:  # Windows: no RLIMIT_NOFILE to fit under
    resource = None

# connections the kernel queues until they are accepted (fewer, and a burst of clients
# waits out SYN retries of a second or more), also the most asyncio accepts in one go
# before any is looked at, beyond the cap for a moment (more, and a burst may find no
# descriptor free: accepting then pauses a second, logged once)
ACCEPT_BACKLOG = 512
ACCEPT_LOG_EVERY = 10.0


def connection_cap(requested: int) -> int:
    """`requested`, lowered to fit the file descriptors the process has left: half of
    those below its soft RLIMIT_NOFILE not open now (the other half stays free for the
    process's own files and for a batch of sockets accepted at once)."""
    if resource is None:
        return requested
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return requested
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux
        in_use = 64
    room = (soft - in_use) // 2
    if room < 8:
        raise OSError(f"this process may open {soft} files and has {in_use} open: too few "
                      "left to serve connections; raise the limit (`ulimit -n 4096` in the "
                      "shell that starts Python)")
    return min(requested, room)


def _raw_error(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response carrying OpenAI's error JSON, closing the connection
    (written before any request was read, so h11 cannot write it)."""
    body = json.dumps({"error": {"message": message, "type": "server_error" if status >= 500
                                 else "invalid_request_error", "param": None, "code": code}})
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n{body}").encode()


class _Guard:
    """One server's limits and its connections waiting for a request's headers, oldest
    first (a dict keeps its insertion order)."""

    def __init__(self, max_connections: int, header_timeout: float | None):
        self.max_connections, self.header_timeout = max_connections, header_timeout
        self.waiting: dict[GuardedH11Protocol, asyncio.TimerHandle | None] = {}
        self.too_many = _raw_error(
            503, "Service Unavailable", f"the server has {max_connections} connections open "
            "(max_connections); try again shortly", "too_many_connections")
        self.too_slow = _raw_error(
            408, "Request Timeout", f"the request's headers did not arrive within the "
            f"server's header_timeout of {header_timeout:g} s", "request_timeout"
        ) if header_timeout else b""


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header timeout and a cap on open connections; `serve`
    makes a subclass per server, its `guard` set (`protocol_class`)."""

    guard: _Guard

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        guard = self.guard
        if len(self.connections) > guard.max_connections:
            if not guard.waiting:  # all busy with requests: this one is refused
                self._refuse(guard.too_many)
                return
            oldest = next(iter(guard.waiting))
            oldest._refuse(guard.too_many)
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_watching()
        super().connection_lost(exc)

    def _watch(self) -> None:
        """Start the header clock when the connection waits for a request, stop it when
        one has arrived."""
        guard = self.guard
        if self.transport.is_closing():
            self._stop_watching()
        elif self.conn.their_state is not h11.IDLE:
            self._stop_watching()
        elif self not in guard.waiting:
            timer = None if guard.header_timeout is None else self.loop.call_later(
                guard.header_timeout, self._refuse, guard.too_slow)
            guard.waiting[self] = timer

    def _stop_watching(self) -> None:
        timer = self.guard.waiting.pop(self, None)
        if timer is not None:
            timer.cancel()

    def _refuse(self, response: bytes) -> None:
        self._stop_watching()
        if not self.transport.is_closing():
            self.transport.write(response)
            self.transport.close()


def protocol_class(max_connections: int, header_timeout: float | None) -> type[H11Protocol]:
    """The HTTP protocol for one server (uvicorn's `http=`)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"guard": _Guard(max_connections, header_timeout)})


class _AcceptErrorLog:
    """The event loop's exception handler: asyncio's "accept() out of system resource"
    (raised once per connection waiting while no descriptor is free) logged at most once
    per `every` seconds with the count left out; anything else as asyncio logs it."""

    MESSAGE = "socket.accept() out of system resource"

    def __init__(self, every: float = ACCEPT_LOG_EVERY):
        self.every, self.last, self.left_out = every, -float("inf"), 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if context.get("message") == self.MESSAGE:
            now = time.monotonic()
            if now - self.last < self.every:
                self.left_out += 1
                return
            more = f"; {self.left_out} more in the last {now - self.last:.0f} s" \
                if self.left_out else ""
            context = {**context, "message": f"{self.MESSAGE}: the process is out of file "
                       f"descriptors (raise `ulimit -n` or lower max_connections){more}"}
            self.last, self.left_out = now, 0
        loop.default_exception_handler(context)


class UvicornServer(uvicorn.Server):
    """uvicorn's server, its event loop's accept errors logged sparingly."""

    async def startup(self, sockets=None) -> None:
        asyncio.get_running_loop().set_exception_handler(_AcceptErrorLog())
        await super().startup(sockets=sockets)
