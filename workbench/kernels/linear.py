"""`QuantizedWeight`: one GGUF weight matrix, kept in its file format, and `x @ W.T` on it.

The model code calls `matmul` for every projection and `rows` for the token
embedding lookup. Storage and compute by format:

- Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: the raw blocks stay as they
  are (typically a read-only view of the mmap'd file); `matmul` runs the Numba
  kernels of `workbench.kernels.cpu` (dot products on the packed blocks for
  small T, tile-wise dequantize + BLAS for prefill). No fp32 copy is kept.
- F16 / BF16: kept 16-bit (2 bytes per weight) and run through the same
  kernels (each weight is a lookup in an exact 65536-entry table). At T = 1
  this is ~1.7x slower than BLAS on an fp32 copy (measured 1.34 vs 0.80 ms on
  4864x896), at half the memory; widening tiles with NumPy's fp16 cast was
  10-20x slower than fp32 BLAS. (A one-time fp32 copy would trade 2x memory
  for that speed; no model in the registry stores matrices in F16.)
- F32: the float32 matrix (a view of the file); `matmul` is `np.dot`.
- Q2_K, Q3_K (no CPU kernel yet): on the first `matmul`, the whole matrix is
  dequantized once to an fp32 copy that is kept (4 bytes per weight) and used
  with `np.dot` from then on. `rows` and `dequantize` never need that copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from workbench.kernels import cpu
from workbench.kernels.quants import check_supported, dequantize

Q = GGMLQuantizationType


class QuantizedWeight:
    """A (N, K) weight matrix (N outputs, K inputs) stored in a GGML format.

    Build it with `from_gguf_tensor`. `matmul(x)` computes `x @ W.T`
    (= `x @ dequantize(raw).T`, up to fp32 summation order) without
    materializing W for formats that have a kernel.
    """

    __slots__ = ("_data", "_qtype", "_shape", "_fp32")

    def __init__(self, data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]):
        """Prefer `from_gguf_tensor`; `data` must already be in the stored layout."""
        self._data = data
        self._qtype = qtype
        self._shape = shape
        self._fp32: np.ndarray | None = None  # Q2_K/Q3_K fallback copy, made on first matmul

    @classmethod
    def from_gguf_tensor(cls, raw: np.ndarray, qtype: GGMLQuantizationType | int,
                         shape: Sequence[int]) -> QuantizedWeight:
        """Wrap a GGUF tensor's data without copying it.

        raw: the tensor data as `gguf.GGUFReader` / `workbench.engine.formats.gguf` give
            it: (N, bytes_per_row) uint8 for quantized types (any shape with the
            right number of bytes is accepted), (N, K) float32/float16 for
            F32/F16, uint8 or uint16 bytes for BF16.
        qtype: its `GGMLQuantizationType`.
        shape: (N, K) in NumPy order (rows first).

        Raises `UnsupportedQuantError` for formats outside
        `workbench.kernels.quants.SUPPORTED_TYPES`, `ValueError` when the data
        size does not match the shape.
        """
        qtype = check_supported(qtype)
        if len(shape) != 2:
            raise ValueError(f"a weight matrix has shape (N, K), got {tuple(shape)}")
        n, k = (int(v) for v in shape)
        bs, ts = GGML_QUANT_SIZES[qtype]
        if k % bs:
            raise ValueError(f"row length K={k} is not a multiple of the {qtype.name} "
                             f"block size {bs}")
        row_bytes = k // bs * ts
        arr = np.asarray(raw)  # a plain ndarray view (drops np.memmap)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        if arr.nbytes != n * row_bytes:
            raise ValueError(f"{qtype.name} weight of shape ({n}, {k}) needs "
                             f"{n * row_bytes} bytes, "
                             f"the data has {arr.nbytes} ({arr.dtype}, shape {arr.shape})")
        flat = arr.reshape(-1).view(np.uint8)
        if qtype == Q.F32:
            data = flat.view(np.float32).reshape(n, k)
        else:
            data = flat.reshape(n, row_bytes)  # (N, bytes_per_row)
        data = data.view()
        data.flags.writeable = False  # mmap'd or not: one (read-only) Numba specialization
        return cls(data, qtype, (n, k))

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K): output features x input features."""
        return self._shape

    @property
    def qtype(self) -> GGMLQuantizationType:
        """The GGML storage format."""
        return self._qtype

    @property
    def nbytes(self) -> int:
        """Bytes of the stored (file-format) data; excludes a Q2_K/Q3_K fallback fp32 copy."""
        return int(self._data.nbytes)

    @property
    def data(self) -> np.ndarray:
        """The stored data: (N, K) float32 for F32, else (N, bytes_per_row) uint8 as in the file."""
        return self._data

    @property
    def has_kernel(self) -> bool:
        """True when `matmul` runs on the stored data (no fp32 copy of W is ever made)."""
        return self._qtype in cpu.GEMV_KERNELS or self._qtype == Q.F32

    def __repr__(self) -> str:
        n, k = self._shape
        mib = self.nbytes / 2**20
        return f"QuantizedWeight({self._qtype.name}, shape=({n}, {k}), {mib:.2f} MiB)"

    def matmul(self, x: np.ndarray, counts: Sequence[int] | None = None) -> np.ndarray:
        """`x @ W.T`: (..., K) float32 -> (..., N) float32 (fp32 accumulation).

        x may be (K,), (T, K) or have more leading dims; it is converted to a
        C-contiguous float32 array if it is not one already.

        counts: x (T, K) holds chunks of several sequences, counts[i] rows each (a
        prefill pass over several prompts): each chunk's rows then get the bits they
        would get alone (`cpu.matmul_chunks`; with BLAS, a one-row chunk runs alone).
        """
        n, k = self._shape
        x = np.asarray(x)
        if x.shape[-1:] != (k,):
            raise ValueError(f"matmul: x has shape {x.shape}, expected (..., {k}) for a "
                             f"{self._qtype.name} weight of shape ({n}, {k})")
        lead = x.shape[:-1]
        x2 = np.ascontiguousarray(x.reshape(-1, k), dtype=np.float32)  # (T, K)
        if counts is not None and len(counts) < 2:
            counts = None
        qt = self._qtype
        if qt in cpu.GEMV_KERNELS:
            if counts is None:
                y = cpu.matmul(x2, self._data, qt)
            else:
                y = cpu.matmul_chunks(x2, self._data, qt, counts)
        else:
            if qt != Q.F32 and self._fp32 is None:
                self._fp32 = dequantize(self._data, qt)
            y = _blas(x2, self._data if qt == Q.F32 else self._fp32, counts)
        return y.reshape(*lead, n)

    def dequantize(self) -> np.ndarray:
        """The whole matrix as float32, (N, K) (a new array; bit-identical to gguf's reference)."""
        if self._fp32 is not None:
            return self._fp32.copy()
        n = self._shape[0]
        if self._qtype in cpu.DEQUANT_KERNELS:
            return cpu.dequantize_rows(self._data, self._qtype, 0, n)
        return dequantize(self._data, self._qtype)

    def rows(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Rows `ids` of W as float32: (len(ids), K). The embedding lookup.

        Only the selected rows are dequantized; the table stays in its format.
        Raises `IndexError` for ids outside [0, N).
        """
        n, k = self._shape
        idx = np.asarray(ids, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            bad = idx[(idx < 0) | (idx >= n)][0]
            raise IndexError(f"row id {bad} is out of range for a weight with {n} rows")
        if self._qtype == Q.F32:
            return self._data[idx].astype(np.float32, copy=True)
        picked = np.ascontiguousarray(self._data[idx])  # (len(ids), bytes_per_row)
        if self._qtype in cpu.DEQUANT_KERNELS:
            return cpu.dequantize_rows(picked, self._qtype, 0, picked.shape[0])
        return dequantize(picked, self._qtype)


def _blas(x: np.ndarray, w: np.ndarray, counts: Sequence[int] | None) -> np.ndarray:
    """x @ w.T for an fp32 matrix w. OpenBLAS gives a row the same bits whatever the other
    rows, except that one row alone goes through its gemv: with `counts`, the one-row
    chunks run one by one and the others together."""
    if counts is None or all(c > 1 for c in counts):
        return x @ w.T
    y = np.empty((x.shape[0], w.shape[0]), np.float32)
    starts = np.cumsum([0, *counts[:-1]])
    single = [int(s) for s, c in zip(starts, counts) if c == 1]
    rest = np.concatenate([np.arange(s, s + c) for s, c in zip(starts, counts) if c > 1]
                          or [np.zeros(0, np.int64)])
    if rest.size:
        y[rest] = x[rest] @ w.T
    for s in single:
        y[s : s + 1] = x[s : s + 1] @ w.T
    return y
