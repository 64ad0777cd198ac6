"""`Worker`: the part shared by cells that generate on a background thread.

Generation runs off the kernel's main thread so that Stop and other widget
messages are handled while tokens stream; `wait` joins that thread.
`StoppableWorker` adds Stop, a `busy` trait following the model's busy signal
(and a `warming` trait, in widgets that have one, following the kernels the model is
compiling, as text), and a `close` that ends both.
"""

from __future__ import annotations

import threading
from typing import Any

from workbench.signals import bind
from workbench.widgets.badges import follow_warming


class Worker:
    """Mixin for a cell that keeps its running generation thread in `self._thread`."""

    _thread: threading.Thread | None = None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the running generation to end; True when none runs any more."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            return not thread.is_alive()
        return True


class StoppableWorker(Worker):
    """Mixin for a widget with a `busy` trait whose worker checks `self._stop` between
    tokens; call `_follow(model)` from `__init__`."""

    _stop: threading.Event | None = None
    _unbind_busy = None

    def _follow(self, model: Any) -> None:
        self._stop = threading.Event()
        unbind = [bind(model.busy, self, "busy", direction="to_widget")]
        if self.has_trait("warming"):
            unbind.append(follow_warming(model, self))
        self._unbind_busy = lambda: [fn() for fn in unbind]

    def stop(self) -> None:
        """Stop the running generation after the current token (no-op when idle)."""
        if self._stop is not None:
            self._stop.set()

    def close(self) -> None:
        """Stop generating, unbind the busy signal and close the widget."""
        self.stop()
        self.wait()
        if self._unbind_busy is not None:
            self._unbind_busy()
            self._unbind_busy = None
        super().close()
