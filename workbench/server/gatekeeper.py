"""`Gatekeeper`: the ASGI middleware that checks a request before its body is read.

It answers 403 for a request a web page sent from another origin (unless `cors_origins`
allows it), 401 for a missing or wrong API key, 413 for a body over `max_body_bytes`
and 408 for a body that does not arrive within `body_timeout`, each as OpenAI's error
JSON, and counts the requests answered.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

from starlette.exceptions import HTTPException

from workbench.server.jobs import ServerState
from workbench.server.schemas import APIError


class Gatekeeper:
    """ASGI middleware, before any body is read: a browser's request from another web
    origin (403, unless `cors_origins` names it); the API key (401) for `/v1/*` (and the
    docs with `protect_docs`); the body size (413, by Content-Length up front or while a
    body without one streams in) and the time to send it (408); the count of answered
    requests.

    A refused body is not read: the error goes out at once and the HTTP layer (uvicorn)
    drops the rest of the body as it arrives, so a client still sending reads the error
    when it is done instead of a reset connection."""

    def __init__(self, app, state: ServerState, cors_origins: Sequence[str] = ()):
        self.app, self.state = app, state
        self.any_origin = "*" in cors_origins
        self.origins = {origin.encode("latin-1") for origin in cors_origins}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = self.state
        try:
            headers = dict(scope["headers"])
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

