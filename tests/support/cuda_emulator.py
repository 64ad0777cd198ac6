"""CUDA kernels run on the CPU: the CUDA C++ of workbench/kernels/gguf.cu and
`cuda.STEP_SOURCE`, compiled with g++ after tests/support/cuda_emulator.hpp, which runs
each block's threads as coroutines (barriers and warp shuffles included).

`EmulatedModule` stands for `cupy.RawModule` and `emulated_cupy()` for the cupy module as
`workbench.kernels.cuda.CudaKernels` and `CupyBackend` use it (NumPy arrays whose
`.data.ptr` is their address), so that the kernels' code and their launches (grids,
argument lists) are checked without a GPU. Slow (a context switch per thread per
barrier): for small shapes.

`LAUNCHES` logs what would be a node of a CUDA graph: each kernel launch by name, and each
CuPy operation that makes new data (an elementwise operation or reduction, a copy, a
conversion, a gather, an assignment into an array) as "op:<name>". Allocations
(`empty`) and views are not logged.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

RUNTIME = Path(__file__).with_name("cuda_emulator.hpp")

LAUNCHES: list[str] = []
"""Kernel launches and data-making CuPy operations, in order (clear it to count)."""

_ARGUMENT_TYPES = {
    np.int32: ctypes.c_int32, np.int64: ctypes.c_int64, np.uint64: ctypes.c_uint64,
    np.float32: ctypes.c_float, np.float64: ctypes.c_double,
}


def _compiler() -> str:
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        pytest.fail("the CUDA emulator needs a C++17 compiler (g++): apt install g++")
    return cxx


def _kernel_names(cxx: str, source: str) -> list[str]:
    """The extern "C" kernels the source defines once its macros are expanded."""
    run = subprocess.run([cxx, "-E", "-P", "-std=c++17", "-x", "c++", "-"], input=source,
                         capture_output=True, text=True, check=True)
    return sorted(set(re.findall(r'extern\s+"C"\s+void\s+(\w+)\s*\(', run.stdout)))


def _build(code: str) -> tuple[ctypes.CDLL, list[str]]:
    cxx = _compiler()
    source = RUNTIME.read_text() + "\n#line 1 \"kernel.cu\"\n" + code
    names = _kernel_names(cxx, source)
    source += "".join(
        f'\nextern "C" int emu_launch_{n}(unsigned gx, unsigned gy, unsigned gz, unsigned bx,'
        f" unsigned by, unsigned bz, void** args) {{\n"
        f"  return emu::launch({n}, gx, gy, gz, bx, by, bz, args);\n}}\n" for n in names)
    key = hashlib.sha256(source.encode()).hexdigest()[:20]
    folder = Path(tempfile.gettempdir()) / "workbench-cuda-emulator"
    folder.mkdir(exist_ok=True)
    library = folder / f"{key}.so"
    if not library.exists():
        work = folder / f"{key}.{os.getpid()}"
        (work.with_suffix(".cpp")).write_text(source)
        run = subprocess.run([cxx, "-std=c++17", "-O1", "-ffp-contract=off", "-fPIC",
                              "-shared", "-w", "-o", str(work.with_suffix(".so")),
                              str(work.with_suffix(".cpp"))], capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"the kernels did not compile for the emulator:\n{run.stderr}")
        os.replace(work.with_suffix(".so"), library)
        work.with_suffix(".cpp").unlink()
    return ctypes.CDLL(str(library)), names


def _dims(d: Any) -> tuple[int, int, int]:
    d = (d,) if isinstance(d, (int, np.integer)) else tuple(d)
    return tuple(int(v) for v in d) + (1,) * (3 - len(d))


class EmulatedKernel:
    """One kernel, called as CuPy's RawKernel is: `kernel(grid, block, args)`."""

    def __init__(self, function: Any, name: str):
        self.function, self.name = function, name

    def __call__(self, grid: Any, block: Any, args: tuple, **unused: Any) -> None:
        values = []
        for i, a in enumerate(args):
            if isinstance(a, np.ndarray):
                if not isinstance(a, EmulatedArray):
                    raise TypeError(f"{self.name}: argument {i} is a host array")
                values.append(ctypes.c_void_p(a.ctypes.data))
            elif type(a) in _ARGUMENT_TYPES:
                values.append(_ARGUMENT_TYPES[type(a)](a.item()))
            else:
                raise TypeError(f"{self.name}: argument {i} is a {type(a).__name__}; pass "
                                "NumPy scalars of the parameter's type")
        pointers = (ctypes.c_void_p * max(1, len(values)))(
            *[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
        LAUNCHES.append(self.name)
        status = self.function(*_dims(grid), *_dims(block), pointers)
        if status:
            raise RuntimeError(f"{self.name}: " + ("a block deadlocked at a barrier"
                                                   if status == 1 else "bad block size"))


class EmulatedModule:
    """`cupy.RawModule(code=...)` compiled for the CPU."""

    def __init__(self, code: str, options: tuple = (), **unused: Any):
        self.library, self.names = _build(code)
        self.kernels: dict[str, EmulatedKernel] = {}

    def get_function(self, name: str) -> EmulatedKernel:
        if name not in self.kernels:
            if name not in self.names:
                raise AttributeError(f"no kernel named {name}")
            function = getattr(self.library, f"emu_launch_{name}")
            function.restype = ctypes.c_int
            function.argtypes = [ctypes.c_uint] * 6 + [ctypes.c_void_p]
            self.kernels[name] = EmulatedKernel(function, name)
        return self.kernels[name]


class _Pointer:
    def __init__(self, ptr: int):
        self.ptr = ptr


def _makes_data(out: Any, inputs: tuple) -> bool:
    """Whether `out` is new data, not a view of one of the inputs."""
    arrays = [a for a in inputs if isinstance(a, np.ndarray)]
    return isinstance(out, np.ndarray) and not any(np.may_share_memory(out, a) for a in arrays)


class EmulatedArray(np.ndarray):
    """A NumPy array standing for a CuPy one: `.data.ptr` is its first element's address;
    the operations that would launch a kernel are logged in `LAUNCHES`."""

    @property
    def data(self) -> _Pointer:  # type: ignore[override]
        return _Pointer(self.ctypes.data)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        LAUNCHES.append(f"op:{ufunc.__name__}.{method}")
        plain = [a.view(np.ndarray) if isinstance(a, EmulatedArray) else a for a in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(a.view(np.ndarray) if isinstance(a, EmulatedArray) else a
                                  for a in kwargs["out"])
        return _on_device(getattr(ufunc, method)(*plain, **kwargs))

    def __setitem__(self, key: Any, value: Any) -> None:
        LAUNCHES.append("op:setitem")
        super().__setitem__(key, value)

    def __getitem__(self, key: Any) -> Any:
        out = super().__getitem__(key)
        if _makes_data(out, (self,)):  # a gather
            LAUNCHES.append("op:getitem")
        return out

    def astype(self, *args: Any, **kwargs: Any) -> Any:
        out = super().astype(*args, **kwargs)
        if out is not self:
            LAUNCHES.append("op:astype")
        return out

    def copy(self, *args: Any, **kwargs: Any) -> Any:
        LAUNCHES.append("op:copy")
        return super().copy(*args, **kwargs)


def _on_device(x: Any) -> Any:
    if isinstance(x, np.generic):
        return np.asarray(x).view(EmulatedArray)
    if isinstance(x, np.ndarray) and not isinstance(x, EmulatedArray):
        return x.view(EmulatedArray)
    return x


_ALLOCATIONS = ("empty", "empty_like")  # no kernel


class _EmulatedCupy(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        value = getattr(np, name)
        if callable(value) and not isinstance(value, type):
            def device_call(*args: Any, **kwargs: Any) -> Any:
                out = value(*args, **kwargs)
                if name not in _ALLOCATIONS and _makes_data(out, args):
                    LAUNCHES.append(f"op:{name}")
                return tuple(map(_on_device, out)) if isinstance(out, tuple) else _on_device(out)
            return device_call
        return value


def _upload(a: Any, dtype: Any = None) -> EmulatedArray:
    """`cupy.asarray`: a host array is copied (device memory is not the host's)."""
    if isinstance(a, EmulatedArray):
        return a if dtype is None or a.dtype == dtype else a.astype(dtype)
    return np.array(a, dtype=dtype).view(EmulatedArray)


def emulated_cupy() -> types.ModuleType:
    """A module that answers for `cupy` where `CudaKernels` uses it: NumPy's functions
    returning `EmulatedArray`s, `asnumpy`, and `RawModule` = `EmulatedModule`."""
    cp = _EmulatedCupy("cupy")
    cp.emulated = True
    cp.asarray = _upload
    cp.RawModule = EmulatedModule
    cp.ndarray = EmulatedArray
    cp.asnumpy = lambda a: np.array(a)
    return cp

