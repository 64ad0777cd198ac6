"""Numba CPU kernels: `y = x @ W.T` computed from GGUF weights in their file format.

Three or four kernels per format (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
Q6_K, F16 through the CPU's half-to-float conversion, BF16 through a lookup
table), picked by `matmul` from T, the number of rows of x:

- `_gemv_<type>`, T <= 2 (decode): dot products on the packed blocks, one
  output row per `prange` iteration, fp32 accumulation, nothing materialized.
  The unpacking is redone for every row of x. For Q8_0, Q4_0, Q4_1, Q5_0,
  Q5_1, Q4_K and Q6_K each block is one explicit 16-lane vector step
  (`workbench.kernels.simd`) into two alternating accumulators; F16 likewise
  converts 16 halves per step.
- `_rows_<type>`, 3 <= T <= `ROWS_MAX_T` (batched decoding; Q8_0, Q4_0,
  Q4_1, Q5_0, Q5_1, Q4_K, Q6_K): each block is unpacked once, in registers,
  and multiplied with 8 (or 4) rows of x (see "multi-row kernels" below).
- `_gemv2_<type>`, `ROWS_MAX_T` < T <= `GEMV_MAX_T` (short prompts; from
  T = 3 for Q5_K, F16 and BF16): four rows of W at a time are dequantized
  into a per-thread fp32 buffer, then multiplied with the T rows of x in 4 x 4
  blocks of outputs (16 accumulators: each load of W or x feeds four
  multiply-adds) on CPUs with 32 vector registers, 4 x 2 blocks on those with
  16 (`_dots_4rows`). Q4_0 and Q4_1 rows are dequantized 32 weights per
  vector step (`simd.deq16`).
- `_dequant_<type>`, T > `GEMV_MAX_T` (prefill) and `dequantize_rows`: rows of
  W to float32, bit-identical to `gguf.quants.dequantize` (same float32 ops in
  the same order, no fastmath). `matmul` dequantizes one tile of rows at a
  time and multiplies it with BLAS.

Arguments (fixed dtypes, C-contiguous, W always read-only, so each kernel has
one specialization, compiled once and cached on disk by `cache=True`):

- `x`: (T, K) float32 activations; `y`: (T, N) float32 output.
- `w`: (N, bytes_per_row) uint8, the raw rows as stored in the file.
- `f16`: `F16_TO_F32` (or `BF16_TO_F32`), 65536-entry tables from 16-bit
  patterns to float32, exact; used for BF16 weights and the last K % 16
  columns of F16 ones. Block scales (fp16) are converted by the CPU instead
  (`simd.half_at`): looking them up in the 256 KiB table evicted the weights
  from the caches (Q4_1 gemv 17-24% slower).
- `xs` (computed inside the gemv kernels): (T, K // 32) float32 sums of x
  over runs of 32, one per block or sub-block (runs of 16 for Q6_K): block
  offsets (`q - 8`, `q - 32`) and additive mins (`d * q + m`) are applied
  once per block as `offset * sum(x)` instead of once per weight. The loops
  read them with `_at` (no negative-index code; with the sums over 32, the
  Q4_1 gemv is 15-20% faster on a cached matrix, 8-10% on a model's layers).
- `n`: the literal 16, passed at run time on purpose: with a compile-time
  trip count LLVM fully unrolls the per-block inner loop and vectorizes across
  blocks with gathers instead (measured ~4x slower on Q8_0). With `n` at run
  time, LLVM's main vector loop wants 64 iterations, so 16-iteration block
  loops run in its 8-lane remainder loop; that is why the hot formats use the
  `simd` steps (1.3-2x faster on 2 threads; Q8_0, near memory bandwidth
  without one, 9-14% faster with `simd.q8x32`).

The dot kernels use `fastmath={"reassoc", "contract"}`: LLVM may reorder sums
(to vectorize them) and fuse multiply-adds; results differ from
`x @ dequantize(W).T` by fp32 rounding only (~1e-7..1e-6 of the output
scale). NaN/inf semantics are kept (no `nnan`/`ninf`).
"""

from __future__ import annotations

import numba
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from llvmlite.binding import get_host_cpu_features
from numba import get_thread_id, prange

from workbench.kernels.cache import njit
from workbench.kernels.simd import (
    deq16,
    half16,
    half16_store,
    half_at,
    nib16,
    nib16_1,
    nib16_hb,
    nib_hb_rows,
    nib_rows,
    q6k16,
    q6k_rows,
    q8_rows,
    q8x32,
    stack_f32x16,
    stack_f32x64,
)

Q = GGMLQuantizationType

# fp16 bit pattern -> float32, exact (NumPy's own conversion).
F16_TO_F32: np.ndarray = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)

# bf16 bit pattern -> float32 (the pattern is the float32's upper half), exact.
BF16_TO_F32: np.ndarray = (np.arange(65536, dtype=np.uint32) << np.uint32(16)).view(np.float32)

_FM = {"reassoc", "contract"}  # fastmath flags of the dot kernels: reorder sums, fuse mul-add
_INNER = 16  # the run-time inner trip count handed to the kernels (see module docstring)


@njit(inline="always")
def _h(w, r, o, f16):
    """fp16 at bytes o, o+1 of row r, as float32 (`simd.half_at`; `f16` is unused here)."""
    return half_at(w, r, o)


@njit(inline="always")
def _u32(w, r, o):
    """Little-endian uint32 at bytes o..o+3 of row r, as int64."""
    return (
        np.int64(w[r, o])
        | (np.int64(w[r, o + 1]) << 8)
        | (np.int64(w[r, o + 2]) << 16)
        | (np.int64(w[r, o + 3]) << 24)
    )


@njit(inline="always")
def _k_scale(w, r, o, j):
    """Q4_K/Q5_K 6-bit scale j (0..7) from the 12 packed bytes at offset o."""
    if j < 4:
        return np.int64(w[r, o + j]) & 63
    return (np.int64(w[r, o + j + 4]) & 15) | ((np.int64(w[r, o + j - 4]) >> 6) << 4)


@njit(inline="always")
def _k_min(w, r, o, j):
    """Q4_K/Q5_K 6-bit min j (0..7) from the 12 packed bytes at offset o."""
    if j < 4:
        return np.int64(w[r, o + j + 4]) & 63
    return (np.int64(w[r, o + j + 4]) >> 4) | ((np.int64(w[r, o + j]) >> 6) << 4)


@njit(cache=True)
def _group_sums(x, size):
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


