"""The CUDA sources as a GPU machine compiles them: NVRTC (NVIDIA's runtime compiler, the
one `cupy.RawModule` calls; its PyPI wheel runs without a GPU) builds `gguf.cu` and
`cuda.STEP_SOURCE` for the H100/H200 (sm_90) with the options `CudaKernels` gives CuPy,
and ptxas's report of each kernel is read:

- both compile, with no warning;
- no kernel spills registers to local memory or keeps a stack frame (the decode step's
  products are memory-bound: a spill would add a round trip to memory per group);
- each kernel's registers times the threads `CudaKernels` launches it with fit one
  multiprocessor's register file (else every launch fails with "too many resources
  requested for launch", which the emulator on the CPU cannot show);
- static shared memory stays within the 48 KiB a block gets without opting in.

The emulator (tests/test_cuda_emulated.py) checks what the kernels compute; this checks
what only NVIDIA's compiler can.
"""

from __future__ import annotations

import ctypes
import importlib.util
import platform
import re
from pathlib import Path

import pytest

from workbench.kernels import cuda

ARCH = "sm_90"
REGISTER_FILE = 65536  # 32-bit registers per multiprocessor (sm_50 to sm_90)
STATIC_SHARED = 48 * 1024
OPTIONS = ("--std=c++17",)  # what CudaKernels passes to cupy.RawModule

pytestmark = pytest.mark.skipif(platform.system() != "Linux",
                                reason="NVRTC's wheel (nvidia-cuda-nvrtc-cu12) is for Linux")


def _nvrtc() -> ctypes.CDLL:
    spec = importlib.util.find_spec("nvidia.cuda_nvrtc")
    assert spec is not None, "NVRTC is missing: pip install -e '.[dev]'"
    (folder,) = spec.submodule_search_locations
    (lib,) = sorted(Path(folder, "lib").glob("libnvrtc.so.*[0-9]"))
    return ctypes.CDLL(str(lib))


def _compile(source: str, name: str) -> tuple[int, str]:
    """NVRTC's result code and log for `source` compiled to a cubin for ARCH, with ptxas
    reporting each kernel's resources."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0,
                                  None, None) == 0
    try:
        options = [*OPTIONS, f"-arch={ARCH}", "--ptxas-options=-v"]
        argv = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        result = lib.nvrtcCompileProgram(prog, len(options), argv)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        return result, log.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


KERNEL = re.compile(r"Compiling entry function '(\w+)'")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?")


def _resources(log: str) -> dict[str, dict[str, int]]:
    """ptxas's report per kernel: stack frame, spills, registers, static shared memory."""
    out: dict[str, dict[str, int]] = {}
    name = None
    for line in log.splitlines():
        if m := KERNEL.search(line):
            name = m.group(1)
            out[name] = {}
        elif name and (m := FRAME.search(line)):
            out[name].update(stack=int(m.group(1)), spills=int(m.group(2)) + int(m.group(3)))
        elif name and (m := USED.search(line)):
            out[name].update(registers=int(m.group(1)), smem=int(m.group(2) or 0))
    return out


def _threads(kernel: str) -> int:
    """The block size `CudaKernels` launches `kernel` with."""
    if kernel.startswith(("gemv_", "step_")):
        return cuda._GEMV_THREADS
    if kernel.startswith("dequantize_"):
        return cuda._DEQUANT_THREADS
    if kernel == "store_kv":
        return cuda._STORE_THREADS
    return cuda._STEP_THREADS  # attend_step, rope_store, rms_norm, rope, glu


@pytest.fixture(scope="module", params=["gguf.cu", "STEP_SOURCE"])
def compiled(request) -> tuple[str, int, str]:
    source = cuda.SOURCE.read_text() if request.param == "gguf.cu" else cuda.STEP_SOURCE
    return (request.param, *_compile(source, request.param))


def test_nvrtc_compiles_the_sources_without_a_warning(compiled):
    name, result, log = compiled
    assert result == 0, log
    assert "warning" not in log.lower(), log


def test_every_kernel_fits_the_multiprocessor_without_spilling(compiled):
    name, result, log = compiled
    assert result == 0, log
    kernels = _resources(log)
    if name == "gguf.cu":  # three kernels per format with CUDA kernels
        assert {f"{kind}_{fmt}" for fmt in cuda.FORMATS.values()
                for kind in ("dequantize", "gemv", "step")} <= set(kernels)
    else:
        assert {"attend_step", "rope_store", "store_kv", "rms_norm", "rope", "glu"} \
            <= set(kernels)
    for kernel, used in kernels.items():
        assert used["stack"] == 0 and used["spills"] == 0, (kernel, used)
        assert used["registers"] * _threads(kernel) <= REGISTER_FILE, (kernel, used)
        assert used["smem"] <= STATIC_SHARED, (kernel, used)
