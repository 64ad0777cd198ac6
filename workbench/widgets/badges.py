"""Small status badges that follow a model's `busy` and `device` signals.

    BusyBadge(m)     # "● busy" / "○ idle", DOM: <span class="wb-badge wb-busy" data-state="busy">
                     # "⚙ compiling 2/4" (data-state="compiling") while m.warming is set
    DeviceBadge(m)   # "cpu", DOM: <span class="wb-badge wb-device" data-state="cpu">
    MemoryBadge(m)   # "KV 41 / 40,960 tok · 1.8 MiB", DOM: <span class="wb-badge wb-memory"
                     # data-state="ok"> ("high" past 80% of the pool, "full" when none free)

Each badge binds its synced trait one way (signal -> widget) with
`workbench.signals.bind`; `close()` removes the link. The memory badge reads `m.memory()`
each time the model's `busy` signal changes (a generation starting or ending).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anywidget
import traitlets

from workbench.signals import Signal, bind

STATIC = Path(__file__).parent / "static"


def _signal_of(source: Any, attribute: str) -> Signal:
    """`source` itself when it is a Signal, else its `attribute` (e.g. an LLM's `busy`)."""
    if isinstance(source, Signal):
        return source
    signal = getattr(source, attribute, None)
    if not isinstance(signal, Signal):
        raise TypeError(f"expected a Signal or an object with a {attribute!r} Signal, "
                        f"got {type(source).__name__}")
    return signal


class _Badge(anywidget.AnyWidget):
    _esm = STATIC / "badge.js"
    _css = STATIC / "widgets.css"

    kind = traitlets.Unicode("").tag(sync=True)
    _unbind = None

    def close(self) -> None:
        """Stop following the signal and close the widget."""
        if self._unbind is not None:
            self._unbind()
            self._unbind = None
        super().close()


class BusyBadge(_Badge):
    """A badge showing whether a model is busy: `BusyBadge(llm)` or `BusyBadge(signal)`.

    The synced trait `busy` follows the signal; the DOM root has the classes
    `wb-badge wb-busy` and `data-state` "busy" or "idle". Given a model, the trait
    `warming` follows its `warming` signal (the kernels it is compiling, as text; ""
    when none): meanwhile `data-state` is "compiling" and the badge shows the progress.
    """

    busy = traitlets.Bool(False).tag(sync=True)
    warming = traitlets.Unicode("").tag(sync=True)

    def __init__(self, model_or_signal: Any, **kwargs: Any):
        super().__init__(kind="busy", **kwargs)
        self.signal: Signal[bool] = _signal_of(model_or_signal, "busy")
        unbind = [bind(self.signal, self, "busy", direction="to_widget"),
                  follow_warming(model_or_signal, self)]
        self._unbind = lambda: [fn() for fn in unbind]

    @property
    def state(self) -> str:
        """"compiling", "busy" or "idle": the badge's `data-state`."""
        if self.warming:
            return "compiling"
        return "busy" if self.busy else "idle"

    @property
    def label(self) -> str:
        """The badge's text."""
        if self.warming:
            return "⚙ compiling " + _progress(self.warming)
        return "● busy" if self.busy else "○ idle"


def follow_warming(model: Any, widget: Any) -> Callable[[], None]:
    """Keep `widget.warming` equal to the text of `model.warming` (the kernels it is
    compiling, "" when none; see `workbench.engine.runtime.warmup`); returns the function that
    stops it. A model without that signal (a remote engine) leaves the trait at ""."""
    warming = getattr(model, "warming", None)
    if not isinstance(warming, Signal):
        return lambda: None

    def show(state: Any) -> None:
        widget.warming = "" if state is None else str(state)

    show(warming.peek())
    return warming.subscribe(show)


def _progress(text: str) -> str:
    """"3/5" from "preparing kernels for this CPU (3/5): ..."."""
    return text[text.find("(") + 1 : text.find(")")] if "(" in text else ""


class DeviceBadge(_Badge):
    """A badge showing the device a model runs on: `DeviceBadge(llm)` or `DeviceBadge(signal)`.

    The synced trait `device` follows the signal; the DOM root has the classes
    `wb-badge wb-device` and `data-state` equal to the device name.
    """

    device = traitlets.Unicode("").tag(sync=True)

    def __init__(self, model_or_signal: Any, **kwargs: Any):
        super().__init__(kind="device", **kwargs)
        self.signal: Signal[str] = _signal_of(model_or_signal, "device")
        self._unbind = bind(self.signal, self, "device", direction="to_widget")

    @property
    def state(self) -> str:
        """The device name: the badge's `data-state` and text."""
        return self.device or "unknown"

    label = state


HIGH_SHARE = 0.8  # the memory badge's "high" state: this share of the KV pool held


class MemoryBadge(_Badge):
    """A badge showing how much of a model's KV cache is held: `MemoryBadge(llm)`.

    The synced traits `label` ("KV 41 / 40,960 tok · 1.8 MiB") and `level` ("ok",
    "high" past HIGH_SHARE of the pool, "full" when no position is free; the DOM root's
    `data-state`, with the classes `wb-badge wb-memory`) follow `llm.memory()`, read
    again whenever the model's `busy` signal changes and on `refresh()`. A model
    without `memory()` (a remote engine) shows "KV ?".
    """

    label = traitlets.Unicode("").tag(sync=True)
    level = traitlets.Unicode("ok").tag(sync=True)
    detail = traitlets.Unicode("").tag(sync=True)

    def __init__(self, model: Any, **kwargs: Any):
        super().__init__(kind="memory", **kwargs)
        self.model = model
        busy = getattr(model, "busy", None)
        self._unbind = busy.subscribe(lambda _: self.refresh()) \
            if isinstance(busy, Signal) else None
        self.refresh()

    def refresh(self) -> None:
        """Read the model's memory now."""
        memory = getattr(self.model, "memory", None)
        if not callable(memory):
            self.label, self.level, self.detail = "KV ?", "ok", "not a local model"
            return
        use = memory()
        total = use.kv_slots * use.kv_cache_size
        self.label = (f"KV {use.kv_tokens_used:,} / {total:,} tok · "
                      f"{use.kv_bytes / 2**20:.1f} MiB")
        self.level = ("full" if use.kv_tokens_free <= 0 else
                      "high" if use.kv_tokens_used >= HIGH_SHARE * total else "ok")
        self.detail = str(use)

    @property
    def state(self) -> str:
        """"ok", "high" or "full": the badge's `data-state`."""
        return self.level
