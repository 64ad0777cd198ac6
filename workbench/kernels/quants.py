"""NumPy reference dequantizers for the GGML weight formats found in GGUF files.

Every function here is plain, vectorized NumPy and gives float32 values that are
bit-identical to `gguf.quants.dequantize` (the tests check this on random
blocks of every type). Float operations are done in the same order as the
reference so that each weight is the same float32 (e.g. Q4_K is
`(d * sc) * q - dmin * m`, two rounded products and a rounded difference).

Block layouts (one block = `block_size(qtype)` weights in `type_size` bytes;
all fp16 fields little-endian; "nibble j" of a 16-byte run means
low nibbles for weights 0..15 and high nibbles for weights 16..31):

- Q8_0 (32 w, 34 B): d fp16, 32 x int8.                      w = d * q
- Q4_0 (32 w, 18 B): d fp16, 16 B nibbles.                    w = d * (q - 8)
- Q4_1 (32 w, 20 B): d fp16, m fp16, 16 B nibbles.            w = d * q + m
- Q5_0 (32 w, 22 B): d fp16, qh u32 (bit j = 5th bit of weight j), 16 B nibbles.
                                                              w = d * (q - 16)
- Q5_1 (32 w, 24 B): d fp16, m fp16, qh u32, 16 B nibbles.    w = d * q + m
- Q2_K (256 w, 84 B): 16 B scales (low nibble scale, high nibble min of each
  16-weight sub-block), 64 B of 2-bit quants, d fp16, dmin fp16.
  Weight 128*h + 32*s + l is bits 2s..2s+1 of byte 32*h + l.
                                                w = (d * sc) * q - dmin * mn
- Q3_K (256 w, 110 B): 32 B hmask, 64 B 2-bit quants (as Q2_K), 12 B packed
  6-bit scales, d fp16. Weight 32*k + l takes bit k of hmask[l]; when that bit
  is 0 the quant is lowered by 4.              w = (d * (sc - 32)) * q
- Q4_K (256 w, 144 B): d fp16, dmin fp16, 12 B packed 6-bit scales/mins for
  eight 32-weight sub-blocks, 128 B nibbles: weight 64*c + 32*h + l is nibble h
  of byte 32*c + l.                            w = (d * sc) * q - dmin * mn
- Q5_K (256 w, 176 B): like Q4_K plus 32 B qh before the nibbles; weight
  32*k + l takes bit k of qh[l] as its 5th bit.
- Q6_K (256 w, 210 B): 128 B low nibbles, 64 B high 2-bit pairs, 16 x int8
  scales (one per 16 weights), d fp16. Weight 128*h + 64*n + m has low nibble
  n of byte 64*h + m and high bits 2s..2s+1 of byte 32*h + l where
  32*s + l = 64*n + m.                         w = (d * sc) * (q - 32)
- F32, F16, BF16: plain floats (BF16 = upper 16 bits of a float32).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from workbench.kernels.formats import FORMATS

Q = GGMLQuantizationType
QK_K = 256

__all__ = [
    "SUPPORTED_TYPES",
    "UnsupportedQuantError",
    "block_size",
    "type_size",
    "row_bytes",
    "check_supported",
    "dequantize",
    "dequantize_blocks",
]


class UnsupportedQuantError(ValueError):
    """A tensor uses a GGML type that workbench cannot dequantize."""


def _fp16(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Two uint8 columns (little-endian halves) -> float32 values of the fp16."""
    bits = lo.astype(np.uint16) | (hi.astype(np.uint16) << np.uint16(8))
    return bits.view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """(n, run*g) packed bytes -> (n, 2*run*g) uint8: per run of bytes, low nibbles then high."""
    n = qs.shape[0]
    runs = qs.reshape(n, -1, 1, run)  # (n, g, 1, run)
    q = (runs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
    return q.reshape(n, -1)  # (n, g * 2 * run)


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """(n, 4) bytes of a little-endian u32 -> (n, 32) uint8 with bit j of it."""
    n = qh.shape[0]
    bits = np.unpackbits(qh, axis=1, bitorder="little")  # (n, 32), bit j of the u32
    return bits.reshape(n, 32)


def _deq_q8_0(b: np.ndarray) -> np.ndarray:
    d = _fp16(b[:, 0], b[:, 1])[:, None]  # (n, 1)
    q = b[:, 2:].view(np.int8).astype(np.float32)  # (n, 32)
    return q * d


def _deq_q4_0(b: np.ndarray) -> np.ndarray:
    d = _fp16(b[:, 0], b[:, 1])[:, None]
    q = _nibbles(b[:, 2:18], 16).astype(np.int8) - np.int8(8)
    return d * q.astype(np.float32)


def _deq_q4_1(b: np.ndarray) -> np.ndarray:
    d = _fp16(b[:, 0], b[:, 1])[:, None]
    m = _fp16(b[:, 2], b[:, 3])[:, None]
    q = _nibbles(b[:, 4:20], 16).astype(np.float32)
    return d * q + m


def _deq_q5_0(b: np.ndarray) -> np.ndarray:
    d = _fp16(b[:, 0], b[:, 1])[:, None]
    q = _nibbles(b[:, 6:22], 16) | (_high_bits32(b[:, 2:6]) << np.uint8(4))
    return d * (q.astype(np.int8) - np.int8(16)).astype(np.float32)


def _deq_q5_1(b: np.ndarray) -> np.ndarray:
    d = _fp16(b[:, 0], b[:, 1])[:, None]
    m = _fp16(b[:, 2], b[:, 3])[:, None]
    q = _nibbles(b[:, 8:24], 16) | (_high_bits32(b[:, 4:8]) << np.uint8(4))
    return d * q.astype(np.float32) + m


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """(n, 64) bytes of 2-bit fields -> (n, 256): weight 128h+32s+l = bits 2s of byte 32h+l."""
    n = qs.shape[0]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = (qs.reshape(n, 2, 1, 32) >> shifts) & np.uint8(3)  # (n, 2, 4, 32)
    return q.reshape(n, QK_K)


def _bitplanes(h: np.ndarray) -> np.ndarray:
    """(n, 32) bytes -> (n, 256) bits: weight 32k + l is bit k of byte l."""
    n = h.shape[0]
    shifts = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return ((h.reshape(n, 1, 32) >> shifts) & np.uint8(1)).reshape(n, QK_K)  # (n, 8*32)


def _deq_q2_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    scales = b[:, 0:16]
    d = _fp16(b[:, 80], b[:, 81])[:, None]
    dmin = _fp16(b[:, 82], b[:, 83])[:, None]
    dl = (d * (scales & np.uint8(0x0F)).astype(np.float32))[:, :, None]  # (n, 16, 1)
    ml = (dmin * (scales >> np.uint8(4)).astype(np.float32))[:, :, None]
    q = _crumbs(b[:, 16:80]).astype(np.float32).reshape(n, 16, 16)  # (n, sub-block, 16)
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k_scales(s: np.ndarray) -> np.ndarray:
    """(n, 12) packed bytes -> (n, 16) signed 6-bit scales (already minus 32), int8."""
    low = np.concatenate([s[:, 0:8] & np.uint8(0x0F), s[:, 0:8] >> np.uint8(4)], axis=1)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)
    high = ((s[:, 8:12].reshape(-1, 1, 4) >> shifts) & np.uint8(3)).reshape(-1, 16)  # (n, 4*4)
    return (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)


