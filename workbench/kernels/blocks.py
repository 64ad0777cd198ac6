"""Per-format block math of the Numba CPU kernels: the pieces `cpu` builds its kernels from.

For every format of `formats.FORMATS` with `cpu` set (named by `Format.name`):

- `dot_<name>`: row r of W (packed) times rows of x. For the formats with `rows`
  (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K), `dot_<name>(w, wi, r, x, K, xs, tp,
  t0, f16, y, T, rows)` writes y[t0 + t, r] for the `rows` rows t0 .. t0 + rows - 1
  (the literal 1, 2, 4 or 8; those past T are zero padding, not written) of the flat
  x (row t at x[t * K:]), each block unpacked once for all of them; xs holds the
  rows' sums of x over runs of `Format.sums`, run g of row t at xs[g * tp + t].
  Every row gets the same bits however many rows are taken together (`simd`).
  For the others (Q5_K, F16, BF16), `dot_<name>(w, wi, r, x, xs, f16, n)` returns
  row r times one row x (K,), float32, xs the sums of x over runs of `Format.sums`.
  w: (N, bytes_per_row) uint8, wi: the same bytes as int8; f16: the format's
  65536-entry table; n: the run-time 16 (`cpu` explains both).
- `row_<name>(w, wi, r, f16, out, n)`: row r of W as float32 into out (K,). Compiled
  without fastmath (`cpu._dequant_*`) it is bit-identical to `quants.dequantize` (same
  float32 ops in the same order); in the fastmath two-stage gemv it may fuse
  multiply-adds. `fast_row_<name>` takes its place there where `Format.fast_row` is set.
All are `inline="always"`: each is compiled into the kernels that call it.

Most blocks go through the 16-lane `simd` steps, two accumulators per row of x (even
and odd blocks: independent add chains); the `dot_<name>` of formats with `rows` are
inlined into kernels compiled without fastmath (`simd` says why), and have none.
Q5_K (and the dequantizers) unpack nibbles in float32: a byte v (0..255) converts
exactly, hi = floor(v / 16), lo = v - 16 * hi. Numba types integer arithmetic as int64,
which LLVM vectorizes 8 lanes wide with 64-bit int->float conversions; the float route
keeps every op 32-bit (measured 1.2-1.3x faster). Q5_K's single high bits are tested
with a select (`_bit`).
"""

from __future__ import annotations

import numpy as np

from workbench.kernels.cache import njit
from workbench.kernels.simd import (
    FASTMATH,
    deq8x32,
    deq16,
    deq16_hb,
    half16,
    half16_store,
    half_at,
    madd_lanes,
    nib16,
    nib16_1,
    nib16_hb,
    prefetch,
    q6k16,
    q8x32,
    stack_f32x16,
    stack_f32x128,
    store_totals,
)

# Bytes ahead of the block being read that each dot product asks the cache to fetch
# (`simd.prefetch`): a core's own misses keep too few lines in flight to stream a matrix
# at the memory's speed. Q8_0 151936x896 gemv (Qwen's lm_head), 2 threads, AVX-512 host:
# 8.1 ms without, 7.0 / 6.0 / 4.6 / 3.9 / 4.1 / 4.6 ms at 512 / 1024 / 2048 / 4096 /
# 8192 / 16384 bytes ahead (bench/bench_kernels.py, one run).
PREFETCH_AHEAD = 4096


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


@njit(inline="always")
def _k_pair(w, r, o, c, d, dmin):
    """Q4_K/Q5_K sub-blocks 2c and 2c + 1 of the super-block at o (scale d, min scale dmin):
    (d * scale, dmin * min) of each, as float32."""
    s = o + 4  # the 12 packed bytes of scales and mins
    return (d * np.float32(_k_scale(w, r, s, 2 * c)), dmin * np.float32(_k_min(w, r, s, 2 * c)),
            d * np.float32(_k_scale(w, r, s, 2 * c + 1)),
            dmin * np.float32(_k_min(w, r, s, 2 * c + 1)))


