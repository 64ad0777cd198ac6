"""Random GGUF quantized blocks, and comparing float32 arrays bit for bit."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

# byte offsets of the fp16 fields (scales, mins) inside one block
F16_FIELDS = {
    Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2],
    Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
}


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, bytes_per_row) uint8: random bytes, with every fp16 field a finite random value."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    n_blocks = rows * (cols // bs)
    raw = rng.integers(0, 256, size=(n_blocks, ts), dtype=np.uint8)  # (blocks, type_size)
    for off in F16_FIELDS[qtype]:
        vals = (rng.standard_normal(raw.shape[0]) * 4).astype(np.float16)
        raw[:, off : off + 2] = vals.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, cols // bs * ts)


def assert_bits_equal(a: np.ndarray, b: np.ndarray) -> None:
    """Both float32 of one shape, and equal bit for bit."""
    assert a.dtype == np.float32 and b.dtype == np.float32
    assert a.shape == b.shape
    diff = a.view(np.uint32) != b.view(np.uint32)
    assert not diff.any(), (f"{diff.sum()} of {a.size} values differ, "
                            f"e.g. {a[diff][:4]} vs {b[diff][:4]}")
