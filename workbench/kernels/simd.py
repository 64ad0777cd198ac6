"""Explicit 16-lane vector steps for the Numba kernels, written as LLVM IR.

The decode kernels spend their time in one step per quantization block:
unpack 16 bytes of 4-bit (or 5-bit) weights and multiply them with 32
activations. Left to LLVM's loop vectorizer, a 16-iteration loop runs in the
8-lane remainder of a vector loop built for 64 iterations, and each block
ends with a horizontal sum. These intrinsics (callable only from `@njit` code)
emit the step as straight vector code on `<16 x float>` values instead, and
add into a 16-float accumulator that the caller sums once per output row.
LLVM lowers the vector types to whatever the CPU has (AVX-512, AVX2, SSE,
NEON), so nothing here depends on an instruction set.

- `stack_f32x16()`: a zeroed 16-float accumulator on the stack (as a 1-D
  array); LLVM keeps it in a register across the block loop. `stack_f32x128()`:
  eight of them, one per row of x.

The dot-product steps take `rows` rows of x at once (the literal 1, 2, 4 or 8;
row t at x[... + t * stride], x a 1-D float32 array) and add into one 16-lane
accumulator per row, acc[16 t:16 t + 16]: each block is unpacked once, whatever
the number of rows. Each row's arithmetic is written out as IEEE operations without
fast-math flags, its products fused by explicit FMAs (`llvm.fma`; fma(a, b, c) below),
the same for every row and every `rows`: a row gets the same bits alone or beside
others, which makes a sequence's logits independent of what else is in its batch
(tests/test_batch_invariance.py). The kernels calling them are compiled without
`fastmath`: Numba would put its flags on every float operation of the kernel, these
steps' included, and LLVM could then reassociate them differently in each kernel (it
did: the one-row and the multi-row Q4_K kernels differed in the last bits). With `lo`,
`hi` the unpacked values as floats and x_lo, x_hi the 16 floats at x[xlo:], x[xhi:]:

- `nib16(acc, w, off, x, xlo, xhi, stride, dlo, dhi, rows)`: for j in 0..15, with
  v = w[off + j], lo = v & 15, hi = v >> 4:
  acc = fma(hi * dhi, x_hi, fma(lo * dlo, x_lo, acc)). The weights times their
  scales (lo * dlo, hi * dhi) are worked out once for all the rows, so each row costs
  two multiply-adds (at 8 rows the Q4_K and Q6_K kernels 1.3x faster than with the
  scales applied per row, Q5_0 1.25x; one row as fast).
- `nib16_1(acc, w, off, x, xlo, xhi, stride, d, rows)`: `nib16` with dlo = dhi = d
  (Q4_0, Q4_1).
- `nib16_hb(acc, w, off, x, xlo, xhi, stride, d, qh, rows)`: the same with 5-bit
  weights (Q5_0/Q5_1) and dlo = dhi = d: bit j of `qh` adds 16 to the low nibble of
  byte j, bit 16 + j to its high nibble.
- `q8x32(acc, w, off, x, xo, stride, d, rows)`: 32 signed bytes (Q8_0), w an int8
  array: `nib16_1`'s step with lo, hi = w[off:off + 16], w[off + 16:off + 32] and x
  at xo, xo + 16.
- `q6k16(acc, w, lo, ho, x, x0, stride, d0, d1, d2, d3, rows)`: 64 weights of a
  Q6_K super-block, 16 from each of its four 32-weight runs: with a = w[lo + j],
  c = w[lo + 32 + j], h = w[ho + j], the unsigned 6-bit values
  (a & 15 | (h & 3) << 4), (c & 15 | (h >> 2 & 3) << 4),
  (a >> 4 | (h >> 4 & 3) << 4), (c >> 4 | (h >> 6) << 4) times
  x[x0 + j], x[x0 + 32 + j], x[x0 + 64 + j], x[x0 + 96 + j], scaled by d0..d3:
  acc = fma(q3 * d3, x3, fma(q2 * d2, x2, fma(q1 * d1, x1, fma(q0 * d0, x0, acc)))),
  the q_i * d_i once for all rows. (The -32 offset is the caller's, through sums of x.)
- `madd_lanes(s, a, xs, xo, rows)`: s[t] = fma(a, xs[xo + t], s[t]) for t < rows: the
  blocks' scalar parts (an offset or min times the block's sum of x), the rows'
  sums of x side by side in xs.
- `store_totals(y, r, t0, T, a0, a1, s, rows)`: y[t0 + t, r] = s[t] + the sum of
  the lanes of a0[16 t:] + a1[16 t:] (halves added pairwise, a fixed order), for
  the rows t0 + t < T.

Other steps:

- `deq16(out, oo, w, off, offset, d, m)`: 32 weights from 16 bytes of
  nibbles: out[oo + j] = (lo_j - offset) * d + m and out[oo + 16 + j] =
  (hi_j - offset) * d + m, rounded step by step (no fused multiply-add), so
  bit-identical to the scalar reference (Q4_0: offset 8, m = -0.0; Q4_1:
  offset 0 and its min m).
- `deq8x32(out, oo, w, off, d)`: out[oo + j] = float(int8 w[off + j]) * d for j in
  0..31 (Q8_0), one rounding each, bit-identical to the scalar reference.
- `deq16_hb(out, oo, w, off, offset, d, m, qh)`: `deq16` of 5-bit weights (Q5_0: offset
  16, m = -0.0; Q5_1: offset 0 and its min), the fifth bits from `qh` as in `nib16_hb`.
- `half16(acc, h, off, x, xo)`: acc[j] += float(h[off + j]) * x[xo + j] for
  j in 0..15, h holding IEEE half-precision bit patterns (uint16): LLVM's
  `fpext` from half, one instruction per 8 or 16 lanes where the CPU converts
  halves (F16C on x86, NEON on ARM).
- `half16_store(out, oo, h, off)`: out[oo + j] = float(h[off + j]), j in 0..15.
- `half_at(w, r, o)`: the IEEE half at bytes o, o + 1 of row r of the 2-D
  uint8 array w, as float32 (a block's scale): a 2-byte load and one
  conversion, where a lookup in a 65536-entry table would evict the weights
  from the L1/L2 caches.
- `prefetch(a, i)`: ask the cache for the line holding a[i] (a 1-D array; i may lie
  past its end: a prefetch never faults), for reading soon (`llvm.prefetch`, one
  instruction on x86 and ARM; nothing where the CPU has none).
- `f32_from_bits(i)`: the float32 whose bit pattern is the int32 `i` (for
  building powers of two in `layers.exp_neg`).

Short-prompt products (`loops.outer_rows`), outer-product form, the loop over K inside
the step so the accumulators stay in registers:

- `outer_tile(tile, to, ldt, a, lda, xt, xo, ldx, K, rows, vecs)`: for the `rows`
  (literal, 1 to 16) rows i of a (float32, row i at a[i * lda:]) and the `vecs` (literal,
  1 to 4) runs of 16 columns v of xt (x transposed: column t of x at xt[xo + k * ldx +
  t]), tile[to + i * ldt + 16 v + l] = sum over k < K of a[i * lda + k] * xt[xo + k * ldx
  + 16 v + l]: each sum one chain of fused multiply-adds in ascending k, the same for
  every lane, so an output's bits depend on neither its place in the tile nor the
  tile's size.

Attention steps (decoding, `layers._attend_group`), eight 8-lane accumulators in a
`stack_f32x64()` as above; k, v are C-contiguous float32 arrays of any shape, indexed
flat:

- `dots8(acc, q, qo, k, at, b, c)`: acc[8 j:8 j + 8] += q[qo + c:][:8] *
  k[at[b + j] + c:][:8] for j in 0..7: eight positions' keys (starting at the int64
  offsets at[b:b + 8]) times one 8-lane step of the query.
- `sums8(acc, out, oo)`: out[oo + j] = the sum of the lanes of accumulator j, j in 0..7.
- `axpy8s(acc, w, v, vo, chunks)`: acc[8 j:8 j + 8] += w * v[vo + 8 j:][:8] for j <
  chunks (the literal 1 or 8): one position's value, weighted, into 64 (or 8) columns.

No bounds are checked: callers pass offsets inside their arrays.

Numba's on-disk cache of a kernel is invalidated by changes to the kernel's own
file only: after editing this module, clear `__pycache__` (or touch `cpu.py`).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils, errors
from numba.extending import intrinsic
from numba.np.numpy_support import carray

from workbench.kernels.cache import njit

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_V16F = ir.VectorType(_F32, 16)
_V16I8 = ir.VectorType(ir.IntType(8), 16)
_V16I32 = ir.VectorType(_I32, 16)
_V8F = ir.VectorType(_F32, 8)
FASTMATH = {"reassoc", "contract"}
"""The fastmath flags of the kernels' dot products (`njit(fastmath=FASTMATH)`): LLVM may
reorder sums (to vectorize them) and fuse multiply-adds; NaN and inf keep their meaning."""
_FAST = ("reassoc", "contract")  # FASTMATH as flags of the IR built here


def _zeroed_stack(floats):
    """An intrinsic returning a pointer to `floats` zeroed float32 on the stack."""

    @intrinsic
    def stack(typingctx):
        def codegen(context, builder, signature, args):
            ptr = cgutils.alloca_once(builder, _F32, size=context.get_constant(types.intp,
                                                                               floats))
            for i in range(0, floats, 16):
                p = builder.gep(ptr, [ir.Constant(ir.IntType(64), i)])
                builder.store(ir.Constant(_V16F, [0.0] * 16),
                              builder.bitcast(p, _V16F.as_pointer()), align=4)
            return ptr

        return types.CPointer(types.float32)(), codegen

    return stack


_stack16, _stack64, _stack128 = _zeroed_stack(16), _zeroed_stack(64), _zeroed_stack(128)


def _data(context, builder, aty, a):
    """The data pointer of array `a` (of Numba type aty)."""
    return context.make_array(aty)(context, builder, a).data


def _element_ptr(context, builder, aryty, ary, index, vec_type):
    """Pointer to ary[index] (a 1-D contiguous array), cast to a pointer to `vec_type`."""
    return builder.bitcast(builder.gep(_data(context, builder, aryty, ary), [index]),
                           vec_type.as_pointer())


def _splat(builder, value):
    one = builder.insert_element(ir.Constant(_V16F, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(_V16F, ir.Undefined),
                                  ir.Constant(_V16I32, [0] * 16))


def _each_row(context, builder, sig, acc, x, stride, rows, step, x_arg=3):
    """acc[16 t:16 t + 16] = step(load_t, acc[16 t:16 t + 16]) for t < rows, where
    load_t(xo) loads the 16 floats x[xo + t * stride:] (x 1-D float32)."""
    aty, xty = sig.args[0], sig.args[x_arg]
    for t in range(rows):
        shift = builder.mul(stride, ir.Constant(stride.type, t))

        def load(xo, shift=shift):
            ptr = _element_ptr(context, builder, xty, x, builder.add(xo, shift), _V16F)
            return builder.load(ptr, align=4)

        pacc = _element_ptr(context, builder, aty, acc, ir.Constant(ir.IntType(64), 16 * t),
                            _V16F)
        builder.store(step(load, builder.load(pacc, align=4)), pacc, align=4)


def _literal_rows(rows) -> int:
    if not isinstance(rows, types.IntegerLiteral) or rows.literal_value not in (1, 2, 4, 8):
        raise errors.TypingError("rows must be the literal 1, 2, 4 or 8")
    return rows.literal_value


def _fma(builder, a, b, c):
    """a * b + c rounded once (`llvm.fma`: one instruction where the CPU has FMA), for
    floats or vectors of floats: the one product the steps let fuse, always fused."""
    ty = a.type
    name = f"llvm.fma.v{ty.count}f32" if isinstance(ty, ir.VectorType) else "llvm.fma.f32"
    fn = builder.module.globals.get(name) or ir.Function(builder.module,
                                                         ir.FunctionType(ty, [ty] * 3), name)
    return builder.call(fn, [a, b, c])


def _one_scale(builder, lo, hi, xlo, xhi, d):
    """acc + lo * d * x[xlo:] + hi * d * x[xhi:] for one row (lo, hi: <16 x float>), as
    fma(hi * d, x[xhi:], fma(lo * d, x[xlo:], acc)): the weights times the scale once for
    all rows."""
    dv = _splat(builder, d)
    lo_d, hi_d = builder.fmul(lo, dv), builder.fmul(hi, dv)

    def step(load, acc):
        return _fma(builder, hi_d, load(xhi), _fma(builder, lo_d, load(xlo), acc))

    return step


def _nibbles(builder, context, wty, w, off):
    """The 16 bytes w[off:off + 16] (w of Numba type wty) as (low nibbles, high nibbles),
    <16 x i32> each."""
    q = builder.zext(builder.load(_element_ptr(context, builder, wty, w, off, _V16I8),
                                  align=1), _V16I32)
    return (builder.and_(q, ir.Constant(_V16I32, [15] * 16)),
            builder.lshr(q, ir.Constant(_V16I32, [4] * 16)))


def _float_nibbles(builder, context, wty, w, off):
    lo, hi = _nibbles(builder, context, wty, w, off)
    return builder.uitofp(lo, _V16F), builder.uitofp(hi, _V16F)


@intrinsic
def nib16(typingctx, acc, w, off, x, xlo, xhi, stride, dlo, dhi, rows):
    n = _literal_rows(rows)
    sig = types.void(acc, w, off, x, xlo, xhi, stride, types.float32, types.float32, rows)

    def codegen(context, builder, signature, args):
        acc_, w_, off_, x_, xlo_, xhi_, stride_, dlo_, dhi_, _ = args
        lo, hi = _float_nibbles(builder, context, signature.args[1], w_, off_)
        # the weights times their scales, once for all rows
        lo_d = builder.fmul(lo, _splat(builder, dlo_))
        hi_d = builder.fmul(hi, _splat(builder, dhi_))

        def step(load, acc):
            return _fma(builder, hi_d, load(xhi_), _fma(builder, lo_d, load(xlo_), acc))

        _each_row(context, builder, signature, acc_, x_, stride_, n, step)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def nib16_1(typingctx, acc, w, off, x, xlo, xhi, stride, d, rows):
    n = _literal_rows(rows)
    sig = types.void(acc, w, off, x, xlo, xhi, stride, types.float32, rows)

    def codegen(context, builder, signature, args):
        acc_, w_, off_, x_, xlo_, xhi_, stride_, d_, _ = args
        lo, hi = _float_nibbles(builder, context, signature.args[1], w_, off_)
        _each_row(context, builder, signature, acc_, x_, stride_, n,
                  _one_scale(builder, lo, hi, xlo_, xhi_, d_))
        return context.get_dummy_value()

    return sig, codegen


# bit j of qh -> lane j (low nibbles), bit 16 + j -> lane j (high nibbles); as signed int32
_LOW_BITS = ir.Constant(_V16I32, [1 << j for j in range(16)])
_HIGH_BITS = ir.Constant(_V16I32, [((1 << (16 + j)) + 2**31) % 2**32 - 2**31 for j in range(16)])


def _five_bits(builder, lo, hi, qh):
    """Low and high nibbles (<16 x i32>) with their fifth bits from the int32 `qh`: bit j
    adds 16 to lane j of `lo`, bit 16 + j to lane j of `hi`."""
    bits = builder.shuffle_vector(
        builder.insert_element(ir.Constant(_V16I32, ir.Undefined), qh, ir.Constant(_I32, 0)),
        ir.Constant(_V16I32, ir.Undefined), ir.Constant(_V16I32, [0] * 16))
    zero = ir.Constant(_V16I32, [0] * 16)
    sixteen = ir.Constant(_V16I32, [16] * 16)
    lo = builder.add(lo, builder.select(
        builder.icmp_unsigned("!=", builder.and_(bits, _LOW_BITS), zero), sixteen, zero))
    hi = builder.add(hi, builder.select(
        builder.icmp_unsigned("!=", builder.and_(bits, _HIGH_BITS), zero), sixteen, zero))
    return lo, hi


@intrinsic
def nib16_hb(typingctx, acc, w, off, x, xlo, xhi, stride, d, qh, rows):
    n = _literal_rows(rows)
    sig = types.void(acc, w, off, x, xlo, xhi, stride, types.float32, types.int32, rows)

    def codegen(context, builder, signature, args):
        acc_, w_, off_, x_, xlo_, xhi_, stride_, d_, qh_, _ = args
        lo, hi = _five_bits(builder, *_nibbles(builder, context, signature.args[1], w_, off_),
                            qh_)
        lo, hi = builder.uitofp(lo, _V16F), builder.uitofp(hi, _V16F)
        _each_row(context, builder, signature, acc_, x_, stride_, n,
                  _one_scale(builder, lo, hi, xlo_, xhi_, d_))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def q8x32(typingctx, acc, w, off, x, xo, stride, d, rows):
    n = _literal_rows(rows)
    sig = types.void(acc, w, off, x, xo, stride, types.float32, rows)

    def codegen(context, builder, signature, args):
        acc_, w_, off_, x_, xo_, stride_, d_, _ = args

        def weights(o):  # 16 int8 at w[o:] as <16 x float>
            ptr = _element_ptr(context, builder, signature.args[1], w_, o, _V16I8)
            return builder.sitofp(builder.load(ptr, align=1), _V16F)

        lo, hi = weights(off_), weights(builder.add(off_, ir.Constant(off_.type, 16)))
        _each_row(context, builder, signature, acc_, x_, stride_, n,
                  _one_scale(builder, lo, hi, xo_, builder.add(xo_, ir.Constant(xo_.type, 16)),
                             d_))
        return context.get_dummy_value()

    return sig, codegen


def _q6k_values(builder, context, wty, w, lo, ho):
    """The four runs' unsigned 6-bit values of `q6k16` (<16 x i32> each): (low 4 bits)
    | (high 2 bits) << 4, from the bytes at w[lo:], w[lo + 32:] and w[ho:]."""

    def load_bytes(offset):
        ptr = _element_ptr(context, builder, wty, w, offset, _V16I8)
        return builder.zext(builder.load(ptr, align=1), _V16I32)

    def const(v):
        return ir.Constant(_V16I32, [v] * 16)

    a = load_bytes(lo)
    c = load_bytes(builder.add(lo, ir.Constant(lo.type, 32)))
    h = load_bytes(ho)
    and_, or_, shl, lshr = builder.and_, builder.or_, builder.shl, builder.lshr
    return [
        or_(and_(a, const(15)), shl(and_(h, const(3)), const(4))),
        or_(and_(c, const(15)), shl(and_(h, const(12)), const(2))),
        or_(lshr(a, const(4)), and_(h, const(48))),
        or_(lshr(c, const(4)), lshr(and_(h, const(192)), const(2))),
    ]


@intrinsic
def q6k16(typingctx, acc, w, lo, ho, x, x0, stride, d0, d1, d2, d3, rows):
    n = _literal_rows(rows)
    f = types.float32
    sig = types.void(acc, w, lo, ho, x, x0, stride, f, f, f, f, rows)

    def codegen(context, builder, signature, args):
        acc_, w_, lo_, ho_, x_, x0_, stride_ = args[:7]
        quads = [builder.uitofp(q, _V16F)
                 for q in _q6k_values(builder, context, signature.args[1], w_, lo_, ho_)]
        # the weights times their scales, once for all rows
        scaled = [builder.fmul(q, _splat(builder, d)) for q, d in zip(quads, args[7:11])]
        offsets = [builder.add(x0_, ir.Constant(x0_.type, 32 * i)) for i in range(4)]

        def step(load, acc):
            for q, xo in zip(scaled, offsets):
                acc = _fma(builder, q, load(xo), acc)
            return acc

        _each_row(context, builder, signature, acc_, x_, stride_, n, step, x_arg=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def madd_lanes(typingctx, s, a, xs, xo, rows):
    n = _literal_rows(rows)
    sig = types.void(s, types.float32, xs, xo, rows)

    def codegen(context, builder, signature, args):
        s_, a_, xs_, xo_, _ = args
        vt = ir.VectorType(_F32, n)  # one lane per row: a single register for the rows
        ps = builder.bitcast(_data(context, builder, signature.args[0], s_), vt.as_pointer())
        px = builder.bitcast(builder.gep(_data(context, builder, signature.args[2], xs_),
                                         [xo_]), vt.as_pointer())
        one = builder.insert_element(ir.Constant(vt, ir.Undefined), a_, ir.Constant(_I32, 0))
        av = builder.shuffle_vector(one, ir.Constant(vt, ir.Undefined),
                                    ir.Constant(ir.VectorType(_I32, n), [0] * n))
        builder.store(_fma(builder, av, builder.load(px, align=4), builder.load(ps, align=4)),
                      ps, align=4)
        return context.get_dummy_value()

    return sig, codegen


def _lane_sum(builder, v, width):
    """The sum of the lanes of v (<width x float>): halves added pairwise."""
    while width > 1:
        half = width // 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half),
                                                      list(range(half))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half),
                                                      list(range(half, width))))
        v, width = builder.fadd(lo, hi), half
    return builder.extract_element(v, ir.Constant(_I32, 0))


@intrinsic
def store_totals(typingctx, y, r, t0, T, a0, a1, s, rows):
    n = _literal_rows(rows)
    sig = types.void(y, r, t0, T, a0, a1, s, rows)

    def codegen(context, builder, signature, args):
        y_, r_, t0_, T_, a0_, a1_, s_, _ = args
        yarr = context.make_array(signature.args[0])(context, builder, y_)
        width = builder.extract_value(yarr.shape, 1)
        d0, d1, ds = (_data(context, builder, signature.args[i], a)
                      for i, a in ((4, a0_), (5, a1_), (6, s_)))
        i64 = ir.IntType(64)
        for t in range(n):  # constant offsets: LLVM keeps the accumulators in registers

            def lanes(data, t=t):
                ptr = builder.gep(data, [ir.Constant(i64, 16 * t)])
                return builder.load(builder.bitcast(ptr, _V16F.as_pointer()), align=4)

            total = builder.fadd(builder.load(builder.gep(ds, [ir.Constant(i64, t)])),
                                 _lane_sum(builder, builder.fadd(lanes(d0), lanes(d1)), 16))
            row = builder.add(t0_, ir.Constant(t0_.type, t))
            with builder.if_then(builder.icmp_signed("<", row, T_)):
                at = builder.add(builder.mul(row, width), r_)
                builder.store(total, builder.gep(yarr.data, [at]))
        return context.get_dummy_value()

    return sig, codegen


def _store_dequantized(context, builder, sig, out, oo, lo, hi, offset, d, m):
    """out[oo + j] = (lo_j - offset) * d + m and out[oo + 16 + j] the same of hi_j (lo, hi:
    <16 x i32>), each operation rounded on its own (no flags: never fused)."""
    sub, dv, mv = _splat(builder, offset), _splat(builder, d), _splat(builder, m)
    for q, o in ((lo, oo), (hi, builder.add(oo, ir.Constant(oo.type, 16)))):
        v = builder.fadd(builder.fmul(builder.fsub(builder.uitofp(q, _V16F), sub), dv), mv)
        builder.store(v, _element_ptr(context, builder, sig.args[0], out, o, _V16F), align=4)


@intrinsic
def deq16(typingctx, out, oo, w, off, offset, d, m):
    sig = types.void(out, oo, w, off, types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        out_, oo_, w_, off_, offset_, d_, m_ = args
        lo, hi = _nibbles(builder, context, signature.args[2], w_, off_)
        _store_dequantized(context, builder, signature, out_, oo_, lo, hi, offset_, d_, m_)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def deq8x32(typingctx, out, oo, w, off, d):
    sig = types.void(out, oo, w, off, types.float32)

    def codegen(context, builder, signature, args):
        out_, oo_, w_, off_, d_ = args
        dv = _splat(builder, d_)
        for half in (0, 16):
            at = builder.add(off_, ir.Constant(off_.type, half))
            q = builder.load(_element_ptr(context, builder, signature.args[2], w_, at, _V16I8),
                             align=1)
            v = builder.fmul(builder.sitofp(q, _V16F), dv)  # no flags: one rounding, as scalar
            o = builder.add(oo_, ir.Constant(oo_.type, half))
            builder.store(v, _element_ptr(context, builder, signature.args[0], out_, o, _V16F),
                          align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def deq16_hb(typingctx, out, oo, w, off, offset, d, m, qh):
    sig = types.void(out, oo, w, off, types.float32, types.float32, types.float32, types.int32)

    def codegen(context, builder, signature, args):
        out_, oo_, w_, off_, offset_, d_, m_, qh_ = args
        lo, hi = _five_bits(builder, *_nibbles(builder, context, signature.args[2], w_, off_),
                            qh_)
        _store_dequantized(context, builder, signature, out_, oo_, lo, hi, offset_, d_, m_)
        return context.get_dummy_value()

    return sig, codegen


_V16H = ir.VectorType(ir.HalfType(), 16)


_ZERO = ir.Constant(ir.IntType(64), 0)


def _floats(context, builder, aty, a, off):
    """a[off:off + 16] (float32) as <16 x float>."""
    return builder.load(_element_ptr(context, builder, aty, a, off, _V16F), align=4)


def _add_into(context, builder, aty, a, off, step):
    """a[off:off + 16] += step (<16 x float>), the add with the kernels' fast flags."""
    ptr = _element_ptr(context, builder, aty, a, off, _V16F)
    builder.store(builder.fadd(builder.load(ptr, align=4), step, flags=_FAST), ptr, align=4)


