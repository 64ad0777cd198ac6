"""The loops the CPU kernels share, whatever the format: sums of x, the two-stage gemv's
products, the multi-row kernel's pass over W.

`cpu` generates each format's kernels around these, with the format's block math from
`blocks` (see `cpu` for when each kernel runs).
"""

from __future__ import annotations

import numpy as np
from llvmlite.binding import get_host_cpu_features
from numba import prange

from workbench.kernels.cache import njit
from workbench.kernels.simd import FASTMATH, stack_f32x64


@njit(cache=True)
def group_sums(x, size):
    """(T, K) float32 -> (T, K // size) float32 sums over each run of `size` columns."""
    T, K = x.shape
    ng = K // size
    xs = np.empty((T, ng), np.float32)
    for t in range(T):
        for g in range(ng):
            s = np.float32(0.0)
            for j in range(size):
                s += x[t, g * size + j]
            xs[t, g] = s
    return xs


# Two-stage gemv: dequantize one row into a per-thread fp32 buffer, then T
# plain dot products over K (long, fully vectorized loops). The unpacking is
# paid once per row whatever T is.


@njit(fastmath=FASTMATH, inline="always")
def _dots(a, x, y, r):
    """y[t, r] = a . x[t] for every row t of x (T, K). Four rows of x at a time share
    each load of a (5 loads per 4 multiply-adds instead of 8)."""
    T, K = x.shape
    t = 0
    while t + 4 <= T:
        s0 = s1 = s2 = s3 = np.float32(0.0)
        for k in range(K):
            v = a[k]
            s0 += v * x[t, k]
            s1 += v * x[t + 1, k]
            s2 += v * x[t + 2, k]
            s3 += v * x[t + 3, k]
        y[t, r], y[t + 1, r], y[t + 2, r], y[t + 3, r] = s0, s1, s2, s3
        t += 4
    while t < T:
        s0 = np.float32(0.0)
        for k in range(K):
            s0 += a[k] * x[t, k]
        y[t, r] = s0
        t += 1


@njit(fastmath=FASTMATH, inline="always")
def _dots4(a, x, y, r):
    """y[t, r + i] = a[i] . x[t] for i = 0..3 and every row t of x (T, K): a 4 x 4 block
    of outputs per pass over K (8 loads per 16 multiply-adds, 16 accumulators)."""
    T, K = x.shape
    t = 0
    while t + 4 <= T:
        s00 = s01 = s02 = s03 = np.float32(0.0)
        s10 = s11 = s12 = s13 = np.float32(0.0)
        s20 = s21 = s22 = s23 = np.float32(0.0)
        s30 = s31 = s32 = s33 = np.float32(0.0)
        for k in range(K):
            x0, x1, x2, x3 = x[t, k], x[t + 1, k], x[t + 2, k], x[t + 3, k]
            v = a[0, k]
            s00 += v * x0
            s01 += v * x1
            s02 += v * x2
            s03 += v * x3
            v = a[1, k]
            s10 += v * x0
            s11 += v * x1
            s12 += v * x2
            s13 += v * x3
            v = a[2, k]
            s20 += v * x0
            s21 += v * x1
            s22 += v * x2
            s23 += v * x3
            v = a[3, k]
            s30 += v * x0
            s31 += v * x1
            s32 += v * x2
            s33 += v * x3
        y[t, r], y[t + 1, r], y[t + 2, r], y[t + 3, r] = s00, s01, s02, s03
        y[t, r + 1], y[t + 1, r + 1], y[t + 2, r + 1], y[t + 3, r + 1] = s10, s11, s12, s13
        y[t, r + 2], y[t + 1, r + 2], y[t + 2, r + 2], y[t + 3, r + 2] = s20, s21, s22, s23
        y[t, r + 3], y[t + 1, r + 3], y[t + 2, r + 3], y[t + 3, r + 3] = s30, s31, s32, s33
        t += 4
    while t < T:
        s00 = s10 = s20 = s30 = np.float32(0.0)
        for k in range(K):
            s00 += a[0, k] * x[t, k]
            s10 += a[1, k] * x[t, k]
            s20 += a[2, k] * x[t, k]
            s30 += a[3, k] * x[t, k]
        y[t, r], y[t, r + 1], y[t, r + 2], y[t, r + 3] = s00, s10, s20, s30
        t += 1


@njit(fastmath=FASTMATH, inline="always")
def _dots42(a, x, y, r):
    """`_dots4` with 4 x 2 blocks of outputs (8 accumulators): with 16 vector registers
    (AVX2) the 16 accumulators of `_dots4` spill to memory (measured 15-25% slower)."""
    T, K = x.shape
    t = 0
    while t + 2 <= T:
        s00 = s01 = s10 = s11 = s20 = s21 = s30 = s31 = np.float32(0.0)
        for k in range(K):
            x0, x1 = x[t, k], x[t + 1, k]
            v = a[0, k]
            s00 += v * x0
            s01 += v * x1
            v = a[1, k]
            s10 += v * x0
            s11 += v * x1
            v = a[2, k]
            s20 += v * x0
            s21 += v * x1
            v = a[3, k]
            s30 += v * x0
            s31 += v * x1
        y[t, r], y[t + 1, r] = s00, s01
        y[t, r + 1], y[t + 1, r + 1] = s10, s11
        y[t, r + 2], y[t + 1, r + 2] = s20, s21
        y[t, r + 3], y[t + 1, r + 3] = s30, s31
        t += 2
    if t < T:
        s00 = s10 = s20 = s30 = np.float32(0.0)
        for k in range(K):
            v = x[t, k]
            s00 += a[0, k] * v
            s10 += a[1, k] * v
            s20 += a[2, k] * v
            s30 += a[3, k] * v
        y[t, r], y[t, r + 1], y[t, r + 2], y[t, r + 3] = s00, s10, s20, s30


