"""Parallel regions that leave the GIL alone, for workbench's kernels.

Numba runs each parallel loop (`prange`) of a function through a launcher it generates:
the launcher takes the GIL (`PyGILState_Ensure`), releases it for the loop
(`PyEval_SaveThread`), then takes it back (`PyEval_RestoreThread`) and returns it. A thread
that must wait for the GIL waits for whoever holds it to let go, which a busy Python
thread does only every switch interval (5 ms by default). SmolLM2's decode step runs ~240
parallel loops a token, so one pure-Python loop elsewhere in the process (a notebook
cell, a server's handler) took decode from ~160 tokens/s to under 1.

The loops themselves never need the GIL: they run compiled code on Numba's thread team,
and the calling thread only waits for them. So a function compiled here with
`nogil=True` (every workbench kernel: `workbench.kernels.cache.njit` sets it) gets
launchers without those four calls: Python releases the GIL once when the function is
called from Python and takes it back once when it returns, whatever the number of loops.
A kernel called from another compiled function that holds the GIL keeps it through its
loops, as any compiled code without parallel loops does.

How: the launcher is built by `numba.np.ufunc.parallel.build_gufunc_kernel` while a
function is compiled. `install()` wraps it: while a workbench dispatcher compiled with
`nogil=True` is being compiled on this thread (Numba's `numba:compile` events), the
launcher is built through a context whose Python API emits nothing for those four calls.
Other functions in the process (the user's own `@njit(parallel=True)`) are compiled as
Numba compiles them. Where Numba no longer builds launchers there, nothing is wrapped and
the kernels keep Numba's launchers (tests/test_kernel_gil.py then fails).
"""

from __future__ import annotations

import threading

import numba.np.ufunc.parallel as _parallel
from numba.core import event

_PACKAGE = "workbench."
_local = threading.local()  # .compiling: the dispatchers being compiled on this thread


class _Compiling(event.Listener):
    """Keeps the stack of dispatchers being compiled on each thread."""

    def on_start(self, e: event.Event) -> None:
        _stack().append(e.data["dispatcher"])

    def on_end(self, e: event.Event) -> None:
        _stack().pop()


def _stack() -> list:
    if not hasattr(_local, "compiling"):
        _local.compiling = []
    return _local.compiling


def _gil_free() -> bool:
    """Whether the function compiled on this thread now is a workbench nogil kernel."""
    stack = _stack()
    if not stack:
        return False
    dispatcher = stack[-1]
    module = getattr(getattr(dispatcher, "py_func", None), "__module__", "") or ""
    return module.startswith(_PACKAGE) and bool(dispatcher.targetoptions.get("nogil"))


class _NoGILCalls:
    """Numba's Python API for one launcher, with its GIL calls emitting no code (the
    values they return only reach each other)."""

    def __init__(self, api):
        self._api = api

    def __getattr__(self, name: str):
        return getattr(self._api, name)

    def gil_ensure(self) -> None:
        return None

    def gil_release(self, state) -> None:
        pass

    def save_thread(self) -> None:
        return None

    def restore_thread(self, state) -> None:
        pass


class _LauncherContext:
    """Numba's target context, handing out `_NoGILCalls` as its Python API."""

    def __init__(self, ctx):
        self._ctx = ctx

    def __getattr__(self, name: str):
        return getattr(self._ctx, name)

    def get_python_api(self, builder):
        return _NoGILCalls(self._ctx.get_python_api(builder))


_numba_launcher = getattr(_parallel, "build_gufunc_kernel", None)


def _launcher(library, ctx, *args, **kwargs):
    if _gil_free():
        ctx = _LauncherContext(ctx)
    return _numba_launcher(library, ctx, *args, **kwargs)


def install() -> None:
    """Build the launchers of workbench's nogil kernels without GIL calls from now on
    (idempotent)."""
    if _numba_launcher is not None and _parallel.build_gufunc_kernel is not _launcher:
        event.register("numba:compile", _Compiling())
        _parallel.build_gufunc_kernel = _launcher
