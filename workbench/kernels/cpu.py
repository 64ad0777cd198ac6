"""Numba CPU kernels: `y = x @ W.T` computed from GGUF weights in their file format.

Three or four kernels per format (those of `formats.FORMATS` with `cpu` set: Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F16 through the CPU's half-to-float
conversion, BF16 through a lookup table), picked by `matmul` from T, the number of
rows of x. Each is generated below from a template, the format's block math
(`blocks`) and the loops all formats share (`loops`):

- `_gemv_<name>`, T = 1 (decode; T <= 2 for Q5_K, F16 and BF16): dot products
  on the packed blocks, one output row per `prange` iteration, fp32
  accumulation, nothing materialized. The unpacking is redone for every row of
  x. For Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K and Q6_K each block is one explicit
  16-lane vector step (`workbench.kernels.simd`) into two alternating
  accumulators; F16 likewise converts 16 halves per step.
- `_rows_<name>`, 2 <= T <= `ROWS_MAX_T` (batched decoding; Q8_0, Q4_0,
  Q4_1, Q5_0, Q5_1, Q4_K, Q6_K): the same steps, each block unpacked once for
  up to 8 rows of x (see `loops`). A row of x gets the very bits it gets from
  `_gemv_<name>`.
- `_gemv2_<name>`, `ROWS_MAX_T` < T <= `GEMV_MAX_T` (short prompts; from
  T = 3 for Q5_K, F16 and BF16; below `OUTER_MIN_T` where `_outer_<name>`
  runs): four rows of W at a time are dequantized
  into a per-thread fp32 buffer, then multiplied with the T rows of x in 4 x 4
  blocks of outputs (16 accumulators: each load of W or x feeds four
  multiply-adds) on CPUs with 32 vector registers, 4 x 2 blocks on those with
  16 (`loops.dots_block`), x padded to a multiple of four rows. Q4_0 and Q4_1
  rows are dequantized 32 weights per vector step (`simd.deq16`).
- `_outer_<name>`, `OUTER_MIN_T` <= T <= `GEMV_MAX_T` on CPUs with 32 vector
  registers: the two-stage kernel in outer-product form (`loops.outer_rows`): 8
  rows of W dequantized at a time, multiplied with x transposed (16 rows of x
  to a vector), each weight broadcast against 2 or 3 vectors of x into 16 or 24
  accumulators, no horizontal sums.
- `_dequant_<name>`, T > `GEMV_MAX_T` (prefill) and `dequantize_rows`: rows of
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

Batch invariance: every kernel computes a row of x the same way whatever the other
rows are, so a sequence's results do not depend on what else is in its batch
(tests/test_batch_invariance.py). The gemv and multi-row kernels share their steps, whose
arithmetic is written out without reassociation (`simd`); the two-stage kernels take
the rows of x four at a time, zero rows added, so no row falls to a remainder loop
that sums in another order; the outer-product kernels sum each output in one chain of
fused multiply-adds, the same in every lane; OpenBLAS's sgemm gives a row the same bits
for two rows or more. The kernel still depends on T: `matmul_chunks` picks it per
sequence. Decode steps of more than `ROWS_MAX_T` sequences go through the two-stage
kernels, whose sums run in another order than the gemv's: the multi-row kernels there
were 1.2-1.4x slower than them on Q4_1 at T = 9 to 16 (1 thread), more than the 5% of
batched decode speed that bit-identical steps may cost; `max_batch` is 8 by default.
"""

from __future__ import annotations

import linecache
import threading
from collections.abc import Sequence

import numba
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from numba import get_thread_id, prange  # noqa: F401 (these four: the generated kernels')

from workbench.kernels import blocks, loops  # noqa: F401
from workbench.kernels.cache import njit  # noqa: F401
from workbench.kernels.formats import FORMATS, Format
from workbench.kernels.simd import FASTMATH

Q = GGMLQuantizationType

# fp16 bit pattern -> float32, exact (NumPy's own conversion).
F16_TO_F32: np.ndarray = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)

# bf16 bit pattern -> float32 (the pattern is the float32's upper half), exact.
BF16_TO_F32: np.ndarray = (np.arange(65536, dtype=np.uint32) << np.uint32(16)).view(np.float32)

_FM = FASTMATH  # fastmath flags of the dot kernels: reorder sums, fuse mul-add
_INNER = 16  # the run-time inner trip count handed to the kernels (see module docstring)
ROWS_MAX_T = 8  # largest T for the multi-row kernels (measurements in `loops`)