def _halves(context, builder, hty, h, off):
    """h[off:off + 16] (uint16 half-precision patterns) as <16 x float>."""
    return builder.fpext(builder.load(_element_ptr(context, builder, hty, h, off, _V16H),
                                      align=2), _V16F)


@intrinsic
def half16_store(typingctx, out, oo, h, off):
    sig = types.void(out, oo, h, off)

    def codegen(context, builder, signature, args):
        out_, oo_, h_, off_ = args
        builder.store(_halves(context, builder, signature.args[2], h_, off_),
                      _element_ptr(context, builder, signature.args[0], out_, oo_, _V16F),
                      align=4)
        return context.get_dummy_value()

    return sig, codegen


def _product_step(vector_at):
    """An intrinsic (acc, p, q, b, bo): acc[o + j] += v[j] * b[bo + j] for j in 0..15, b
    float32, where `vector_at(context, builder, signature, p, q)` gives v (<16 x float>)
    and the offset o."""

    @intrinsic
    def step(typingctx, acc, p, q, b, bo):
        sig = types.void(acc, p, q, b, bo)

        def codegen(context, builder, signature, args):
            acc_, p_, q_, b_, bo_ = args
            v, o = vector_at(context, builder, signature, p_, q_)
            bv = _floats(context, builder, signature.args[3], b_, bo_)
            _add_into(context, builder, signature.args[0], acc_, o,
                      builder.fmul(v, bv, flags=_FAST))
            return context.get_dummy_value()

        return sig, codegen

    return step