@njit(inline="always")
def _at(a, i):
    """a[i] for an index i >= 0, read without the code Numba adds to every signed index
    for negative ones (a test and a conditional move in each block of the dot loops)."""
    return a[np.uint64(i)]


# --------------------------------------------------------------------------- dot products
# One row r of W against one row of activations x (K,), with xs (K//32,) its
# 32-group sums (K//16 and 16-group sums for Q6_K). Q4_0, Q4_1, Q5_0, Q5_1,
# Q4_K and Q6_K blocks go through the 16-lane `simd` steps. Q5_K (and the
# dequantizers below) unpack nibbles in float32: a byte v (0..255) converts
# exactly, hi = floor(v / 16), lo = v - 16 * hi. Numba types integer
# arithmetic as int64, which LLVM vectorizes 8 lanes wide with 64-bit
# int->float conversions; the float route keeps every op 32-bit (measured
# 1.2-1.3x faster). Q5_K's single high bits are tested with a select (`_bit`).


@njit(fastmath=_FM, inline="always")
def _split(v):
    """A byte value as float32 -> (low nibble, high nibble), exact."""
    hi = np.floor(v * np.float32(0.0625))
    return v - np.float32(16.0) * hi, hi


@njit(fastmath=_FM, inline="always")
def _total(a0, a1):
    """Sum of two 16-lane accumulators."""
    s = np.float32(0.0)
    for j in range(16):
        s += a0[j] + a1[j]
    return s


@njit(fastmath=_FM, inline="always")
def _dot_q8_0(w, wi, r, x, f16, n):
    # Two accumulators, even and odd blocks: independent add chains.
    nb = x.shape[0] // 32
    wr = wi[r]
    a0, a1 = stack_f32x16(), stack_f32x16()
    for b in range(0, nb, 2):
        o = b * 34
        q8x32(a0, wr, o + 2, x, b * 32, _h(w, r, o, f16))
        if b + 1 < nb:
            q8x32(a1, wr, o + 36, x, b * 32 + 32, _h(w, r, o + 34, f16))
    return _total(a0, a1)


@njit(fastmath=_FM, inline="always")
def _blk_q4_0(acc, w, r, x, xs, f16, b):
    """Block b of a Q4_0 row into acc (vector part); returns the scalar part."""
    o = b * 18
    d = _h(w, r, o, f16)
    nib16_1(acc, w[r], o + 2, x, b * 32, b * 32 + 16, d)
    return -np.float32(8.0) * d * _at(xs, b)


@njit(fastmath=_FM, inline="always")
def _dot_q4_0(w, r, x, xs, f16, n):
    # Two accumulators, even and odd blocks: independent add chains.
    nb = x.shape[0] // 32
    a0, a1 = stack_f32x16(), stack_f32x16()
    s = np.float32(0.0)
    for b in range(0, nb, 2):
        s += _blk_q4_0(a0, w, r, x, xs, f16, b)
        if b + 1 < nb:
            s += _blk_q4_0(a1, w, r, x, xs, f16, b + 1)
    return s + _total(a0, a1)


@njit(fastmath=_FM, inline="always")
def _blk_q4_1(acc, w, r, x, xs, f16, b):
    o = b * 20
    d = _h(w, r, o, f16)
    nib16_1(acc, w[r], o + 4, x, b * 32, b * 32 + 16, d)
    return _h(w, r, o + 2, f16) * _at(xs, b)


@njit(fastmath=_FM, inline="always")
def _dot_q4_1(w, r, x, xs, f16, n):
    nb = x.shape[0] // 32
    a0, a1 = stack_f32x16(), stack_f32x16()
    s = np.float32(0.0)
    for b in range(0, nb, 2):
        s += _blk_q4_1(a0, w, r, x, xs, f16, b)
        if b + 1 < nb:
            s += _blk_q4_1(a1, w, r, x, xs, f16, b + 1)
    return s + _total(a0, a1)


@njit(fastmath=_FM, inline="always")
def _bit(bits, mask, value):
    """`value` where `bits & mask` is non-zero, else 0.0 (vectorizes to a test and a blend)."""
    return value if (bits & mask) != 0 else np.float32(0.0)


@njit(fastmath=_FM, inline="always")
def _blk_q5_0(acc, w, r, x, xs, f16, b):
    o = b * 22
    d = _h(w, r, o, f16)
    nib16_hb(acc, w[r], o + 6, x, b * 32, b * 32 + 16, d, np.int32(_u32(w, r, o + 2)))
    return -np.float32(16.0) * d * _at(xs, b)


@njit(fastmath=_FM, inline="always")
def _dot_q5_0(w, r, x, xs, f16, n):
    nb = x.shape[0] // 32
    a0, a1 = stack_f32x16(), stack_f32x16()
    s = np.float32(0.0)
    for b in range(0, nb, 2):
        s += _blk_q5_0(a0, w, r, x, xs, f16, b)
        if b + 1 < nb:
            s += _blk_q5_0(a1, w, r, x, xs, f16, b + 1)
    return s + _total(a0, a1)


@njit(fastmath=_FM, inline="always")
def _blk_q5_1(acc, w, r, x, xs, f16, b):
    o = b * 24
    nib16_hb(acc, w[r], o + 8, x, b * 32, b * 32 + 16, _h(w, r, o, f16),
             np.int32(_u32(w, r, o + 4)))
    return _h(w, r, o + 2, f16) * _at(xs, b)


@njit(fastmath=_FM, inline="always")
def _dot_q5_1(w, r, x, xs, f16, n):
    nb = x.shape[0] // 32
    a0, a1 = stack_f32x16(), stack_f32x16()
    s = np.float32(0.0)
    for b in range(0, nb, 2):
        s += _blk_q5_1(a0, w, r, x, xs, f16, b)
        if b + 1 < nb:
            s += _blk_q5_1(a1, w, r, x, xs, f16, b + 1)
    return s + _total(a0, a1)


