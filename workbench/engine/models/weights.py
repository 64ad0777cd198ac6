"""GGUF tensors as model weights: matrices as `QuantizedWeight`, vectors as float32.

Every architecture module builds its layers from these functions, so a
tensor in a format the kernels cannot run gives the same clear error (file and
tensor named) whichever model it belongs to.
"""

from __future__ import annotations

import numpy as np

from workbench.engine.formats.gguf import GGUFError, GGUFFile, UnsupportedTensorTypeError
from workbench.kernels.linear import QuantizedWeight
from workbench.kernels.quants import UnsupportedQuantError


def linear(g: GGUFFile, name: str) -> QuantizedWeight:
    """The (N, K) matrix `name`, kept in its file format (a view of the mapped file)."""
    t = g.tensor(name)
    try:
        return QuantizedWeight.from_gguf_tensor(t.data, t.qtype, t.shape)
    except UnsupportedQuantError as exc:
        raise UnsupportedTensorTypeError(f"{g.path.name}: tensor {name!r}: {exc}") from None


def fused(g: GGUFFile, names: list[str]) -> QuantizedWeight | Stacked:
    """The matrices `names` stacked row-wise into one weight, (sum of N, K), when they share
    a format and K: a private copy read from the file (the mapped pages stay untouched).
    Otherwise a `Stacked` that runs them one by one and joins the outputs."""
    infos = [g.tensor(n) for n in names]
    if len({(t.qtype, t.shape[1:]) for t in infos}) > 1 or any(len(t.shape) != 2 for t in infos):
        return Stacked([linear(g, n) for n in names])
    n_rows = sum(t.shape[0] for t in infos)
    raw = np.concatenate([t.read(g.path) for t in infos])
    try:
        return QuantizedWeight.from_gguf_tensor(raw, infos[0].qtype, (n_rows, infos[0].shape[1]))
    except UnsupportedQuantError as exc:
        raise UnsupportedTensorTypeError(f"{g.path.name}: tensor {names[0]!r}: {exc}") from None


def experts(g: GGUFFile, name: str) -> list[QuantizedWeight]:
    """The 3-D tensor `name`, (n_expert, N, K), as one (N, K) matrix per expert (views of
    the mapped file: an expert no token is routed to is never read)."""
    t = g.tensor(name)
    if len(t.shape) != 3:
        raise GGUFError(f"{g.path.name}: tensor {name!r} has shape {t.shape}, expected "
                        "(n_expert, N, K)")
    try:
        return [QuantizedWeight.from_gguf_tensor(t.data[e], t.qtype, t.shape[1:])
                for e in range(t.shape[0])]
    except UnsupportedQuantError as exc:
        raise UnsupportedTensorTypeError(f"{g.path.name}: tensor {name!r}: {exc}") from None


class Stacked:
    """Weights of different formats standing in for one stacked matrix."""

    def __init__(self, parts: list[QuantizedWeight]):
        self.parts = parts

    def matmul(self, x: np.ndarray, counts=None) -> np.ndarray:
        return np.concatenate([w.matmul(x, counts) for w in self.parts], axis=-1)


def vector(g: GGUFFile, name: str, optional: bool = False) -> np.ndarray | None:
    """The 1-D tensor `name` as float32 (norm weights, biases); None when `optional` and absent."""
    if optional and name not in g.tensors:
        return None
    return np.asarray(g.tensor(name).data, dtype=np.float32).reshape(-1)