def _halves_at(context, builder, signature, h, off):
    return _halves(context, builder, signature.args[1], h, off), _ZERO


half16 = _product_step(_halves_at)  # (acc, h, off, x, xo)


@intrinsic
def half_at(typingctx, w, r, o):
    sig = types.float32(w, r, o)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1], args[2]])
        h = builder.load(builder.bitcast(ptr, ir.HalfType().as_pointer()), align=1)
        return builder.fpext(h, _F32)

    return sig, codegen


@intrinsic
def prefetch(typingctx, w, off):
    sig = types.void(w, off)

    def codegen(context, builder, signature, args):
        ptr = builder.gep(_data(context, builder, signature.args[0], args[0]), [args[1]])
        i8p = builder.bitcast(ptr, ir.IntType(8).as_pointer())
        fn = builder.module.globals.get("llvm.prefetch.p0i8") or ir.Function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p.type, _I32, _I32, _I32]),
            "llvm.prefetch.p0i8")
        builder.call(fn, [i8p, ir.Constant(_I32, 0), ir.Constant(_I32, 3),
                          ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def f32_from_bits(typingctx, i):
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], _F32)

    return sig, codegen


@njit(inline="always")
def stack_f32x16():
    """A zeroed (16,) float32 accumulator on the stack (only inside @njit code)."""
    return carray(_stack16(), (16,))


