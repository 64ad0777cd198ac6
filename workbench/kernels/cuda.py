"""CUDA kernels for GGUF weight matrices (`gguf.cu`), and their NumPy stand-in.

A weight matrix of logical shape (N, K) lives on the GPU as the GGUF file stores it: a
uint8 array of N rows of `quants.row_bytes(qtype, K)` bytes each, rows contiguous (F32
matrices may arrive as float32 (N, K); only their bytes are used). Nothing is inflated to
float32 in memory. The kernels of `gguf.cu` decode it in groups of 32 consecutive weights
of a row (one block of the 32-weight formats, one eighth of a K-quant super-block, or 32
floats), for every format in `FORMATS`:

- `gemv_<fmt>`: y = x @ W.T for T <= `GEMV_MAX_T` tokens (decode; short prompts): one warp
  per row of W, each group decoded once and multiplied with every token's 32 inputs.
- `dequantize_<fmt>`: chosen rows of W as float32 (the embedding lookup), and on the
  prefill path (T > `GEMV_MAX_T`) tiles of `TILE_WEIGHTS` weights that cuBLAS multiplies
  (`x @ tile.T`), so the float32 copy of W never exceeds one tile.
- `step_<fmt>`: the recorded decode step's products, T <= `STEP_MAX_T` tokens, with the
  layer's work on either side in the same launch: the RMSNorm before (each block finds
  its tokens' scale), a bias, and after it the residual add or the gated activation
  (gate and up rows paired in one warp) (`step_matmul`).

The decoders round each product and sum as `workbench.kernels.quants` (the NumPy reference,
bit-identical to gguf-py) does, so `dequantize` gives the same float32 values; `matmul`
differs only by float32 summation order.

The decode step's other kernels live in `STEP_SOURCE`, a module of its own:
`attend_step` is the attention of the decode tokens of one step, each over its own
KV-cache slot, after `store_kv` has written each token's key and value there; `rms_norm`
(with the residual add before it, where given), `rope` and `glu` each do in one launch what
a dozen CuPy operations did. The recorded decode step (a CUDA graph) is a few hundred
launches, and each launch costs more than the tiny work it does, so their number is the
step's time. `attend_step` also replaces `cupy.matmul`, because CuPy refuses every cuBLAS
call while a stream is being captured into a CUDA graph ("calling cuBLAS API during
stream capture is currently unsupported", cupy#6290).

`CudaKernels` compiles `gguf.cu` with NVRTC through `cupy.RawModule` on first use, once per
process (CuPy keeps the compiled module in its disk cache). `ReferenceKernels` has the same
API in plain NumPy, so that `CupyBackend` runs in tests with NumPy standing in for CuPy.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from workbench.kernels import formats, quants

Q = GGMLQuantizationType

SOURCE = Path(__file__).with_name("gguf.cu")
"""The CUDA C++ source of the kernels."""

GEMV_MAX_T = 8
"""Most tokens (rows of x) the gemv kernels take; `matmul` with more dequantizes tiles and
uses cuBLAS. Must equal `GEMV_MAX_T` in gguf.cu."""

STEP_MAX_T = 64
"""Most tokens (sequences of a recorded decode step) `step_matmul` takes. Must equal
`STEP_MAX_T` in gguf.cu."""

EPILOGUES = {"store": 0, "add": 1, "silu": 2, "gelu": 3}
"""What `step_matmul` does with each result (`Epilogue` in gguf.cu): store it, add it to
the output (the residual stream), or, for W of gate rows then up rows, store act(gate) *
up with SiLU or tanh GELU."""

TILE_WEIGHTS = 1 << 24
"""Weights dequantized at once on the prefill path (64 MiB of float32)."""

FORMATS: dict[GGMLQuantizationType, str] = {f.qtype: f.name for f in formats.FORMATS if f.cuda}
"""The formats with kernels (those of `formats.FORMATS` with `cuda` set), and the suffix
of their kernels' names in gguf.cu."""

GROUP = 32  # weights one thread decodes at once; every K must be a multiple
_GEMV_THREADS = 128  # 4 warps per block, one row of W each
_DEQUANT_THREADS = 256
_MAX_BLOCKS = 1 << 16  # grid-stride kernels (dequantize, rope, glu): their loops cover the rest
_INT32_MAX = 2**31 - 1

ATTEND_MAX_HEAD_DIM = 256
"""Largest head size `attend_step` takes (ATT_MAX_HD in `STEP_SOURCE`)."""
_STEP_THREADS = 256  # ATT_THREADS in STEP_SOURCE: attend_step, rms_norm (their reductions
# are over its warps), rope and glu
_STORE_THREADS = 64  # store_kv's threads stride over a head's dimensions

