"""Numba CPU kernels for the work of a transformer layer besides the matmuls.

Decoding runs one token per sequence through ~30 layers; done with NumPy,
each layer costs dozens of small array operations whose Python overhead
exceeds their arithmetic. These kernels do each step in one call:

- `rms_norm(x, weight, eps, out)`: RMSNorm of each row;
- `add_rms_norm(x, h, weight, eps, out)`: the residual add `x += h`, then
  RMSNorm of the sum into `out`;
- `silu_mul(gu, out)`: SwiGLU, `silu(gate) * up` from the fused gate/up output;
  `gelu_mul(gu, out)` the same with tanh-GELU (GeGLU, Gemma);
- `attend(qkv, ...)`: for N sequences at their own positions, split the fused
  Q/K/V projection into heads, apply the per-head Q/K RMSNorm (Qwen3) and
  RoPE, write the new key and value into each sequence's KV-cache slot and
  attend over everything cached (or the last `window` positions, from a
  rotating cache), grouped-query style: one job per sequence and KV head, which
  reads the cached keys and values in tiles of ~16 KiB, each from memory once for
  all the query heads sharing it (at several hundred positions the step is then
  bound by reading the cache); with fewer such jobs than threads, the query heads
  of a group are split between threads.

Prefill (`workbench.engine.models.llama`, NumPy around these and the matmuls) uses
`rms_norm` too, and:

- `rope_rows(x, cos, sin, start, dim, neox)`: RoPE of every row and head of x
  (T, H, hd) in place, with `attend`'s rotation;
- `hide_keys(scores, n, own, window)`: -inf, in place, where a chunk of queries'
  scores meet a key later than the query or outside its sliding window (only those
  entries are written), before `softmax_rows`.

The tests hold these kernels to transformers' logits and compare token-by-token
decoding through them with a single prefill pass.

For encoders (BERT), whose layers see a whole padded batch at once:

- `add_layer_norm(x, h, bias, weight, norm_bias, eps)`: post-LN residual,
  `x = LayerNorm(x + h + bias)` in place;
- `layer_norm(x, weight, bias, eps, out)`: pre-LN (Whisper), `out = LayerNorm(x)`;
- `bias_gelu(x, bias)`: `x = gelu(x + bias)` in place, the exact (erf) GELU;
- `encoder_attend(qkv, lengths, n_head, out)`: bidirectional attention of each
  sequence over its own first `lengths[b]` tokens (padding is never attended);
- `softmax_rows(scores, top)`: the attention softmax of each row, in place,
  given the row maxima (Whisper's encoder blocks of 256 x 1500 scores), with
  `exp_neg`, a float32 exp for arguments in [-60, 0] that LLVM vectorizes
  (a libm `exp` call per element would not be).

Transformers' BERT (checked to 1e-4 in the tests) is their reference. All
kernels are compiled once and cached on disk.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from workbench.kernels.cache import njit
from workbench.kernels.simd import axpy8s, dots8, f32_from_bits, stack_f32x64, sums8

_FM = {"reassoc", "contract"}  # reorder sums, fuse multiply-adds; NaN/inf semantics kept


@njit(fastmath=_FM, cache=True)
def rms_norm(x, weight, eps, out):
    """out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight, for each row of x (T, D)."""
    T, D = x.shape
    for t in range(T):
        ss = np.float32(0.0)
        for i in range(D):
            ss += x[t, i] * x[t, i]
        r = np.float32(1.0) / np.sqrt(ss / np.float32(D) + np.float32(eps))
        for i in range(D):
            out[t, i] = x[t, i] * r * weight[i]


@njit(fastmath=_FM, cache=True)
def add_rms_norm(x, h, weight, eps, out):
    """x += h (the residual stream, in place); out = rms_norm(x) row by row. x, h: (T, D)."""
    T, D = x.shape
    for t in range(T):
        ss = np.float32(0.0)
        for i in range(D):
            v = x[t, i] + h[t, i]
            x[t, i] = v
            ss += v * v
        r = np.float32(1.0) / np.sqrt(ss / np.float32(D) + np.float32(eps))
        for i in range(D):
            out[t, i] = x[t, i] * r * weight[i]


@njit(fastmath=_FM, error_model="numpy", cache=True)
def silu_mul(gu, out):
    """out = silu(gate) * up, where gu (T, 2F) holds gate in [:, :F] and up in [:, F:].

    silu(g) = g sigmoid(g), the sigmoid from `exp_neg(-|g|)`, which LLVM vectorizes (a
    libm exp call per element it would not: measured 7x slower at 8 x 1536)."""
    T, F = out.shape
    for t in range(T):
        for i in range(F):
            g = gu[t, i]
            e = exp_neg(-abs(g))
            s = (np.float32(1.0) if g >= 0 else e) / (np.float32(1.0) + e)
            out[t, i] = g * s * gu[t, F + i]


_GELU_C = np.float32(math.sqrt(2.0 / math.pi))


@njit(fastmath=_FM, error_model="numpy", cache=True)
def gelu_mul(gu, out):
    """out = gelu(gate) * up (GeGLU, with GELU's tanh approximation as Gemma uses it),
    where gu (T, 2F) holds gate in [:, :F] and up in [:, F:].

    gelu(g) = g (1 + tanh(u)) / 2 = g sigmoid(2u), u = sqrt(2/pi) (g + 0.044715 g^3); the
    sigmoid comes from `exp_neg(-2|u|)`, which LLVM vectorizes (a libm tanh it would not)."""
    T, F = out.shape
    for t in range(T):
        for i in range(F):
            g = gu[t, i]
            u = _GELU_C * (g + np.float32(0.044715) * g * g * g)
            e = exp_neg(np.float32(-2.0) * abs(u))
            s = (np.float32(1.0) if u >= 0 else e) / (np.float32(1.0) + e)
            out[t, i] = g * s * gu[t, F + i]


@njit(fastmath=_FM, inline="always")
def _head_norm(v, weight, eps):
    """RMSNorm of one head vector v (hd,) in place (Qwen3's Q/K norm)."""
    ss = np.float32(0.0)
    for i in range(v.shape[0]):
        ss += v[i] * v[i]
    r = np.float32(1.0) / np.sqrt(ss / np.float32(v.shape[0]) + np.float32(eps))
    for i in range(v.shape[0]):
        v[i] = v[i] * r * weight[i]


@njit(fastmath=_FM, inline="always")
def _rope(v, cos, sin, dim, neox):
    """Rotate the first `dim` entries of one head vector v in place; cos, sin: (dim // 2,)."""
    half = dim // 2
    for i in range(half):
        if neox:  # pairs (i, i + dim/2)
            a, b = v[i], v[i + half]
            v[i] = a * cos[i] - b * sin[i]
            v[i + half] = a * sin[i] + b * cos[i]
        else:  # pairs (2i, 2i + 1)
            a, b = v[2 * i], v[2 * i + 1]
            v[2 * i] = a * cos[i] - b * sin[i]
            v[2 * i + 1] = a * sin[i] + b * cos[i]


@njit(fastmath=_FM, cache=True)
def rope_rows(x, cos, sin, start, dim, neox):
    """Rotate x (T, H, hd) in place, row t at position start + t, every head the same way
    (`_rope`, the decode kernels' rotation); cos, sin: (max_len, dim // 2) tables."""
    T, H, _ = x.shape
    for t in range(T):
        for h in range(H):
            _rope(x[t, h], cos[start + t], sin[start + t], dim, neox)


@njit(fastmath=_FM, error_model="numpy", cache=True)
def _attend_group(qkv, n, kv, group, g0, g1, slots, pos, cos, sin, rope_dim, neox, q_norm,
                  eps, keys, values, out, src, forked, window, ring):
    """Query heads g0 .. g1 - 1 of the `group` heads of sequence n that share KV head kv
    (grouped-query attention): norm, RoPE, softmax(q K^T / sqrt(hd)) V into out[n].

    The scores take eight positions at a time (`simd.dots8`: an 8-lane accumulator per
    position, all eight summed at once by `simd.sums8`); the weighted sum of values keeps
    64 output columns in registers across a tile of positions (`simd.axpy8s`). Head sizes
    that are not multiples of 8 take plain loops for the last hd % 8 columns. Against
    the former 16-lane step per position (a horizontal sum per score, the output added
    in memory), `attend` on 2 Zen 3 cores, in one process: 1.2-1.35x faster at 100
    positions, 1.6-1.9x at 500 to 1,000 (8 sequences; 3 and 7 query heads per KV
    head, hd 64).

    src, forked: when forked, src (N, L) is the slot holding each position (a forked
    branch reads its shared prefix from other slots); else each position of sequence n
    is in its own slot and src is not read.
    One compiled function, called from the serial and the parallel loop (inlined into
    both, each src case compiled apart, it took four times as long to compile: ~20 s
    of a cold start). Measured against the inlined version, with the former 16-lane
    steps: 0.93-1.07x at one sequence, up to 1.11x at four sequences over 300 positions.
    window: 0, or attend to the last `window` positions only (sliding-window layers);
    ring: 0, or position s is kept at s % ring (a rotating cache of a sliding-window layer)."""
    n_kv, L, hd = keys.shape[1], keys.shape[2], keys.shape[3]
    p = pos[n]
    lo = max(0, p - window + 1) if window else 0
    S = p + 1 - lo
    x = qkv[n]
    q0 = (kv * group + g0) * hd  # the heads are adjacent: x[q0 : q0 + (g1 - g0) * hd]
    G = g1 - g0
    for g in range(G):
        q = x[q0 + g * hd : q0 + (g + 1) * hd]
        if q_norm.shape[0]:
            _head_norm(q, q_norm, eps)
        _rope(q, cos[p], sin[p], rope_dim, neox)
    # where each attended position's key (and value) starts in the flat cache arrays; the
    # last one repeated up to a multiple of 8 positions (their scores are left unread)
    Sp = (S + 7) // 8 * 8
    at = np.empty(Sp, np.int64)
    for i in range(Sp):
        s = lo + min(i, S - 1)
        slot = src[n, s] if forked else slots[n]
        at[i] = ((slot * n_kv + kv) * L + (s % ring if ring else s)) * hd
    kf, vf = keys.reshape(keys.size), values.reshape(values.size)
    hd8 = hd - hd % 8  # columns in steps of 8; the rest one by one
    # positions are taken in tiles of ~16 KiB of keys (or values): each tile is read from
    # memory once, then from the L1 cache for the other query heads of the group
    tile = max(8, 4096 // hd // 8 * 8)
    scores = np.empty(G * Sp, np.float32)  # (G, Sp)
    for t0 in range(0, Sp, tile):
        for g in range(G):
            qo = q0 + g * hd
            for b in range(t0, min(Sp, t0 + tile), 8):
                acc = stack_f32x64()
                for c in range(0, hd8, 8):
                    dots8(acc, x, qo, kf, at, b, c)
                sums8(acc, scores, g * Sp + b)
                for j in range(b, b + 8):
                    for c in range(hd8, hd):
                        scores[g * Sp + j] += x[qo + c] * kf[at[j] + c]
    scale = np.float32(1.0 / np.sqrt(hd))
    for g in range(G):
        row = scores[g * Sp : g * Sp + S]
        m = -np.inf
        for i in range(S):
            row[i] *= scale
            m = max(m, row[i])
        total = np.float32(0.0)
        for i in range(S):
            e = exp_neg(row[i] - m)
            row[i] = e
            total += e
        r = np.float32(1.0) / total
        for i in range(S):
            row[i] *= r
    o = out[n]
    for j in range(q0, q0 + G * hd):
        o[j] = 0.0
    for t0 in range(0, S, tile):
        t1 = min(S, t0 + tile)
        for g in range(G):
            oo, w = q0 + g * hd, scores[g * Sp : g * Sp + S]
            for c0 in range(0, hd8, 64):
                if hd8 - c0 >= 64:
                    acc = stack_f32x64()
                    for i in range(t0, t1):
                        axpy8s(acc, w[i], vf, at[i] + c0, 8)
                    for c in range(64):
                        o[oo + c0 + c] += acc[c]
                else:  # the last hd8 % 64 columns, eight at a time
                    for c1 in range(c0, hd8, 8):
                        acc = stack_f32x64()
                        for i in range(t0, t1):
                            axpy8s(acc, w[i], vf, at[i] + c1, 1)
                        for c in range(8):
                            o[oo + c1 + c] += acc[c]
            for c in range(hd8, hd):
                t = np.float32(0.0)
                for i in range(t0, t1):
                    t += w[i] * vf[at[i] + c]
                o[oo + c] += t


@njit(fastmath=_FM, cache=True)
def _write_kv(qkv, n_head, n_kv, slots, pos, cos, sin, rope_dim, neox, k_norm, eps, keys,
              values, ring):
    """Norm and rotate each new key; write keys and values at [slot, :, pos] of the pool
    (at [slot, :, pos % ring] with a rotating cache)."""
    hd = keys.shape[3]
    for n in range(qkv.shape[0]):
        p = pos[n]
        at = p % ring if ring else p
        for h in range(n_kv):
            k = qkv[n, (n_head + h) * hd : (n_head + h + 1) * hd]
            if k_norm.shape[0]:
                _head_norm(k, k_norm, eps)
            _rope(k, cos[p], sin[p], rope_dim, neox)
            v0 = (n_head + n_kv + h) * hd
            for i in range(hd):
                keys[slots[n], h, at, i] = k[i]
                values[slots[n], h, at, i] = qkv[n, v0 + i]


@njit(fastmath=_FM, cache=True)
def _heads_serial(qkv, n_kv, group, slots, pos, cos, sin, rope_dim, neox, q_norm, eps,
                  keys, values, out, src, forked, window, ring):
    for job in range(qkv.shape[0] * n_kv):
        # 0 * group, not 0: a literal 0 would make this call a second specialization
        _attend_group(qkv, job // n_kv, job % n_kv, group, 0 * group, group, slots, pos, cos, sin,
                      rope_dim, neox, q_norm, eps, keys, values, out, src, forked, window,
                      ring)


@njit(parallel=True, fastmath=_FM, cache=True)
def _heads_parallel(qkv, n_kv, group, slots, pos, cos, sin, rope_dim, neox, q_norm, eps,
                    keys, values, out, src, forked, window, ring, threads):
    # One job per sequence and KV head; with fewer of those than threads (one sequence
    # of a model with one or two KV heads), each group's query heads are split between
    # jobs, which then each read the group's cache.
    pairs = qkv.shape[0] * n_kv
    parts = min(group, max(1, threads // pairs))
    for job in prange(pairs * parts):
        pair, part = job // parts, job % parts
        _attend_group(qkv, pair // n_kv, pair % n_kv, group, part * group // parts,
                      (part + 1) * group // parts, slots, pos, cos, sin, rope_dim, neox,
                      q_norm, eps, keys, values, out, src, forked, window, ring)


# Below this many multiply-adds (all heads, all cached positions) the heads run on
# one thread: starting the thread pool costs more (~20 us) than the work.
PARALLEL_ATTENTION_MACS = 1 << 16


def attend(qkv: np.ndarray, n_head: int, n_kv: int, slots: np.ndarray, pos: np.ndarray,
           cos: np.ndarray, sin: np.ndarray, rope_dim: int, neox: bool, q_norm: np.ndarray,
           k_norm: np.ndarray, eps: float, keys: np.ndarray, values: np.ndarray,
           out: np.ndarray, src: np.ndarray | None = None, window: int = 0,
           ring: int = 0) -> None:
    """Self-attention of N new tokens, one per sequence, each at its own position.

    qkv: (N, (n_head + 2 n_kv) * hd) float32, the fused Q, K, V projections
        (with biases added); modified in place (norms, RoPE).
    slots, pos: (N,) int64, each sequence's KV-pool slot and its token's position.
    cos, sin: (max_len, rope_dim // 2) RoPE tables; neox: rotate halves, not pairs.
    q_norm, k_norm: (hd,) per-head RMSNorm weights, or empty arrays for none.
    keys, values: (n_slots, n_kv, max_len, hd) one layer of the KV pool; the new
        key and value are written at [slot, :, pos].
    out: (N, n_head * hd) the attention output (before the output projection).
    src: None, or (N, L > max(pos)) int64: the slot holding each earlier position of
        each sequence (forked branches share their prefix with other slots).
    window: 0, or the sliding window: each token sees itself and the `window - 1`
        positions before it.
    ring: 0, or the length of a rotating cache: position s lives at [slot, :, s % ring]
        (needs ring >= window; src must be None).
    """
    has_src = src is not None
    # eps as float32, as the decode stack passes it: one compiled attention serves both
    attend_compiled(qkv, n_head, n_kv, slots, pos, cos, sin, rope_dim, neox, q_norm, k_norm,
                    np.float32(eps), keys, values, out, src if has_src else NO_SRC, has_src,
                    window, ring, numba.get_num_threads())


NO_SRC = np.zeros((0, 0), np.int64)  # `attend_compiled`'s src when no sequence is a fork


@njit(cache=True)
def attend_compiled(qkv, n_head, n_kv, slots, pos, cos, sin, rope_dim, neox, q_norm, k_norm,
                    eps, keys, values, out, src, has_src, window, ring, threads):
    """`attend` callable from compiled code: src is always an array, read only when has_src;
    `threads`, the number of Numba threads (passed in: reading it from compiled code would
    keep Numba from caching the kernel)."""
    _write_kv(qkv, n_head, n_kv, slots, pos, cos, sin, rope_dim, neox, k_norm, eps, keys,
              values, ring)
    seen = pos.sum() + pos.shape[0] if window == 0 else pos.shape[0] * window
    macs = 2 * n_head * keys.shape[3] * seen
    group = n_head // n_kv
    if macs >= PARALLEL_ATTENTION_MACS:
        _heads_parallel(qkv, n_kv, group, slots, pos, cos, sin, rope_dim, neox, q_norm, eps,
                        keys, values, out, src, has_src, window, ring, threads)
    else:
        _heads_serial(qkv, n_kv, group, slots, pos, cos, sin, rope_dim, neox, q_norm, eps,
                      keys, values, out, src, has_src, window, ring)


# -- encoder layers -------------------------------------------------------------------------
#
# These run between BLAS matrix products, so they are serial: OpenBLAS's worker threads
# keep spinning for a while after each call, and a parallel Numba region started then
# waits for its descheduled threads (measured 10x slower on 2 cores). They use NumPy's
# error model (no ZeroDivisionError checks), which lets LLVM vectorize the divisions.

_SQRT_HALF = np.float32(1.0 / math.sqrt(2.0))

# erf(z) ~ z P(z^2) / Q(z^2) on [-4, 4] (erf is +-1 in float32 beyond): a single-precision
# rational minimax fit; evaluated in float32 its error is below 4e-7 (3 ulps at 1.0)
# against math.erf (checked in the tests)
_ERF_P = tuple(np.float32(c) for c in (
    -2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
    -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
    -1.60960333262415e-02))
_ERF_Q = tuple(np.float32(c) for c in (
    -1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
    -7.37332916720468e-03, -1.42647390514189e-02))
_P0, _P1, _P2, _P3, _P4, _P5, _P6 = _ERF_P
_Q0, _Q1, _Q2, _Q3, _Q4 = _ERF_Q


@njit(fastmath=_FM, error_model="numpy", inline="always")
def _erf(z):
    z = min(max(z, np.float32(-4.0)), np.float32(4.0))
    z2 = z * z
    p = ((((((_P0 * z2 + _P1) * z2 + _P2) * z2 + _P3) * z2 + _P4) * z2 + _P5) * z2 + _P6) * z
    q = (((_Q0 * z2 + _Q1) * z2 + _Q2) * z2 + _Q3) * z2 + _Q4
    return p / q


@njit(fastmath=_FM, error_model="numpy", cache=True)
def erf(x, out):
    """out = erf(x) elementwise for float32 arrays x, out of shape (n,) (the GELU's erf)."""
    for i in range(x.shape[0]):
        out[i] = _erf(x[i])


@njit(fastmath=_FM, error_model="numpy", inline="always")
def _normalize(row, weight, bias, eps, dst):
    """dst = LayerNorm(row) * weight + bias for one row (dst may be row itself)."""
    D = row.shape[0]
    mean = np.float32(0.0)
    for i in range(D):
        mean += row[i]
    mean /= np.float32(D)
    var = np.float32(0.0)
    for i in range(D):
        d = row[i] - mean
        var += d * d
    r = np.float32(1.0) / np.sqrt(var / np.float32(D) + np.float32(eps))
    for i in range(D):
        dst[i] = (row[i] - mean) * r * weight[i] + bias[i]


@njit(fastmath=_FM, error_model="numpy", cache=True)
def add_layer_norm(x, h, bias, weight, norm_bias, eps):
    """x[t] = LayerNorm(x[t] + h[t] + bias) * weight + norm_bias, in place. x, h: (T, D)."""
    T, D = x.shape
    for t in range(T):
        row, add = x[t], h[t]
        for i in range(D):
            row[i] += add[i] + bias[i]
        _normalize(row, weight, norm_bias, eps, row)


@njit(fastmath=_FM, error_model="numpy", cache=True)
def layer_norm(x, weight, bias, eps, out):
    """out[t] = LayerNorm(x[t]) * weight + bias for each row of x (T, D); out may be x."""
    for t in range(x.shape[0]):
        _normalize(x[t], weight, bias, eps, out[t])


@njit(fastmath=_FM, error_model="numpy", cache=True)
def bias_gelu(x, bias):
    """x = gelu(x + bias) in place, gelu(v) = v/2 (1 + erf(v / sqrt 2)). x: (T, F)."""
    T, F = x.shape
    for t in range(T):
        row = x[t]
        for i in range(F):
            v = row[i] + bias[i]
            row[i] = np.float32(0.5) * v * (np.float32(1.0) + _erf(v * _SQRT_HALF))


@njit(fastmath=_FM, error_model="numpy", cache=True)
def encoder_attend(qkv, lengths, n_head, out):
    """Bidirectional multi-head attention within each padded sequence.

    qkv: (B, T, 3 D) float32, Q, K, V projections side by side (biases added).
    lengths: (B,) int64, the real tokens of each sequence; rows past them are padding,
        never attended to, and their output rows are left as they are.
    out: (B, T, D) the attention output (before the output projection).
    """
    B, T, D3 = qkv.shape
    D = D3 // 3
    hd = D // n_head
    scale = np.float32(1.0 / np.sqrt(hd))
    scores = np.empty(T, np.float32)
    acc = np.empty(hd, np.float32)
    for b in range(B):
        n = lengths[b]
        for h in range(n_head):
            q0, k0, v0 = h * hd, D + h * hd, 2 * D + h * hd
            for t in range(n):
                q = qkv[b, t, q0 : q0 + hd]
                top = np.float32(-np.inf)
                for s in range(n):
                    k = qkv[b, s, k0 : k0 + hd]
                    dot = np.float32(0.0)
                    for i in range(hd):
                        dot += q[i] * k[i]
                    dot *= scale
                    scores[s] = dot
                    top = max(top, dot)
                total = np.float32(0.0)
                for s in range(n):
                    e = np.exp(scores[s] - top)
                    scores[s] = e
                    total += e
                acc[:] = 0.0
                for s in range(n):
                    v = qkv[b, s, v0 : v0 + hd]
                    p = scores[s]
                    for i in range(hd):
                        acc[i] += p * v[i]
                inv = np.float32(1.0) / total
                o = out[b, t, h * hd : h * hd + hd]
                for i in range(hd):
                    o[i] = acc[i] * inv


# exp(y) for y in [-60, 0]: y = k ln2 + r with k = rint(y / ln2) and |r| <= ln2 / 2
# (ln2 split in a high part exact in float32 and a correction, Cody-Waite style), then
# e^r by its Taylor series to r^6 (truncation error below 1.3e-7 relative) times 2^k
# built from its exponent bits. Every step is plain float32/int32 arithmetic.
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_FLOOR = np.float32(-60.0)  # e^-60 ~ 8.8e-27: normal in float32 (see `softmax_rows`)


@njit(fastmath=_FM, error_model="numpy", inline="always")
def exp_neg(y):
    """e^y for float32 y in [-60, 0] (clamped to -60 below), relative error < 3e-7."""
    y = max(y, _EXP_FLOOR)
    k = np.rint(y * _LOG2E)
    r = (y - k * _LN2_HI) - k * _LN2_LO
    p = np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    return p * f32_from_bits((np.int32(k) + np.int32(127)) << np.int32(23))


@njit(fastmath=_FM, error_model="numpy", cache=True)
def softmax_rows(scores, top):
    """Softmax of each row of scores (R, S) in place; top (R,): the row maxima.

    Weights below e^-60 of the row's largest become e^-60 (not 0, and never a
    subnormal: subnormal weights slow the products with the values ~10x); a
    -inf score (a masked key) gets that weight too.
    """
    R, S = scores.shape
    for r in range(R):
        row = scores[r]
        m = top[r]
        total = np.float32(0.0)
        for j in range(S):
            e = exp_neg(row[j] - m)
            row[j] = e
            total += e
        inv = np.float32(1.0) / total
        for j in range(S):
            row[j] *= inv



@njit(cache=True)
def hide_keys(scores, n, own, window):
    """Set to -inf, in place, the scores of the keys a query may not see: scores (R, S)
    holds R = heads x n rows (row r: query r % n of a head) over S keys, key `own + i`
    being query i's own position; a query sees the keys up to its own and, with a sliding
    `window`, not those `window` or more behind it. Touches only the hidden entries."""
    R, S = scores.shape
    hidden = np.float32(-np.inf)
    for r in range(R):
        last = own + r % n
        for j in range(last + 1, S):
            scores[r, j] = hidden
        if window:
            for j in range(min(S, max(0, last - window + 1))):
                scores[r, j] = hidden
