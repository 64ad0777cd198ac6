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
  array); LLVM keeps it in a register across the block loop.
- `nib16(acc, w, off, x, xlo, xhi, dlo, dhi)`: for j in 0..15, with
  v = w[off + j]: acc[j] += dlo * (v & 15) * x[xlo + j] + dhi * (v >> 4) * x[xhi + j].
- `nib16_1(acc, w, off, x, xlo, xhi, d)`: `nib16` with dlo = dhi = d, the scale
  applied once to the sum (Q4_0, Q4_1).
- `nib16_hb(acc, w, off, x, xlo, xhi, d, qh)`: the same with 5-bit weights
  (Q5_0/Q5_1) and dlo = dhi = d: bit j of `qh` adds 16 to the low nibble of
  byte j, bit 16 + j to its high nibble.
- `q8x32(acc, w, off, x, xo, d)`: 32 signed bytes (Q8_0): for j in 0..15,
  acc[j] += d * (w[off + j] * x[xo + j] + w[off + 16 + j] * x[xo + 16 + j]),
  w an int8 array.
- `q6k16(acc, w, lo, ho, x, x0, d0, d1, d2, d3)`: 64 weights of a Q6_K
  super-block, 16 from each of its four 32-weight runs: with a = w[lo + j],
  c = w[lo + 32 + j], h = w[ho + j], the unsigned 6-bit values
  (a & 15 | (h & 3) << 4), (c & 15 | (h >> 2 & 3) << 4),
  (a >> 4 | (h >> 4 & 3) << 4), (c >> 4 | (h >> 6) << 4) times
  x[x0 + j], x[x0 + 32 + j], x[x0 + 64 + j], x[x0 + 96 + j], scaled by d0..d3.
  (The -32 offset is the caller's, through sums of x.)
- `deq16(out, oo, w, off, offset, d, m)`: 32 weights from 16 bytes of
  nibbles: out[oo + j] = (lo_j - offset) * d + m and out[oo + 16 + j] =
  (hi_j - offset) * d + m, rounded step by step (no fused multiply-add), so
  bit-identical to the scalar reference (Q4_0: offset 8, m = -0.0; Q4_1:
  offset 0 and its min m).
- `half16(acc, h, off, x, xo)`: acc[j] += float(h[off + j]) * x[xo + j] for
  j in 0..15, h holding IEEE half-precision bit patterns (uint16): LLVM's
  `fpext` from half, one instruction per 8 or 16 lanes where the CPU converts
  halves (F16C on x86, NEON on ARM).
- `half16_store(out, oo, h, off)`: out[oo + j] = float(h[off + j]), j in 0..15.
- `half_at(w, r, o)`: the IEEE half at bytes o, o + 1 of row r of the 2-D
  uint8 array w, as float32 (a block's scale): a 2-byte load and one
  conversion, where a lookup in a 65536-entry table would evict the weights
  from the L1/L2 caches.
- `f32_from_bits(i)`: the float32 whose bit pattern is the int32 `i` (for
  building powers of two in `layers.exp_neg`).

Multi-row steps (batched decoding, `cpu._rows`): the block's weights are
unpacked to floats once, `w = q * a + c` with a block's scale `a` and offset or
min `c`, and multiplied with `rows` (the literal 4 or 8) rows of x at once:
acc[8 t : 8 t + 8] += products with x[t * stride + ...] for t < rows, `acc` a
(64,) `stack_f32x64()` of eight 8-lane accumulators, one per row of x, kept in
registers across the block loop (the caller sums each one's lanes).

- `nib_rows(acc, w, off, x, xlo, xhi, stride, alo, clo, ahi, chi, rows)`: the
  16 bytes w[off:off + 16]: weight j of the low nibbles (v & 15) * alo + clo
  meets x[xlo + j], of the high ones (v >> 4) * ahi + chi meets x[xhi + j].
- `nib_hb_rows(acc, w, off, x, xlo, xhi, stride, a, c, qh, rows)`: the same for
  5-bit weights (Q5_0/Q5_1, bits of `qh` as in `nib16_hb`), one scale and offset.
- `q8_rows(acc, w, off, x, xo, stride, a, rows)`: 32 signed bytes (w int8),
  weight j is w[off + j] * a, meeting x[xo + j].
- `q6k_rows(acc, w, lo, ho, x, x0, stride, a0, a1, a2, a3, rows)`: the 64
  weights of `q6k16`, run i as (q - 32) * ai.

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


_stack16, _stack64 = _zeroed_stack(16), _zeroed_stack(64)


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


def _accumulate(builder, context, sig, args, lo, hi, one_scale=False):
    """acc += dlo * lo * x[xlo:] + dhi * hi * x[xhi:] (lo, hi: <16 x float>). With
    `one_scale` (dlo and dhi the same value) the scale multiplies the sum once:
    acc += d * (lo * x[xlo:] + hi * x[xhi:]), two vector operations fewer per step."""
    acc, _, _, x, xlo, xhi, dlo, dhi = args
    pacc = _element_ptr(context, builder, sig.args[0], acc, ir.Constant(ir.IntType(64), 0), _V16F)
    px_lo = _element_ptr(context, builder, sig.args[3], x, xlo, _V16F)
    px_hi = _element_ptr(context, builder, sig.args[3], x, xhi, _V16F)
    a = builder.fmul(lo, builder.load(px_lo, align=4), flags=_FAST)
    b = builder.fmul(hi, builder.load(px_hi, align=4), flags=_FAST)
    if one_scale:
        step = builder.fmul(builder.fadd(a, b, flags=_FAST), _splat(builder, dlo), flags=_FAST)
    else:
        step = builder.fadd(builder.fmul(a, _splat(builder, dlo), flags=_FAST),
                            builder.fmul(b, _splat(builder, dhi), flags=_FAST), flags=_FAST)
    # the add into acc has no fast flags: LLVM then keeps one add on the loop-carried
    # path instead of chaining both products into it (half the latency per block)
    builder.store(builder.fadd(builder.load(pacc, align=4), step), pacc, align=4)


def _nibbles(builder, context, wty, w, off):
    """The 16 bytes w[off:off + 16] (w of Numba type wty) as (low nibbles, high nibbles),
    <16 x i32> each."""
    q = builder.zext(builder.load(_element_ptr(context, builder, wty, w, off, _V16I8),
                                  align=1), _V16I32)
    return (builder.and_(q, ir.Constant(_V16I32, [15] * 16)),
            builder.lshr(q, ir.Constant(_V16I32, [4] * 16)))


@intrinsic
def nib16(typingctx, acc, w, off, x, xlo, xhi, dlo, dhi):
    sig = types.void(acc, w, off, x, xlo, xhi, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        lo, hi = _nibbles(builder, context, signature.args[1], args[1], args[2])
        _accumulate(builder, context, signature, args,
                    builder.uitofp(lo, _V16F), builder.uitofp(hi, _V16F))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def nib16_1(typingctx, acc, w, off, x, xlo, xhi, d):
    sig = types.void(acc, w, off, x, xlo, xhi, types.float32)

    def codegen(context, builder, signature, args):
        lo, hi = _nibbles(builder, context, signature.args[1], args[1], args[2])
        _accumulate(builder, context, signature, list(args) + [args[6]],
                    builder.uitofp(lo, _V16F), builder.uitofp(hi, _V16F), one_scale=True)
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
def nib16_hb(typingctx, acc, w, off, x, xlo, xhi, d, qh):
    sig = types.void(acc, w, off, x, xlo, xhi, types.float32, types.int32)

    def codegen(context, builder, signature, args):
        lo, hi = _five_bits(builder, *_nibbles(builder, context, signature.args[1], args[1],
                                                args[2]), args[7])
        new_args = list(args[:7]) + [args[6]]  # dlo = dhi = d
        _accumulate(builder, context, signature, new_args,
                    builder.uitofp(lo, _V16F), builder.uitofp(hi, _V16F), one_scale=True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def q8x32(typingctx, acc, w, off, x, xo, d):
    sig = types.void(acc, w, off, x, xo, types.float32)

    def codegen(context, builder, signature, args):
        acc_, w_, off_, x_, xo_, d_ = args

        def weights(o):  # 16 int8 at w[o:] as <16 x float>
            ptr = _element_ptr(context, builder, signature.args[1], w_, o, _V16I8)
            return builder.sitofp(builder.load(ptr, align=1), _V16F)

        sixteen = ir.Constant(off_.type, 16)
        lo, hi = weights(off_), weights(builder.add(off_, sixteen))
        _accumulate(builder, context, signature,
                    [acc_, w_, off_, x_, xo_, builder.add(xo_, sixteen), d_, d_],
                    lo, hi, one_scale=True)
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
def q6k16(typingctx, acc, w, lo, ho, x, x0, d0, d1, d2, d3):
    sig = types.void(acc, w, lo, ho, x, x0, types.float32, types.float32, types.float32,
                     types.float32)

    def codegen(context, builder, signature, args):
        acc_, w_, lo_, ho_, x_, x0_ = args[:6]
        xty = signature.args[4]
        quads = _q6k_values(builder, context, signature.args[1], w_, lo_, ho_)
        total = None
        for i, q in enumerate(quads):
            px = _element_ptr(context, builder, xty, x_,
                              builder.add(x0_, ir.Constant(x0_.type, 32 * i)), _V16F)
            term = builder.fmul(builder.fmul(builder.uitofp(q, _V16F), builder.load(px, align=4),
                                             flags=_FAST), _splat(builder, args[6 + i]),
                                flags=_FAST)
            total = term if total is None else builder.fadd(total, term, flags=_FAST)
        pacc = _element_ptr(context, builder, signature.args[0], acc_,
                            ir.Constant(ir.IntType(64), 0), _V16F)
        builder.store(builder.fadd(builder.load(pacc, align=4), total), pacc, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def deq16(typingctx, out, oo, w, off, offset, d, m):
    sig = types.void(out, oo, w, off, types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        out_, oo_, w_, off_, offset_, d_, m_ = args
        lo, hi = _nibbles(builder, context, signature.args[2], w_, off_)
        sub, dv, mv = _splat(builder, offset_), _splat(builder, d_), _splat(builder, m_)
        for q, o in ((lo, oo_), (hi, builder.add(oo_, ir.Constant(oo_.type, 16)))):
            v = builder.fadd(builder.fmul(builder.fsub(builder.uitofp(q, _V16F), sub), dv), mv)
            builder.store(v, _element_ptr(context, builder, signature.args[0], out_, o, _V16F),
                          align=4)
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
    """Eight zeroed 8-lane accumulators, (64,) float32 on the stack, for the `*_rows`
    steps (only inside @njit code)."""
    return carray(_stack64(), (64,))


# -- multi-row steps -------------------------------------------------------------------------


def _literal_rows(rows) -> int:
    if not isinstance(rows, types.IntegerLiteral) or rows.literal_value not in (4, 8):
        raise errors.TypingError("rows must be the literal 4 or 8")
    return rows.literal_value


def _rows_fma(context, builder, sig, acc, x, stride, rows, weights, x_arg=3):
    """acc[8 t:8 t + 8] += sum over (w, xo) in `weights` of w * x[xo + t * stride:][:16],
    t < rows; each w a <16 x float> of dequantized weights, taken as two 8-lane halves.
    The products of a row are summed first and added to its accumulator last, so that
    one add per block is on the loop-carried path."""
    aty, xty = sig.args[0], sig.args[x_arg]
    acc_data = context.make_array(aty)(context, builder, acc).data
    x_data = context.make_array(xty)(context, builder, x).data
    halves = []
    for w, xo in weights:
        for h in (0, 8):
            part = builder.shuffle_vector(w, w, ir.Constant(ir.VectorType(_I32, 8),
                                                            list(range(h, h + 8))))
            halves.append((part, builder.add(xo, ir.Constant(xo.type, h))))
    for t in range(rows):
        row = builder.mul(stride, ir.Constant(stride.type, t))
        total = None
        for part, xo in halves:
            ptr = builder.bitcast(builder.gep(x_data, [builder.add(xo, row)]), _V8F.as_pointer())
            term = builder.fmul(part, builder.load(ptr, align=4), flags=_FAST)
            total = term if total is None else builder.fadd(total, term, flags=_FAST)
        pa = builder.bitcast(builder.gep(acc_data, [ir.Constant(ir.IntType(64), 8 * t)]),
                             _V8F.as_pointer())
        builder.store(builder.fadd(builder.load(pa, align=4), total), pa, align=4)


def _scaled(builder, q, a, c):
    """q * a + c for <16 x i32> q (unsigned) and float32 scalars a, c."""
    return builder.fadd(builder.fmul(builder.uitofp(q, _V16F), _splat(builder, a),
                                     flags=_FAST), _splat(builder, c), flags=_FAST)


@intrinsic
def nib_rows(typingctx, acc, w, off, x, xlo, xhi, stride, alo, clo, ahi, chi, rows):
    n = _literal_rows(rows)
    f = types.float32
    sig = types.void(acc, w, off, x, xlo, xhi, stride, f, f, f, f, rows)

    def codegen(context, builder, signature, args):
        acc_, w_, off_, x_, xlo_, xhi_, stride_, alo_, clo_, ahi_, chi_, _ = args
        lo, hi = _nibbles(builder, context, signature.args[1], w_, off_)
        _rows_fma(context, builder, signature, acc_, x_, stride_, n,
                  [(_scaled(builder, lo, alo_, clo_), xlo_),
                   (_scaled(builder, hi, ahi_, chi_), xhi_)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def nib_hb_rows(typingctx, acc, w, off, x, xlo, xhi, stride, a, c, qh, rows):
    n = _literal_rows(rows)
    sig = types.void(acc, w, off, x, xlo, xhi, stride, types.float32, types.float32,
                     types.int32, rows)

    def codegen(context, builder, signature, args):
        acc_, w_, off_, x_, xlo_, xhi_, stride_, a_, c_, qh_, _ = args
        lo, hi = _five_bits(builder, *_nibbles(builder, context, signature.args[1], w_, off_),
                            qh_)
        _rows_fma(context, builder, signature, acc_, x_, stride_, n,
                  [(_scaled(builder, lo, a_, c_), xlo_), (_scaled(builder, hi, a_, c_), xhi_)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def q8_rows(typingctx, acc, w, off, x, xo, stride, a, rows):
    n = _literal_rows(rows)
    sig = types.void(acc, w, off, x, xo, stride, types.float32, rows)

    def codegen(context, builder, signature, args):
        acc_, w_, off_, x_, xo_, stride_, a_, _ = args
        av = _splat(builder, a_)
        weights = []
        for h in (0, 16):
            ptr = _element_ptr(context, builder, signature.args[1], w_,
                               builder.add(off_, ir.Constant(off_.type, h)), _V16I8)
            q = builder.sitofp(builder.load(ptr, align=1), _V16F)
            weights.append((builder.fmul(q, av, flags=_FAST),
                            builder.add(xo_, ir.Constant(xo_.type, h))))
        _rows_fma(context, builder, signature, acc_, x_, stride_, n, weights)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def q6k_rows(typingctx, acc, w, lo, ho, x, x0, stride, a0, a1, a2, a3, rows):
    n = _literal_rows(rows)
    f = types.float32
    sig = types.void(acc, w, lo, ho, x, x0, stride, f, f, f, f, rows)

    def codegen(context, builder, signature, args):
        acc_, w_, lo_, ho_, x_, x0_, stride_ = args[:7]
        quads = _q6k_values(builder, context, signature.args[1], w_, lo_, ho_)
        weights = []
        for i, q in enumerate(quads):
            a = args[7 + i]
            c = builder.fmul(a, ir.Constant(_F32, -32.0))
            weights.append((_scaled(builder, q, a, c),
                            builder.add(x0_, ir.Constant(x0_.type, 32 * i))))
        _rows_fma(context, builder, signature, acc_, x_, stride_, n, weights, x_arg=4)
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