STEP_SOURCE = r"""
// The decode step's kernels besides the weights' products. store_kv (or, in the fused
// step, rope_store) writes each row's new key and value into its slot, then attend_step
// reads them; rms_norm, rope and glu are the layers' elementwise work, one launch each. No
// header, so that NVRTC compiles it as it is.
//
// attend_step: the attention of B decode tokens, row b at position pos[b] of the KV-cache
// slot slots[b] (the sequences of one recorded step).
//   q (B, n_head, hd) after RoPE; keys, values (n_slots, n_kv, max_len, hd), rows of
//   positions; out (B, n_head, hd) = softmax(scale * q . k[s]) over the positions s that
//   row b sees (s <= pos[b], and s > pos[b] - window when window > 0), weighting v[s].
// One block per (query head, row) (head h reads KV head h / (n_head / n_kv)). The positions
// go by in tiles of ATT_TILE, each in three phases with a running (online) softmax:
//   1. scores: each thread takes whole positions (every ATT_THREADS-th), the dot product of
//      q (in shared memory) with its key row read as float4 where hd % 4 == 0: no shuffles,
//      and every thread's loads independent of the others';
//   2. the tile's maximum and the exponentials (in shared memory) and their sum;
//   3. values: the threads form `groups` = ATT_THREADS / hd groups of hd, thread (g, d)
//      summing column d over every groups-th position (loads coalesced along d).
// The groups' sums are added at the end.
constexpr int ATT_THREADS = 256;
constexpr int ATT_WARPS = ATT_THREADS / 32;
constexpr int ATT_MAX_HD = 256;
constexpr int ATT_TILE = 1024;
constexpr int ATT_UNROLL = 8;

// The maximum (max = true) or the sum of v over the block; red: ATT_WARPS floats of
// shared memory. Every thread returns the result.
__device__ float att_block_reduce(float v, float* red, bool max) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float o = __shfl_xor_sync(0xffffffffu, v, offset);
    v = max ? fmaxf(v, o) : v + o;
  }
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = red[0];
  for (int w = 1; w < ATT_WARPS; ++w) r = max ? fmaxf(r, red[w]) : r + red[w];
  __syncthreads();  // red is written again by the next reduction
  return r;
}

extern "C" __global__ void attend_step(const float* __restrict__ q,
                                       const float* __restrict__ keys,
                                       const float* __restrict__ values,
                                       const int* __restrict__ slots,
                                       const int* __restrict__ pos_at, float* __restrict__ out,
                                       int n_head, int n_kv, int hd, int max_len, int window,
                                       float scale) {
  __shared__ __align__(16) float qs[ATT_MAX_HD];
  __shared__ float p[ATT_TILE];           // the tile's scores, then their exponentials
  __shared__ float part[ATT_THREADS];     // the value groups' sums, (groups, hd)
  __shared__ float red[ATT_WARPS];
  const float neg_inf = __int_as_float(0xff800000);
  const int h = blockIdx.x, row = blockIdx.y, t = threadIdx.x;
  const long long kv_head = (long long)slots[row] * n_kv + h / (n_head / n_kv);
  const float* k_rows = keys + kv_head * max_len * hd;
  const float* v_rows = values + kv_head * max_len * hd;
  const long long q_at = ((long long)row * n_head + h) * hd;  // this head's q and out
  const int pos = pos_at[row];
  const int lo = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
  const int groups = ATT_THREADS / hd, g = t / hd, d = t - g * hd;
  const bool sums = g < groups;  // a thread of phase 3 (hd need not divide ATT_THREADS)
  const bool by4 = (hd & 3) == 0;
  for (int i = t; i < hd; i += ATT_THREADS) qs[i] = q[q_at + i] * scale;
  __syncthreads();

  float m = neg_inf, l = 0.0f, acc = 0.0f;  // running maximum, sum of exp, column d's sum
  for (int start = lo; start <= pos; start += ATT_TILE) {
    const int n = min(ATT_TILE, pos + 1 - start);
    float tile_max = neg_inf;
    for (int i = t; i < n; i += ATT_THREADS) {  // 1. scores
      const float* k = k_rows + (long long)(start + i) * hd;
      float dot = 0.0f;
      if (by4) {
        const float4* k4 = reinterpret_cast<const float4*>(k);
        const float4* q4 = reinterpret_cast<const float4*>(qs);
#pragma unroll 8
        for (int j = 0; j < hd / 4; ++j) {
          const float4 a = q4[j], b = k4[j];
          dot += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
        }
      } else {
        for (int j = 0; j < hd; ++j) dot += qs[j] * k[j];
      }
      p[i] = dot;
      tile_max = fmaxf(tile_max, dot);
    }
    const float m_new = fmaxf(m, att_block_reduce(tile_max, red, true));  // 2. softmax
    float tile_sum = 0.0f;
    for (int i = t; i < n; i += ATT_THREADS) {
      const float e = expf(p[i] - m_new);
      p[i] = e;
      tile_sum += e;
    }
    const float shrink = expf(m - m_new);  // 0 on the first tile
    l = l * shrink + att_block_reduce(tile_sum, red, false);  // its barrier publishes p
    m = m_new;
    if (sums) {  // 3. values, ATT_UNROLL positions' loads in flight at once
      const float* v = v_rows + (long long)start * hd + d;
      float a[ATT_UNROLL] = {};
      int i = g;
      for (; i + (ATT_UNROLL - 1) * groups < n; i += ATT_UNROLL * groups) {
        float vv[ATT_UNROLL];
#pragma unroll
        for (int u = 0; u < ATT_UNROLL; ++u) vv[u] = v[(long long)(i + u * groups) * hd];
#pragma unroll
        for (int u = 0; u < ATT_UNROLL; ++u) a[u] += p[i + u * groups] * vv[u];
      }
      for (; i < n; i += groups) a[0] += p[i] * v[(long long)i * hd];
      float sum = 0.0f;
#pragma unroll
      for (int u = 0; u < ATT_UNROLL; ++u) sum += a[u];
      acc = acc * shrink + sum;
    }
    __syncthreads();  // p is written again by the next tile
  }
  if (sums) part[t] = acc;
  __syncthreads();
  for (int i = t; i < hd; i += ATT_THREADS) {
    float o = 0.0f;
    for (int j = 0; j < groups; ++j) o += part[j * hd + i];
    out[q_at + i] = o / l;
  }
}

// store_kv: row b's new key and value (k, v: (B, n_kv, hd)) into slot slots[b] at position
// pos[b] of keys and values (n_slots, n_kv, max_len, hd). One block per (KV head, row).
extern "C" __global__ void store_kv(const float* __restrict__ k, const float* __restrict__ v,
                                    float* __restrict__ keys, float* __restrict__ values,
                                    const int* __restrict__ slots,
                                    const int* __restrict__ pos_at, int n_kv, int hd,
                                    int max_len) {
  const int g = blockIdx.x, row = blockIdx.y;
  const long long dst = (((long long)slots[row] * n_kv + g) * max_len + pos_at[row]) * hd;
  const long long src = ((long long)row * n_kv + g) * hd;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    keys[dst + d] = k[src + d];
    values[dst + d] = v[src + d];
  }
}

// RoPE's pair of entry j < dim of a head (half = dim / 2): the pair's angle i, and where
// its two entries lie in the head, ia and ib. neox: (i, i + half); else (2i, 2i + 1).
__device__ __forceinline__ void rope_pair(int j, int half, int neox, int& i, int& ia,
                                          int& ib) {
  i = neox ? (j < half ? j : j - half) : j / 2;
  ia = neox ? i : 2 * i;
  ib = neox ? i + half : 2 * i + 1;
}

// rope_store: the step's queries, keys and values from the QKV product qkv (B, (n_head +
// 2 n_kv) hd), heads side by side: one block of ATT_THREADS per (head, row b), heads
// [0, n_head) of q, then n_kv of k, then n_kv of v. A q or k head is RMS-normed over hd
// and times q_norm / k_norm where those are not null (Qwen 3, Gemma 3), then turned by
// RoPE (as `rope`) to position pos[b]; q heads go to q_out (B, n_head, hd), k and v heads
// into slot slots[b] of keys and values (n_slots, n_kv, max_len, hd) at position pos[b].
extern "C" __global__ void rope_store(const float* __restrict__ qkv,
                                      const float* __restrict__ q_norm,
                                      const float* __restrict__ k_norm, float eps,
                                      const float* __restrict__ cos_t,
                                      const float* __restrict__ sin_t, int dim, int neox,
                                      float* __restrict__ q_out, float* __restrict__ keys,
                                      float* __restrict__ values,
                                      const int* __restrict__ slots,
                                      const int* __restrict__ pos_at, int n_head, int n_kv,
                                      int hd, int max_len) {
  __shared__ float head[ATT_MAX_HD];
  __shared__ float red[ATT_WARPS];
  const int h = blockIdx.x, row = blockIdx.y, t = threadIdx.x;
  const float* src = qkv + ((long long)row * (n_head + 2 * n_kv) + h) * hd;
  const int pos = pos_at[row];
  const long long slot = (long long)slots[row] * n_kv;
  if (h >= n_head + n_kv) {  // a value head: stored as it is
    float* dst = values + ((slot + h - n_head - n_kv) * max_len + pos) * hd;
    for (int d = t; d < hd; d += ATT_THREADS) dst[d] = src[d];
    return;  // the whole block
  }
  const float* w = h < n_head ? q_norm : k_norm;
  float inv = 1.0f;
  if (w != nullptr) {
    float squares = 0.0f;
    for (int d = t; d < hd; d += ATT_THREADS) squares += src[d] * src[d];
    inv = 1.0f / sqrtf(att_block_reduce(squares, red, false) / hd + eps);
  }
  for (int d = t; d < hd; d += ATT_THREADS) head[d] = w != nullptr ? src[d] * inv * w[d] : src[d];
  __syncthreads();
  float* dst = h < n_head ? q_out + ((long long)row * n_head + h) * hd
                          : keys + ((slot + h - n_head) * max_len + pos) * hd;
  const int half = dim / 2;
  for (int j = t; j < hd; j += ATT_THREADS) {
    if (j >= dim) {
      dst[j] = head[j];
      continue;
    }
    int i, ia, ib;
    rope_pair(j, half, neox, i, ia, ib);
    const float c = cos_t[(long long)pos * half + i], s = sin_t[(long long)pos * half + i];
    dst[j] = j == ia ? head[ia] * c - head[ib] * s : head[ia] * s + head[ib] * c;
  }
}

// rms_norm: each row r of x (rows, n) times 1 / sqrt(mean(row^2) + eps), times w (n,), into
// out. With `a` (not null) the row is first the residual sum x[r] + a[r], which goes to
// sum_out too. One block of ATT_THREADS per row.
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ a,
                                    const float* __restrict__ w, float* __restrict__ sum_out,
                                    float* __restrict__ out, int n, float eps) {
  __shared__ float red[ATT_WARPS];
  const long long base = (long long)blockIdx.x * n;
  float squares = 0.0f;
  for (int i = threadIdx.x; i < n; i += ATT_THREADS) {
    float v = x[base + i];
    if (a != nullptr) {
      v += a[base + i];
      sum_out[base + i] = v;  // read back below by this same thread
    }
    squares += v * v;
  }
  const float inv = 1.0f / sqrtf(att_block_reduce(squares, red, false) / n + eps);
  for (int i = threadIdx.x; i < n; i += ATT_THREADS) {
    const float v = a != nullptr ? sum_out[base + i] : x[base + i];
    out[base + i] = v * inv * w[i];
  }
}

// rope: x (T, heads, hd) rotated, token t by the angles of position pos[t] (cos_t, sin_t:
// (max_len, dim / 2) tables); the leading `dim` entries of each head turn, the rest are
// copied. neox: pairs (i, i + dim / 2); else interleaved pairs (2i, 2i + 1). One thread
// per output entry.
extern "C" __global__ void rope(const float* __restrict__ x, const float* __restrict__ cos_t,
                                const float* __restrict__ sin_t, const int* __restrict__ pos,
                                float* __restrict__ out, int heads, int hd, int dim, int neox,
                                long long total) {
  const int half = dim / 2;
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
       e += (long long)gridDim.x * blockDim.x) {
    const int j = (int)(e % hd);
    if (j >= dim) {
      out[e] = x[e];
      continue;
    }
    const long long head = e - j;  // the head's first entry
    const long long t = e / ((long long)heads * hd);
    int i, ia, ib;
    rope_pair(j, half, neox, i, ia, ib);
    const long long at = (long long)pos[t] * half + i;
    const float c = cos_t[at], s = sin_t[at], xa = x[head + ia], xb = x[head + ib];
    out[e] = j == ia ? xa * c - xb * s : xa * s + xb * c;
  }
}

// glu: gu (rows, 2 n_ff), gate then up -> out (rows, n_ff) = act(gate) * up, act SiLU
// (gate / (1 + exp(-gate))) or, with `gelu`, tanh GELU. One thread per output entry.
extern "C" __global__ void glu(const float* __restrict__ gu, float* __restrict__ out,
                               int n_ff, int gelu, long long total) {
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
       e += (long long)gridDim.x * blockDim.x) {
    const long long r = e / n_ff;
    const int i = (int)(e - r * n_ff);
    const float g = gu[2 * r * n_ff + i], u = gu[(2 * r + 1) * n_ff + i];
    const float act = gelu ? 0.5f * g * (1.0f + tanhf(0.7978845608028654f *
                                                      (g + 0.044715f * g * g * g)))
                           : g / (1.0f + expf(-g));
    out[e] = act * u;
  }
}
"""
"""The CUDA C++ source of the decode step's kernels besides the weights' products
(`store_kv`, `attend_step`, `rope_store`, `rms_norm`, `rope`, `glu`), compiled apart from
gguf.cu."""