@njit(inline="always")
def _at(a, i):
    """a[i] for an index i >= 0, read without the code Numba adds to every signed index
    for negative ones (a test and a conditional move in each block of the dot loops)."""
    return a[np.uint64(i)]


# --------------------------------------------------------------------------- dot products


@njit(fastmath=FASTMATH, inline="always")
def _split(v):
    """A byte value as float32 -> (low nibble, high nibble), exact."""
    hi = np.floor(v * np.float32(0.0625))
    return v - np.float32(16.0) * hi, hi


@njit(fastmath=FASTMATH, inline="always")
def _total(a0, a1):
    """Sum of two 16-lane accumulators."""
    s = np.float32(0.0)
    for j in range(16):
        s += a0[j] + a1[j]
    return s


@njit(inline="always")
def dot_q8_0(w, wi, r, x, K, xs, tp, t0, f16, y, T, rows):
    nb = K // 32
    xo = t0 * K
    wr = wi[r]
    a0, a1, s = stack_f32x128(), stack_f32x128(), stack_f32x16()
    for b in range(0, nb, 2):
        o = b * 34
        prefetch(wr, o + PREFETCH_AHEAD)
        q8x32(a0, wr, o + 2, x, xo + b * 32, K, _h(w, r, o, f16), rows)
        if b + 1 < nb:
            q8x32(a1, wr, o + 36, x, xo + b * 32 + 32, K, _h(w, r, o + 34, f16), rows)
    store_totals(y, r, t0, T, a0, a1, s, rows)


@njit(inline="always")
def _block_pairs(block, w, r, x, K, xs, tp, t0, f16, y, T, rows):
    """Rows t0 .. t0 + rows - 1 of x times row r of a 32-weight format, into y:
    `block(acc, s, w, r, x, xo, K, xs, xso, tp, f16, b, rows)` adds the vector part of
    block b into acc and its scalar part (offset or min times the block's sum of x)
    into s, for each row. Even and odd blocks go to two accumulators per row."""
    nb = K // 32
    xo = t0 * K
    wr, size = w[r], w.shape[1] // nb  # (bytes of a block)
    a0, a1, s = stack_f32x128(), stack_f32x128(), stack_f32x16()
    for b in range(0, nb, 2):
        prefetch(wr, b * size + PREFETCH_AHEAD)
        block(a0, s, w, r, x, xo, K, xs, b * tp + t0, f16, b, rows)
        if b + 1 < nb:
            block(a1, s, w, r, x, xo, K, xs, (b + 1) * tp + t0, f16, b + 1, rows)
    store_totals(y, r, t0, T, a0, a1, s, rows)


@njit(inline="always")
def _blk_q4_0(acc, s, w, r, x, xo, K, xs, xso, f16, b, rows):
    """Block b of a Q4_0 row: (q - 8) d."""
    o = b * 18
    d = _h(w, r, o, f16)
    nib16_1(acc, w[r], o + 2, x, xo + b * 32, xo + b * 32 + 16, K, d, rows)
    madd_lanes(s, -np.float32(8.0) * d, xs, xso, rows)


@njit(inline="always")
def dot_q4_0(w, wi, r, x, K, xs, tp, t0, f16, y, T, rows):
    _block_pairs(_blk_q4_0, w, r, x, K, xs, tp, t0, f16, y, T, rows)


@njit(inline="always")
def _blk_q4_1(acc, s, w, r, x, xo, K, xs, xso, f16, b, rows):
    """q d + m."""
    o = b * 20
    nib16_1(acc, w[r], o + 4, x, xo + b * 32, xo + b * 32 + 16, K, _h(w, r, o, f16), rows)
    madd_lanes(s, _h(w, r, o + 2, f16), xs, xso, rows)