@njit(fastmath=_FM, inline="always")
def _dot_q4_k(w, r, x, xs, f16, n):
    nb = x.shape[0] // 256
    wr = w[r]
    a0, a1 = stack_f32x16(), stack_f32x16()
    s = np.float32(0.0)
    for b in range(nb):
        o = b * 144
        xo = b * 256
        d = _h(w, r, o, f16)
        dmin = _h(w, r, o + 2, f16)
        for c in range(4):  # pairs of 32-weight sub-blocks sharing 32 bytes
            qo = o + 16 + 32 * c
            x0 = xo + 64 * c
            d0 = d * np.float32(_k_scale(w, r, o + 4, 2 * c))
            d1 = d * np.float32(_k_scale(w, r, o + 4, 2 * c + 1))
            nib16(a0, wr, qo, x, x0, x0 + 32, d0, d1)  # bytes 0-15 of the pair
            nib16(a1, wr, qo + 16, x, x0 + 16, x0 + 48, d0, d1)  # bytes 16-31
            g = x0 // 32  # sub-block 2c
            s -= (dmin * np.float32(_k_min(w, r, o + 4, 2 * c))) * _at(xs, g)
            s -= (dmin * np.float32(_k_min(w, r, o + 4, 2 * c + 1))) * _at(xs, g + 1)
    return s + _total(a0, a1)


@njit(fastmath=_FM, inline="always")
def _dot_q5_k(w, r, x, xs, f16, n):
    nb = x.shape[0] // 256
    s = np.float32(0.0)
    for b in range(nb):
        o = b * 176
        xo = b * 256
        d = _h(w, r, o, f16)
        dmin = _h(w, r, o + 2, f16)
        for c in range(4):
            qo = o + 48 + 32 * c
            x0 = xo + 64 * c
            m0 = 1 << (2 * c)  # 5th bits of sub-blocks 2c, 2c+1: bits 2c, 2c+1 of qh[j]
            m1 = 2 << (2 * c)
            t0 = np.float32(0.0)
            t1 = np.float32(0.0)
            for j in range(2 * n):
                lo, hi = _split(np.float32(w[r, qo + j]))
                h = w[r, o + 16 + j]
                t0 += (lo + _bit(h, m0, np.float32(16.0))) * x[x0 + j]
                t1 += (hi + _bit(h, m1, np.float32(16.0))) * x[x0 + 32 + j]
            g = x0 // 32
            s += (d * np.float32(_k_scale(w, r, o + 4, 2 * c))) * t0
            s += (d * np.float32(_k_scale(w, r, o + 4, 2 * c + 1))) * t1
            s -= (dmin * np.float32(_k_min(w, r, o + 4, 2 * c))) * _at(xs, g)
            s -= (dmin * np.float32(_k_min(w, r, o + 4, 2 * c + 1))) * _at(xs, g + 1)
    return s


@njit(fastmath=_FM, inline="always")
def _dot_q6_k(w, wi, r, x, xs, f16, n):
    nb = x.shape[0] // 256
    wr = w[r]
    a0, a1 = stack_f32x16(), stack_f32x16()
    s = np.float32(0.0)
    for b in range(nb):
        o = b * 210
        xo = b * 256
        d = _h(w, r, o + 208, f16)
        for h in range(2):  # two halves of 128 weights
            so = o + 192 + 8 * h  # scale of weights 128h + 32s + 16*half: 8h + 2s + half
            x0 = xo + 128 * h
            d0, d1 = d * np.float32(wi[r, so]), d * np.float32(wi[r, so + 2])
            d2, d3 = d * np.float32(wi[r, so + 4]), d * np.float32(wi[r, so + 6])
            q6k16(a0, wr, o + 64 * h, o + 128 + 32 * h, x, x0, d0, d1, d2, d3)
            g = x0 // 16  # 16-group of the first run; the others are 2, 4, 6 groups further
            s -= np.float32(32.0) * (d0 * _at(xs, g) + d1 * _at(xs, g + 2) + d2 * _at(xs, g + 4)
                                     + d3 * _at(xs, g + 6))
            e0, e1 = d * np.float32(wi[r, so + 1]), d * np.float32(wi[r, so + 3])
            e2, e3 = d * np.float32(wi[r, so + 5]), d * np.float32(wi[r, so + 7])
            q6k16(a1, wr, o + 64 * h + 16, o + 128 + 32 * h + 16, x, x0 + 16, e0, e1, e2, e3)
            s -= np.float32(32.0) * (e0 * _at(xs, g + 1) + e1 * _at(xs, g + 3) + e2 * _at(xs, g + 5)
                                     + e3 * _at(xs, g + 7))
    return s + _total(a0, a1)


# One gemv kernel per format: prange over output rows, loop over the T rows of x.
# All share the signature (x, w, f16, y, n); the block sums of x (`xs`) are
# computed inside, so one call from Python does everything.


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv_q8_0(x, w, f16, y, n):
    wi = w.view(np.int8)
    for r in prange(w.shape[0]):
        for t in range(x.shape[0]):
            y[t, r] = _dot_q8_0(w, wi, r, x[t], f16, n)


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv_q4_0(x, w, f16, y, n):
    xs = _group_sums(x, 32)
    for r in prange(w.shape[0]):
        for t in range(x.shape[0]):
            y[t, r] = _dot_q4_0(w, r, x[t], xs[t], f16, n)


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv_q4_1(x, w, f16, y, n):
    xs = _group_sums(x, 32)
    for r in prange(w.shape[0]):
        for t in range(x.shape[0]):
            y[t, r] = _dot_q4_1(w, r, x[t], xs[t], f16, n)


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv_q5_0(x, w, f16, y, n):
    xs = _group_sums(x, 32)
    for r in prange(w.shape[0]):
        for t in range(x.shape[0]):
            y[t, r] = _dot_q5_0(w, r, x[t], xs[t], f16, n)


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv_q5_1(x, w, f16, y, n):
    xs = _group_sums(x, 32)
    for r in prange(w.shape[0]):
        for t in range(x.shape[0]):
            y[t, r] = _dot_q5_1(w, r, x[t], xs[t], f16, n)


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv_q4_k(x, w, f16, y, n):
    xs = _group_sums(x, 32)
    for r in prange(w.shape[0]):
        for t in range(x.shape[0]):
            y[t, r] = _dot_q4_k(w, r, x[t], xs[t], f16, n)


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv_q5_k(x, w, f16, y, n):
    xs = _group_sums(x, 32)
    for r in prange(w.shape[0]):
        for t in range(x.shape[0]):
            y[t, r] = _dot_q5_k(w, r, x[t], xs[t], f16, n)


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv_q6_k(x, w, f16, y, n):
    xs = _group_sums(x, 16)
    wi = w.view(np.int8)
    for r in prange(w.shape[0]):
        for t in range(x.shape[0]):
            y[t, r] = _dot_q6_k(w, wi, r, x[t], xs[t], f16, n)