STEP_KERNELS = ("store_kv", "attend_step", "rope_store", "rms_norm", "rope", "glu")
"""The extern "C" kernels of `STEP_SOURCE`."""


def kernel_names() -> list[str]:
    """The extern "C" kernel names that gguf.cu defines: `dequantize_<fmt>`, `gemv_<fmt>`,
    `step_<fmt>`."""
    return [f"{kind}_{suffix}" for suffix in FORMATS.values()
            for kind in ("dequantize", "gemv", "step")]


def _supports(qtype: Any) -> bool:
    try:
        return GGMLQuantizationType(qtype) in FORMATS
    except ValueError:
        return False


def _layout(data: Any, qtype: Any, shape: tuple[int, int]) -> tuple[Q, int, int, int]:
    """Check a weight's data against its format and shape: (qtype, N, K, row_bytes), or a
    ValueError naming the problem."""
    if not _supports(qtype):
        raise quants.UnsupportedQuantError(
            f"no CUDA kernel for GGML type {getattr(qtype, 'name', qtype)}; supported: "
            + ", ".join(t.name for t in FORMATS))
    qtype = GGMLQuantizationType(qtype)
    if len(shape) != 2:
        raise ValueError(f"a weight matrix has shape (N, K), got {tuple(shape)}")
    n, k = (int(v) for v in shape)
    bs, ts = GGML_QUANT_SIZES[qtype]
    if k <= 0 or k % GROUP or k % bs:
        raise ValueError(f"{qtype.name} kernels need a row length K that is a positive "
                         f"multiple of {max(GROUP, bs)}, got K={k}")
    row_bytes = k // bs * ts
    if data.nbytes != n * row_bytes:
        raise ValueError(f"{qtype.name} weight of shape ({n}, {k}) needs {n * row_bytes} "
                         f"bytes, the data has {data.nbytes}")
    if max(n, k, row_bytes) > _INT32_MAX:
        raise ValueError(f"weight of shape ({n}, {k}) is too large for the kernels "
                         "(N, K and the bytes of one row must fit in int32)")
    return qtype, n, k, row_bytes


