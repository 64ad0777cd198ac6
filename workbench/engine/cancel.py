"""Cancelling an engine call from another thread.

Long engine calls (`LLM.generate_batch`, `Encoder.embed_batch`,
`WhisperModel.transcribe`, ...) take `cancel=`: anything with `is_set()`,
usually a `threading.Event`. They look at it between steps (a token, a batch of
texts, a 30 s window) and raise `Cancelled` once it is set, so the thread that
asked can drop the call (the server does, when its client disconnects).
"""

from __future__ import annotations

from typing import Protocol


class CancelFlag(Protocol):
    """What `cancel=` takes: a `threading.Event` or anything with `is_set()`."""

    def is_set(self) -> bool: ...


class Cancelled(Exception):
    """The call was cancelled through its `cancel=` flag before it finished."""


def check_cancel(cancel: CancelFlag | None) -> None:
    """Raise `Cancelled` if `cancel` is set (None is never set)."""
    if cancel is not None and cancel.is_set():
        raise Cancelled("cancelled")
