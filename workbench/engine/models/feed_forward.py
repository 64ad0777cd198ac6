"""The gated feed-forward of the llama family: down(act(gate(x)) * up(x)), with gate and
up as one matrix (gate rows first), act SiLU (SwiGLU: llama, qwen, phi3, and every
expert of the mixture-of-experts models) or tanh GELU (GeGLU: Gemma 3).

`glu` runs it on the host through the Numba activation kernels
(`workbench.kernels.layers.silu_mul`, `gelu_mul`), `device_glu` on a GPU backend's
arrays (`glu_activation`: the formulas those kernels compute, over an array module).
`FeedForward` is a dense layer's;
`workbench.engine.models.moe` sends each expert through the same two functions.
"""

from __future__ import annotations

import numpy as np

from workbench.engine.formats.gguf import GGUFFile
from workbench.engine.models.weights import fused, linear
from workbench.engine.runtime.formulas import glu_activation  # noqa: F401  (importable from here)
from workbench.kernels import layers


def glu(gate_up, down, x: np.ndarray, act=layers.silu_mul, counts=None) -> np.ndarray:
    """x (T, D) -> (T, D) on the host; `act` is the activation kernel (`layers.silu_mul`
    or `layers.gelu_mul`); `counts`: x's rows are chunks of several sequences
    (`QuantizedWeight.matmul`)."""
    gu = gate_up.matmul(x, counts)  # (T, 2 F): gate, then up
    h = np.empty((x.shape[0], gu.shape[1] // 2), np.float32)
    act(gu, h)
    return down.matmul(h, counts)


def device_glu(backend, gate_up, down, x, gelu: bool = False):
    """x (T, D) -> (T, D) on a backend's arrays (`Backend.glu`: one kernel on CUDA)."""
    return down.matmul(backend.glu(gate_up.matmul(x), gelu))


class FeedForward:
    """SwiGLU, down(silu(gate(x)) * up(x)), or GeGLU with `act="gelu"` (tanh GELU, Gemma);
    gate and up fused when they share a format (phi3 stores them as one `ffn_up`)."""

    def __init__(self, g: GGUFFile, i: int, act: str = "silu"):
        p = f"blk.{i}."
        if p + "ffn_gate.weight" in g.tensors:
            self.gate_up = fused(g, [p + "ffn_gate.weight", p + "ffn_up.weight"])
        else:  # phi3: gate and up rows in one matrix
            self.gate_up = linear(g, p + "ffn_up.weight")
        self.down = linear(g, p + "ffn_down.weight")
        self.gelu = act == "gelu"  # the family's activation: GeGLU (Gemma 3) or SwiGLU
        self.act = layers.gelu_mul if self.gelu else layers.silu_mul  # its host kernel

    def __call__(self, x: np.ndarray, counts=None) -> np.ndarray:
        """x (T, n_embd) -> (T, n_embd); `counts` as in `glu`."""
        return glu(self.gate_up, self.down, x, self.act, counts)
