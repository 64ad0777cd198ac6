"""The GGUF weight formats workbench computes on: one table, `FORMATS`.

Every place that dispatches on a weight format derives from this table: the NumPy
reference dequantizers (`quants`), the Numba CPU kernels and their dispatch tables
(`cpu`), the fused decode stack's per-format branches (`decode`) and the CUDA kernels
(`cuda`, gguf.cu). An entry says which of them a format has; the per-format code itself
is found by name, `<piece>_<name>` with `name` the lower-case GGML type name
(`Format.name`):

- `quants._deq_<name>`: whole blocks to float32, the bit-exact NumPy reference (every
  format but the float ones); `quants._aff_<name>` where `affine_bits` is set;
- `blocks.dot_<name>` and `blocks.row_<name>` (entries with `cpu`): one packed row of W
  times x (for entries with `rows`: times 1, 2, 4 or 8 rows of x, each block unpacked
  once, each row with the same bits however many are taken), and one row of W to
  float32 (bit-exact without fastmath), from which `cpu` generates the gemv, multi-row
  (entries with `rows`), two-stage gemv and dequantize kernels; `blocks.fast_row_<name>`
  replaces `row_<name>` in the two-stage gemv where `fast_row` is set;
- gguf.cu (entries with `cuda`): a decoder struct and its `GGUF_KERNELS(<name>, ...)`
  line, which define the kernels `dequantize_<name>` and `gemv_<name>`.

Adding a format is one entry here plus those pieces. This module imports no Numba, so
`quants` and `cuda` use it without loading the compiler.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType


@dataclass(frozen=True)
class Format:
    """What workbench has for one GGML weight format (see the module docstring)."""

    qtype: GGMLQuantizationType
    cpu: bool = False  # packed-block CPU kernels: gemv, two-stage gemv, dequantize
    rows: bool = False  # the CPU multi-row kernel (batched decoding), steps of `simd`
    sums: int = 0  # the CPU gemv sums x over runs of this many columns (block offsets
    #                and mins are applied to those sums); 0: the format needs none
    bf16: bool = False  # the CPU kernels' 65536-entry table is `BF16_TO_F32`, not F16's
    fast_row: bool = False  # the two-stage gemv unpacks rows with `blocks.fast_row_<name>`
    affine_bits: int = 0  # code width of its 32-weight affine groups (MLX), 0: none
    cuda: bool = True  # gguf.cu has its kernels

    @property
    def name(self) -> str:
        """The lower-case type name, the suffix of every per-format function and kernel."""
        return self.qtype.name.lower()

    @property
    def block_weights(self) -> int:
        """Weights per block (1 for the float formats)."""
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def block_bytes(self) -> int:
        """Bytes per block."""
        return GGML_QUANT_SIZES[self.qtype][1]


FORMATS: tuple[Format, ...] = (
    Format(Q.F32),
    Format(Q.F16, cpu=True, fast_row=True),
    Format(Q.BF16, cpu=True, bf16=True),
    Format(Q.Q8_0, cpu=True, rows=True, affine_bits=8),
    Format(Q.Q4_0, cpu=True, rows=True, sums=32, affine_bits=4),
    Format(Q.Q4_1, cpu=True, rows=True, sums=32, affine_bits=4),
    Format(Q.Q5_0, cpu=True, rows=True, sums=32, affine_bits=5),
    Format(Q.Q5_1, cpu=True, rows=True, sums=32, affine_bits=5),
    Format(Q.Q2_K),
    Format(Q.Q3_K),
    Format(Q.Q4_K, cpu=True, rows=True, sums=32, affine_bits=4),
    Format(Q.Q5_K, cpu=True, sums=32, affine_bits=5),
    Format(Q.Q6_K, cpu=True, rows=True, sums=16),
)
"""Every supported format, in the order workbench lists them."""

BY_TYPE: dict[GGMLQuantizationType, Format] = {f.qtype: f for f in FORMATS}
"""`FORMATS` by GGML type."""
