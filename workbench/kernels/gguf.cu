// GGUF weight matrices on CUDA: rows dequantized to float32, and x @ W.T for a few tokens.
//
// W is an (N, K) matrix kept exactly as the GGUF file stores it: N rows of `row_bytes`
// bytes, one after the other; a row is K / block_weights blocks. Every format here splits
// a row into groups of 32 consecutive weights: a block of the 32-weight formats is one
// group, a K-quant super-block of 256 weights is 8 groups, and the float formats are cut
// into runs of 32. So each format has one decoder, `decode(row, g, w)`, that writes the
// float32 values of group g of a row into w[0..31], and two templated kernels use it:
//
//   dequantize_<fmt>(w, ids, out, n_rows, N, K, row_bytes)
//       out (n_rows, K) = rows ids[0..n_rows) of W (rows 0..n_rows when ids is null).
//       An id outside [0, N) gives a row of NaN (the kernel cannot raise).
//   gemv_<fmt>(w, x, y, N, K, row_bytes, T)
//       y (T, N) = x (T, K) @ W.T for T <= GEMV_MAX_T: one warp per row of W, its lanes
//       striding over the row's groups, each decoded once and used for all T tokens.
//   step_<fmt>(w, x, y, N, K, row_bytes, T, ldy, norm_w, eps, bias, epilogue)
//       The recorded decode step's product for T <= STEP_MAX_T tokens, with the layer's
//       work on either side of it in the same launch: the RMSNorm before it, a bias, and
//       the residual add or the gated activation after it (see step_rows).
//
// The decoders give the same float32 values as `workbench/kernels/quants.py` (and so as
// gguf-py): products and sums are rounded one at a time with __fmul_rn / __fadd_rn /
// __fsub_rn, which the compiler never contracts into an FMA, in the reference's order.
//
// The file includes no header, so that NVRTC (cupy.RawModule) and nvcc both compile it as
// it is; fp16 is decoded from its bits by hand.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

constexpr int GROUP = 32;      // weights decoded at once
constexpr int GEMV_MAX_T = 8;  // most tokens one gemv call handles (workbench.kernels.cuda)
constexpr int STEP_MAX_T = 64;  // most tokens one step_<fmt> call handles (the same)

// -- bits -> numbers -----------------------------------------------------------------------

__device__ __forceinline__ float half_to_float(u32 h) {
  const u32 sign = (h & 0x8000u) << 16;
  const u32 exponent = (h >> 10) & 0x1fu;
  const u32 mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) {  // inf or NaN (payload kept)
    return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));
  }
  if (exponent != 0) {  // normal: rebias the exponent from 15 to 127
    return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  }
  const float v = (float)mantissa * 5.9604644775390625e-8f;  // zero or subnormal: m * 2^-24
  return sign ? -v : v;
}

// The little-endian fp16 at p (any alignment).
__device__ __forceinline__ float fp16_at(const u8* p) {
  return half_to_float((u32)p[0] | ((u32)p[1] << 8));
}