# --------------------------------------------------------------------------- kernels by format
# Every format with `cpu` gets `_gemv_<name>`, `_gemv2_<name>`, `_dequant_<name>` and, with
# `rows`, `_rows_<name>`, written from these templates and compiled into this module's
# namespace by `_define_kernels`. Source text rather than a factory of closures: each
# kernel is then a plain module-level function with a name and a line of its own, which
# Numba's disk cache stores and finds like a hand-written one (`cache` stamps it with the
# sources of this module, which holds the templates, and of `formats`, `blocks`, `loops`).
# All share the signature (x, w, f16, y, n) (two-stage: (x, w, f16, scratch, y, n)); the
# sums of x are computed inside, so one call from Python does everything.

_GEMV = """
@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv_{name}(x, w, f16, y, n):{sums}
    wi = w.view(np.int8)
    for r in prange(w.shape[0]):
        for t in range(x.shape[0]):
            xt = x[t]
            y[t, r] = blocks.dot_{name}(w, wi, r, xt, {xs_t}, f16, n)
"""
# The formats with multi-row steps: one row of x at a time, through the same code as the
# multi-row kernel (`loops.rows_loop`), so a row gets the same bits from either.
_GEMV_ROWS = """
@njit(parallel=True, cache=True)
def _gemv_{name}(x, w, f16, y, n):
    T, K = x.shape
    xf, xs, tp = loops.padded_rows(x, {size}, 1)
    wi = w.view(np.int8)
    for r in prange(w.shape[0]):
        for t in range(T):
            blocks.dot_{name}(w, wi, r, xf, K, xs, tp, t, f16, y, T, 1)
"""
# The sums of x for the formats that need them; the others get x itself in their place
# (unused: no second slice of x per row, which cost ~2% of a small Q8_0 gemv).
_SUMS = """
    xs = loops.group_sums(x, {size})  # (T, K // {size})"""

# Two-stage gemv: dequantize four rows into a per-thread fp32 buffer, then T plain dot
# products over K (long, fully vectorized loops). The unpacking is paid once per row
# whatever T is.
_GEMV2 = """
@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv2_{name}(x, w, f16, scratch, y, n):
    wi = w.view(np.int8)
    N = w.shape[0]
    xp = loops.padded4(x)  # (T rounded up to a multiple of 4, K)
    for p in prange((N + 3) // 4):
        buf = scratch[get_thread_id()]  # (4, K)
        r = 4 * p
        for i in range(min(4, N - r)):
            blocks.{row}(w, wi, r + i, f16, buf[i], n)
        loops.dots_block(buf, xp, y, r, N)
"""

# Two-stage gemv in outer-product form (`loops.outer_rows`; CPUs with 32 vector registers).
# No fastmath: its sums are explicit FMA chains.
_OUTER = """
@njit(parallel=True, cache=True)
def _outer_{name}(x, w, f16, xt, scratch, y, n):
    loops.outer_rows(blocks.{row}, x, w, f16, xt, scratch, y, n)
"""

# Bit-exact dequantization of rows r0 .. r0 + len(out) (fastmath off).
_DEQUANT = """
@njit(cache=True)
def _dequant_{name}(w, r0, f16, out, n):
    wi = w.view(np.int8)
    for i in range(out.shape[0]):
        blocks.row_{name}(w, wi, r0 + i, f16, out[i], n)
"""

_ROWS = """
@njit(parallel=True, cache=True)
def _rows_{name}(x, w, f16, y, n):
    loops.rows_loop(blocks.dot_{name}, {size}, x, w, f16, y)
"""

# The generated code's file name: this file's, marked. Numba names the kernels' cache files
# after its stem ("cpu"), so it must stay a valid file name.
_SOURCE_NAME = f"{__file__}::generated"


def _kernels_source(fmt: Format) -> str:
    """The Python source of one format's kernels."""
    sums = _SUMS.format(size=fmt.sums) if fmt.sums else ""
    xs_t = "xs[t]" if fmt.sums else "xt"
    row = f"fast_row_{fmt.name}" if fmt.fast_row else f"row_{fmt.name}"
    if fmt.rows:
        parts = [_GEMV_ROWS.format(name=fmt.name, size=fmt.sums),
                 _ROWS.format(name=fmt.name, size=fmt.sums)]
    else:
        parts = [_GEMV.format(name=fmt.name, sums=sums, xs_t=xs_t)]
    parts += [_GEMV2.format(name=fmt.name, row=row), _OUTER.format(name=fmt.name, row=row),
              _DEQUANT.format(name=fmt.name)]
    return "".join(parts)


def _define_kernels(formats: tuple[Format, ...]) -> None:
    """Compile the kernels of `formats` into this module's namespace (Numba compiles each
    on its first call, or loads it from the disk cache). The source is registered with
    `linecache`, so tracebacks and `inspect.getsource` show it."""
    source = "".join(_kernels_source(f) for f in formats)
    linecache.cache[_SOURCE_NAME] = (len(source), None, source.splitlines(True), _SOURCE_NAME)
    exec(compile(source, _SOURCE_NAME, "exec"), globals())


