"""The elementwise formulas of the decoder layers, written once over an array module `xp`
(NumPy, CuPy or MLX): the models' reference math (`workbench.engine.models`) and the
device backends' fallbacks (`workbench.engine.runtime.backend`) both call them."""

from __future__ import annotations

import numpy as np


def rms_norm(x, weight, eps: float, xp=np):
    """RMSNorm over the last axis, on NumPy arrays or, with `xp`, a device backend's
    (`workbench.engine.models.llama_device`): one formula for both."""
    return x * (1.0 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + eps)) * weight


def rotate(xp, x, cos, sin, dim: int, neox: bool):
    """x (..., head_dim) rotated by angles whose cos and sin broadcast against
    (..., dim / 2); only the leading `dim` entries of each head turn, the rest are kept."""
    if neox:
        a, b = x[..., : dim // 2], x[..., dim // 2 : dim]
        parts = [a * cos - b * sin, a * sin + b * cos]
    else:  # interleaved pairs (x[2i], x[2i+1]): rotate, then interleave back
        a, b = x[..., 0:dim:2], x[..., 1:dim:2]
        pairs = xp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1)  # (..., dim/2, 2)
        parts = [pairs.reshape(*x.shape[:-1], dim)]
    if dim < x.shape[-1]:
        parts.append(x[..., dim:])
    return xp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]


def glu_activation(xp, gu, gelu: bool = False):
    """gu (T, 2 F), gate then up -> act(gate) * up (T, F) on an array module `xp`: the
    formulas the host kernels compute (SiLU, or tanh GELU with `gelu`)."""
    n_ff = gu.shape[1] // 2
    gate, up = gu[:, :n_ff], gu[:, n_ff:]
    if gelu:  # tanh GELU
        act = 0.5 * gate * (1.0 + xp.tanh(0.7978845608028654 * (
            gate + 0.044715 * gate * gate * gate)))
    else:
        act = gate / (1.0 + xp.exp(-gate))
    return act * up
