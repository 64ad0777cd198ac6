"""The devices the fidelity tests run on, and opening a model on one of them.

The defaults: the NumPy engine, the MLX backend (`mlx[cpu]` runs its array code on this
CPU) and the CuPy backend's code with NumPy standing in for CuPy and `ReferenceKernels`
for its RawKernels. `WORKBENCH_TEST_DEVICES=cuda` (as tests/test_gpu.py sets it) runs
them on a real GPU instead.
"""

from __future__ import annotations

import os

import pytest

DEVICES = tuple(os.environ.get("WORKBENCH_TEST_DEVICES", "cpu,mlx,cuda-on-numpy").split(","))


def require_device(device: str) -> None:
    """Fail clearly where the MLX backend cannot run (it is a dev dependency: never skip)."""
    if device == "mlx":
        try:
            import mlx.core  # noqa: F401
        except ImportError as exc:
            pytest.fail(f"the mlx tests need `pip install \"mlx[cpu]\"` (a dev dependency): {exc}")


def cuda_on_numpy(graphs: bool = True):
    """The CuPy backend with NumPy standing in for CuPy. With `graphs` (as on a GPU) the
    decode step takes the path that CUDA graphs record; a "recording" re-runs it."""
    import numpy as np

    from workbench.engine.runtime.backend import CupyBackend
    from workbench.kernels.cuda import ReferenceKernels

    return CupyBackend(np, ReferenceKernels(), name="cuda", graphs=graphs)


def cuda_emulated():
    """The CuPy backend running the real CUDA kernels on the CPU (tests/support/
    cuda_emulator.py: g++ and coroutines), NumPy arrays for CuPy's; the decode step takes
    the path that CUDA graphs record. Slow: for tiny models."""
    from tests.support.cuda_emulator import emulated_cupy
    from workbench.engine.runtime.backend import CupyBackend
    from workbench.kernels.cuda import CudaKernels

    cupy = emulated_cupy()
    return CupyBackend(cupy, CudaKernels(cupy), name="cuda", graphs=True)


def open_llm(source, device: str, **options):
    """`LLM.load(source, device=...)`, with "cuda-on-numpy" and "cuda-emulated" for the
    stand-in backends."""
    from workbench import LLM
    from workbench.engine.formats import sources
    from workbench.engine.formats.gguf import open_gguf

    require_device(device)
    stand_ins = {"cuda-on-numpy": cuda_on_numpy, "cuda-emulated": cuda_emulated}
    if device in stand_ins:
        return LLM(open_gguf(sources.resolve(source)), backend=stand_ins[device](), **options)
    return LLM.load(source, device=device, **options)


def open_encoder(source, device: str, **options):
    """`Encoder.load(source, device=...)`, with "cuda-on-numpy" for the stand-in backend."""
    from workbench import Encoder
    from workbench.engine.formats import sources
    from workbench.engine.formats.gguf import open_gguf

    require_device(device)
    if device == "cuda-on-numpy":
        return Encoder(open_gguf(sources.resolve(source)), backend=cuda_on_numpy(), **options)
    return Encoder.load(source, device=device, **options)