# --------------------------------------------------------------------------- dequantizers
# `_row_<type>(w, r, f16, out, n)` writes row r of W as float32 into `out` (K,).
# Inlined into the non-fastmath `_dequant_*` kernels they are bit-identical to
# the NumPy reference (same float32 ops in the same order); inlined into the
# fastmath two-stage gemv kernels they may fuse multiply-adds.


@njit(inline="always")
def _row_q8_0(w, wi, r, f16, out, n):
    for b in range(out.shape[0] // 32):
        o = b * 34
        d = _h(w, r, o, f16)
        for j in range(2 * n):
            out[b * 32 + j] = np.float32(wi[r, o + 2 + j]) * d


@njit(inline="always")
def _row_q4_0(w, r, f16, out, n):
    wr = w[r]
    for b in range(out.shape[0] // 32):
        o = b * 18
        deq16(out, b * 32, wr, o + 2, np.float32(8.0), _h(w, r, o, f16), np.float32(-0.0))


@njit(inline="always")
def _row_q4_1(w, r, f16, out, n):
    wr = w[r]
    for b in range(out.shape[0] // 32):
        o = b * 20
        deq16(out, b * 32, wr, o + 4, np.float32(0.0), _h(w, r, o, f16), _h(w, r, o + 2, f16))


@njit(inline="always")
def _row_q5_0(w, r, f16, out, n):
    for b in range(out.shape[0] // 32):
        o = b * 22
        d = _h(w, r, o, f16)
        qh = _u32(w, r, o + 2)
        for j in range(n):
            q = np.int64(w[r, o + 6 + j])
            lo = (q & 15) | (((qh >> j) & 1) << 4)
            hi = (q >> 4) | (((qh >> (j + 16)) & 1) << 4)
            out[b * 32 + j] = d * np.float32(lo - 16)
            out[b * 32 + 16 + j] = d * np.float32(hi - 16)


@njit(inline="always")
def _row_q5_1(w, r, f16, out, n):
    for b in range(out.shape[0] // 32):
        o = b * 24
        d = _h(w, r, o, f16)
        m = _h(w, r, o + 2, f16)
        qh = _u32(w, r, o + 4)
        for j in range(n):
            q = np.int64(w[r, o + 8 + j])
            lo = (q & 15) | (((qh >> j) & 1) << 4)
            hi = (q >> 4) | (((qh >> (j + 16)) & 1) << 4)
            out[b * 32 + j] = d * np.float32(lo) + m
            out[b * 32 + 16 + j] = d * np.float32(hi) + m


@njit(inline="always")
def _row_q4_k(w, r, f16, out, n):
    for b in range(out.shape[0] // 256):
        o = b * 144
        d = _h(w, r, o, f16)
        dmin = _h(w, r, o + 2, f16)
        for c in range(4):
            d0 = d * np.float32(_k_scale(w, r, o + 4, 2 * c))
            m0 = dmin * np.float32(_k_min(w, r, o + 4, 2 * c))
            d1 = d * np.float32(_k_scale(w, r, o + 4, 2 * c + 1))
            m1 = dmin * np.float32(_k_min(w, r, o + 4, 2 * c + 1))
            e = b * 256 + 64 * c
            for j in range(2 * n):
                lo, hi = _split(np.float32(w[r, o + 16 + 32 * c + j]))
                out[e + j] = d0 * lo - m0
                out[e + 32 + j] = d1 * hi - m1


@njit(inline="always")
def _row_q5_k(w, r, f16, out, n):
    for b in range(out.shape[0] // 256):
        o = b * 176
        d = _h(w, r, o, f16)
        dmin = _h(w, r, o + 2, f16)
        for c in range(4):
            d0 = d * np.float32(_k_scale(w, r, o + 4, 2 * c))
            m0 = dmin * np.float32(_k_min(w, r, o + 4, 2 * c))
            d1 = d * np.float32(_k_scale(w, r, o + 4, 2 * c + 1))
            m1 = dmin * np.float32(_k_min(w, r, o + 4, 2 * c + 1))
            e = b * 256 + 64 * c
            for j in range(2 * n):
                q = np.int64(w[r, o + 48 + 32 * c + j])
                h = np.int64(w[r, o + 16 + j]) >> (2 * c)
                out[e + j] = d0 * np.float32((q & 15) | ((h & 1) << 4)) - m0
                out[e + 32 + j] = d1 * np.float32((q >> 4) | ((h & 2) << 3)) - m1


@njit(inline="always")
def _row_q6_k(w, wi, r, f16, out, n):
    for b in range(out.shape[0] // 256):
        o = b * 210
        d = _h(w, r, o + 208, f16)
        for h in range(2):
            for half in range(2):
                so = o + 192 + 8 * h + half  # scale of weights 128h + 32s + 16*half: 8h + 2s + half
                d0 = d * np.float32(wi[r, so])
                d1 = d * np.float32(wi[r, so + 2])
                d2 = d * np.float32(wi[r, so + 4])
                d3 = d * np.float32(wi[r, so + 6])
                lo = o + 64 * h + 16 * half
                ho = o + 128 + 32 * h + 16 * half
                e = b * 256 + 128 * h + 16 * half
                for j in range(n):
                    a = np.int64(w[r, lo + j])
                    c = np.int64(w[r, lo + 32 + j])
                    hb = np.int64(w[r, ho + j])
                    out[e + j] = d0 * np.float32(((a & 15) | ((hb & 3) << 4)) - 32)
                    out[e + 32 + j] = d1 * np.float32(((c & 15) | ((hb & 12) << 2)) - 32)
                    out[e + 64 + j] = d2 * np.float32(((a >> 4) | (hb & 48)) - 32)
                    out[e + 96 + j] = d3 * np.float32(((c >> 4) | ((hb >> 2) & 48)) - 32)


# Bit-exact dequantization of rows r0 .. r0 + len(out) (fastmath off).


@njit(cache=True)
def _dequant_q8_0(w, r0, f16, out, n):
    wi = w.view(np.int8)
    for i in range(out.shape[0]):
        _row_q8_0(w, wi, r0 + i, f16, out[i], n)


@njit(cache=True)
def _dequant_q4_0(w, r0, f16, out, n):
    for i in range(out.shape[0]):
        _row_q4_0(w, r0 + i, f16, out[i], n)


@njit(cache=True)
def _dequant_q4_1(w, r0, f16, out, n):
    for i in range(out.shape[0]):
        _row_q4_1(w, r0 + i, f16, out[i], n)


@njit(cache=True)
def _dequant_q5_0(w, r0, f16, out, n):
    for i in range(out.shape[0]):
        _row_q5_0(w, r0 + i, f16, out[i], n)


@njit(cache=True)
def _dequant_q5_1(w, r0, f16, out, n):
    for i in range(out.shape[0]):
        _row_q5_1(w, r0 + i, f16, out[i], n)


@njit(cache=True)
def _dequant_q4_k(w, r0, f16, out, n):
    for i in range(out.shape[0]):
        _row_q4_k(w, r0 + i, f16, out[i], n)


@njit(cache=True)
def _dequant_q5_k(w, r0, f16, out, n):
    for i in range(out.shape[0]):
        _row_q5_k(w, r0 + i, f16, out[i], n)


@njit(cache=True)
def _dequant_q6_k(w, r0, f16, out, n):
    wi = w.view(np.int8)
    for i in range(out.shape[0]):
        _row_q6_k(w, wi, r0 + i, f16, out[i], n)


# Two-stage gemv: dequantize one row into a per-thread fp32 buffer, then T
# plain dot products over K (long, fully vectorized loops). The unpacking is
# paid once per row whatever T is.


@njit(fastmath=_FM, inline="always")
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


@njit(fastmath=_FM, inline="always")
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


@njit(fastmath=_FM, inline="always")
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


@njit(fastmath=_FM, inline="always")
def _dots_4rows(a, x, y, r):
    """y[t, r + i] = a[i] . x[t] for i = 0..3 and every row t of x, blocked for the CPU."""
    if _WIDE_REGISTERS:
        _dots4(a, x, y, r)
    else:
        _dots42(a, x, y, r)


@njit(fastmath=_FM, inline="always")
def _dots_block(buf, x, y, r, N):
    """The two-stage kernels' products for rows r .. min(r + 4, N) - 1, dequantized in buf."""
    if r + 4 <= N:
        _dots_4rows(buf, x, y, r)
    else:
        for i in range(N - r):
            _dots(buf[i], x, y, r + i)


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv2_q8_0(x, w, f16, scratch, y, n):
    wi = w.view(np.int8)
    N = w.shape[0]
    for p in prange((N + 3) // 4):
        buf = scratch[get_thread_id()]  # (4, K)
        r = 4 * p
        for i in range(min(4, N - r)):
            _row_q8_0(w, wi, r + i, f16, buf[i], n)
        _dots_block(buf, x, y, r, N)


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv2_q4_0(x, w, f16, scratch, y, n):
    N = w.shape[0]
    for p in prange((N + 3) // 4):
        buf = scratch[get_thread_id()]  # (4, K)
        r = 4 * p
        for i in range(min(4, N - r)):
            _row_q4_0(w, r + i, f16, buf[i], n)
        _dots_block(buf, x, y, r, N)


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv2_q4_1(x, w, f16, scratch, y, n):
    N = w.shape[0]
    for p in prange((N + 3) // 4):
        buf = scratch[get_thread_id()]  # (4, K)
        r = 4 * p
        for i in range(min(4, N - r)):
            _row_q4_1(w, r + i, f16, buf[i], n)
        _dots_block(buf, x, y, r, N)


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv2_q5_0(x, w, f16, scratch, y, n):
    N = w.shape[0]
    for p in prange((N + 3) // 4):
        buf = scratch[get_thread_id()]  # (4, K)
        r = 4 * p
        for i in range(min(4, N - r)):
            _row_q5_0(w, r + i, f16, buf[i], n)
        _dots_block(buf, x, y, r, N)


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv2_q5_1(x, w, f16, scratch, y, n):
    N = w.shape[0]
    for p in prange((N + 3) // 4):
        buf = scratch[get_thread_id()]  # (4, K)
        r = 4 * p
        for i in range(min(4, N - r)):
            _row_q5_1(w, r + i, f16, buf[i], n)
        _dots_block(buf, x, y, r, N)


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv2_q4_k(x, w, f16, scratch, y, n):
    N = w.shape[0]
    for p in prange((N + 3) // 4):
        buf = scratch[get_thread_id()]  # (4, K)
        r = 4 * p
        for i in range(min(4, N - r)):
            _row_q4_k(w, r + i, f16, buf[i], n)
        _dots_block(buf, x, y, r, N)


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv2_q5_k(x, w, f16, scratch, y, n):
    N = w.shape[0]
    for p in prange((N + 3) // 4):
        buf = scratch[get_thread_id()]  # (4, K)
        r = 4 * p
        for i in range(min(4, N - r)):
            _row_q5_k(w, r + i, f16, buf[i], n)
        _dots_block(buf, x, y, r, N)


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv2_q6_k(x, w, f16, scratch, y, n):
    wi = w.view(np.int8)
    N = w.shape[0]
    for p in prange((N + 3) // 4):
        buf = scratch[get_thread_id()]  # (4, K)
        r = 4 * p
        for i in range(min(4, N - r)):
            _row_q6_k(w, wi, r + i, f16, buf[i], n)
        _dots_block(buf, x, y, r, N)


# 16-bit floats. F16: the `simd.half16` steps convert 16 halves at a time (the
# CPU's own conversion; the table `f16` serves the last K % 16 columns). BF16:
# each weight is a lookup in `BF16_TO_F32` (passed as `f16`), exact. w is
# (N, 2 K) bytes, viewed as (N, K) uint16.


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv_f16(x, w, f16, y, n):
    h = w.view(np.uint16)
    K = x.shape[1]
    K16 = K - K % 16
    for r in prange(w.shape[0]):
        hr = h[r]
        for t in range(x.shape[0]):
            xt = x[t]
            a0, a1 = stack_f32x16(), stack_f32x16()
            k = 0
            while k + 32 <= K16:
                half16(a0, hr, k, xt, k)
                half16(a1, hr, k + 16, xt, k + 16)
                k += 32
            if k < K16:
                half16(a0, hr, k, xt, k)
            s = _total(a0, a1)
            for j in range(K16, K):
                s += f16[np.int64(hr[j])] * xt[j]
            y[t, r] = s


@njit(inline="always")
def _row_f16(h, r, f16, out):
    K = out.shape[0]
    K16 = K - K % 16
    hr = h[r]
    for k in range(0, K16, 16):
        half16_store(out, k, hr, k)
    for k in range(K16, K):
        out[k] = f16[np.int64(hr[k])]


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv2_f16(x, w, f16, scratch, y, n):
    h = w.view(np.uint16)
    N = w.shape[0]
    for p in prange((N + 3) // 4):
        buf = scratch[get_thread_id()]  # (4, K)
        r = 4 * p
        for i in range(min(4, N - r)):
            _row_f16(h, r + i, f16, buf[i])
        _dots_block(buf, x, y, r, N)


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv_bf16(x, w, f16, y, n):
    h = w.view(np.uint16)
    for r in prange(w.shape[0]):
        for t in range(x.shape[0]):
            s = np.float32(0.0)
            for k in range(x.shape[1]):
                s += f16[np.int64(h[r, k])] * x[t, k]
            y[t, r] = s


@njit(inline="always")
def _row_table16(h, r, f16, out):
    for k in range(out.shape[0]):
        out[k] = f16[np.int64(h[r, k])]


@njit(cache=True)
def _dequant_f16(w, r0, f16, out, n):
    h = w.view(np.uint16)
    for i in range(out.shape[0]):
        _row_table16(h, r0 + i, f16, out[i])


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv2_bf16(x, w, f16, scratch, y, n):
    h = w.view(np.uint16)
    N = w.shape[0]
    for p in prange((N + 3) // 4):
        buf = scratch[get_thread_id()]  # (4, K)
        r = 4 * p
        for i in range(min(4, N - r)):
            _row_table16(h, r + i, f16, buf[i])
        _dots_block(buf, x, y, r, N)


# --------------------------------------------------------------------------- multi-row kernels
# Batched decoding (3 <= T <= `ROWS_MAX_T`), `_rows_<type>`: each block of a row
# of W is unpacked to floats once, in registers, and multiplied with 4 or 8 rows
# of x at a time (`simd.*_rows`: 8 accumulators of 8 lanes, one per row of x).
# The two-stage kernels store each dequantized row and read it back for every
# pair of rows of x; here only x goes through memory. x is read in passes of at
# most `_ROWS_PASS` columns, so that the 8 rows of a pass stay in the L1 cache
# while a group of `_ROWS_GROUP` rows of W goes by; each pass adds its sums
# into y. Against the two-stage kernels at T = 8, 2 threads, in one process
# (medians of interleaved runs): all of SmolLM2's Q4_1 layer matrices
# 1.06-1.15x faster, Qwen2.5 0.5B's (Q5_0, Q4_K, Q6_K, Q8_0) 1.2x, the Q8_0
# output matrices 1.36x (SmolLM2) and 1.10x (Qwen). With 5 to 7 rows of x the
# zero rows cost as much as the gain: about even.

ROWS_MAX_T = 8
_ROWS_GROUP = 8
_ROWS_PASS = 768  # 8 rows of x: 24 KiB


@njit(fastmath=_FM, inline="always")
def _rows_loop(block, qk, x, w, y):
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
    passes = (K + _ROWS_PASS - 1) // _ROWS_PASS
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


@njit(fastmath=_FM, inline="always")
def _rblk_q8_0(acc, w, wi, r, b, x, xo, K, rows):  # q * d
    o = b * 34
    q8_rows(acc, wi[r], o + 2, x, xo, K, half_at(w, r, o), rows)


@njit(fastmath=_FM, inline="always")
def _rblk_q4_0(acc, w, wi, r, b, x, xo, K, rows):  # (q - 8) * d
    o = b * 18
    d = half_at(w, r, o)
    c = -np.float32(8.0) * d
    nib_rows(acc, w[r], o + 2, x, xo, xo + 16, K, d, c, d, c, rows)


@njit(fastmath=_FM, inline="always")
def _rblk_q4_1(acc, w, wi, r, b, x, xo, K, rows):  # q * d + m
    o = b * 20
    d, m = half_at(w, r, o), half_at(w, r, o + 2)
    nib_rows(acc, w[r], o + 4, x, xo, xo + 16, K, d, m, d, m, rows)


@njit(fastmath=_FM, inline="always")
def _rblk_q5_0(acc, w, wi, r, b, x, xo, K, rows):  # (q - 16) * d
    o = b * 22
    d = half_at(w, r, o)
    nib_hb_rows(acc, w[r], o + 6, x, xo, xo + 16, K, d, -np.float32(16.0) * d,
                np.int32(_u32(w, r, o + 2)), rows)


@njit(fastmath=_FM, inline="always")
def _rblk_q5_1(acc, w, wi, r, b, x, xo, K, rows):  # q * d + m
    o = b * 24
    nib_hb_rows(acc, w[r], o + 8, x, xo, xo + 16, K, half_at(w, r, o), half_at(w, r, o + 2),
                np.int32(_u32(w, r, o + 4)), rows)


@njit(fastmath=_FM, inline="always")
def _rblk_q4_k(acc, w, wi, r, b, x, xo, K, rows):  # q * d * scale - dmin * min
    o = b * 144
    d, dmin = half_at(w, r, o), half_at(w, r, o + 2)
    for c in range(4):  # pairs of 32-weight sub-blocks sharing 32 bytes, as in `_dot_q4_k`
        qo = o + 16 + 32 * c
        x0 = xo + 64 * c
        a0 = d * np.float32(_k_scale(w, r, o + 4, 2 * c))
        a1 = d * np.float32(_k_scale(w, r, o + 4, 2 * c + 1))
        c0 = -(dmin * np.float32(_k_min(w, r, o + 4, 2 * c)))
        c1 = -(dmin * np.float32(_k_min(w, r, o + 4, 2 * c + 1)))
        nib_rows(acc, w[r], qo, x, x0, x0 + 32, K, a0, c0, a1, c1, rows)
        nib_rows(acc, w[r], qo + 16, x, x0 + 16, x0 + 48, K, a0, c0, a1, c1, rows)


@njit(fastmath=_FM, inline="always")
def _rblk_q6_k(acc, w, wi, r, b, x, xo, K, rows):  # (q - 32) * d * scale
    o = b * 210
    d = half_at(w, r, o + 208)
    for h in range(2):  # halves of 128 weights; 16-weight sub-blocks as in `_dot_q6_k`
        so = o + 192 + 8 * h
        for i in range(2):
            q6k_rows(acc, w[r], o + 64 * h + 16 * i, o + 128 + 32 * h + 16 * i, x,
                     xo + 128 * h + 16 * i, K, d * np.float32(wi[r, so + i]),
                     d * np.float32(wi[r, so + 2 + i]), d * np.float32(wi[r, so + 4 + i]),
                     d * np.float32(wi[r, so + 6 + i]), rows)


@njit(parallel=True, fastmath=_FM, cache=True)
def _rows_q8_0(x, w, f16, y, n):
    _rows_loop(_rblk_q8_0, 32, x, w, y)


@njit(parallel=True, fastmath=_FM, cache=True)
def _rows_q4_0(x, w, f16, y, n):
    _rows_loop(_rblk_q4_0, 32, x, w, y)


@njit(parallel=True, fastmath=_FM, cache=True)
def _rows_q4_1(x, w, f16, y, n):
    _rows_loop(_rblk_q4_1, 32, x, w, y)


@njit(parallel=True, fastmath=_FM, cache=True)
def _rows_q5_0(x, w, f16, y, n):
    _rows_loop(_rblk_q5_0, 32, x, w, y)


@njit(parallel=True, fastmath=_FM, cache=True)
def _rows_q5_1(x, w, f16, y, n):
    _rows_loop(_rblk_q5_1, 32, x, w, y)


@njit(parallel=True, fastmath=_FM, cache=True)
def _rows_q4_k(x, w, f16, y, n):
    _rows_loop(_rblk_q4_k, 256, x, w, y)


@njit(parallel=True, fastmath=_FM, cache=True)
def _rows_q6_k(x, w, f16, y, n):
    _rows_loop(_rblk_q6_k, 256, x, w, y)


# --------------------------------------------------------------------------- dispatch

GEMV_KERNELS = {
    Q.Q8_0: _gemv_q8_0,
    Q.Q4_0: _gemv_q4_0,
    Q.Q4_1: _gemv_q4_1,
    Q.Q5_0: _gemv_q5_0,
    Q.Q5_1: _gemv_q5_1,
    Q.Q4_K: _gemv_q4_k,
    Q.Q5_K: _gemv_q5_k,
    Q.Q6_K: _gemv_q6_k,
    Q.F16: _gemv_f16,
    Q.BF16: _gemv_bf16,
}
DEQUANT_KERNELS = {
    Q.Q8_0: _dequant_q8_0,
    Q.Q4_0: _dequant_q4_0,
    Q.Q4_1: _dequant_q4_1,
    Q.Q5_0: _dequant_q5_0,
    Q.Q5_1: _dequant_q5_1,
    Q.Q4_K: _dequant_q4_k,
    Q.Q5_K: _dequant_q5_k,
    Q.Q6_K: _dequant_q6_k,
    Q.F16: _dequant_f16,
    Q.BF16: _dequant_f16,
}
GEMV2_KERNELS = {
    Q.Q8_0: _gemv2_q8_0,
    Q.Q4_0: _gemv2_q4_0,
    Q.Q4_1: _gemv2_q4_1,
    Q.Q5_0: _gemv2_q5_0,
    Q.Q5_1: _gemv2_q5_1,
    Q.Q4_K: _gemv2_q4_k,
    Q.Q5_K: _gemv2_q5_k,
    Q.Q6_K: _gemv2_q6_k,
    Q.F16: _gemv2_f16,
    Q.BF16: _gemv2_bf16,
}
ROWS_KERNELS = {  # Q5_K, F16 and BF16 keep the two-stage kernels
    Q.Q8_0: _rows_q8_0,
    Q.Q4_0: _rows_q4_0,
    Q.Q4_1: _rows_q4_1,
    Q.Q5_0: _rows_q5_0,
    Q.Q5_1: _rows_q5_1,
    Q.Q4_K: _rows_q4_k,
    Q.Q6_K: _rows_q6_k,
}
KERNEL_TYPES: tuple[GGMLQuantizationType, ...] = tuple(GEMV_KERNELS)


# Largest T for the Numba-only kernels. Measured with 2 threads (ms), two-stage
# (4 x 4 blocked dots) / tile+BLAS: Q4_1 49152x576 T=8 4.1 / 9.5, T=16 6.4 / 13.0;
# Q4_1 4864x896 T=32 1.9 / 2.6, T=64 3.2 / 4.9, T=128 6.8 / 7.6, T=512 28.6 / 23.2.
GEMV_MAX_T = 64
# Weights dequantized per tile on the BLAS path (1M floats = 4 MiB of fp32);
# 256K and 4M were 5-40% slower from T=16 to T=512.
TILE_WEIGHTS = 1 << 20


def _table(qtype: GGMLQuantizationType) -> np.ndarray:
    """The fp16 table, or the bf16 one for BF16 weights."""
    return BF16_TO_F32 if qtype == Q.BF16 else F16_TO_F32


def _frozen(w: np.ndarray) -> np.ndarray:
    """A read-only view of w: mmap'd weights are read-only, so kernels are compiled
    for read-only arrays only (one specialization each, whatever the caller has)."""
    if w.flags.writeable:
        w = w.view()
        w.flags.writeable = False
    return w


def _check(x: np.ndarray, w: np.ndarray, qtype: GGMLQuantizationType,
           out: np.ndarray | None) -> np.ndarray:
    """Validate the arguments; return the output array (out, or a new (T, N) array)."""
    if qtype not in GEMV_KERNELS:
        raise ValueError(f"no CPU kernel for {GGMLQuantizationType(qtype).name}; kernels: "
                         + ", ".join(t.name for t in KERNEL_TYPES))
    if x.dtype != np.float32 or x.ndim != 2 or not x.flags.c_contiguous:
        raise ValueError("x must be a C-contiguous (T, K) float32 array")
    if w.dtype != np.uint8 or w.ndim != 2 or not w.flags.c_contiguous:
        raise ValueError("w must be a C-contiguous (N, bytes_per_row) uint8 array")
    shape = (x.shape[0], w.shape[0])
    if out is None:
        return np.empty(shape, np.float32)
    if out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous float32 array of shape {shape}")
    return out


def gemv(x: np.ndarray, w: np.ndarray, qtype: GGMLQuantizationType,
         out: np.ndarray | None = None) -> np.ndarray:
    """`x @ dequantize(w).T` by dot products on the packed blocks (the decode path).

    x: (T, K) float32, C-contiguous; w: (N, bytes_per_row) uint8 raw blocks of
    `qtype`; returns (T, N) float32 (written into `out` when given). Unpacks
    every block once per row of x, so its cost grows linearly in T: the
    fastest kernel for T = 1.
    """
    return _gemv(x, w, qtype, _check(x, w, qtype, out))


def gemv_dequant_rows(x: np.ndarray, w: np.ndarray, qtype: GGMLQuantizationType,
                      out: np.ndarray | None = None) -> np.ndarray:
    """`x @ dequantize(w).T`, dequantizing each row of W once into a per-thread buffer.

    Same contract as `gemv`; the unpacking is shared by the T rows of x, so
    this is the faster kernel for `ROWS_MAX_T` < T <= `GEMV_MAX_T` (from T = 3
    for the formats without `gemv_rows`).
    """
    return _gemv_dequant_rows(x, w, qtype, _check(x, w, qtype, out))


def gemv_rows(x: np.ndarray, w: np.ndarray, qtype: GGMLQuantizationType,
              out: np.ndarray | None = None) -> np.ndarray:
    """`x @ dequantize(w).T`, unpacking each block once for 8 (or 4) rows of x at a time.

    Same contract as `gemv`, for the formats in `ROWS_KERNELS` (others raise
    ValueError); any T works, and it is the faster kernel for 3 <= T <=
    `ROWS_MAX_T` (batched decoding).
    """
    y = _check(x, w, qtype, out)
    if qtype not in ROWS_KERNELS:
        raise ValueError(f"no multi-row kernel for {GGMLQuantizationType(qtype).name}")
    return _gemv_rows(x, w, qtype, y)


# The unchecked kernel calls behind `gemv`, `gemv_dequant_rows`, `gemv_rows` and `matmul`
# (which checks its arguments once and then picks one of them).


def _gemv(x: np.ndarray, w: np.ndarray, qtype: GGMLQuantizationType, y: np.ndarray
          ) -> np.ndarray:
    GEMV_KERNELS[qtype](_writeable(x), _frozen(w), _table(qtype), y, _INNER)
    return y


def _gemv_dequant_rows(x: np.ndarray, w: np.ndarray, qtype: GGMLQuantizationType,
                       y: np.ndarray) -> np.ndarray:
    # (threads, 4, K): four dequantized rows per thread
    scratch = np.empty((numba.config.NUMBA_NUM_THREADS, 4, x.shape[1]), np.float32)
    GEMV2_KERNELS[qtype](_writeable(x), _frozen(w), _table(qtype), scratch, y, _INNER)
    return y


def _gemv_rows(x: np.ndarray, w: np.ndarray, qtype: GGMLQuantizationType, y: np.ndarray
               ) -> np.ndarray:
    ROWS_KERNELS[qtype](_writeable(x), _frozen(w), _table(qtype), y, _INNER)
    return y


def _writeable(x: np.ndarray) -> np.ndarray:
    """x itself, or a copy when read-only (kernels are compiled for writeable x only)."""
    return x if x.flags.writeable else x.copy()


def dequantize_rows(w: np.ndarray, qtype: GGMLQuantizationType, r0: int, r1: int,
                    out: np.ndarray | None = None) -> np.ndarray:
    """Rows r0..r1 of W as float32, bit-identical to `gguf.quants.dequantize`.

    w: (N, bytes_per_row) uint8 raw blocks; returns (r1 - r0, K) float32
    (written into `out` when given: C-contiguous float32 of that shape).
    """
    if qtype not in DEQUANT_KERNELS:
        raise ValueError(f"no CPU kernel for {GGMLQuantizationType(qtype).name}")
    bs, ts = GGML_QUANT_SIZES[qtype]
    k = w.shape[1] // ts * bs
    if out is None:
        out = np.empty((r1 - r0, k), np.float32)
    elif out.shape != (r1 - r0, k) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous float32 array of shape ({r1 - r0}, {k})")
    if w.dtype != np.uint8 or w.ndim != 2 or not w.flags.c_contiguous:
        raise ValueError("w must be a C-contiguous (N, bytes_per_row) uint8 array")
    if not 0 <= r0 <= r1 <= w.shape[0]:
        raise ValueError(f"row range [{r0}, {r1}) outside the {w.shape[0]} rows of w")
    DEQUANT_KERNELS[qtype](_frozen(w), r0, _table(qtype), out, _INNER)
    return out


def matmul(x: np.ndarray, w: np.ndarray, qtype: GGMLQuantizationType,
           out: np.ndarray | None = None) -> np.ndarray:
    """`x @ dequantize(w).T` on quantized weights, fp32 accumulation.

    x: (T, K) float32, C-contiguous; w: (N, bytes_per_row) uint8 raw blocks.
    Returns (T, N) float32, written into `out` when given. Picks the kernel by T:

    - T <= 2 (decode): `gemv`, dot products on the packed blocks;
    - 3 <= T <= `ROWS_MAX_T` (batched decoding): `gemv_rows` for the formats
      it has, else `gemv_dequant_rows`;
    - larger T up to `GEMV_MAX_T`: `gemv_dequant_rows`;
    - larger T (prefill): W is dequantized one tile of `TILE_WEIGHTS` floats
      at a time (serial Numba) and each tile is multiplied with BLAS
      (`np.dot`, multithreaded), so the fp32 copy never exceeds one tile.
      The dequantization is serial on purpose: OpenBLAS's worker threads
      keep spinning after a call, and a parallel Numba region right after
      one waits for its descheduled threads (measured 5-10x slower).
    """
    y = _check(x, w, qtype, out)
    T, K = x.shape
    if T <= 2:
        return _gemv(x, w, qtype, y)
    if T <= ROWS_MAX_T and qtype in ROWS_KERNELS:
        return _gemv_rows(x, w, qtype, y)
    if T <= GEMV_MAX_T:
        return _gemv_dequant_rows(x, w, qtype, y)
    w = _frozen(w)
    N = w.shape[0]
    rows = max(16, min(N, TILE_WEIGHTS // K))
    tile = np.empty((rows, K), np.float32)
    kern = DEQUANT_KERNELS[qtype]
    table = _table(qtype)
    # BLAS is faster as (rows, K) @ (K, T) for small T and as (T, K) @ (K, rows) for large T.
    wide = T > 64
    yt = y if wide else np.empty((N, T), np.float32)  # (N, T): each tile fills contiguous rows
    for r0 in range(0, N, rows):
        r1 = min(N, r0 + rows)
        part = tile[: r1 - r0]
        kern(w, r0, table, part, _INNER)
        if wide:
            np.matmul(x, part.T, out=y[:, r0:r1])  # (T, K) @ (K, rows)
        else:
            np.dot(part, x.T, out=yt[r0:r1])  # (rows, K) @ (K, T)
    if not wide:
        y[...] = yt.T
    return y