@njit(inline="always")
def dot_q4_1(w, wi, r, x, K, xs, tp, t0, f16, y, T, rows):
    _block_pairs(_blk_q4_1, w, r, x, K, xs, tp, t0, f16, y, T, rows)


@njit(fastmath=FASTMATH, inline="always")
def _bit(bits, mask, value):
    """`value` where `bits & mask` is non-zero, else 0.0 (vectorizes to a test and a blend)."""
    return value if (bits & mask) != 0 else np.float32(0.0)


@njit(inline="always")
def _blk_q5_0(acc, s, w, r, x, xo, K, xs, xso, f16, b, rows):
    """(q - 16) d, q of 5 bits."""
    o = b * 22
    d = _h(w, r, o, f16)
    nib16_hb(acc, w[r], o + 6, x, xo + b * 32, xo + b * 32 + 16, K, d,
             np.int32(_u32(w, r, o + 2)), rows)
    madd_lanes(s, -np.float32(16.0) * d, xs, xso, rows)


@njit(inline="always")
def dot_q5_0(w, wi, r, x, K, xs, tp, t0, f16, y, T, rows):
    _block_pairs(_blk_q5_0, w, r, x, K, xs, tp, t0, f16, y, T, rows)


@njit(inline="always")
def _blk_q5_1(acc, s, w, r, x, xo, K, xs, xso, f16, b, rows):
    """q d + m, q of 5 bits."""
    o = b * 24
    nib16_hb(acc, w[r], o + 8, x, xo + b * 32, xo + b * 32 + 16, K, _h(w, r, o, f16),
             np.int32(_u32(w, r, o + 4)), rows)
    madd_lanes(s, _h(w, r, o + 2, f16), xs, xso, rows)


@njit(inline="always")
def dot_q5_1(w, wi, r, x, K, xs, tp, t0, f16, y, T, rows):
    _block_pairs(_blk_q5_1, w, r, x, K, xs, tp, t0, f16, y, T, rows)


@njit(inline="always")
def dot_q4_k(w, wi, r, x, K, xs, tp, t0, f16, y, T, rows):
    nb = K // 256
    xo = t0 * K
    wr = w[r]
    a0, a1, s = stack_f32x128(), stack_f32x128(), stack_f32x16()
    for b in range(nb):
        o = b * 144
        d = _h(w, r, o, f16)
        dmin = _h(w, r, o + 2, f16)
        for c in range(4):  # pairs of 32-weight sub-blocks sharing 32 bytes
            prefetch(wr, o + 48 * c + PREFETCH_AHEAD)  # (144 bytes in all)
            qo = o + 16 + 32 * c
            x0 = xo + b * 256 + 64 * c
            d0, m0, d1, m1 = _k_pair(w, r, o, c, d, dmin)
            nib16(a0, wr, qo, x, x0, x0 + 32, K, d0, d1, rows)  # bytes 0-15 of the pair
            nib16(a1, wr, qo + 16, x, x0 + 16, x0 + 48, K, d0, d1, rows)  # bytes 16-31
            g = b * 8 + 2 * c  # sub-block 2c
            madd_lanes(s, -m0, xs, g * tp + t0, rows)
            madd_lanes(s, -m1, xs, (g + 1) * tp + t0, rows)
    store_totals(y, r, t0, T, a0, a1, s, rows)


@njit(fastmath=FASTMATH, inline="always")
def dot_q5_k(w, wi, r, x, xs, f16, n):
    nb = x.shape[0] // 256
    wr = w[r]
    s = np.float32(0.0)
    for b in range(nb):
        o = b * 176
        xo = b * 256
        d = _h(w, r, o, f16)
        dmin = _h(w, r, o + 2, f16)
        for c in range(4):
            prefetch(wr, o + 48 * c + PREFETCH_AHEAD)  # (176 bytes in all)
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
            d0, m0, d1, m1 = _k_pair(w, r, o, c, d, dmin)
            s += d0 * t0
            s += d1 * t1
            s -= m0 * _at(xs, g)
            s -= m1 * _at(xs, g + 1)
    return s


