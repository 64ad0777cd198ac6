"""`LocalEngine`: what the engines that run here (`LLM`, `Encoder`, `WhisperModel`) share:
the backend they run on and the signals a notebook cell watches."""

from __future__ import annotations

from workbench.engine.backend import Backend, select_backend
from workbench.engine.lifecycle import Closeable
from workbench.engine.warmup import Warming
from workbench.signals import BusyCounter, Signal


class LocalEngine(Closeable):
    """A model run in this process. `device` (the backend's name), `busy` (True while any
    call runs) and `warming` (kernels being compiled: progress, or None; see
    `workbench.engine.warmup`) are signals; `backend` is None on the CPU."""

    backend: Backend | None

    def _start_signals(self, device: str, backend: Backend | None) -> None:
        """Pick the backend `device` names (or `backend` itself) and set up the signals."""
        name, self.backend = select_backend(device, backend)
        self.device: Signal[str] = Signal(name, name="device")
        self.busy: Signal[bool] = Signal(False, name="busy")
        self._busy = BusyCounter(self.busy)
        self.warming: Signal[Warming | None] = Signal(None, name="warming")

    def marked_busy(self) -> BusyCounter:
        """`with engine.marked_busy():` the `busy` signal is True inside (refcounted: calls
        that nest or overlap keep it True until the last one ends)."""
        return self._busy