_CPU_FORMATS = tuple(f for f in FORMATS if f.cpu)
_define_kernels(_CPU_FORMATS)

GEMV_KERNELS = {f.qtype: globals()[f"_gemv_{f.name}"] for f in _CPU_FORMATS}
GEMV2_KERNELS = {f.qtype: globals()[f"_gemv2_{f.name}"] for f in _CPU_FORMATS}
OUTER_KERNELS = {f.qtype: globals()[f"_outer_{f.name}"] for f in _CPU_FORMATS}
DEQUANT_KERNELS = {f.qtype: globals()[f"_dequant_{f.name}"] for f in _CPU_FORMATS}
ROWS_KERNELS = {f.qtype: globals()[f"_rows_{f.name}"] for f in _CPU_FORMATS if f.rows}
KERNEL_TYPES: tuple[GGMLQuantizationType, ...] = tuple(GEMV_KERNELS)
_BF16_TABLE = frozenset(f.qtype for f in _CPU_FORMATS if f.bf16)


# Largest T for the Numba-only kernels. Measured with 2 threads (ms), two-stage
# (4 x 4 blocked dots) / tile+BLAS: Q4_1 49152x576 T=8 4.1 / 9.5, T=16 6.4 / 13.0;
# Q4_1 4864x896 T=32 1.9 / 2.6, T=64 3.2 / 4.9, T=128 6.8 / 7.6, T=512 28.6 / 23.2.
GEMV_MAX_T = 64
# The two-stage kernels take the outer-product form (`loops.outer_rows`) on CPUs with 32
# vector registers for OUTER_MIN_T <= T <= GEMV_MAX_T (two to four vectors of 16 rows of
# x, in one or two passes). Below, its zero rows cost more than it saves (2 threads,
# AVX-512 host, one run, against `loops.dots_block`, Qwen2.5's Q5_0 4864 x 896, 896 x 896
# and Q6_K 896 x 4864: T=17 0.90-0.94x, T=20 0.89-0.93x, T=24 1.03-1.12x, T=25
# 1.02-1.46x, T=40 1.11-1.28x, T=64 1.11-1.24x).
OUTER = loops.WIDE_REGISTERS
OUTER_MIN_T = 25


# Weights dequantized per tile on the BLAS path (8M floats = 32 MiB of fp32: a whole
# matrix of the models we run, so one BLAS call each). Against 1M (bench/bench_kernels.py,
# one run, AVX-512 host, 2 threads): Qwen2.5's 896x4864 Q5_0 at T=512 17.9 -> 14.4 ms and
# at T=128 6.6 -> 5.1 ms, Q4_1 19.4 -> 14.1 ms; its 4864x896 and SmolLM2's shapes within
# the noise (+-8%). (Before the BLAS path took T > 64 only, 256K and 4M had been 5-40%
# slower than 1M from T=16 to T=512.) Each thread keeps its tile buffer (`_tile`, at most
# this many floats) between calls: a 512-token Qwen2.5-Coder Q4_K_M prefill 1.90 -> 1.74 s,
# its dequantization 264 -> 150 ms (fresh pages faulted in and zeroed every call before).
TILE_WEIGHTS = 1 << 23


def _table(qtype: GGMLQuantizationType) -> np.ndarray:
    """The fp16 table, or the bf16 one for the formats that take it (BF16)."""
    return BF16_TO_F32 if qtype in _BF16_TABLE else F16_TO_F32


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


def gemv_outer(x: np.ndarray, w: np.ndarray, qtype: GGMLQuantizationType,
               out: np.ndarray | None = None) -> np.ndarray:
    """`x @ dequantize(w).T`, the two-stage kernel in outer-product form (`loops.outer_rows`).

    Same contract as `gemv`; any T (passes of up to `GEMV_MAX_T` rows), on any CPU.
    `matmul` picks it for `OUTER_MIN_T` <= T <= `GEMV_MAX_T` on CPUs with 32 vector
    registers (`OUTER`). A row of x gets the same bits whatever the other rows are.
    """
    return _outer(x, w, qtype, _check(x, w, qtype, out))


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
    threads, K = numba.config.NUMBA_NUM_THREADS, x.shape[1]
    scratch = _scratch(threads * 4 * K).reshape(threads, 4, K)  # four dequantized rows each
    GEMV2_KERNELS[qtype](_writeable(x), _frozen(w), _table(qtype), scratch, y, _INNER)
    return y


