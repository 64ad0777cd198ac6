"""`Closeable`: the context-manager half of everything that holds a model, a server or a
connection, so that `with LLM.load(...) as m:` frees it at the end of the block."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T", bound="Closeable")


class Closeable:
    """A resource released by `close()`; `with` calls it on leaving the block."""

    def close(self) -> None:
        """Release the resource (subclasses say what that frees)."""
        raise NotImplementedError

    def __enter__(self: T) -> T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
