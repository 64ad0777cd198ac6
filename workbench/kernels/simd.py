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
- `dot16(acc, a, ao, b, bo)`: acc[j] += a[ao + j] * b[bo + j], j in 0..15 (float32).
- `axpy16(y, yo, w, x, xo)`: y[yo + j] += w * x[xo + j], j in 0..15 (float32; the
  attention's weighted sum of values).
- `half_at(w, r, o)`: the IEEE half at bytes o, o + 1 of row r of the 2-D
  uint8 array w, as float32 (a block's scale): a 2-byte load and one
  conversion, where a lookup in a 65536-entry table would evict the weights
  from the L1/L2 caches.
- `f32_from_bits(i)`: the float32 whose bit pattern is the int32 `i` (for
  building powers of two in `layers.exp_neg`).

No bounds are checked: callers pass offsets inside their arrays.

Numba's on-disk cache of a kernel is invalidated by changes to the kernel's own
file only: after editing this module, clear `__pycache__` (or touch `cpu.py`).
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.numpy_support import carray

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_V16F = ir.VectorType(_F32, 16)
_V16I8 = ir.VectorType(ir.IntType(8), 16)
_V16I32 = ir.VectorType(_I32, 16)
_FAST = ("reassoc", "contract")  # as the kernels' fastmath: reorder, fuse multiply-adds


@intrinsic
def _stack16(typingctx):
    def codegen(context, builder, signature, args):
        ptr = cgutils.alloca_once(builder, _F32, size=context.get_constant(types.intp, 16))
        builder.store(ir.Constant(_V16F, [0.0] * 16), builder.bitcast(ptr, _V16F.as_pointer()))
        return ptr

    return types.CPointer(types.float32)(), codegen


def _element_ptr(context, builder, aryty, ary, index, vec_type):
    """Pointer to ary[index] (a 1-D contiguous array), cast to a pointer to `vec_type`."""
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.bitcast(builder.gep(data, [index]), vec_type.as_pointer())


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


@intrinsic
def nib16_hb(typingctx, acc, w, off, x, xlo, xhi, d, qh):
    sig = types.void(acc, w, off, x, xlo, xhi, types.float32, types.int32)

    def codegen(context, builder, signature, args):
        lo, hi = _nibbles(builder, context, signature.args[1], args[1], args[2])
        bits = builder.shuffle_vector(
            builder.insert_element(ir.Constant(_V16I32, ir.Undefined), args[7],
                                   ir.Constant(_I32, 0)),
            ir.Constant(_V16I32, ir.Undefined), ir.Constant(_V16I32, [0] * 16))
        zero = ir.Constant(_V16I32, [0] * 16)
        sixteen = ir.Constant(_V16I32, [16] * 16)
        lo = builder.add(lo, builder.select(
            builder.icmp_unsigned("!=", builder.and_(bits, _LOW_BITS), zero), sixteen, zero))
        hi = builder.add(hi, builder.select(
            builder.icmp_unsigned("!=", builder.and_(bits, _HIGH_BITS), zero), sixteen, zero))
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


@intrinsic
def q6k16(typingctx, acc, w, lo, ho, x, x0, d0, d1, d2, d3):
    sig = types.void(acc, w, lo, ho, x, x0, types.float32, types.float32, types.float32,
                     types.float32)

    def codegen(context, builder, signature, args):
        acc_, w_, lo_, ho_, x_, x0_ = args[:6]
        wty, xty = signature.args[1], signature.args[4]

        def load_bytes(offset):
            ptr = _element_ptr(context, builder, wty, w_, offset, _V16I8)
            return builder.zext(builder.load(ptr, align=1), _V16I32)

        def const(v):
            return ir.Constant(_V16I32, [v] * 16)

        a = load_bytes(lo_)
        c = load_bytes(builder.add(lo_, ir.Constant(lo_.type, 32)))
        h = load_bytes(ho_)
        and_, or_, shl, lshr = builder.and_, builder.or_, builder.shl, builder.lshr
        quads = [  # the four runs' 6-bit values, each (low 4 bits) | (high 2 bits) << 4
            or_(and_(a, const(15)), shl(and_(h, const(3)), const(4))),
            or_(and_(c, const(15)), shl(and_(h, const(12)), const(2))),
            or_(lshr(a, const(4)), and_(h, const(48))),
            or_(lshr(c, const(4)), lshr(and_(h, const(192)), const(2))),
        ]
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
def half16(typingctx, acc, h, off, x, xo):
    sig = types.void(acc, h, off, x, xo)

    def codegen(context, builder, signature, args):
        acc_, h_, off_, x_, xo_ = args
        w = _halves(context, builder, signature.args[1], h_, off_)
        xv = _floats(context, builder, signature.args[3], x_, xo_)
        _add_into(context, builder, signature.args[0], acc_, _ZERO,
                  builder.fmul(w, xv, flags=_FAST))
        return context.get_dummy_value()

    return sig, codegen


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


@intrinsic
def dot16(typingctx, acc, a, ao, b, bo):
    sig = types.void(acc, a, ao, b, bo)

    def codegen(context, builder, signature, args):
        acc_, a_, ao_, b_, bo_ = args
        av = _floats(context, builder, signature.args[1], a_, ao_)
        bv = _floats(context, builder, signature.args[3], b_, bo_)
        _add_into(context, builder, signature.args[0], acc_, _ZERO,
                  builder.fmul(av, bv, flags=_FAST))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def axpy16(typingctx, y, yo, w, x, xo):
    sig = types.void(y, yo, w, x, xo)

    def codegen(context, builder, signature, args):
        y_, yo_, w_, x_, xo_ = args
        xv = _floats(context, builder, signature.args[3], x_, xo_)
        _add_into(context, builder, signature.args[0], y_, yo_,
                  builder.fmul(_splat(builder, w_), xv, flags=_FAST))
        return context.get_dummy_value()

    return sig, codegen


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