def _outer(x: np.ndarray, w: np.ndarray, qtype: GGMLQuantizationType, y: np.ndarray
           ) -> np.ndarray:
    T, K = x.shape
    threads, per_thread = numba.config.NUMBA_NUM_THREADS, loops.outer_floats(K)
    shared = loops.outer_shared_floats(K, w.shape[0])
    buf = _scratch(shared + threads * per_thread)
    xt = buf[:shared]  # x transposed, then y transposed
    scratch = buf[shared:].reshape(threads, per_thread)
    x, w, table = _writeable(x), _frozen(w), _table(qtype)
    step = loops.OUTER_MAX_T  # passes of at most 64 rows (views: no copies)
    for t0 in range(0, T, step):
        OUTER_KERNELS[qtype](x[t0 : t0 + step], w, table, xt, scratch, y[t0 : t0 + step],
                             _INNER)
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
    Returns (T, N) float32, written into `out` when given. Picks the kernel by T
    (`kernel_for`):

    - T = 1 (decode): `gemv`, dot products on the packed blocks;
    - 2 <= T <= `ROWS_MAX_T` (batched decoding): `gemv_rows` for the formats
      it has (T = 2 for the others: `gemv`), else `gemv_dequant_rows`;
    - larger T up to `GEMV_MAX_T`: `gemv_dequant_rows`, or from `OUTER_MIN_T` on
      CPUs with 32 vector registers `gemv_outer`;
    - larger T (prefill): W is dequantized one tile of `TILE_WEIGHTS` floats
      at a time (serial Numba) and each tile is multiplied with BLAS
      (`np.dot`, multithreaded), so the fp32 copy never exceeds one tile.
      The dequantization is serial on purpose: OpenBLAS's worker threads
      keep spinning after a call, and a parallel Numba region right after
      one waits for its descheduled threads (measured 5-10x slower).

    Every kernel gives a row of x the same bits whatever the other rows are (`gemv`
    and `gemv_rows` the same bits as each other; OpenBLAS's sgemm, for two rows or
    more, does too): a row's result depends on x's row count only through the kernel
    that count picks. `matmul_chunks` keeps that choice per sequence.
    """
    y = _check(x, w, qtype, out)
    return kernel_for(x.shape[0], qtype)(x, w, qtype, y)


def kernel_for(T: int, qtype: GGMLQuantizationType):
    """The unchecked kernel call `matmul` makes for T rows of x: `fn(x, w, qtype, y)`."""
    if T == 1:
        return _gemv
    if T <= ROWS_MAX_T and qtype in ROWS_KERNELS:
        return _gemv_rows
    if T <= 2:
        return _gemv
    if T <= GEMV_MAX_T:
        return _outer if OUTER and T >= OUTER_MIN_T else _gemv_dequant_rows
    return _tiled


def matmul_chunks(x: np.ndarray, w: np.ndarray, qtype: GGMLQuantizationType,
                  counts: Sequence[int]) -> np.ndarray:
    """`matmul` of x whose rows are chunks of several sequences, counts[i] rows each (a
    prefill pass over several prompts): each chunk's rows get the kernel `matmul` picks
    for counts[i] rows, so the very bits `matmul(chunk)` gives them, whatever the other
    chunks are. The chunks that pick the same kernel run in one call."""
    y = _check(x, w, qtype, None)
    groups: dict = {}
    row = 0
    for n in counts:
        groups.setdefault(kernel_for(n, qtype), []).append(np.arange(row, row + n))
        row += n
    if row != x.shape[0]:
        raise ValueError(f"counts add up to {row} rows, x has {x.shape[0]}")
    if len(groups) == 1:
        kernel = next(iter(groups))
        return kernel(x, w, qtype, y)
    for kernel, spans in groups.items():
        rows = np.concatenate(spans)
        y[rows] = kernel(np.ascontiguousarray(x[rows]), w, qtype,
                         np.empty((rows.size, y.shape[1]), np.float32))
    return y


_SCRATCH = threading.local()  # .buf: the calling thread's float32 buffer for the kernels


def _scratch(size: int) -> np.ndarray:
    """`size` float32 of the calling thread's, kept between calls (the tiles of W on the
    BLAS path, the two-stage kernels' rows of W): a fresh buffer each call would be fresh
    pages (glibc maps blocks this large anew every time), which the kernel faults in and
    zeroes on first touch."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.size < size:
        buf = _SCRATCH.buf = np.empty(size, np.float32)
    return buf[:size]


def _tile(rows: int, K: int) -> np.ndarray:
    """A (rows, K) float32 buffer of the calling thread's (`_scratch`)."""
    return _scratch(rows * K).reshape(rows, K)


def _tiled(x: np.ndarray, w: np.ndarray, qtype: GGMLQuantizationType, y: np.ndarray
           ) -> np.ndarray:
    """y = x @ dequantize(w).T, W dequantized one tile at a time, each tile through BLAS."""
    T, K = x.shape
    w = _frozen(w)
    N = w.shape[0]
    rows = max(16, min(N, TILE_WEIGHTS // K))
    tile = _tile(rows, K)
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
