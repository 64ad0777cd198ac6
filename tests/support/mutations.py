"""What the seeded fuzzing of model files writes into them: hostile metadata values, counts
no loader may trust unchecked, and a few bytes overwritten."""

from __future__ import annotations

import math
import random

from gguf import GGUFValueType as VT

HOSTILE_INTS = [0, 1, -1, 2, 3, 7, 2**31 - 1, -2**31, 2**32 - 1, 2**63 - 1, 2**64 - 1, 64, 269]
HOSTILE_VALUES = [(v, VT.UINT64 if v >= 2**63 else VT.INT64 if v < 0 else VT.UINT32
                   if v < 2**32 else VT.UINT64) for v in HOSTILE_INTS] + [
    (math.nan, VT.FLOAT32), (math.inf, VT.FLOAT64), (-1e-6, VT.FLOAT32), (1e38, VT.FLOAT32),
    (0.0, VT.FLOAT32), ("x", VT.STRING), ("", VT.STRING), (True, VT.BOOL),
    ([1, 2], VT.ARRAY, VT.INT32), (["a"], VT.ARRAY, VT.STRING), ([0.5], VT.ARRAY, VT.FLOAT32)]
# Counts that pass the int32 bound but that no loop or allocation may trust before checking
# them against the tensors (a huge block_count used to build millions of dict entries).
LARGE_COUNTS = [2_000_000, 2**24 + 2, 2**31 - 1]
EXTRA_COUNT_KEYS = ("llama.expert_count", "llama.expert_used_count",
                    "llama.attention.key_length", "llama.attention.value_length",
                    "llama.vocab_size")


def mutated_bytes(rng: random.Random, data: bytes, span: int) -> bytes:
    """`data` with a few bytes of its first `span` replaced: random bytes, or an extreme
    little-endian integer over a 4- or 8-byte field."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(min(span, len(out)))
        if rng.random() < 0.5:
            out[at] = rng.randrange(256)
        else:
            width = rng.choice((4, 8))
            value = rng.choice((0, 1, 2**(8 * width) - 1, 2**(8 * width - 1), 2**31, 1000,
                                2_000_000, 2**31 - 1))
            out[at : at + width] = value.to_bytes(width, "little")[: len(out) - at]
    return bytes(out)