@njit(inline="always")
def _q6k_quarter(acc, s, w, wi, r, o, h, i, d, x, x0, K, xs, g, tp, t0, rows):
    """Weights 16 i .. 16 i + 15 of each 32-weight run of half h of the super-block at o
    (scales at so + i, so + 2 + i, ...), the -32 offset through the sums of x."""
    so = o + 192 + 8 * h + i  # scale of weights 128h + 32s + 16i: 8h + 2s + i
    d0, d1 = d * np.float32(wi[r, so]), d * np.float32(wi[r, so + 2])
    d2, d3 = d * np.float32(wi[r, so + 4]), d * np.float32(wi[r, so + 6])
    q6k16(acc, w[r], o + 64 * h + 16 * i, o + 128 + 32 * h + 16 * i, x, x0 + 16 * i, K,
          d0, d1, d2, d3, rows)
    madd_lanes(s, np.float32(-32.0) * d0, xs, (g + i) * tp + t0, rows)
    madd_lanes(s, np.float32(-32.0) * d1, xs, (g + i + 2) * tp + t0, rows)
    madd_lanes(s, np.float32(-32.0) * d2, xs, (g + i + 4) * tp + t0, rows)
    madd_lanes(s, np.float32(-32.0) * d3, xs, (g + i + 6) * tp + t0, rows)


@njit(inline="always")
def dot_q6_k(w, wi, r, x, K, xs, tp, t0, f16, y, T, rows):
    nb = K // 256
    wr = w[r]
    a0, a1, s = stack_f32x128(), stack_f32x128(), stack_f32x16()
    for b in range(nb):
        o = b * 210
        d = _h(w, r, o + 208, f16)
        for h in range(2):  # two halves of 128 weights
            prefetch(wr, o + 128 * h + PREFETCH_AHEAD)  # (210 bytes in all)
            prefetch(wr, o + 128 * h + 64 + PREFETCH_AHEAD)
            x0 = t0 * K + b * 256 + 128 * h
            g = b * 16 + 8 * h  # 16-group of the first run; the others are 2, 4, 6 further
            _q6k_quarter(a0, s, w, wi, r, o, h, 0, d, x, x0, K, xs, g, tp, t0, rows)
            _q6k_quarter(a1, s, w, wi, r, o, h, 1, d, x, x0, K, xs, g, tp, t0, rows)
    store_totals(y, r, t0, T, a0, a1, s, rows)


# --------------------------------------------------------------------------- row dequantizers


