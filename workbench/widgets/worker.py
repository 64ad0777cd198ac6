"""`Worker`: the part shared by cells that generate on a background thread.

Generation runs off the kernel's main thread so that Stop and other widget
messages are handled while tokens stream; `wait` joins that thread.
"""

from __future__ import annotations

import threading


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
