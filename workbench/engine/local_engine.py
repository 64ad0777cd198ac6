"""`LocalEngine`: what the engines that run here (`LLM`, `Encoder`, `WhisperModel`) share:
the backend they run on, the signals a notebook cell watches, and the steps their
constructors take (`_start_engine`, `_place_model`, `_start_warmup`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from workbench.engine.lifecycle import Closeable
from workbench.engine.runtime.backend import Backend, check_weight_dtype, select_backend
from workbench.engine.runtime.warmup import KernelTask, KernelWarmup, Warming
from workbench.signals import BusyCounter, Signal

M = TypeVar("M")


class LocalEngine(Closeable):
    """A model run in this process. `device` (the backend's name), `busy` (True while any
    call runs) and `warming` (kernels being compiled: progress, or None; see
    `workbench.engine.runtime.warmup`) are signals; `backend` is None on the CPU."""

    backend: Backend | None
    path: Path
    config: Any
    warmup: KernelWarmup

    def _start_engine(self, path: Path, device: str, backend: Backend | None,
                      dtype: str | None = None) -> None:
        """A constructor's first steps: the backend `device` names (refused here, before
        any weights load, when there is none; `dtype`: the float format its matrices
        are uploaded in, `workbench.engine.runtime.backend.WEIGHT_DTYPES`) and the
        signals, the file's path, and the lock held around every forward pass (one at a
        time per model; the kernel warm-up holds it too)."""
        self._start_signals(device, backend)
        check_weight_dtype(dtype, self.backend)
        if dtype is not None:
            self.backend.weight_dtype = dtype
        self.path = path
        self._forward_lock = threading.Lock()

    def _place_model(self, host: M, device_twin: Callable[[M, Backend], Any], *,
                     prepare_kernels: bool) -> M | Any:
        """The model to run: `host` (built on the CPU) as it is, or on a GPU backend its
        `device_twin(host, backend)` (weights uploaded once, the host copies dropped).
        Sets `config` from `host` and notes its kernel tasks for `_start_warmup` (on the
        CPU, with `prepare_kernels`)."""
        self.config = host.config
        self._kernel_tasks: list[KernelTask] = (
            host.kernel_tasks() if prepare_kernels and self.backend is None else [])
        return host if self.backend is None else device_twin(host, self.backend)

    def _start_warmup(self, helper: list[str] | None = None) -> None:
        """A constructor's last step: the kernel tasks noted by `_place_model` start in a
        background thread (`warmup`, progress in `warming`); `helper`: see
        `KernelWarmup`."""
        self.warmup = KernelWarmup(self._kernel_tasks, self.warming, self._forward_lock,
                                   helper).start()
        self._kernel_tasks = []

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