// The little-endian u32 at p (any alignment).
__device__ __forceinline__ u32 u32_at(const u8* p) {
  return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

// -- float formats ---------------------------------------------------------------------------

// F32: 4-byte little-endian floats.
struct F32 {
  static constexpr int BLOCK_WEIGHTS = 1, BLOCK_BYTES = 4;
  __device__ static void decode(const u8* row, int g, float* w) {
    const float* p = reinterpret_cast<const float*>(row) + g * GROUP;
#pragma unroll
    for (int j = 0; j < GROUP; ++j) w[j] = p[j];
  }
};

// F16: IEEE half floats.
struct F16 {
  static constexpr int BLOCK_WEIGHTS = 1, BLOCK_BYTES = 2;
  __device__ static void decode(const u8* row, int g, float* w) {
    const u16* p = reinterpret_cast<const u16*>(row) + g * GROUP;
#pragma unroll
    for (int j = 0; j < GROUP; ++j) w[j] = half_to_float(p[j]);
  }
};

// BF16: the upper 16 bits of a float32.
struct BF16 {
  static constexpr int BLOCK_WEIGHTS = 1, BLOCK_BYTES = 2;
  __device__ static void decode(const u8* row, int g, float* w) {
    const u16* p = reinterpret_cast<const u16*>(row) + g * GROUP;
#pragma unroll
    for (int j = 0; j < GROUP; ++j) w[j] = __uint_as_float((u32)p[j] << 16);
  }
};

// -- 32-weight blocks ----------------------------------------------------------------------
// "Nibbles" (16 bytes at qs): weight j < 16 is the low nibble of qs[j], weight j + 16 the
// high nibble of qs[j].

// Q8_0 (34 B): d fp16 | 32 x int8 q.                                  w = q * d
struct Q8_0 {
  static constexpr int BLOCK_WEIGHTS = 32, BLOCK_BYTES = 34;
  __device__ static void decode(const u8* row, int g, float* w) {
    const u8* b = row + g * BLOCK_BYTES;
    const float d = fp16_at(b);
#pragma unroll
    for (int j = 0; j < 32; ++j) w[j] = __fmul_rn((float)(i8)b[2 + j], d);
  }
};

// Q4_0, Q4_1, Q5_0, Q5_1: d fp16 | m fp16 (the formats with a min) | qh u32 (the 5-bit
// ones: bit j is the 5th bit of weight j) | 16 B nibbles.
//   Q4_0 (18 B): w = d * (q - 8)        Q4_1 (20 B): w = d * q + m
//   Q5_0 (22 B): w = d * (q - 16)       Q5_1 (24 B): w = d * q + m
template <int BITS, bool MIN>
struct Block32 {
  static constexpr int QH = MIN ? 4 : 2;                 // offset of qh
  static constexpr int QS = QH + (BITS == 5 ? 4 : 0);    // offset of the nibbles
  static constexpr int BLOCK_WEIGHTS = 32, BLOCK_BYTES = QS + 16;
  __device__ static float value(float d, float m, int q) {
    return MIN ? __fadd_rn(__fmul_rn(d, (float)q), m)
               : __fmul_rn(d, (float)(q - (1 << (BITS - 1))));
  }
  __device__ static void decode(const u8* row, int g, float* w) {
    const u8* b = row + g * BLOCK_BYTES;
    const float d = fp16_at(b);
    const float m = MIN ? fp16_at(b + 2) : 0.0f;
    const u32 qh = BITS == 5 ? u32_at(b + QH) : 0u;  // 4-bit: no 5th bits
    const u8* qs = b + QS;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int lo = (qs[j] & 0xF) | (((qh >> j) & 1) << 4);
      const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      w[j] = value(d, m, lo);
      w[j + 16] = value(d, m, hi);
    }
  }
};
using Q4_0 = Block32<4, false>;
using Q4_1 = Block32<4, true>;
using Q5_0 = Block32<5, false>;
using Q5_1 = Block32<5, true>;

// -- 256-weight K-quant super-blocks: group g is sub-block g % 8 of super-block g / 8 ----
// "2-bit fields" (64 B at qs): weight 128*h + 32*s + l (l < 32) is bits 2s..2s+1 of
// qs[32*h + l], so group `sub` reads bits 2*(sub % 4) of qs[32*(sub / 4) + l].

// Q2_K (84 B): 16 B scales (low nibble scale, high nibble min, one byte per 16 weights)
// | 64 B 2-bit fields | d fp16 | dmin fp16.               w = (d * sc) * q - dmin * mn
struct Q2_K {
  static constexpr int BLOCK_WEIGHTS = 256, BLOCK_BYTES = 84;
  __device__ static void decode(const u8* row, int g, float* w) {
    const u8* b = row + (g >> 3) * BLOCK_BYTES;
    const int sub = g & 7;
    const float d = fp16_at(b + 80), dmin = fp16_at(b + 82);
    const u8* qs = b + 16 + 32 * (sub >> 2);
    const int shift = 2 * (sub & 3);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const u8 s = b[2 * sub + half];
      const float dl = __fmul_rn(d, (float)(s & 0xF));
      const float ml = __fmul_rn(dmin, (float)(s >> 4));
#pragma unroll
      for (int l = 16 * half; l < 16 * half + 16; ++l) {
        w[l] = __fsub_rn(__fmul_rn(dl, (float)((qs[l] >> shift) & 3)), ml);
      }
    }
  }
};

