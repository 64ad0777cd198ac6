"""Rotary position embedding (RoPE) for the llama family, on the host and on the devices.

`Rope` holds the cos/sin tables of one layer kind; `rotate` is the rotation itself,
written once over an array module (`xp`: NumPy for prefill and cache edits, CuPy or
MLX in `workbench.engine.models.llama_device`). The Numba decode kernels
(`workbench.kernels.layers.attend`) rotate from the same tables.

Two layouts: llama rotates interleaved pairs (x[2i], x[2i+1]) (llama.cpp's converter
permutes Hugging Face's Q/K rows into it); NEOX (qwen, phi3, gemma3) rotates halves
(x[i], x[i + d/2]). Frequencies may be divided pair by pair: Llama 3's
`rope_freqs.weight`, or Phi-3's LongRoPE factors (`rope_factors`).
"""

from __future__ import annotations

import numpy as np

from workbench.engine.formats.gguf import GGUFError, GGUFFile
from workbench.engine.models.llama_config import LlamaConfig
from workbench.engine.models.weights import vector
from workbench.engine.runtime.formulas import rotate
from workbench.kernels import layers


def rope_factors(g: GGUFFile, cfg: LlamaConfig, max_len: int) -> np.ndarray | None:
    """The per-pair frequency divisors of the file, checked: Llama 3's `rope_freqs`, or
    Phi-3's LongRoPE, whose long factors apply when the context (`max_len`) is longer
    than the original one and the short factors otherwise (chosen once, as llama.cpp
    does); None when the file has neither."""
    factors = vector(g, "rope_freqs.weight", optional=True)
    if "rope_factors_long.weight" in g.tensors or "rope_factors_short.weight" in g.tensors:
        if not cfg.rope_orig_ctx:
            raise GGUFError(f"{g.path.name} has LongRoPE factors but no "
                            f"{cfg.arch}.rope.scaling.original_context_length")
        which = "long" if max_len > cfg.rope_orig_ctx else "short"
        factors = vector(g, f"rope_factors_{which}.weight")
    if factors is not None and factors.size != cfg.rope_dim // 2:
        raise GGUFError(f"{g.path.name}: {factors.size} RoPE frequency factors for "
                        f"{cfg.rope_dim // 2} rotated pairs")
    if factors is not None and not (np.all(np.isfinite(factors)) and np.all(factors > 0)):
        raise GGUFError(f"{g.path.name}: the RoPE frequency factors must be finite and > 0")
    return factors


class Rope:
    """Rotary position embedding with cos/sin tables precomputed for `max_len` positions."""

    def __init__(self, cfg: LlamaConfig, max_len: int, freq_factors: np.ndarray | None,
                 base: float | None = None, linear_factor: float | None = None,
                 scale: float = 1.0):
        """`base` and `linear_factor` override the config's (Gemma 3's local layers);
        `freq_factors` divide the frequencies pair by pair (Llama 3, LongRoPE); `scale`
        multiplies cos and sin (LongRoPE's attention factor)."""
        base = cfg.rope_base if base is None else base
        factor = cfg.rope_linear_factor if linear_factor is None else linear_factor
        half = cfg.rope_dim // 2
        inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2.0 / cfg.rope_dim)
        if freq_factors is not None:  # Llama 3 long-context scaling, stored per dimension pair
            inv_freq = inv_freq / freq_factors.astype(np.float64)
        pos = np.arange(max_len, dtype=np.float64) / factor
        angles = np.outer(pos, inv_freq)  # (max_len, half)
        self.cos = (np.cos(angles) * scale).astype(np.float32)
        self.sin = (np.sin(angles) * scale).astype(np.float32)
        self.dim, self.neox = cfg.rope_dim, cfg.rope_neox
        self._inv_freq = inv_freq / factor

    def __call__(self, x: np.ndarray, start: int) -> np.ndarray:
        """x of shape (T, n_head, head_dim) rotated for positions start .. start+T-1 (a new
        array; the host kernel `layers.rope_rows`, the decode kernels' rotation)."""
        out = np.array(x, dtype=np.float32, order="C")  # (T, n_head, head_dim), a copy
        layers.rope_rows(out, self.cos, self.sin, start, self.dim, self.neox)
        return out

    def shift(self, x: np.ndarray, delta: int) -> np.ndarray:
        """Move already rotated x (..., head_dim) by `delta` positions (negative: back);
        rotations add up, so this equals rotating at the new positions (a pure rotation:
        `scale` was applied once, when x was rotated first)."""
        angles = delta * self._inv_freq  # (half,)
        return rotate(np, x, np.cos(angles).astype(np.float32),
                      np.sin(angles).astype(np.float32), self.dim, self.neox)