def _deq_q3_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d = _fp16(b[:, 108], b[:, 109])[:, None]
    dl = (d * _q3_k_scales(b[:, 96:108]).astype(np.float32))[:, :, None]  # (n, 16, 1)
    low = _crumbs(b[:, 32:96]).astype(np.int8)
    missing_high = (_bitplanes(b[:, 0:32]) ^ np.uint8(1)).astype(np.int8) << np.int8(2)
    q = (low - missing_high).astype(np.float32).reshape(n, 16, 16)
    return (dl * q).reshape(n, QK_K)


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, 12) packed bytes of Q4_K/Q5_K -> (scales, mins), each (n, 8) uint8 of 6 bits."""
    a, m, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    low6, low4, top2 = np.uint8(63), np.uint8(0x0F), np.uint8(0x30)
    sc = np.concatenate([a & low6, (hi & low4) | ((a >> np.uint8(2)) & top2)], axis=1)
    mn = np.concatenate([m & low6, (hi >> np.uint8(4)) | ((m >> np.uint8(2)) & top2)], axis=1)
    return sc, mn


def _k_sub_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K blocks (n, type_size) -> the 8 sub-block scales d * sc and mins
    dmin * m, each (n, 8, 1) float32."""
    d = _fp16(b[:, 0], b[:, 1])[:, None]
    dmin = _fp16(b[:, 2], b[:, 3])[:, None]
    sc, mn = _k_scale_min(b[:, 4:16])
    return (d * sc.astype(np.float32))[:, :, None], (dmin * mn.astype(np.float32))[:, :, None]


def _deq_q4_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    dl, ml = _k_sub_scales(b)
    q = _nibbles(b[:, 16:144], 32).astype(np.float32).reshape(n, 8, 32)
    return (dl * q - ml).reshape(n, QK_K)