// Q3_K (110 B): 32 B hmask | 64 B 2-bit fields | 12 B sixteen 6-bit scales | d fp16.
// Weight 32*k + l takes bit k of hmask[l]: when it is 0 the quant is lowered by 4.
// Scale i (one per 16 weights): low 4 bits are the low (i < 8) or high (i >= 8) nibble of
// scales[i % 8], top 2 bits are bits 2*(i / 4) of scales[8 + i % 4]; minus 32.
//                                                                  w = (d * sc) * q
struct Q3_K {
  static constexpr int BLOCK_WEIGHTS = 256, BLOCK_BYTES = 110;
  __device__ static int scale(const u8* s, int i) {
    const int low = i < 8 ? (s[i] & 0xF) : (s[i - 8] >> 4);
    const int high = (s[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
    return (low | (high << 4)) - 32;
  }
  __device__ static void decode(const u8* row, int g, float* w) {
    const u8* b = row + (g >> 3) * BLOCK_BYTES;
    const int sub = g & 7;
    const float d = fp16_at(b + 108);
    const u8* hmask = b;
    const u8* qs = b + 32 + 32 * (sub >> 2);
    const int shift = 2 * (sub & 3);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float dl = __fmul_rn(d, (float)scale(b + 96, 2 * sub + half));
#pragma unroll
      for (int l = 16 * half; l < 16 * half + 16; ++l) {
        const int low = (qs[l] >> shift) & 3;
        const int q = ((hmask[l] >> sub) & 1) ? low : low - 4;
        w[l] = __fmul_rn(dl, (float)q);
      }
    }
  }
};

// Q4_K / Q5_K: 12 B of eight 6-bit scales and mins, one pair per 32-weight sub-block j:
// j < 4: sc = s[j] & 63, mn = s[j + 4] & 63;
// j >= 4: sc = (s[j + 4] & 0xF) | (s[j - 4] >> 6) << 4, mn = (s[j + 4] >> 4) | (s[j] >> 6) << 4.
__device__ __forceinline__ void k_scale_min(const u8* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// A Q4_K / Q5_K super-block's d * sc and dmin * mn for sub-block j.
__device__ __forceinline__ void k_group_scales(const u8* b, int j, float& dl, float& ml) {
  int sc, mn;
  k_scale_min(b + 4, j, sc, mn);
  dl = __fmul_rn(fp16_at(b), (float)sc);
  ml = __fmul_rn(fp16_at(b + 2), (float)mn);
}

// Q4_K (144 B): d fp16 | dmin fp16 | 12 B scales and mins | 128 B nibbles: weight
// 64*c + 32*h + l is nibble h (0 low, 1 high) of qs[32*c + l].
// Q5_K (176 B): the same with 32 B qh before the nibbles; weight 32*k + l takes bit k of
// qh[l] as its 5th bit.                             w = (d * sc) * q - dmin * mn
template <bool FIFTH>
struct KQuant45 {
  static constexpr int QS = FIFTH ? 48 : 16;  // offset of the nibbles
  static constexpr int BLOCK_WEIGHTS = 256, BLOCK_BYTES = QS + 128;
  __device__ static void decode(const u8* row, int g, float* w) {
    const u8* b = row + (g >> 3) * BLOCK_BYTES;
    const int sub = g & 7;
    float dl, ml;
    k_group_scales(b, sub, dl, ml);
    const u8* qh = b + 16;  // Q5_K only
    const u8* qs = b + QS + 32 * (sub >> 1);
    const int shift = 4 * (sub & 1);
#pragma unroll
    for (int l = 0; l < 32; ++l) {
      const int q = ((qs[l] >> shift) & 0xF) | (FIFTH ? ((qh[l] >> sub) & 1) << 4 : 0);
      w[l] = __fsub_rn(__fmul_rn(dl, (float)q), ml);
    }
  }
};
using Q4_K = KQuant45<false>;
using Q5_K = KQuant45<true>;

// Q6_K (210 B): 128 B low nibbles ql | 64 B 2-bit fields qh | 16 x int8 scales (one per
// 16 weights) | d fp16. Weight 128*h + 64*n + m (m < 64) has low 4 bits = nibble n of
// ql[64*h + m] and high 2 bits from the 2-bit fields as in Q2_K.   w = (d * sc) * (q - 32)
struct Q6_K {
  static constexpr int BLOCK_WEIGHTS = 256, BLOCK_BYTES = 210;
  __device__ static void decode(const u8* row, int g, float* w) {
    const u8* b = row + (g >> 3) * BLOCK_BYTES;
    const int sub = g & 7;
    const float d = fp16_at(b + 208);
    const int h = sub >> 2, s = sub & 3;  // weights 128*h + 32*s + l
    const u8* ql = b + 64 * h + 32 * (s & 1);  // m = 32*(s % 2) + l, nibble n = s / 2
    const int ql_shift = 4 * (s >> 1);
    const u8* qh = b + 128 + 32 * h;
    const int qh_shift = 2 * s;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float dl = __fmul_rn(d, (float)(i8)b[192 + 2 * sub + half]);
#pragma unroll
      for (int l = 16 * half; l < 16 * half + 16; ++l) {
        const int q = ((ql[l] >> ql_shift) & 0xF) | (((qh[l] >> qh_shift) & 3) << 4);
        w[l] = __fmul_rn(dl, (float)(q - 32));
      }
    }
  }
};

// -- kernels -------------------------------------------------------------------------------

// One thread per (output row, group); a grid-stride loop, so any grid size covers the output.
// out must be 16-byte aligned (each group is stored as 8 float4).
template <class F>
__device__ void dequantize_rows(const u8* __restrict__ w, const i64* __restrict__ ids,
                                float* __restrict__ out, int n_rows, int N, int K,
                                int row_bytes) {
  const int groups = K / GROUP;
  const i64 total = (i64)n_rows * groups;
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
    const i64 r = i / groups;
    const int g = (int)(i - r * groups);
    const i64 src = ids ? ids[r] : r;
    float v[GROUP];
    if (src >= 0 && src < N) {
      F::decode(w + src * row_bytes, g, v);
    } else {
#pragma unroll
      for (int j = 0; j < GROUP; ++j) v[j] = __uint_as_float(0x7fc00000u);  // NaN
    }
    float4* dst = reinterpret_cast<float4*>(out + r * K + (i64)g * GROUP);
#pragma unroll
    for (int j = 0; j < GROUP / 4; ++j) {
      float4 q;
      q.x = v[4 * j];
      q.y = v[4 * j + 1];
      q.z = v[4 * j + 2];
      q.w = v[4 * j + 3];
      dst[j] = q;
    }
  }
}

