"""The OpenAI-compatible server and the remote engine.

- `serve(engine, ...)` (also `workbench.serve`): run the app in a background thread.
- `create_app(engines, ...)`: the FastAPI app itself, to mount or run elsewhere.
- `RemoteEngine(base_url, model)`: an engine over any OpenAI-compatible server.

The server's packages (FastAPI, uvicorn, sse-starlette) load on first use.
"""

from __future__ import annotations

from workbench.server.runner import Server, serve

__all__ = ["RemoteEngine", "Server", "create_app", "serve"]


def __getattr__(name: str):
    if name == "create_app":
        from workbench.server.app import create_app

        return create_app
    if name == "RemoteEngine":
        from workbench.server.remote import RemoteEngine

        return RemoteEngine
    raise AttributeError(f"module 'workbench.server' has no attribute {name!r}")