def _deq_q5_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    dl, ml = _k_sub_scales(b)
    q = _nibbles(b[:, 48:176], 32) | (_bitplanes(b[:, 16:48]) << np.uint8(4))
    q = q.astype(np.float32).reshape(n, 8, 32)
    return (dl * q - ml).reshape(n, QK_K)


def _deq_q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d = _fp16(b[:, 208], b[:, 209])[:, None]
    dl = (d * b[:, 192:208].view(np.int8).astype(np.float32))[:, :, None]  # (n, 16, 1)
    low = _nibbles(b[:, 0:128], 64)  # (n, 256)
    high = _crumbs(b[:, 128:192])  # (n, 256)
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    return (dl * q.astype(np.float32).reshape(n, 16, 16)).reshape(n, QK_K)


# The NumPy dequantizer of each block format, `_deq_<name>` above (see `formats`).
_BLOCK_DEQUANTIZERS = {f.qtype: globals()[f"_deq_{f.name}"]
                       for f in FORMATS if f.block_weights > 1}

FLOAT_TYPES: tuple[GGMLQuantizationType, ...] = tuple(
    f.qtype for f in FORMATS if f.block_weights == 1)
SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = tuple(f.qtype for f in FORMATS)

# Blocks dequantized per NumPy pass: bounds the temporaries to a few MiB.
_CHUNK_WEIGHTS = 1 << 20


def check_supported(qtype: GGMLQuantizationType | int) -> GGMLQuantizationType:
    """Return `qtype` as a `GGMLQuantizationType`, or raise `UnsupportedQuantError`."""
    try:
        qtype = GGMLQuantizationType(qtype)
    except ValueError:
        raise UnsupportedQuantError(
            f"unknown GGML type id {qtype!r}; supported types: "
            + ", ".join(t.name for t in SUPPORTED_TYPES)
        ) from None
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedQuantError(
            f"GGML type {qtype.name} is not supported by workbench; supported types: "
            + ", ".join(t.name for t in SUPPORTED_TYPES)
            + ". Re-quantize the model to one of these (e.g. Q4_K_M or Q8_0)."
        )
    return qtype


def block_size(qtype: GGMLQuantizationType | int) -> int:
    """Weights per block of `qtype` (1 for F32/F16/BF16, 32 for Q*_0/1, 256 for K-quants)."""
    return GGML_QUANT_SIZES[check_supported(qtype)][0]


def type_size(qtype: GGMLQuantizationType | int) -> int:
    """Bytes per block of `qtype`."""
    return GGML_QUANT_SIZES[check_supported(qtype)][1]


def row_bytes(qtype: GGMLQuantizationType | int, n_cols: int) -> int:
    """Bytes taken by one row of `n_cols` weights of `qtype` (n_cols a multiple of the block)."""
    bs, ts = GGML_QUANT_SIZES[check_supported(qtype)]
    if n_cols % bs:
        raise ValueError(f"row length {n_cols} is not a multiple of the "
                         f"{GGMLQuantizationType(qtype).name} block size {bs}")
    return n_cols // bs * ts


