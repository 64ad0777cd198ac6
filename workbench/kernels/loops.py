"""The loops the CPU kernels share, whatever the format: sums of x, the two-stage gemv's
products, the multi-row kernel's pass over W.

`cpu` generates each format's kernels around these, with the format's block math from
`blocks` (see `cpu` for when each kernel runs).
"""

from __future__ import annotations

import numpy as np
from llvmlite.binding import get_host_cpu_features
from numba import get_thread_id, prange

from workbench.kernels.cache import njit
from workbench.kernels.simd import FASTMATH, outer_tile


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
# paid once per row whatever T is. The rows of x are taken four at a time, x
# padded with zero rows to a multiple of four (`padded4`): a row's sums are then
# the same code whatever T is and wherever the row is (a remainder loop for the
# last T % 4 rows would add them up in another order), so each row of y has the
# same bits whatever else is in x.


@njit(fastmath=FASTMATH, inline="always")
def padded4(x):
    """x (T, K), or a copy with zero rows up to a multiple of 4 rows (element loops:
    no parallel loop of Numba's own in a parallel kernel)."""
    T, K = x.shape
    if T % 4 == 0:
        return x
    xp = np.empty(((T + 3) // 4 * 4, K), np.float32)
    for t in range(xp.shape[0]):
        for k in range(K):
            xp[t, k] = x[t, k] if t < T else np.float32(0.0)
    return xp


@njit(fastmath=FASTMATH, inline="always")
def _dots(a, x, y, r):
    """y[t, r] = a . x[t] for the rows t < len(y) of x (Tp, K), Tp a multiple of 4. Four
    rows of x at a time share each load of a (5 loads per 4 multiply-adds instead of 8)."""
    T, K = y.shape[0], x.shape[1]
    Tp = x.shape[0]
    t = 0
    while t + 4 <= Tp:
        s0 = s1 = s2 = s3 = np.float32(0.0)
        for k in range(K):
            v = a[k]
            s0 += v * x[t, k]
            s1 += v * x[t + 1, k]
            s2 += v * x[t + 2, k]
            s3 += v * x[t + 3, k]
        _store4(y, t, r, T, s0, s1, s2, s3)
        t += 4


@njit(inline="always")
def _store4(y, t, r, T, s0, s1, s2, s3):
    """y[t + i, r] = s_i for the rows t + i < T."""
    y[t, r] = s0
    if t + 1 < T:
        y[t + 1, r] = s1
    if t + 2 < T:
        y[t + 2, r] = s2
    if t + 3 < T:
        y[t + 3, r] = s3


@njit(fastmath=FASTMATH, inline="always")
def _dots4(a, x, y, r):
    """y[t, r + i] = a[i] . x[t] for i = 0..3 and the rows t < len(y) of x (Tp, K): a 4 x 4
    block of outputs per pass over K (8 loads per 16 multiply-adds, 16 accumulators)."""
    T, K = y.shape[0], x.shape[1]
    Tp = x.shape[0]
    t = 0
    while t + 4 <= Tp:
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
        _store4(y, t, r, T, s00, s01, s02, s03)
        _store4(y, t, r + 1, T, s10, s11, s12, s13)
        _store4(y, t, r + 2, T, s20, s21, s22, s23)
        _store4(y, t, r + 3, T, s30, s31, s32, s33)
        t += 4


@njit(fastmath=FASTMATH, inline="always")
def _dots42(a, x, y, r):
    """`_dots4` with 4 x 2 blocks of outputs (8 accumulators): with 16 vector registers
    (AVX2) the 16 accumulators of `_dots4` spill to memory (measured 15-25% slower)."""
    T, K = y.shape[0], x.shape[1]
    Tp = x.shape[0]
    t = 0
    while t + 2 <= Tp:
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
        if t < T:
            y[t, r], y[t, r + 1], y[t, r + 2], y[t, r + 3] = s00, s10, s20, s30
        if t + 1 < T:
            y[t + 1, r], y[t + 1, r + 1], y[t + 1, r + 2], y[t + 1, r + 3] = s01, s11, s21, s31
        t += 2


# 32 vector registers (AVX-512) hold `_dots4`'s 16 accumulators; 16 (AVX2, SSE, and NEON's
# 32 narrower ones aside) do not. A module constant: each machine compiles (and caches) its
# own kernels, so the choice is made once per CPU.
WIDE_REGISTERS = bool(get_host_cpu_features().get("avx512f", False))


@njit(fastmath=FASTMATH, inline="always")
def _dots_4rows(a, x, y, r):
    """y[t, r + i] = a[i] . x[t] for i = 0..3 and every row t of x, blocked for the CPU."""
    if WIDE_REGISTERS:
        _dots4(a, x, y, r)
    else:
        _dots42(a, x, y, r)


@njit(fastmath=FASTMATH, inline="always")
def dots_block(buf, x, y, r, N):
    """The two-stage kernels' products for rows r .. min(r + 4, N) - 1, dequantized in buf;
    x from `padded4`, y with the rows of x before the padding."""
    if r + 4 <= N:
        _dots_4rows(buf, x, y, r)
    else:
        for i in range(N - r):
            _dots(buf[i], x, y, r + i)


# Two-stage gemv, outer-product form (`cpu._outer_<name>`, on CPUs with 32 vector
# registers): R rows of W are dequantized into the thread's buffer, and `simd.outer_tile`
# multiplies them with all T rows of x at once, x transposed so that 16 rows of x are
# one vector: each step of k broadcasts one weight of each of the R rows and multiplies
# it with V vectors of x into R x V accumulators (no horizontal sums; each weight loaded
# once per pass, each x vector once per R rows). Each output is one fused multiply-add
# chain in ascending k, whatever T, R and V are, so a row of x gets the same bits
# wherever it sits. R = 8 rows of W and V = 3 vectors of x (24 accumulators) for 33 to 48
# rows of x, else passes of V = 2 (16 accumulators; rows of x past T are zeros): two tile
# shapes and one loop over W, so the kernel compiles in ~2 s (~4.5 s when V = 2, 3 and 4
# had a loop each, R = 12, 8, 6). With 2 threads on an AVX-512 host it runs Qwen2.5's
# Q5_0 4864 x 896 at 237 GFLOP/s for T = 40, 254 for 48 and 239 for 64 (`dots_block`:
# 178-180; NumPy's sgemm on 2048 x 2048 matrices: ~300).
OUTER_R = 8
OUTER_MAX_T = 64  # rows of x `outer_rows` takes at most (`cpu.GEMV_MAX_T`, a pass of `cpu._outer`)


@njit(inline="always")
def outer_rows(row, x, w, f16, xt, scratch, y, n):
    """y (T, N) = x @ W.T for T <= `OUTER_MAX_T`, `OUTER_R` rows of W at a time: `row` a
    `blocks.row_<name>` dequantizing one row of W; xt a float32 buffer of at least
    `outer_shared_floats(K, N)` floats, scratch (threads, at least `outer_floats(K)`)
    float32. The tiles go to y transposed in xt, (N, tp), which is copied into y at the
    end: stored straight into y, each tile's outputs were columns of y, every row of y
    its own cache line at a stride of N floats (a multiple of 4 KiB for most matrices,
    so all in one set of the L1 cache); Qwen2.5's Q5_0 9728 x 896 at T = 40 3.26 -> 2.92
    ms, Gemma 3's 4096 x 640 1.13 -> 0.92 ms (2 threads, AVX-512 host)."""
    T, K = x.shape
    N = w.shape[0]
    tp = 48 if 32 < T <= 48 else 32 * ((T + 31) // 32)  # rows of x with the zero ones
    for k in prange(K):  # xt[k * tp + t] = x[t, k]: (K, tp), flat
        for t in range(tp):
            xt[k * tp + t] = x[t, k] if t < T else np.float32(0.0)
    yt = xt[OUTER_MAX_T * K :]  # yt[r * tp + t] = y[t, r]: (N rounded up to R, tp), flat
    wi = w.view(np.int8)
    R = OUTER_R
    for p in prange((N + R - 1) // R):
        a = scratch[get_thread_id()][: R * K]  # (R, K) flat: rows r0 .. r0 + R of W
        r0 = R * p  # (rows past N: stale, their outputs unused)
        for i in range(min(R, N - r0)):
            row(w, wi, r0 + i, f16, a[i * K : (i + 1) * K], n)
        if tp == 48:  # three vectors of rows of x in one pass
            outer_tile(yt, r0 * tp, tp, a, K, xt, 0, tp, K, OUTER_R, 3)
        else:  # passes of two vectors over the same rows of W
            for t0 in range(0, tp, 32):
                outer_tile(yt, r0 * tp + t0, tp, a, K, xt, t0, tp, K, OUTER_R, 2)
    for b in prange((N + 63) // 64):  # y's rows in runs of 64 columns
        for t in range(T):
            for r in range(64 * b, min(N, 64 * b + 64)):
                y[t, r] = yt[r * tp + t]


@njit(cache=True)
def outer_floats(K):
    """The float32 scratch each thread needs in `outer_rows` for rows of K weights: R rows
    of W."""
    return OUTER_R * K


@njit(cache=True)
def outer_shared_floats(K, N):
    """The float32 buffer `outer_rows` shares among its threads for an N x K matrix: x
    transposed and y transposed, `OUTER_MAX_T` rows each at most."""
    return OUTER_MAX_T * (K + (N + OUTER_R - 1) // OUTER_R * OUTER_R)


# --------------------------------------------------------------------------- multi-row kernels
# Batched decoding (2 <= T <= `cpu.ROWS_MAX_T`), `cpu._rows_<name>`: each block of a row of
# W is unpacked once and multiplied with up to 8 rows of x (4 on CPUs with 16 vector
# registers), `blocks.dot_<name>` with the literal `rows`: 8, 4, 2 or 1 at a time, zero
# rows added where T leaves 3 or 5 to 7. Each row of x has two 16-lane accumulators of
# its own and the steps of the one-row gemv (`cpu._gemv_<name>`), so a row gets the very
# bits it gets alone. Both kernels are compiled without fast-math flags (which Numba
# would put on every float operation, the steps' included, letting LLVM reassociate
# them differently in each context); the steps fuse their products by explicit FMAs.
# Against the former kernels (the gemv for T <= 2; for 3 <= T <= 8 weights dequantized
# per block and multiplied with 8-lane rows, another arithmetic than the gemv's), one
# thread, min of 200 calls, ms: SmolLM2's Q4_1 960 x 576 T=1 0.036 / 0.031-0.036, T=2
# 0.070 / 0.049, T=4 0.082 / 0.067-0.075, T=8 0.133 / 0.130-0.135; Q4_1 576 x 1536 T=8
# 0.215 / 0.220; Qwen2.5's Q5_0 896 x 896 T=1 0.062 / 0.058, T=8 0.214 / 0.158-0.177;
# Q6_K 896 x 4864 T=1 0.46 / 0.475, T=8 1.58-1.62 / 1.53-1.70.

MOST_ROWS = 8 if WIDE_REGISTERS else 4  # rows of x per pass over a row of W


@njit(fastmath=FASTMATH, inline="always")
def padded_rows(x, size, most):
    """x (T, K) as one flat array with zero rows up to what the passes of at most `most`
    rows read, the sums of each row over runs of `size` columns (0: none) side by side
    (run g of row t at xs[g * tp + t]), and tp, the rows with the zero ones. Element
    loops on purpose: in a parallel function Numba turns np.zeros and each slice copy
    into a parallel loop of its own, each a start of the thread pool."""
    T, K = x.shape
    full = T // most * most
    left = T - full
    tp = full + (8 if left > 4 else 4 if left > 2 else left)
    xf = np.empty(tp * K, np.float32)
    for t in range(T):
        for k in range(K):
            xf[t * K + k] = x[t, k]
    for i in range(T * K, tp * K):
        xf[i] = 0.0
    ng = K // size if size else 0
    xs = np.empty(ng * tp, np.float32)
    if size:
        sums = group_sums(x, size)  # (T, ng)
        for g in range(ng):
            for t in range(T):
                xs[g * tp + t] = sums[t, g]
            for t in range(T, tp):
                xs[g * tp + t] = 0.0
    return xf, xs, tp


@njit(fastmath=FASTMATH, inline="always")
def rows_loop(dot, size, x, w, f16, y):
    """y = x @ W.T with `dot` (a `blocks.dot_<name>` of a format whose runs of x are summed
    over `size` columns, 0: none) taking 8, 4, 2 or 1 rows of x per pass over a row of W."""
    T, K = x.shape
    xf, xs, tp = padded_rows(x, size, MOST_ROWS)
    wi = w.view(np.int8)
    for r in prange(w.shape[0]):
        t0 = 0
        while t0 < T:
            left = T - t0
            if left > 4 and MOST_ROWS == 8:
                dot(w, wi, r, xf, K, xs, tp, t0, f16, y, T, 8)
                t0 += 8
            elif left > 2:
                dot(w, wi, r, xf, K, xs, tp, t0, f16, y, T, 4)
                t0 += 4
            elif left == 2:
                dot(w, wi, r, xf, K, xs, tp, t0, f16, y, T, 2)
                t0 += 2
            else:
                dot(w, wi, r, xf, K, xs, tp, t0, f16, y, T, 1)
                t0 += 1