// y (T, N) = x (T, K) @ W.T, T <= GEMV_MAX_T. One warp per row n of W (blockDim.x / 32 rows
// per block): lane l decodes groups l, l + 32, ... of the row once and multiplies each with
// the same 32 columns of every token; the lanes' partial sums are then added with
// butterfly shuffles. x must be 16-byte aligned (read as float4).
template <class F>
__device__ void gemv_rows(const u8* __restrict__ w, const float* __restrict__ x,
                          float* __restrict__ y, int N, int K, int row_bytes, int T) {
  const int lane = threadIdx.x & 31;
  const i64 n = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (n >= N) return;  // n is the same on every lane of a warp: the warp leaves whole
  const u8* row = w + n * row_bytes;
  const int groups = K / GROUP;
  float acc[GEMV_MAX_T];
#pragma unroll
  for (int t = 0; t < GEMV_MAX_T; ++t) acc[t] = 0.0f;

  for (int g = lane; g < groups; g += 32) {
    float v[GROUP];
    F::decode(row, g, v);
#pragma unroll
    for (int t = 0; t < GEMV_MAX_T; ++t) {
      if (t < T) {
        const float4* xt = reinterpret_cast<const float4*>(x + (i64)t * K + (i64)g * GROUP);
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < GROUP / 4; ++j) {
          const float4 q = xt[j];
          s += v[4 * j] * q.x + v[4 * j + 1] * q.y + v[4 * j + 2] * q.z + v[4 * j + 3] * q.w;
        }
        acc[t] += s;
      }
    }
  }

