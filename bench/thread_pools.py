"""One thread count for every library a benchmark loads, so that the engines compared
use the same cores. Scripts here import it as `thread_pools` (run as `python bench/x.py`,
this folder is first on sys.path)."""

from __future__ import annotations

import os

POOL_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                  "NUMBA_NUM_THREADS")


def pin_thread_pools(threads: int) -> None:
    """Size OpenMP's, OpenBLAS's, MKL's and Numba's pools to `threads`. They read these
    variables once, when they load: call this before NumPy, Numba, torch or CTranslate2."""
    for var in POOL_VARIABLES:
        os.environ[var] = str(threads)
