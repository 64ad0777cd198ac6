"""How much of an array's memory is resident: the pages under it that are in RAM
(`mincore`), for the KV pool's lazily committed buffers."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np


def resident_bytes(rows: np.ndarray) -> int:
    """Bytes of the pages under the contiguous array `rows` that are in memory."""
    page = mmap.PAGESIZE
    start = rows.ctypes.data - rows.ctypes.data % page
    n_pages = -(-(rows.ctypes.data + rows.nbytes - start) // page)
    vec = (ctypes.c_ubyte * n_pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(start, n_pages * page, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(v & 1 for v in vec) * page