@functools.cache
def _module(cupy: Any) -> Any:
    """gguf.cu compiled and loaded by the module `cupy` (once per process; CuPy also
    caches it on disk)."""
    return cupy.RawModule(code=SOURCE.read_text(), options=("--std=c++17",))


def _blocks(total: int, threads: int) -> int:
    """Blocks of `threads` for a grid-stride kernel over `total` items: one item per
    thread, up to `_MAX_BLOCKS` blocks (the loop covers the rest)."""
    return min((total + threads - 1) // threads, _MAX_BLOCKS)


@functools.cache
def _step_kernels(cupy: Any) -> dict[str, Any]:
    """The kernels of STEP_SOURCE by name, compiled and loaded by the module `cupy` (once
    per process)."""
    module = cupy.RawModule(code=STEP_SOURCE, options=("--std=c++17",))
    return {name: module.get_function(name) for name in STEP_KERNELS}


def _attend_layout(q: Any, k: Any, v: Any, keys: Any, values: Any, slots: Any, pos: Any
                   ) -> tuple[int, int, int, int, int]:
    """Check `attend_step`'s arguments: (B, n_head, n_kv, hd, max_len), or a ValueError."""
    if q.ndim != 3 or keys.ndim != 4 or keys.shape != values.shape:
        raise ValueError(f"attend_step needs q (B, n_head, hd) and keys, values (n_slots, "
                         f"n_kv, max_len, hd), got {tuple(q.shape)}, {tuple(keys.shape)}, "
                         f"{tuple(values.shape)}")
    (b, n_head, hd), (_, n_kv, max_len, hd_kv) = q.shape, keys.shape
    if hd != hd_kv or n_kv < 1 or n_head % n_kv:
        raise ValueError(f"q {tuple(q.shape)} does not fit keys {tuple(keys.shape)}")
    if (k is None) != (v is None):
        raise ValueError("give both k and v, or neither")
    if k is not None and (tuple(k.shape) != (b, n_kv, hd) or tuple(v.shape) != (b, n_kv, hd)):
        raise ValueError(f"k and v must have shape ({b}, {n_kv}, {hd}), got "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if tuple(slots.shape) != (b,) or tuple(pos.shape) != (b,):
        raise ValueError(f"slots and pos must have shape ({b},), got {tuple(slots.shape)}, "
                         f"{tuple(pos.shape)}")
    return b, n_head, n_kv, hd, max_len


def _step_layout(data: Any, qtype: Any, shape: tuple[int, int], x: Any, out: Any,
                 epilogue: str) -> tuple[Q, int, int, int, int]:
    """Check `step_matmul`'s arguments: (qtype, N, K, row_bytes, outputs per token), or a
    ValueError naming the problem."""
    qtype, n, k, row_bytes = _layout(data, qtype, shape)
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue must be one of {', '.join(EPILOGUES)}, got {epilogue!r}")
    gated = epilogue in ("silu", "gelu")
    if gated and n % 2:
        raise ValueError(f"a gated product needs gate and up rows, got {n} rows")
    width = n // 2 if gated else n
    if x.ndim != 2 or x.shape[1] != k or not 0 < x.shape[0] <= STEP_MAX_T:
        raise ValueError(f"x must have shape (T, {k}) with 0 < T <= {STEP_MAX_T}, got "
                         f"{tuple(x.shape)}")
    if tuple(out.shape) != (x.shape[0], width) or out.strides[1] != out.itemsize:
        raise ValueError(f"out must have shape ({x.shape[0]}, {width}) with adjacent "
                         f"columns, got {tuple(out.shape)}")
    return qtype, n, k, row_bytes, width


class CudaKernels:
    """The RawKernels of gguf.cu for `workbench.engine.runtime.backend.CupyBackend`.

    All arrays are CuPy arrays on the current device; the module is compiled on the first
    call that needs it. `cupy`: the module to use, cupy itself by default (the tests pass
    a stand-in that runs the kernels on the CPU).
    """

    def __init__(self, cupy: Any = None) -> None:
        if cupy is None:
            import cupy
        self.cp = cupy

    def supports(self, qtype: GGMLQuantizationType | int) -> bool:
        """Whether gguf.cu has kernels for this format."""
        return _supports(qtype)

    def _kernel(self, kind: str, qtype: Q) -> Any:
        return _module(self.cp).get_function(f"{kind}_{FORMATS[qtype]}")

    def _bytes(self, data: Any) -> Any:
        """The weight's bytes as a flat uint8 array (a view when `data` is contiguous)."""
        w = self.cp.ascontiguousarray(data).reshape(-1).view(self.cp.uint8)
        if w.data.ptr % 4:  # F32/F16/BF16 rows are read as 4- and 2-byte words
            raise ValueError("weight data on the device must be 4-byte aligned")
        return w

    def matmul(self, data: Any, qtype: GGMLQuantizationType, shape: tuple[int, int],
               x: Any) -> Any:
        """x (T, K) float32 @ W.T -> (T, N) float32, for W (N, K) stored in `qtype`.

        data: the GGUF bytes of W on the device (N * row_bytes of them, any shape).
        T <= `GEMV_MAX_T` runs the gemv kernel; larger T dequantizes W in tiles of
        `TILE_WEIGHTS` weights and multiplies each with cuBLAS.
        """
        cp = self.cp
        qtype, n, k, row_bytes = _layout(data, qtype, shape)
        w = self._bytes(data)
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        if x.ndim != 2 or x.shape[1] != k:
            raise ValueError(f"x must have shape (T, {k}) for a ({n}, {k}) weight, "
                             f"got {tuple(x.shape)}")
        t = x.shape[0]
        if t == 0 or n == 0:
            return cp.zeros((t, n), dtype=cp.float32)
        if x.data.ptr % 16:  # a view at an odd offset: the kernels read x as float4
            x = x.copy()

        if t <= GEMV_MAX_T:
            y = cp.empty((t, n), dtype=cp.float32)
            rows_per_block = _GEMV_THREADS // 32
            grid = (n + rows_per_block - 1) // rows_per_block
            self._kernel("gemv", qtype)(
                (grid,), (_GEMV_THREADS,),
                (w, x, y, np.int32(n), np.int32(k), np.int32(row_bytes), np.int32(t)))
            return y

        if qtype == Q.F32:  # already float32: cuBLAS on the data itself
            return x @ w.view(cp.float32).reshape(n, k).T
        tile_rows = max(1, TILE_WEIGHTS // k)
        if n <= tile_rows:
            return x @ self._rows(w, qtype, None, n, n, k, row_bytes).T
        y = cp.empty((t, n), dtype=cp.float32)
        for r0 in range(0, n, tile_rows):
            r1 = min(n, r0 + tile_rows)
            tile = self._rows(w[r0 * row_bytes : r1 * row_bytes], qtype, None, r1 - r0,
                              r1 - r0, k, row_bytes)  # (r1 - r0, K)
            y[:, r0:r1] = x @ tile.T
        return y

    def dequantize(self, data: Any, qtype: GGMLQuantizationType, shape: tuple[int, int],
                   ids: Any = None) -> Any:
        """Rows `ids` of W (N, K) as float32 (len(ids), K); all N rows when ids is None.

        ids: device (or host) integers in [0, N); the kernel cannot raise, so an id
        outside that range gives a row of NaN.
        """
        cp = self.cp
        qtype, n, k, row_bytes = _layout(data, qtype, shape)
        w = self._bytes(data)
        if ids is None:
            return self._rows(w, qtype, None, n, n, k, row_bytes)
        ids = cp.ascontiguousarray(cp.asarray(ids, dtype=cp.int64).reshape(-1))
        if ids.size > _INT32_MAX:
            raise ValueError(f"too many row ids ({ids.size}) for one call")
        return self._rows(w, qtype, ids, ids.size, n, k, row_bytes)

    def step_matmul(self, data: Any, qtype: GGMLQuantizationType, shape: tuple[int, int],
                    x: Any, out: Any, norm: Any = None, eps: float = 0.0, bias: Any = None,
                    epilogue: str = "store") -> None:
        """The recorded decode step's product, one launch: r = x' (T, K) @ W.T + bias for
        T <= `STEP_MAX_T`, x' = RMSNorm(x) * norm when `norm` (K,) is given, else x; then
        by `epilogue` (`EPILOGUES`) out = r, out += r (the residual add), or, for W of n_ff
        gate rows then n_ff up rows, out = act(gate) * up (T, n_ff).

        x: (T, K) float32 device array; out: float32 (T, N or n_ff), its columns adjacent
        (a block of columns of a wider C-contiguous array will do); norm and bias float32
        vectors or None. Nothing is allocated, so that a recording replays it as it is."""
        cp = self.cp
        qtype, n, k, row_bytes, width = _step_layout(data, qtype, shape, x, out, epilogue)
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        if x.data.ptr % 16 or (norm is not None and norm.data.ptr % 16):
            raise ValueError("x and norm must be 16-byte aligned (read as float4)")
        if out.dtype != cp.float32:
            raise ValueError(f"out must be float32, got {out.dtype}")
        null = np.uint64(0)  # 8 zero bytes: a null pointer
        rows_per_block = _GEMV_THREADS // 32
        self._kernel("step", qtype)(
            ((width + rows_per_block - 1) // rows_per_block,), (_GEMV_THREADS,),
            (self._bytes(data), x, out, np.int32(n), np.int32(k), np.int32(row_bytes),
             np.int32(x.shape[0]), np.int32(out.strides[0] // out.itemsize),
             null if norm is None else norm, np.float32(eps),
             null if bias is None else cp.ascontiguousarray(bias, dtype=cp.float32),
             np.int32(EPILOGUES[epilogue])))

    def rope_store(self, qkv: Any, q_norm: Any, k_norm: Any, eps: float, cos: Any, sin: Any,
                   dim: int, neox: bool, keys: Any, values: Any, slots: Any, pos: Any,
                   n_head: int) -> Any:
        """The step's queries, keys and values from its QKV product qkv (B, (n_head + 2
        n_kv) hd) float32, one launch: each q and k head RMS-normed times q_norm / k_norm
        where those are given (per head), then rotated by RoPE to position pos[b] (as
        `rope`); row b's keys and values go into slot slots[b] of keys and values
        (n_slots, n_kv, max_len, hd) at pos[b]. Returns the queries (B, n_head, hd)."""
        cp = self.cp
        _, n_kv, max_len, hd = keys.shape
        b = qkv.shape[0]
        if tuple(qkv.shape) != (b, (n_head + 2 * n_kv) * hd) or hd > ATTEND_MAX_HEAD_DIM:
            raise ValueError(f"qkv {tuple(qkv.shape)} does not fit {n_head} query heads and "
                             f"keys {tuple(keys.shape)}")
        q = cp.empty((b, n_head, hd), dtype=cp.float32)
        null = np.uint64(0)
        self._step("rope_store")(
            (n_head + 2 * n_kv, b), (_STEP_THREADS,),
            (cp.ascontiguousarray(qkv, dtype=cp.float32), null if q_norm is None else q_norm,
             null if k_norm is None else k_norm, np.float32(eps), cos, sin, np.int32(dim),
             np.int32(neox), q, keys, values, slots, pos, np.int32(n_head), np.int32(n_kv),
             np.int32(hd), np.int32(max_len)))
        return q

    def attend_step(self, q: Any, k: Any, v: Any, keys: Any, values: Any, slots: Any,
                    pos: Any, window: int, scale: float) -> Any:
        """The attention of B decode tokens: row b's new key and value k[b], v[b]
        (n_kv, hd) go into slot slots[b] of keys and values (n_slots, n_kv, max_len, hd)
        float32, C-contiguous (one layer of a `DeviceKVPool`) at position pos[b] (k and v
        None: they are there already, `rope_store`); then
        q[b] (n_head, hd) attends over that slot's positions up to pos[b] (with `window`
        > 0, those after pos[b] - window). slots and pos: (B,) int32 device arrays, read
        by the kernels, never by the host; each pos[b] must lie in [0, max_len). Rows
        may repeat (the same slot, position, k and v). Returns (B, n_head * hd) float32.

        The launches are fixed by the shapes and `window`, so a CUDA graph that records
        them serves every slot and position. Raises a RuntimeError (the recorded step
        then falls back to the unrecorded one) for a head size over
        `ATTEND_MAX_HEAD_DIM` (NotImplementedError) or a failed compile."""
        cp = self.cp
        b, n_head, n_kv, hd, max_len = _attend_layout(q, k, v, keys, values, slots, pos)
        if hd > ATTEND_MAX_HEAD_DIM:
            raise NotImplementedError(f"attend_step takes head sizes up to "
                                      f"{ATTEND_MAX_HEAD_DIM}, got {hd}")
        if keys.dtype != cp.float32 or values.dtype != cp.float32 or not (
                keys.flags.c_contiguous and values.flags.c_contiguous):
            raise ValueError("keys and values must be C-contiguous float32")
        if slots.dtype != cp.int32 or pos.dtype != cp.int32:
            raise ValueError("slots and pos must be int32 device arrays")
        store, attend = self._step("store_kv"), self._step("attend_step")
        q = cp.ascontiguousarray(q, dtype=cp.float32)
        slots, pos = cp.ascontiguousarray(slots), cp.ascontiguousarray(pos)
        if k is not None:
            k, v = (cp.ascontiguousarray(a, dtype=cp.float32) for a in (k, v))
            store((n_kv, b), (_STORE_THREADS,),
                  (k, v, keys, values, slots, pos, np.int32(n_kv), np.int32(hd),
                   np.int32(max_len)))
        out = cp.empty((b, n_head * hd), dtype=cp.float32)
        attend((n_head, b), (_STEP_THREADS,),
               (q, keys, values, slots, pos, out, np.int32(n_head), np.int32(n_kv),
                np.int32(hd), np.int32(max_len), np.int32(window), np.float32(scale)))
        return out

    def rms_norm(self, x: Any, weight: Any, eps: float, add: Any = None) -> Any:
        """RMSNorm over the last axis of x (..., n) float32, times weight (n,) float32.
        With `add` (x's shape): the residual sum x + add and its norm, as a pair."""
        cp = self.cp
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        n = x.shape[-1]
        out = cp.empty_like(x)
        summed = None if add is None else cp.empty_like(x)
        if x.size:
            null = np.uint64(0)  # 8 zero bytes: a null pointer
            self._step("rms_norm")(
                (x.size // n,), (_STEP_THREADS,),
                (x, null if add is None else cp.ascontiguousarray(add, dtype=cp.float32),
                 weight, null if summed is None else summed, out, np.int32(n),
                 np.float32(eps)))
        return out if add is None else (summed, out)

    def rope(self, x: Any, cos: Any, sin: Any, pos: Any, dim: int, neox: bool) -> Any:
        """x (T, heads, hd) float32, token t rotated by the angles of position pos[t]
        (pos: (T,) int32 on the device; cos, sin: (max_len, dim / 2) float32 tables): the
        leading `dim` entries of each head, in NEOX halves or interleaved pairs."""
        cp = self.cp
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        out = cp.empty_like(x)
        if x.size:
            _, heads, hd = x.shape
            self._step("rope")(
                (_blocks(x.size, _STEP_THREADS),), (_STEP_THREADS,),
                (x, cos, sin, cp.ascontiguousarray(pos, dtype=cp.int32), out,
                 np.int32(heads), np.int32(hd), np.int32(dim), np.int32(neox),
                 np.int64(x.size)))
        return out

    def glu(self, gu: Any, gelu: bool) -> Any:
        """gu (T, 2 n_ff) float32, gate then up -> act(gate) * up (T, n_ff), act SiLU or
        (`gelu`) tanh GELU."""
        cp = self.cp
        gu = cp.ascontiguousarray(gu, dtype=cp.float32)
        out = cp.empty((gu.shape[0], gu.shape[1] // 2), dtype=cp.float32)
        if out.size:
            self._step("glu")((_blocks(out.size, _STEP_THREADS),), (_STEP_THREADS,),
                              (gu, out, np.int32(out.shape[1]), np.int32(gelu),
                               np.int64(out.size)))
        return out

    def _step(self, name: str) -> Any:
        try:
            return _step_kernels(self.cp)[name]
        except Exception as e:  # NVRTC's CompileException, said plainly
            raise RuntimeError(f"the decode step's kernels did not compile: {e}") from e

    def _rows(self, w: Any, qtype: Q, ids: Any, n_rows: int, n: int, k: int,
              row_bytes: int) -> Any:
        """Run dequantize_<fmt>: rows ids (int64), or rows 0..n_rows when ids is None."""
        cp = self.cp
        out = cp.empty((n_rows, k), dtype=cp.float32)
        if n_rows == 0:
            return out
        total = n_rows * (k // GROUP)  # one thread per group of 32 weights
        grid = _blocks(total, _DEQUANT_THREADS)
        ids_arg = np.uint64(0) if ids is None else ids  # 8 zero bytes: a null pointer
        self._kernel("dequantize", qtype)(
            (grid,), (_DEQUANT_THREADS,),
            (w, ids_arg, out, np.int32(n_rows), np.int32(n), np.int32(k),
             np.int32(row_bytes)))
        return out


class ReferenceKernels:
    """The API of `CudaKernels` in plain NumPy (`quants.dequantize` on the bytes): the
    numerical reference for the kernels, and what `CupyBackend` runs in tests with NumPy
    standing in for CuPy. Unlike the kernels it raises on an id outside [0, N)."""

    def supports(self, qtype: GGMLQuantizationType | int) -> bool:
        """Whether `CudaKernels` has kernels for this format."""
        return _supports(qtype)

    def matmul(self, data: np.ndarray, qtype: GGMLQuantizationType,
               shape: tuple[int, int], x: np.ndarray) -> np.ndarray:
        """x (T, K) float32 @ W.T -> (T, N) float32."""
        qtype, n, k, _ = _layout(data, qtype, shape)
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != k:
            raise ValueError(f"x must have shape (T, {k}) for a ({n}, {k}) weight, "
                             f"got {x.shape}")
        return x @ self.dequantize(data, qtype, shape).T

    def dequantize(self, data: np.ndarray, qtype: GGMLQuantizationType,
                   shape: tuple[int, int], ids: Any = None) -> np.ndarray:
        """Rows `ids` of W (N, K) as float32 (len(ids), K); all N rows when ids is None."""
        qtype, n, k, row_bytes = _layout(data, qtype, shape)
        rows = np.ascontiguousarray(data).reshape(-1).view(np.uint8).reshape(n, row_bytes)
        if ids is not None:
            ids = np.asarray(ids).reshape(-1)
            if ids.dtype.kind not in "iu":
                raise ValueError(f"row ids must be integers, got {ids.dtype}")
            if ids.size and (ids.min() < 0 or ids.max() >= n):
                raise ValueError(f"row ids must lie in [0, {n})")
            rows = rows[ids]
        return quants.dequantize(rows, qtype).reshape(-1, k)

    def attend_step(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, keys: np.ndarray,
                    values: np.ndarray, slots: Any, pos: Any, window: int,
                    scale: float) -> np.ndarray:
        """`CudaKernels.attend_step` in NumPy, row by row."""
        b, n_head, n_kv, hd, _ = _attend_layout(q, k, v, keys, values, slots, pos)
        # plain arrays: what the kernels read on the device, read here
        slots, pos = np.asarray(slots), np.asarray(pos)
        if k is not None:
            keys[slots, :, pos] = k  # row b's (n_kv, hd) into slot slots[b], position pos[b]
            values[slots, :, pos] = v
        q = np.asarray(q, dtype=np.float32).reshape(b, n_kv, n_head // n_kv, hd)
        out = np.empty((b, n_head * hd), dtype=np.float32)
        for row, (slot, p) in enumerate(zip(slots.tolist(), pos.tolist())):
            lo = max(0, p - window + 1) if window else 0
            kk, vv = keys[slot, :, lo : p + 1], values[slot, :, lo : p + 1]  # (n_kv, S, hd)
            scores = (q[row] @ kk.swapaxes(-1, -2)) * np.float32(scale)  # (n_kv, group, S)
            e = np.exp(scores - scores.max(axis=-1, keepdims=True))
            out[row] = ((e / e.sum(axis=-1, keepdims=True)) @ vv).reshape(-1)  # (n_kv, group, hd)
        return out

    def step_matmul(self, data: np.ndarray, qtype: GGMLQuantizationType,
                    shape: tuple[int, int], x: np.ndarray, out: np.ndarray, norm: Any = None,
                    eps: float = 0.0, bias: Any = None, epilogue: str = "store") -> None:
        """`CudaKernels.step_matmul` in NumPy: the norm, the product, the bias, then the
        epilogue, each as written."""
        _step_layout(data, qtype, shape, x, out, epilogue)
        x = np.asarray(x, dtype=np.float32)
        r = self.matmul(data, qtype, shape, x if norm is None else self.rms_norm(x, norm, eps))
        if bias is not None:
            r = r + bias
        if epilogue == "store":
            out[...] = r
        elif epilogue == "add":
            out += r
        else:
            out[...] = self.glu(r, epilogue == "gelu")

    def rope_store(self, qkv: np.ndarray, q_norm: Any, k_norm: Any, eps: float,
                   cos: np.ndarray, sin: np.ndarray, dim: int, neox: bool, keys: np.ndarray,
                   values: np.ndarray, slots: Any, pos: Any, n_head: int) -> np.ndarray:
        """`CudaKernels.rope_store` in NumPy: the per-head norms, RoPE and the stores."""
        _, n_kv, _, hd = keys.shape
        heads = np.asarray(qkv, dtype=np.float32).reshape(qkv.shape[0], -1, hd)  # (B, heads, hd)
        q, k, v = np.split(heads, [n_head, n_head + n_kv], axis=1)
        if q_norm is not None:
            q, k = self.rms_norm(q, q_norm, eps), self.rms_norm(k, k_norm, eps)
        q, k = self.rope(q, cos, sin, pos, dim, neox), self.rope(k, cos, sin, pos, dim, neox)
        slots, pos = np.asarray(slots), np.asarray(pos)
        keys[slots, :, pos] = k  # row b's (n_kv, hd) into slot slots[b], position pos[b]
        values[slots, :, pos] = v
        return q

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float,
                 add: np.ndarray | None = None) -> Any:
        """`CudaKernels.rms_norm` in NumPy."""
        x = np.asarray(x, dtype=np.float32)
        summed = x if add is None else x + add
        mean_square = np.mean(summed * summed, axis=-1, keepdims=True)
        out = summed * (1.0 / np.sqrt(mean_square + np.float32(eps))) * weight
        return out if add is None else (summed, out)

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, pos: Any, dim: int,
             neox: bool) -> np.ndarray:
        """`CudaKernels.rope` in NumPy: each pair's two entries by index."""
        x = np.asarray(x, dtype=np.float32)
        pos = np.asarray(pos)
        c, s = cos[pos][:, None, :], sin[pos][:, None, :]  # (T, 1, dim / 2)
        first = np.arange(dim // 2) if neox else np.arange(0, dim, 2)  # each pair's first
        second = first + dim // 2 if neox else first + 1
        a, b = x[..., first], x[..., second]
        out = x.copy()  # entries past `dim` stay
        out[..., first] = a * c - b * s
        out[..., second] = a * s + b * c
        return out

    def glu(self, gu: np.ndarray, gelu: bool) -> np.ndarray:
        """`CudaKernels.glu` in NumPy."""
        gate, up = np.split(np.asarray(gu, dtype=np.float32), 2, axis=1)
        if gelu:
            inner = np.float32(np.sqrt(2 / np.pi)) * (gate + np.float32(0.044715) * gate ** 3)
            return np.float32(0.5) * gate * (1 + np.tanh(inner)) * up
        return gate / (1 + np.exp(-gate)) * up
