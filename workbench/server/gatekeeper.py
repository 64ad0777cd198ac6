"""`Gatekeeper`: the ASGI middleware that checks a request before its body is read.

It answers 403 for a request that names a host the server does not answer to (a page
on another site reaching a loopback server by DNS rebinding), 403 for a request a web
page sent from another origin (unless `cors_origins` allows it), 401 for a missing or
wrong API key, 413 for a body over `max_body_bytes` and 408 for a body that does not
arrive within `body_timeout`, each as OpenAI's error JSON, and counts the requests
answered.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import Collection, Sequence

from starlette.exceptions import HTTPException

from workbench.server.jobs import ServerState
from workbench.server.schemas import APIError


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an IP address, without a port) always means this machine:
    a loopback address, `localhost` or a name under `.localhost` (RFC 6761: resolved to
    loopback without asking DNS)."""
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts_for(listen_host: str, allowed: Sequence[str] | None) -> frozenset[str] | None:
    """The names a request's `Host` may give, besides the loopback ones (`is_loopback`),
    for a server listening on `listen_host`; None: any. By default (`allowed` None) a
    server listening on loopback answers to loopback names only, since a web page that
    rebinds its own name to 127.0.0.1 sends that name; one listening on other interfaces
    answers any (its clients name it as they reach it: set an API key). "*" allows any."""
    if allowed is None:
        return frozenset() if is_loopback(listen_host.strip("[]")) else None
    if "*" in allowed:
        return None
    return frozenset(h.lower().rstrip(".") for h in allowed)


def _host_name(header: bytes) -> str:
    """The host of a `Host` header, without its port, lower case, without a final dot:
    "[::1]:8000" -> "::1", "Box.LAN.:80" -> "box.lan"."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1 : text.find("]")] if "]" in text else text
    return (text.rsplit(":", 1)[0] if text.count(":") == 1 else text).rstrip(".")


class Gatekeeper:
    """ASGI middleware, before any body is read: a `Host` the server does not answer to
    (403, where `allowed_hosts` is not None: `allowed_hosts_for`); a browser's request
    from another web origin (403, unless `cors_origins` names it); the API key (401) for
    `/v1/*` (and the docs with `protect_docs`); the body size (413, by Content-Length up
    front or while a body without one streams in) and the time to send it (408); the
    count of answered requests.

    A refused body is not read: the error goes out at once and the HTTP layer (uvicorn)
    drops the rest of the body as it arrives, so a client still sending reads the error
    when it is done instead of a reset connection."""

    def __init__(self, app, state: ServerState, cors_origins: Sequence[str] = (),
                 allowed_hosts: Collection[str] | None = None):
        self.app, self.state = app, state
        self.allowed_hosts = allowed_hosts
        self.any_origin = "*" in cors_origins
        self.origins = {origin.encode("latin-1") for origin in cors_origins}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = self.state
        try:
            headers = dict(scope["headers"])
            host = headers.get(b"host")
            if not self.host_allowed(host):
                return await _send_error(send, APIError(
                    403, f"host {_host_name(host)!r} not allowed: this server answers to "
                    "localhost, 127.0.0.1 and the names serve(..., allowed_hosts=[...]) "
                    "(--allowed-host) adds; a web page that points its own name at this "
                    "machine sends that name", code="host_not_allowed"))
            if self.cross_site(scope, headers):
                return await _send_error(send, APIError(
                    403, "cross-site request refused: this server lets no web page of "
                    "another origin call it; allow the page's origin with "
                    "serve(..., cors_origins=[...]) (--cors-origin)",
                    code="cross_site_request"))
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

    def host_allowed(self, header: bytes | None) -> bool:
        """Whether the request's `Host` header names this server: any name where
        `allowed_hosts` is None; else a loopback name or one of `allowed_hosts`.
        A request without the header (HTTP/1.0) is no browser's and passes."""
        if self.allowed_hosts is None or header is None:
            return True
        host = _host_name(header)
        return is_loopback(host) or host in self.allowed_hosts

    def cross_site(self, scope, headers: dict[bytes, bytes]) -> bool:
        """Whether a browser sent this request for a page of another origin that
        `cors_origins` does not allow. Browsers name the page's origin (`Origin`, on
        every POST and cross-origin fetch) and say how it relates to this server
        (`Sec-Fetch-Site`); neither header can be set by the page. Other clients
        send neither. A plain link followed to this server (a GET navigation) is not
        refused: its answer goes to the user, not to the page."""
        origin, site = headers.get(b"origin"), headers.get(b"sec-fetch-site")
        if (origin is None and site is None) or self.any_origin or origin in self.origins:
            return False
        if site is not None:
            if site in (b"same-origin", b"none"):  # this server's own pages, the user
                return False
            return not (scope["method"] in ("GET", "HEAD")
                        and headers.get(b"sec-fetch-mode") == b"navigate")
        # a browser without Fetch Metadata: the page's origin against this server's
        host = headers.get(b"host", b"")
        return origin not in (b"http://" + host, b"https://" + host)


async def _send_error(send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})

