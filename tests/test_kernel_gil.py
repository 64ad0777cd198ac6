"""Workbench's kernels run their parallel loops without touching the GIL
(`workbench.kernels.gil`), so that a busy Python thread of the same process (a notebook
cell, a server handler) does not hold every loop of a decode step for a switch interval.
Other code's parallel functions keep Numba's own launchers.

The launcher of a parallel loop is linked into the compiled function's library (Numba's
`parallelgufuncwrapper`): the LLVM function that calls `numba_parallel_for`. Its code says
whether it takes the GIL (`numba_gil_ensure`, `PyEval_SaveThread` / `PyEval_RestoreThread`).
The loop body's own wrapper beside it takes the GIL only to raise an error, as before.
"""

from __future__ import annotations

import re

import numba
import numpy as np

from workbench.kernels import cache
from workbench.kernels.lens import lens_rows

GIL_CALLS = ("numba_gil_ensure", "PyEval_SaveThread", "PyEval_RestoreThread")


def _launchers(dispatcher) -> list[str]:
    """The LLVM IR of each parallel launcher linked into `dispatcher`'s one compiled
    overload: the functions that call `numba_parallel_for`."""
    (overload,) = dispatcher.overloads.values()
    found = []
    for lib in overload.library._linking_libraries:
        if lib.name == "parallelgufuncwrapper":
            functions = re.findall(r"^define .*?^}$", lib.get_llvm_str(), re.S | re.M)
            found += [f for f in functions if "@numba_parallel_for(" in f]
    return found


def _lens_args():
    return (np.zeros((3, 700), np.float32), np.zeros((3, 4), np.int32),
            np.zeros((3, 4), np.float32), np.zeros(3, np.float32))


def test_workbench_kernels_launch_their_loops_without_the_gil():
    # a kernel of ours compiled afresh (the shipped one may come from the disk cache,
    # which keeps object code only): the options `cache.njit` gives it, in memory
    options = _options_in_memory()
    assert options["nogil"] and options["parallel"]
    kernel = numba.njit(**options)(lens_rows.py_func)
    args = _lens_args()
    args[0][:, 5] = 1.0
    kernel(*args)
    assert (args[1][:, 0] == 5).all()  # it ran, and is the lens
    launchers = _launchers(kernel)
    assert launchers, "no parallel launcher found: has Numba changed how it builds them?"
    for ir in launchers:
        assert "numba_parallel_for" in ir
        assert not any(call in ir for call in GIL_CALLS), "the launcher takes the GIL"


def test_other_parallel_functions_keep_numbas_launchers():
    """The same loop, compiled outside workbench's modules (or without nogil): Numba's
    launcher, which releases and retakes the GIL around each loop."""
    options = _options_in_memory()
    for function, nogil in ((_copy_of(lens_rows.py_func, "user_module"), True),
                            (lens_rows.py_func, False)):
        kernel = numba.njit(**{**options, "nogil": nogil})(function)
        kernel(*_lens_args())
        launchers = _launchers(kernel)
        assert launchers and all(all(call in ir for call in GIL_CALLS) for ir in launchers)


def test_njit_releases_the_gil_unless_told_otherwise():
    assert lens_rows.targetoptions["nogil"]

    @cache.njit(nogil=False)
    def held(x):
        return x + 1

    assert held(1) == 2 and not held.targetoptions["nogil"]


def _options_in_memory() -> dict:
    """`lens_rows`'s options, compiled in memory (njit sets nopython itself)."""
    options = {k: v for k, v in lens_rows.targetoptions.items() if k != "nopython"}
    return {**options, "cache": False}


def _copy_of(function, module: str):
    """`function` as if defined in `module`."""
    import types

    copy = types.FunctionType(function.__code__, function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)
    copy.__module__ = module
    return copy
