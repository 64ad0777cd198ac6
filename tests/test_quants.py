"""NumPy reference dequantizers vs `gguf.quants.dequantize`, bit for bit."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from tests.support.quant_blocks import F16_FIELDS, assert_bits_equal, random_blocks
from workbench.engine.formats import sources
from workbench.kernels.quants import (
    SUPPORTED_TYPES,
    UnsupportedQuantError,
    block_size,
    dequantize,
    row_bytes,
)

QUANTIZED = [t for t in SUPPORTED_TYPES if t not in (Q.F32, Q.F16, Q.BF16)]


def test_every_format_is_covered():
    assert set(F16_FIELDS) == set(QUANTIZED)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_matches_gguf_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    raw = random_blocks(qtype, rows=7, cols=3 * 256, rng=rng)
    ours = dequantize(raw, qtype)
    assert ours.shape == (7, 3 * 256)
    assert_bits_equal(ours, gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_leading_dims_and_chunking(qtype, monkeypatch):
    """3-D data keeps its leading dims; results do not depend on the chunk size."""
    import workbench.kernels.quants as quants

    rng = np.random.default_rng(100 + int(qtype))
    raw = random_blocks(qtype, rows=6, cols=512, rng=rng).reshape(2, 3, -1)
    whole = dequantize(raw, qtype)
    monkeypatch.setattr(quants, "_CHUNK_WEIGHTS", 256)  # one super-block per pass
    assert_bits_equal(dequantize(raw, qtype), whole)
    assert whole.shape == (2, 3, 512)


def test_known_values_q4_0_and_q8_0():
    """Hand-built blocks, independent of any reference implementation."""
    q4 = np.zeros((1, 18), np.uint8)
    q4[0, :2] = np.array([0.5], np.float16).view(np.uint8)
    q4[0, 2:] = 0x2F  # low nibble 15 -> weights 0..15, high nibble 2 -> weights 16..31
    expect = np.r_[np.full(16, 0.5 * (15 - 8)), np.full(16, 0.5 * (2 - 8))].astype(np.float32)
    np.testing.assert_array_equal(dequantize(q4, Q.Q4_0)[0], expect)

    q8 = np.zeros((1, 34), np.uint8)
    q8[0, :2] = np.array([-2.0], np.float16).view(np.uint8)
    q8[0, 2:] = np.arange(-16, 16, dtype=np.int8).view(np.uint8)
    expect = -2.0 * np.arange(-16, 16, dtype=np.float32)
    np.testing.assert_array_equal(dequantize(q8, Q.Q8_0)[0], expect)


def test_float_types():
    rng = np.random.default_rng(1)
    w32 = rng.standard_normal((4, 40)).astype(np.float32)
    assert_bits_equal(dequantize(w32, Q.F32), w32)
    assert_bits_equal(dequantize(w32.view(np.uint8), Q.F32), w32)  # raw bytes

    w16 = w32.astype(np.float16)
    assert_bits_equal(dequantize(w16, Q.F16), gguf.quants.dequantize(w16, Q.F16))
    assert_bits_equal(dequantize(w16.view(np.uint8), Q.F16), w16.astype(np.float32))

    bf = (w32.view(np.uint32) >> 16).astype(np.uint16)  # truncated bf16 bit patterns, (4, 40)
    as_bytes = bf.view(np.uint8)  # what GGUFReader gives for BF16: (4, 80) uint8
    ref = gguf.quants.dequantize(as_bytes, Q.BF16)
    assert_bits_equal(dequantize(as_bytes, Q.BF16), ref)
    assert_bits_equal(dequantize(bf, Q.BF16), ref)
    assert_bits_equal(dequantize(bf.view(np.int16), Q.BF16), ref)
    assert ref.shape == (4, 40)


def test_block_size_and_row_bytes():
    assert block_size(Q.F32) == 1
    assert block_size(Q.Q8_0) == 32
    assert block_size(Q.Q4_K) == 256
    assert row_bytes(Q.Q4_K, 512) == 288
    with pytest.raises(ValueError, match="not a multiple"):
        row_bytes(Q.Q6_K, 300)


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.IQ4_XS, Q.TQ1_0, Q.MXFP4, Q.Q8_K, 31, 999],
                         ids=lambda t: getattr(t, "name", str(t)))
def test_unsupported_types_raise(qtype):
    raw = np.zeros((1, 64), np.uint8)
    with pytest.raises(UnsupportedQuantError) as exc:
        dequantize(raw, qtype)
    msg = str(exc.value)
    name = getattr(qtype, "name", str(qtype))
    assert name in msg
    assert "Q4_K" in msg and "Q8_0" in msg  # lists what is supported
    assert isinstance(exc.value, ValueError)
    with pytest.raises(UnsupportedQuantError):
        block_size(qtype)


def test_bad_row_length():
    with pytest.raises(ValueError, match="Q8_0"):
        dequantize(np.zeros((2, 35), np.uint8), Q.Q8_0)


@pytest.mark.slow
@pytest.mark.parametrize("alias", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_real_tensors(alias):
    """First rows of one tensor of every type in the real model files."""
    from workbench.engine.formats.gguf import open_gguf

    file = sources.pull(alias)

    seen = set()
    for t in open_gguf(file).tensors.values():
        if t.qtype in seen or len(t.shape) != 2:
            continue
        seen.add(t.qtype)
        part = t.data[:64]
        assert_bits_equal(dequantize(part, t.qtype), gguf.quants.dequantize(part, t.qtype))
    assert seen