#pragma unroll
  for (int t = 0; t < GEMV_MAX_T; ++t) {
    if (t < T) {  // T is the same on every lane: all 32 take part in each shuffle
      float s = acc[t];
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) s += __shfl_xor_sync(0xffffffffu, s, offset);
      if (lane == 0) y[(i64)t * N + n] = s;
    }
  }
}

// The epilogues of step_rows: what becomes of row n's result r for token t.
enum Epilogue {
  STORE = 0,  // y[t, n] = r
  ADD = 1,    // y[t, n] += r (the residual stream)
  SILU = 2,   // W is gate rows then up rows (N = 2 n_ff): y[t, n] = silu(gate) * up, n < n_ff
  GELU = 3,   // the same with tanh GELU (GeGLU)
};

// The recorded decode step's products: y = x (T, K) @ W.T for T <= STEP_MAX_T tokens,
// y's rows `ldy` floats apart (a block of columns of a wider array). One warp per output
// row (SILU, GELU: per pair of rows, gate n and up n + n_ff), its lanes striding over the
// row's groups as in gemv_rows; tokens go by in chunks of GEMV_MAX_T, each group decoded
// again per chunk, so that the sums stay in registers.
// - norm_w not null: x's rows are first RMS-normed and times norm_w: the block finds each
//   token's 1 / sqrt(mean(x^2) + eps) (in shared memory), the products run over x * norm_w
//   and each sum is scaled by it.
// - bias not null: + bias[n] (gate and up: bias[n], bias[n + n_ff]).
// x and norm_w must be 16-byte aligned.
template <class F>
__device__ void step_rows(const u8* __restrict__ w, const float* __restrict__ x,
                          float* __restrict__ y, int N, int K, int row_bytes, int T, int ldy,
                          const float* __restrict__ norm_w, float eps,
                          const float* __restrict__ bias, int epilogue) {
  __shared__ float inv[STEP_MAX_T];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if (norm_w != nullptr) {  // every thread takes part, before any leaves
    for (int t = warp; t < T; t += warps) {
      const float* xt = x + (i64)t * K;
      float s = 0.0f;
      for (int k = lane; k < K; k += 32) s += xt[k] * xt[k];
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) s += __shfl_xor_sync(0xffffffffu, s, offset);
      if (lane == 0) inv[t] = 1.0f / sqrtf(s / K + eps);
    }
    __syncthreads();
  }
  const bool gated = epilogue == SILU || epilogue == GELU;
  const int rows = gated ? N / 2 : N;  // outputs per token
  const i64 n = (i64)blockIdx.x * warps + warp;
  if (n >= rows) return;  // the same on every lane of a warp: the warp leaves whole
  const u8* row = w + n * row_bytes;
  const u8* up_row = w + (n + rows) * row_bytes;  // read when gated
  const int groups = K / GROUP;
  for (int t0 = 0; t0 < T; t0 += GEMV_MAX_T) {
    float acc[GEMV_MAX_T], up[GEMV_MAX_T];
#pragma unroll
    for (int t = 0; t < GEMV_MAX_T; ++t) acc[t] = up[t] = 0.0f;
    for (int g = lane; g < groups; g += 32) {
      float v[GROUP], u[GROUP];
      F::decode(row, g, v);
      if (gated) F::decode(up_row, g, u);
      const float4* nw =
          norm_w != nullptr ? reinterpret_cast<const float4*>(norm_w + (i64)g * GROUP) : nullptr;
#pragma unroll
      for (int t = 0; t < GEMV_MAX_T; ++t) {
        if (t0 + t < T) {
          const float4* xt =
              reinterpret_cast<const float4*>(x + (i64)(t0 + t) * K + (i64)g * GROUP);
          float s = 0.0f, su = 0.0f;
#pragma unroll
          for (int j = 0; j < GROUP / 4; ++j) {
            float4 q = xt[j];
            if (norm_w != nullptr) {
              const float4 m = nw[j];
              q.x *= m.x;
              q.y *= m.y;
              q.z *= m.z;
              q.w *= m.w;
            }
            s += v[4 * j] * q.x + v[4 * j + 1] * q.y + v[4 * j + 2] * q.z + v[4 * j + 3] * q.w;
            if (gated)
              su += u[4 * j] * q.x + u[4 * j + 1] * q.y + u[4 * j + 2] * q.z + u[4 * j + 3] * q.w;
          }
          acc[t] += s;
          up[t] += su;
        }
      }
    }
#pragma unroll
    for (int t = 0; t < GEMV_MAX_T; ++t) {
      if (t0 + t >= T) continue;  // T is the same on every lane: all 32 shuffle
      float s = acc[t], su = up[t];
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) {
        s += __shfl_xor_sync(0xffffffffu, s, offset);
        if (gated) su += __shfl_xor_sync(0xffffffffu, su, offset);
      }
      if (lane != 0) continue;
      if (norm_w != nullptr) {
        s *= inv[t0 + t];
        su *= inv[t0 + t];
      }
      if (bias != nullptr) {
        s += bias[n];
        if (gated) su += bias[n + rows];
      }
      float* out = y + (i64)(t0 + t) * ldy + n;
      if (epilogue == STORE) {
        *out = s;
      } else if (epilogue == ADD) {
        *out += s;
      } else if (epilogue == SILU) {
        *out = s / (1.0f + expf(-s)) * su;
      } else {
        *out = 0.5f * s * (1.0f + tanhf(0.7978845608028654f * (s + 0.044715f * s * s * s))) * su;
      }
    }
  }
}

