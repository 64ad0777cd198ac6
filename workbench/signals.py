"""Reactive state: `Signal`, `Computed`, `effect`, `batch`, and a bridge to widget traits.

    busy = Signal(False)
    label = Computed(lambda: "working" if busy.get() else "idle")
    stop = effect(lambda: print(label.get()))   # prints "idle", then again on change
    busy.set(True)                              # prints "working"
    stop()                                      # no more re-runs

Reading a signal with `.get()` inside an effect or a computed records it as a
dependency; setting it re-runs what depends on it. Inside `with batch():`
notifications wait until the block ends, and each dependant runs once.

Thread safety: one re-entrant lock guards the whole graph, and notifications
run while it is held, in the thread that set the signal. Callbacks therefore
see a consistent graph, and must not block waiting for another thread that is
itself setting a signal.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_lock = threading.RLock()
_tracking = threading.local()  # .stack: observers currently recording their dependencies
_batch_depth = 0
_pending: dict[_Observer, None] = {}  # ordered set of observers to run when the batch ends
_changed: dict[Signal, None] = {}  # signals whose subscribers to call when the batch ends


def _stack() -> list:
    stack = getattr(_tracking, "stack", None)
    if stack is None:
        stack = _tracking.stack = []
    return stack


class Signal(Generic[T]):
    """A value that notifies its dependants and subscribers when it changes."""

    def __init__(self, value: T, *, name: str | None = None):
        self._value = value
        self.name = name
        self._observers: dict[_Observer, None] = {}
        self._subscribers: list[Callable[[T], Any]] = []

    def get(self) -> T:
        """The current value; inside an effect or computed this records a dependency."""
        with _lock:
            stack = _stack()
            if stack:
                observer = stack[-1]
                self._observers[observer] = None
                observer._sources[self] = None
            return self._value

    def peek(self) -> T:
        """The current value, without recording a dependency."""
        return self._value

    def set(self, value: T) -> None:
        """Change the value; nothing happens when it equals the current one."""
        with _lock:
            if _equal(self._value, value):
                return
            self._value = value
            self._notify()

    def update(self, fn: Callable[[T], T]) -> None:
        """Set the value to `fn(current value)`, atomically."""
        with _lock:
            self.set(fn(self._value))

    @property
    def value(self) -> T:
        return self.get()

    @value.setter
    def value(self, value: T) -> None:
        self.set(value)

    def subscribe(self, fn: Callable[[T], Any]) -> Callable[[], None]:
        """Call `fn(new_value)` after every change; returns a function that unsubscribes."""
        with _lock:
            self._subscribers.append(fn)

        def unsubscribe() -> None:
            with _lock:
                if fn in self._subscribers:
                    self._subscribers.remove(fn)

        return unsubscribe

    def _notify(self) -> None:
        _changed[self] = None
        for observer in list(self._observers):
            _pending[observer] = None
        if _batch_depth == 0:
            _flush()

    def __repr__(self) -> str:
        label = f" {self.name}" if self.name else ""
        return f"<{type(self).__name__}{label} {self._value!r}>"


class _Observer:
    """Something that re-runs when a signal it read changes (an effect or a computed)."""

    def __init__(self):
        self._sources: dict[Signal, None] = {}
        self._disposed = False

    def _track(self, fn: Callable[[], T]) -> T:
        """Run fn recording the signals it reads (replacing the previous record)."""
        for source in self._sources:
            source._observers.pop(self, None)
        self._sources = {}
        stack = _stack()
        stack.append(self)
        try:
            return fn()
        finally:
            stack.pop()

    def _dispose(self) -> None:
        with _lock:
            self._disposed = True
            for source in self._sources:
                source._observers.pop(self, None)
            self._sources = {}
            _pending.pop(self, None)

    def _run(self) -> None:
        raise NotImplementedError


class Computed(Signal[T]):
    """A read-only signal derived from others: `Computed(lambda: a.get() + b.get())`."""

    def __init__(self, fn: Callable[[], T], *, name: str | None = None):
        self._fn = fn
        self._node = _ComputedNode(self)
        with _lock:
            super().__init__(self._node._track(fn), name=name)

    def set(self, value: T) -> None:
        raise AttributeError("a Computed is read-only; set the signals it derives from")

    def _recompute(self) -> None:
        value = self._node._track(self._fn)
        if not _equal(self._value, value):
            self._value = value
            self._notify()

    def dispose(self) -> None:
        """Stop following the signals this computed reads."""
        self._node._dispose()


class _ComputedNode(_Observer):
    def __init__(self, computed: Computed):
        super().__init__()
        self.computed = computed

    def _run(self) -> None:
        self.computed._recompute()


class _Effect(_Observer):
    def __init__(self, fn: Callable[[], Any]):
        super().__init__()
        self.fn = fn

    def _run(self) -> None:
        if not self._disposed:
            self._track(self.fn)


def effect(fn: Callable[[], Any]) -> Callable[[], None]:
    """Run `fn` now and again whenever a signal it read changes; returns a disposer."""
    e = _Effect(fn)
    with _lock:
        e._run()
    return e._dispose


@contextmanager
def batch() -> Iterator[None]:
    """Defer notifications until the block ends; each dependant then runs once."""
    global _batch_depth
    with _lock:
        _batch_depth += 1
        try:
            yield
        finally:
            _batch_depth -= 1
            if _batch_depth == 0:
                _flush()


def _flush() -> None:
    """Run pending observers (computeds first, so effects see fresh values), then subscribers.

    Runs as a batch itself: what the observers set joins the queue being drained.
    """
    global _batch_depth
    _batch_depth += 1
    try:
        _drain()
    finally:
        _batch_depth -= 1


def _drain() -> None:
    while _pending or _changed:
        while _pending:
            computed = next((o for o in _pending if isinstance(o, _ComputedNode)), None)
            observer = computed if computed is not None else next(iter(_pending))
            del _pending[observer]
            observer._run()
        while _changed and not _pending:
            signal = next(iter(_changed))
            del _changed[signal]
            for fn in list(signal._subscribers):
                fn(signal._value)


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a is b or a == b)
    except Exception:  # e.g. arrays: compare by identity only
        return a is b


class BusyCounter:
    """Refcounted busy state: `busy` is True while any `with counter:` block is open.

    Correct when one busy method calls another and across threads; an exception
    inside the block still closes it.
    """

    def __init__(self, signal: Signal[bool]):
        self.signal = signal
        self._count = 0
        self._count_lock = threading.Lock()

    def __enter__(self) -> BusyCounter:
        with self._count_lock:
            self._count += 1
            first = self._count == 1
        if first:
            self.signal.set(True)
        return self

    def __exit__(self, *exc) -> None:
        with self._count_lock:
            self._count -= 1
            last = self._count == 0
        if last:
            self.signal.set(False)


def bind(signal: Signal, widget: Any, trait: str, *, direction: str = "both"
         ) -> Callable[[], None]:
    """Link `signal` to the traitlet `trait` of `widget` (any `traitlets.HasTraits`).

    direction: "to_widget" (signal drives the trait), "from_widget" (the trait
    drives the signal) or "both". The trait takes the signal's value at once
    (unless "from_widget"). Returns a function that removes the link.
    """
    if direction not in ("both", "to_widget", "from_widget"):
        raise ValueError("direction must be 'both', 'to_widget' or 'from_widget'")
    undo: list[Callable[[], None]] = []
    if direction in ("both", "to_widget"):
        setattr(widget, trait, signal.peek())
        undo.append(signal.subscribe(lambda value: setattr(widget, trait, value)))
    if direction in ("both", "from_widget"):
        if isinstance(signal, Computed):
            raise ValueError("a Computed cannot be driven by a widget")

        def on_change(change: dict) -> None:
            signal.set(change["new"])

        widget.observe(on_change, names=trait)
        undo.append(lambda: widget.unobserve(on_change, names=trait))

    def unbind() -> None:
        for fn in undo:
            fn()

    return unbind
