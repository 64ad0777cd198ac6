"""Loading hostile files: each refusal must come fast, and the cases that used to allocate
gigabytes run in a subprocess under an address-space limit and a timeout."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAST = 5.0  # seconds: a generous bound on every refusal (each takes milliseconds)
LIMIT_AS = 2 << 30  # address-space limit of the subprocess cases (2 GiB)


def refused(error: type[Exception], match: str, load, *args):
    """Run `load(*args)`; assert it raises `error` matching `match` within `FAST` seconds."""
    start = time.perf_counter()
    with pytest.raises(error, match=match) as info:
        load(*args)
    assert time.perf_counter() - start < FAST
    assert issubclass(info.type, ValueError)
    return info.value


def run_limited(code: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """Run Python `code` from the repository root in a subprocess with at most `LIMIT_AS`
    bytes of address space and `timeout` seconds."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (LIMIT_AS, LIMIT_AS))

    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               NUMBA_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, preexec_fn=limit,
                          capture_output=True, text=True, timeout=timeout)


def assert_limited_refusal(code: str, error: str, match: str, within: float = FAST) -> None:
    """`code` (which sets `load` to a zero-argument callable) must raise `error` matching
    `match` inside the limited subprocess, within `within` seconds."""
    script = f"""
import re, time
{code}
start = time.perf_counter()
try:
    load()
except Exception as exc:
    took = time.perf_counter() - start
    print("RAISED", type(exc).__name__, took)
    print(exc)
else:
    print("LOADED")
"""
    done = run_limited(script)
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and lines and lines[0].startswith("RAISED"), \
        (done.returncode, done.stdout[-2000:], done.stderr[-3000:])
    _, name, took = lines[0].split()
    assert name == error, done.stdout
    assert float(took) < within, done.stdout
    import re

    assert re.search(match, "\n".join(lines[1:])), done.stdout
