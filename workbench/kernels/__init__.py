"""Hot ops on GGUF weights: NumPy reference dequantizers and Numba CPU kernels.

- `workbench.kernels.formats`: the table of supported GGML formats, from which every
  per-format dispatch below is derived.
- `workbench.kernels.quants`: `dequantize(raw, qtype)` for every supported GGML
  format, bit-identical to `gguf.quants.dequantize` (pure NumPy, no Numba).
- `workbench.kernels.cpu`: Numba kernels computing `x @ W.T` on packed blocks (built
  from `blocks`, the per-format block math, and `loops`, the shared loops).
- `workbench.kernels.linear`: `QuantizedWeight`, the object the model calls.

`QuantizedWeight` is imported lazily so that `quants` can be used without
loading Numba.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from workbench.kernels.quants import (
    SUPPORTED_TYPES,
    UnsupportedQuantError,
    block_size,
    dequantize,
)

if TYPE_CHECKING:
    from workbench.kernels.linear import QuantizedWeight

__all__ = [
    "SUPPORTED_TYPES",
    "QuantizedWeight",
    "UnsupportedQuantError",
    "block_size",
    "dequantize",
]


def __getattr__(name: str) -> Any:
    if name == "QuantizedWeight":
        from workbench.kernels.linear import QuantizedWeight

        return QuantizedWeight
    raise AttributeError(f"module 'workbench.kernels' has no attribute {name!r}")