// extern "C" names, one triple per format: dequantize_<name>, gemv_<name>, step_<name>.
#define GGUF_KERNELS(name, Format)                                                        \
  extern "C" __global__ void dequantize_##name(const u8* w, const i64* ids, float* out,   \
                                               int n_rows, int N, int K, int row_bytes) { \
    dequantize_rows<Format>(w, ids, out, n_rows, N, K, row_bytes);                        \
  }                                                                                       \
  extern "C" __global__ void gemv_##name(const u8* w, const float* x, float* y, int N,    \
                                         int K, int row_bytes, int T) {                   \
    gemv_rows<Format>(w, x, y, N, K, row_bytes, T);                                       \
  }                                                                                       \
  extern "C" __global__ void step_##name(const u8* w, const float* x, float* y, int N,    \
                                         int K, int row_bytes, int T, int ldy,            \
                                         const float* norm_w, float eps, const float* bias, \
                                         int epilogue) {                                  \
    step_rows<Format>(w, x, y, N, K, row_bytes, T, ldy, norm_w, eps, bias, epilogue);     \
  }

GGUF_KERNELS(f32, F32)
GGUF_KERNELS(f16, F16)
GGUF_KERNELS(bf16, BF16)
GGUF_KERNELS(q8_0, Q8_0)
GGUF_KERNELS(q4_0, Q4_0)
GGUF_KERNELS(q4_1, Q4_1)
GGUF_KERNELS(q5_0, Q5_0)
GGUF_KERNELS(q5_1, Q5_1)
GGUF_KERNELS(q2_k, Q2_K)
GGUF_KERNELS(q3_k, Q3_K)
GGUF_KERNELS(q4_k, Q4_K)
GGUF_KERNELS(q5_k, Q5_K)
GGUF_KERNELS(q6_k, Q6_K)
