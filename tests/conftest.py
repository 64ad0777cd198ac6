"""Shared test fixtures: reference files from ../shared and the real models."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared"


def shared_file(*parts: str) -> Path:
    """A file under ../shared; fails the test (never skips) when it is missing."""
    path = SHARED.joinpath(*parts)
    if not path.is_file():
        pytest.fail(f"missing shared test data {path}: the tests expect ../shared beside the "
                    "repository (as CI provides it)")
    return path


def reference(name: str) -> dict:
    """A reference JSON from ../shared/reference."""
    return json.loads(shared_file("reference", name).read_text())


@pytest.fixture(scope="session")
def smollm2():
    from workbench import LLM

    with LLM.load("smollm2-135m") as m:
        yield m


@pytest.fixture(scope="session")
def minilm():
    from workbench import Encoder

    with Encoder.load("minilm-l6") as enc:
        yield enc


@pytest.fixture(scope="module")
def engines(smollm2, minilm):
    """What the server tests serve, by model id: a chat model, an embedder, Whisper."""
    from workbench import WhisperModel

    with WhisperModel.load("whisper-tiny.en") as whisper:
        yield {"smollm2-135m": smollm2, "minilm-l6": minilm, "whisper-tiny.en": whisper}


@pytest.fixture(scope="session")
def qwen():
    from workbench import LLM

    with LLM.load("qwen2.5-coder-0.5b") as m:
        yield m


@pytest.fixture(scope="session")
def gemma3():
    from workbench import LLM

    with LLM.load("gemma3-270m") as m:
        yield m


# The devices the fidelity tests run on: the NumPy engine, the MLX backend (`mlx[cpu]` runs
# its array code on this CPU) and the CuPy backend's code with NumPy standing in for CuPy
# and `ReferenceKernels` for its RawKernels. `WORKBENCH_TEST_DEVICES=cuda` (as
# tests/test_gpu.py sets it) runs them on a real GPU instead.
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

    from workbench.engine.backend import CupyBackend
    from workbench.kernels.cuda import ReferenceKernels

    return CupyBackend(np, ReferenceKernels(), name="cuda", graphs=graphs)


def open_llm(source, device: str, **options):
    """`LLM.load(source, device=...)`, with "cuda-on-numpy" for the stand-in backend."""
    from workbench import LLM, registry
    from workbench.engine.gguf import open_gguf

    require_device(device)
    if device == "cuda-on-numpy":
        return LLM(open_gguf(registry.resolve(source)), backend=cuda_on_numpy(), **options)
    return LLM.load(source, device=device, **options)


def open_encoder(source, device: str, **options):
    """`Encoder.load(source, device=...)`, with "cuda-on-numpy" for the stand-in backend."""
    from workbench import Encoder, registry
    from workbench.engine.gguf import open_gguf

    require_device(device)
    if device == "cuda-on-numpy":
        return Encoder(open_gguf(registry.resolve(source)), backend=cuda_on_numpy(), **options)
    return Encoder.load(source, device=device, **options)