@njit(inline="always")
def row_q8_0(w, wi, r, f16, out, n):
    wr = w[r]
    for b in range(out.shape[0] // 32):
        o = b * 34
        deq8x32(out, b * 32, wr, o + 2, _h(w, r, o, f16))


@njit(inline="always")
def row_q4_0(w, wi, r, f16, out, n):
    wr = w[r]
    for b in range(out.shape[0] // 32):
        o = b * 18
        deq16(out, b * 32, wr, o + 2, np.float32(8.0), _h(w, r, o, f16), np.float32(-0.0))


@njit(inline="always")
def row_q4_1(w, wi, r, f16, out, n):
    wr = w[r]
    for b in range(out.shape[0] // 32):
        o = b * 20
        deq16(out, b * 32, wr, o + 4, np.float32(0.0), _h(w, r, o, f16), _h(w, r, o + 2, f16))


@njit(inline="always")
def row_q5_0(w, wi, r, f16, out, n):
    wr = w[r]
    for b in range(out.shape[0] // 32):
        o = b * 22
        deq16_hb(out, b * 32, wr, o + 6, np.float32(16.0), _h(w, r, o, f16),
                 np.float32(-0.0), np.int32(_u32(w, r, o + 2)))


@njit(inline="always")
def row_q5_1(w, wi, r, f16, out, n):
    wr = w[r]
    for b in range(out.shape[0] // 32):
        o = b * 24
        deq16_hb(out, b * 32, wr, o + 8, np.float32(0.0), _h(w, r, o, f16),
                 _h(w, r, o + 2, f16), np.int32(_u32(w, r, o + 4)))


@njit(inline="always")
def row_q4_k(w, wi, r, f16, out, n):
    for b in range(out.shape[0] // 256):
        o = b * 144
        d = _h(w, r, o, f16)
        dmin = _h(w, r, o + 2, f16)
        for c in range(4):
            d0, m0, d1, m1 = _k_pair(w, r, o, c, d, dmin)
            e = b * 256 + 64 * c
            for j in range(2 * n):
                lo, hi = _split(np.float32(w[r, o + 16 + 32 * c + j]))
                out[e + j] = d0 * lo - m0
                out[e + 32 + j] = d1 * hi - m1


@njit(inline="always")
def row_q5_k(w, wi, r, f16, out, n):
    for b in range(out.shape[0] // 256):
        o = b * 176
        d = _h(w, r, o, f16)
        dmin = _h(w, r, o + 2, f16)
        for c in range(4):
            d0, m0, d1, m1 = _k_pair(w, r, o, c, d, dmin)
            e = b * 256 + 64 * c
            for j in range(2 * n):
                q = np.int64(w[r, o + 48 + 32 * c + j])
                h = np.int64(w[r, o + 16 + j]) >> (2 * c)
                out[e + j] = d0 * np.float32((q & 15) | ((h & 1) << 4)) - m0
                out[e + 32 + j] = d1 * np.float32((q >> 4) | ((h & 2) << 3)) - m1


@njit(inline="always")
def row_q6_k(w, wi, r, f16, out, n):
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


# --------------------------------------------------------------------------- 16-bit floats
# w is (N, 2 K) bytes, each row viewed as K uint16. F16: the `simd.half16` steps convert
# 16 halves at a time (the CPU's own conversion); the table `f16` serves the last K % 16
# columns and the bit-exact dequantizer. BF16: each weight is a lookup in `BF16_TO_F32`
# (passed as `f16`), exact.


@njit(fastmath=FASTMATH, inline="always")
def dot_f16(w, wi, r, x, xs, f16, n):
    hr = w[r].view(np.uint16)  # (K,)
    K = x.shape[0]
    K16 = K - K % 16
    a0, a1 = stack_f32x16(), stack_f32x16()
    k = 0
    while k + 32 <= K16:
        half16(a0, hr, k, x, k)
        half16(a1, hr, k + 16, x, k + 16)
        k += 32
    if k < K16:
        half16(a0, hr, k, x, k)
    s = _total(a0, a1)
    for j in range(K16, K):
        s += f16[np.int64(hr[j])] * x[j]
    return s


@njit(inline="always")
def row_f16(w, wi, r, f16, out, n):
    hr = w[r].view(np.uint16)  # (K,)
    for k in range(out.shape[0]):
        out[k] = f16[np.int64(hr[k])]


@njit(inline="always")
def fast_row_f16(w, wi, r, f16, out, n):
    hr = w[r].view(np.uint16)  # (K,)
    K = out.shape[0]
    K16 = K - K % 16
    for k in range(0, K16, 16):
        half16_store(out, k, hr, k)
    for k in range(K16, K):
        out[k] = f16[np.int64(hr[k])]


@njit(fastmath=FASTMATH, inline="always")
def dot_bf16(w, wi, r, x, xs, f16, n):
    hr = w[r].view(np.uint16)  # (K,)
    s = np.float32(0.0)
    for k in range(x.shape[0]):
        s += f16[np.int64(hr[k])] * x[k]
    return s


row_bf16 = row_f16  # a lookup in the table passed as `f16`, which is BF16's here