# 32 vector registers (AVX-512) hold `_dots4`'s 16 accumulators; 16 (AVX2, SSE, and NEON's
# 32 narrower ones aside) do not. A module constant: each machine compiles (and caches) its
# own kernels, so the choice is made once per CPU.
_WIDE_REGISTERS = bool(get_host_cpu_features().get("avx512f", False))


@njit(fastmath=FASTMATH, inline="always")
def _dots_4rows(a, x, y, r):
    """y[t, r + i] = a[i] . x[t] for i = 0..3 and every row t of x, blocked for the CPU."""
    if _WIDE_REGISTERS:
        _dots4(a, x, y, r)
    else:
        _dots42(a, x, y, r)


@njit(fastmath=FASTMATH, inline="always")
def dots_block(buf, x, y, r, N):
    """The two-stage kernels' products for rows r .. min(r + 4, N) - 1, dequantized in buf."""
    if r + 4 <= N:
        _dots_4rows(buf, x, y, r)
    else:
        for i in range(N - r):
            _dots(buf[i], x, y, r + i)


# --------------------------------------------------------------------------- multi-row kernels
# Batched decoding (3 <= T <= `cpu.ROWS_MAX_T`), `cpu._rows_<name>`: each block of a row
# of W is unpacked to floats once, in registers, and multiplied with 4 or 8 rows
# of x at a time (`simd.*_rows`: 8 accumulators of 8 lanes, one per row of x).
# The two-stage kernels store each dequantized row and read it back for every
# pair of rows of x; here only x goes through memory. x is read in passes of at
# most `ROWS_PASS` columns, so that the 8 rows of a pass stay in the L1 cache
# while a group of `_ROWS_GROUP` rows of W goes by; each pass adds its sums
# into y. Against the two-stage kernels at T = 8, 2 threads, in one process
# (medians of interleaved runs): all of SmolLM2's Q4_1 layer matrices
# 1.06-1.15x faster, Qwen2.5 0.5B's (Q5_0, Q4_K, Q6_K, Q8_0) 1.2x, the Q8_0
# output matrices 1.36x (SmolLM2) and 1.10x (Qwen). With 5 to 7 rows of x the
# zero rows cost as much as the gain: about even.


_ROWS_GROUP = 8
ROWS_PASS = 768  # 8 rows of x: 24 KiB


@njit(fastmath=FASTMATH, inline="always")
def rows_loop(block, qk, x, w, y):
    """y = x @ W.T with `block(acc, w, wi, r, b, xf, xo, K, rows)` adding block b of
    row r (qk weights) times `rows` rows of the flat x (row t of the group at
    xf[xo + t * K:]) into acc."""
    T, K = x.shape
    N = w.shape[0]
    nb = K // qk
    tp = (T + 3) // 4 * 4
    # (tp * K,): x, then zero rows up to a multiple of 4. Element loops on purpose: in a
    # parallel function Numba turns np.zeros and each slice copy into a parallel loop of
    # its own, each a start of the thread pool (they cost 10 of the 15 us of a call at
    # T = 8, N = 16).
    xf = np.empty(tp * K, np.float32)
    for t in range(T):
        for k in range(K):
            xf[t * K + k] = x[t, k]
    for i in range(T * K, tp * K):
        xf[i] = 0.0
    passes = (K + ROWS_PASS - 1) // ROWS_PASS
    per = (nb + passes - 1) // passes  # blocks per pass
    wi = w.view(np.int8)
    for g in prange((N + _ROWS_GROUP - 1) // _ROWS_GROUP):
        for t0 in range(0, tp, 8):
            nt = min(8, T - t0)
            for b0 in range(0, nb, per):
                for r in range(g * _ROWS_GROUP, min(N, (g + 1) * _ROWS_GROUP)):
                    acc = stack_f32x64()
                    if tp - t0 >= 8:
                        for b in range(b0, min(b0 + per, nb)):
                            block(acc, w, wi, r, b, xf, t0 * K + b * qk, K, 8)
                    else:  # the last 4 (or fewer) rows of x
                        for b in range(b0, min(b0 + per, nb)):
                            block(acc, w, wi, r, b, xf, t0 * K + b * qk, K, 4)
                    for t in range(nt):
                        s = np.float32(0.0)
                        for j in range(8):
                            s += acc[8 * t + j]
                        y[t0 + t, r] = s if b0 == 0 else y[t0 + t, r] + s