def dequantize_blocks(blocks: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Dequantize whole blocks of a quantized type.

    blocks: (n_blocks, type_size) uint8 -> (n_blocks, block_size) float32.
    """
    qtype = check_supported(qtype)
    if qtype in FLOAT_TYPES:
        raise ValueError(f"{qtype.name} has no blocks; use dequantize()")
    return _BLOCK_DEQUANTIZERS[qtype](np.ascontiguousarray(blocks, dtype=np.uint8))


def _as_bytes(raw: np.ndarray) -> np.ndarray:
    """Any-dtype C-contiguous array -> its bytes, last axis scaled by the itemsize."""
    raw = np.ascontiguousarray(raw)
    if raw.ndim == 0:
        raw = raw.reshape(1)
    return raw.view(np.uint8)  # (..., last * itemsize)


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Dequantize a GGUF tensor's data to float32.

    raw: the tensor's data as `gguf.GGUFReader` (or `workbench.engine.formats.gguf`) gives
        it: for quantized types uint8 of shape (..., bytes_per_row); for F32/F16
        typed arrays (..., cols) or their bytes; for BF16 uint8 (..., 2 * cols) or
        uint16/int16 (..., cols).
    qtype: the tensor's `GGMLQuantizationType`.

    Returns float32 of shape (..., cols), i.e. (rows, cols) for a matrix.
    Raises `UnsupportedQuantError` for types outside `SUPPORTED_TYPES`.
    """
    qtype = check_supported(qtype)
    if qtype == Q.F32:
        if raw.dtype == np.float32:
            return np.array(raw, dtype=np.float32, copy=True)
        return _as_bytes(raw).view(np.float32).copy()
    if qtype == Q.F16:
        if raw.dtype == np.float16:
            return raw.astype(np.float32)
        return _as_bytes(raw).view(np.float16).astype(np.float32)
    if qtype == Q.BF16:
        bits = _as_bytes(raw).view(np.uint16)  # (..., cols)
        return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)

    bs, ts = GGML_QUANT_SIZES[qtype]
    data = _as_bytes(raw)
    if data.shape[-1] % ts:
        raise ValueError(f"{qtype.name} data has {data.shape[-1]} bytes per row, "
                         f"not a multiple of its {ts}-byte block")
    out_shape = (*data.shape[:-1], data.shape[-1] // ts * bs)
    blocks = data.reshape(-1, ts)  # (n_blocks, type_size)
    out = np.empty((blocks.shape[0], bs), dtype=np.float32)  # (n_blocks, block_size)
    step = max(1, _CHUNK_WEIGHTS // bs)
    fn = _BLOCK_DEQUANTIZERS[qtype]
    for i in range(0, blocks.shape[0], step):
        out[i : i + step] = fn(blocks[i : i + step])
    return out.reshape(out_shape)


# -- affine groups of 32: value = scale * code + bias, exactly ------------------------------
# The formats whose every run of 32 weights shares one scale and one offset, as MLX's
# quantized matmul stores weights. Each entry: blocks (n, type_size) -> codes (n, block)
# uint8, scales and biases (n, block // 32) float32; `AFFINE_BITS` the code width.

def _aff_q8_0(b: np.ndarray):
    d = _fp16(b[:, 0], b[:, 1])[:, None]
    codes = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # 0 .. 255
    return codes, d, -128.0 * d


def _aff_q4_0(b: np.ndarray):
    d = _fp16(b[:, 0], b[:, 1])[:, None]
    return _nibbles(b[:, 2:18], 16), d, -8.0 * d


def _aff_q4_1(b: np.ndarray):
    d, m = _fp16(b[:, 0], b[:, 1])[:, None], _fp16(b[:, 2], b[:, 3])[:, None]
    return _nibbles(b[:, 4:20], 16), d, m


def _aff_q5_0(b: np.ndarray):
    d = _fp16(b[:, 0], b[:, 1])[:, None]
    codes = _nibbles(b[:, 6:22], 16) | (_high_bits32(b[:, 2:6]) << np.uint8(4))
    return codes, d, -16.0 * d


def _aff_q5_1(b: np.ndarray):
    codes = _nibbles(b[:, 8:24], 16) | (_high_bits32(b[:, 4:8]) << np.uint8(4))
    return codes, _fp16(b[:, 0], b[:, 1])[:, None], _fp16(b[:, 2], b[:, 3])[:, None]


def _aff_q4_k(b: np.ndarray):
    dl, ml = _k_sub_scales(b)  # (n, 8, 1) each
    return _nibbles(b[:, 16:144], 32), dl[:, :, 0], -ml[:, :, 0]


def _aff_q5_k(b: np.ndarray):
    dl, ml = _k_sub_scales(b)
    codes = _nibbles(b[:, 48:176], 32) | (_bitplanes(b[:, 16:48]) << np.uint8(4))
    return codes, dl[:, :, 0], -ml[:, :, 0]


_AFFINE = {f.qtype: globals()[f"_aff_{f.name}"] for f in FORMATS if f.affine_bits}
AFFINE_BITS = {f.qtype: f.affine_bits for f in FORMATS if f.affine_bits}


def affine_groups(raw: np.ndarray, qtype: GGMLQuantizationType
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A matrix (N, bytes_per_row) in one of the `AFFINE_BITS` formats as integer codes
    (N, K) uint8 and per-32-weight scales and biases (N, K // 32) float32 such that
    scale * code + bias equals `dequantize` exactly (fp16 scales times small integers
    are exact in float32)."""
    qtype = check_supported(qtype)
    if qtype not in _AFFINE:
        raise UnsupportedQuantError(f"{qtype.name} has no 32-weight affine groups")
    bs, ts = GGML_QUANT_SIZES[qtype]
    rows = _as_bytes(raw)
    n = rows.shape[0]
    blocks = np.ascontiguousarray(rows.reshape(-1, ts))  # (N * K / bs, type_size)
    codes, scales, biases = _AFFINE[qtype](blocks)
    return (codes.reshape(n, -1), np.ascontiguousarray(scales, np.float32).reshape(n, -1),
            np.ascontiguousarray(biases, np.float32).reshape(n, -1))