@njit(inline="always")
def stack_f32x64():
    """Eight zeroed 8-lane accumulators, (64,) float32 on the stack, for the attention
    steps (only inside @njit code)."""
    return carray(_stack64(), (64,))


@njit(inline="always")
def stack_f32x128():
    """Eight zeroed 16-lane accumulators, (128,) float32 on the stack, one per row of x
    for the dot-product steps (only inside @njit code)."""
    return carray(_stack128(), (128,))


# -- short-prompt products ------------------------------------------------------------------


@intrinsic
def outer_tile(typingctx, tile, to, ldt, a, lda, xt, xo, ldx, K, rows, vecs):
    if not (isinstance(rows, types.IntegerLiteral) and 1 <= rows.literal_value <= 16
            and isinstance(vecs, types.IntegerLiteral) and 1 <= vecs.literal_value <= 4):
        raise errors.TypingError("rows must be a literal 1..16 and vecs a literal 1..4")
    R, V = rows.literal_value, vecs.literal_value
    sig = types.void(tile, to, ldt, a, lda, xt, xo, ldx, K, rows, vecs)

    def codegen(context, builder, signature, args):
        tile_, to_, ldt_, a_, lda_, xt_, xo_, ldx_, K_, _, _ = args
        t_data, a_data, x_data = (_data(context, builder, signature.args[i], v)
                                  for i, v in ((0, tile_), (3, a_), (5, xt_)))
        idx = K_.type
        zero = ir.Constant(_V16F, [0.0] * 16)
        entry = builder.block
        loop = builder.append_basic_block("outer.k")
        done = builder.append_basic_block("outer.done")
        builder.cbranch(builder.icmp_signed(">", K_, ir.Constant(idx, 0)), loop, done)
        # loop: k and the R x V accumulators as phi nodes (registers, never memory)
        builder.position_at_end(loop)
        k = builder.phi(idx)
        acc = [[builder.phi(_V16F) for _ in range(V)] for _ in range(R)]
        xk = builder.add(xo_, builder.mul(k, ldx_))
        xv = [builder.load(builder.bitcast(builder.gep(x_data, [builder.add(
            xk, ir.Constant(idx, 16 * v))]), _V16F.as_pointer()), align=4) for v in range(V)]
        new = []
        for i in range(R):
            at = builder.add(builder.mul(lda_, ir.Constant(idx, i)), k)
            ai = _splat(builder, builder.load(builder.gep(a_data, [at])))
            new.append([_fma(builder, ai, xv[v], acc[i][v]) for v in range(V)])
        k_next = builder.add(k, ir.Constant(idx, 1))
        latch = builder.block
        k.add_incoming(ir.Constant(idx, 0), entry)
        k.add_incoming(k_next, latch)
        for i in range(R):
            for v in range(V):
                acc[i][v].add_incoming(zero, entry)
                acc[i][v].add_incoming(new[i][v], latch)
        builder.cbranch(builder.icmp_signed("<", k_next, K_), loop, done)
        # done: store the sums (zero where K is 0)
        builder.position_at_end(done)
        totals = [builder.phi(_V16F) for _ in range(R * V)]  # phis first in their block
        for j, total in enumerate(totals):
            total.add_incoming(zero, entry)
            total.add_incoming(new[j // V][j % V], latch)
            i, v = divmod(j, V)
            at = builder.add(builder.add(to_, builder.mul(ldt_, ir.Constant(ldt_.type, i))),
                             ir.Constant(ldt_.type, 16 * v))
            ptr = builder.gep(t_data, [at])
            builder.store(total, builder.bitcast(ptr, _V16F.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


# -- attention steps -------------------------------------------------------------------------
# Decoding attention (`layers._attend_group`) reads the cached keys and values of one KV head,
# each position's hd floats contiguous. The scores take eight positions at a time, each with
# its own 8-lane accumulator (no horizontal sum per position: `sums8` reduces all eight at
# once); the weighted sum of values keeps 64 output columns in eight 8-lane accumulators
# across the positions instead of adding into memory.


def _splat8(builder, value):
    one = builder.insert_element(ir.Constant(_V8F, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(_V8F, ir.Undefined),
                                  ir.Constant(ir.VectorType(_I32, 8), [0] * 8))


def _acc8(builder, acc_data, j):
    """Pointer to the j-th 8-lane accumulator of a (64,) stack accumulator."""
    return builder.bitcast(builder.gep(acc_data, [ir.Constant(ir.IntType(64), 8 * j)]),
                           _V8F.as_pointer())


def _add8(builder, pa, step):
    builder.store(builder.fadd(builder.load(pa, align=4), step, flags=_FAST), pa, align=4)


@intrinsic
def dots8(typingctx, acc, q, qo, k, at, b, c):
    """acc[8 j:8 j + 8] += q[qo + c:][:8] * k.flat[at[b + j] + c:][:8] for j in 0..7: one
    8-lane step of the dot products of q with the keys of eight positions (k a C-contiguous
    float32 array of any shape, at an int64 array of flat offsets into it)."""
    sig = types.void(acc, q, qo, k, at, b, c)

    def codegen(context, builder, signature, args):
        acc_, q_, qo_, k_, at_, b_, c_ = args
        a_data = _data(context, builder, signature.args[0], acc_)
        k_data = _data(context, builder, signature.args[3], k_)
        at_data = _data(context, builder, signature.args[4], at_)
        qv = builder.load(_element_ptr(context, builder, signature.args[1], q_,
                                       builder.add(qo_, c_), _V8F), align=4)
        for j in range(8):
            o = builder.load(builder.gep(at_data, [builder.add(b_, ir.Constant(b_.type, j))]))
            kp = builder.bitcast(builder.gep(k_data, [builder.add(o, c_)]), _V8F.as_pointer())
            _add8(builder, _acc8(builder, a_data, j),
                  builder.fmul(qv, builder.load(kp, align=4), flags=_FAST))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def sums8(typingctx, acc, out, oo):
    """out[oo + j] = the sum of the eight lanes acc[8 j:8 j + 8], for j in 0..7 (pairwise
    adds of shuffled halves: seven vector adds for the eight sums)."""
    sig = types.void(acc, out, oo)

    def codegen(context, builder, signature, args):
        acc_, out_, oo_ = args
        a_data = _data(context, builder, signature.args[0], acc_)
        v = [builder.load(_acc8(builder, a_data, j), align=4) for j in range(8)]

        def fold(a, b, even, odd):
            lo = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 8), even))
            hi = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 8), odd))
            return builder.fadd(lo, hi, flags=_FAST)

        # lanes of each step: pairs of adjacent lanes, then pairs of pairs, then halves
        v = [fold(v[i], v[i + 1], [0, 8, 2, 10, 4, 12, 6, 14], [1, 9, 3, 11, 5, 13, 7, 15])
             for i in range(0, 8, 2)]  # [a01, b01, a23, b23, a45, b45, a67, b67] of a, b
        v = [fold(v[i], v[i + 1], [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15])
             for i in range(0, 4, 2)]  # [a0-3, b0-3, c0-3, d0-3, a4-7, b4-7, c4-7, d4-7]
        total = fold(v[0], v[1], [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])
        builder.store(total, _element_ptr(context, builder, signature.args[1], out_, oo_, _V8F),
                      align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def axpy8s(typingctx, acc, w, v, vo, chunks):
    """acc[8 j:8 j + 8] += w * v.flat[vo + 8 j:][:8] for j < chunks (the literal 1 or 8):
    one position's value, weighted, into up to 64 output columns (v a C-contiguous float32
    array of any shape)."""
    if not isinstance(chunks, types.IntegerLiteral) or chunks.literal_value not in (1, 8):
        raise errors.TypingError("chunks must be the literal 1 or 8")
    n = chunks.literal_value
    sig = types.void(acc, types.float32, v, vo, chunks)

    def codegen(context, builder, signature, args):
        acc_, w_, v_, vo_, _ = args
        a_data = _data(context, builder, signature.args[0], acc_)
        v_data = _data(context, builder, signature.args[2], v_)
        wv = _splat8(builder, w_)
        for j in range(n):
            vp = builder.bitcast(builder.gep(v_data, [builder.add(vo_, ir.Constant(vo_.type,
                                                                                  8 * j))]),
                                 _V8F.as_pointer())
            _add8(builder, _acc8(builder, a_data, j),
                  builder.fmul(wv, builder.load(vp, align=4), flags=_FAST))
        return context.get_dummy_value()

    return sig, codegen
