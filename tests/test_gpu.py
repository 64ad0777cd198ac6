"""On a machine with CUDA (marker `gpu`): the fidelity suites and the benchmark on the GPU.

Each fidelity module runs again in a child pytest with `WORKBENCH_TEST_DEVICES=cuda`
(tests/support/devices.py), so every device-parametrized check (llama.cpp golden runs,
tiny transformers models, sentence-transformers embeddings, Whisper transcripts)
runs on `device="cuda"` (decode steps recorded as CUDA graphs), and so does the device
sampler's comparison with the host's (tests/test_device.py) and the device twin's batched
prefill (tests/test_branch.py); the llama.cpp golden runs once more with the graphs
off; `bench/llm.py --device cuda` prints the speed table with the graphs on and off.
The CUDA kernels themselves are checked in tests/test_cuda_kernels.py. Without a GPU
every test here is skipped, with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]
FIDELITY = ["tests/test_tiny_models.py", "tests/test_tiny_families.py",
            "tests/test_llamacpp_reference.py", "tests/test_encoder.py",
            "tests/test_whisper.py", "tests/test_device.py", "tests/test_branch.py"]


def _cuda_reason() -> str | None:
    """None where CuPy sees a CUDA device, else why not."""
    try:
        import cupy
    except ImportError as exc:
        return f"cupy is not installed ({exc})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, or a driver too old for this CuPy
        return f"no CUDA device: {exc}"
    return None if n else "no CUDA device"


@pytest.fixture(scope="module", autouse=True)
def cuda():
    reason = _cuda_reason()
    if reason:
        pytest.skip(reason)


def _pytest_on_cuda(module: str, **env: str) -> None:
    env = {**os.environ, "WORKBENCH_TEST_DEVICES": "cuda", **env}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-k", "cuda", module], cwd=ROOT, env=env, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]


@pytest.mark.parametrize("module", FIDELITY)
def test_fidelity_on_cuda(module):
    _pytest_on_cuda(module)


def test_llamacpp_golden_runs_without_cuda_graphs():
    """The decode step run op by op (WORKBENCH_CUDA_GRAPHS=0) agrees with llama.cpp too."""
    _pytest_on_cuda("tests/test_llamacpp_reference.py", WORKBENCH_CUDA_GRAPHS="0")


@pytest.mark.parametrize("graphs", ["1", "0"], ids=["graphs", "no-graphs"])
def test_bench_on_cuda(graphs):
    pytest.importorskip("llama_cpp", reason="the benchmark's peer: pip install llama-cpp-python")
    run = subprocess.run([sys.executable, "bench/llm.py", "--device", "cuda", "--rounds", "3",
                          "--no-rss"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "WORKBENCH_CUDA_GRAPHS": graphs})
    print(f"WORKBENCH_CUDA_GRAPHS={graphs}\n{run.stdout}")
    assert run.returncode == 0, run.stderr[-4000:]
    assert "workbench on cuda" in run.stdout and "decode tok/s" in run.stdout
