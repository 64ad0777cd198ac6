"""Numba CPU kernels and `QuantizedWeight` vs `x @ dequantize(W).T`.

Tolerance: the kernels accumulate in fp32 in a different order than the
reference (vectorized partial sums, per-block scales applied to block sums,
constant offsets and mins folded in through sums of x). Such reordering changes
a K-term fp32 dot product by roughly sqrt(K) * 2^-24 of the magnitude of its
terms: ~1e-6 of the output scale for K <= 5000 (observed: <= 5e-7). A layout
bug (a swapped nibble, a wrong scale) shows up at 1e-3..1 of the output scale.
So each test asserts max|y - ref| <= 1e-5 * max|ref|, with `ref` computed in
float64 from the bit-exact NumPy dequantization.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from tests.support.quant_blocks import F16_FIELDS, assert_bits_equal, random_blocks
from workbench.engine.formats import sources
from workbench.kernels import cpu
from workbench.kernels.linear import QuantizedWeight
from workbench.kernels.quants import SUPPORTED_TYPES, UnsupportedQuantError, dequantize

KERNEL_TYPES = list(cpu.KERNEL_TYPES)
RTOL = 1e-5


def random_weight(qtype: Q, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(n, bytes_per_row) uint8 as a GGUF file stores it: random blocks, or random 16-bit floats."""
    if qtype in F16_FIELDS:
        return random_blocks(qtype, n, k, rng)
    w = rng.standard_normal((n, k)).astype(np.float32)
    if qtype == Q.F16:
        return w.astype(np.float16).view(np.uint8)
    if qtype == Q.BF16:
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    return w.view(np.uint8)


def reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x @ w.T in float64."""
    return x.astype(np.float64) @ w.astype(np.float64).T


def assert_close(y: np.ndarray, ref: np.ndarray) -> None:
    assert y.dtype == np.float32
    assert y.shape == ref.shape
    err = np.abs(y - ref).max()
    scale = np.abs(ref).max()
    assert err <= RTOL * scale + 1e-30, f"max|diff| {err:.3g}, max|ref| {scale:.3g}"


def test_required_kernels_exist():
    assert {Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q4_K, Q.Q6_K, Q.F16, Q.BF16} <= set(KERNEL_TYPES)
    assert set(cpu.DEQUANT_KERNELS) == set(cpu.GEMV_KERNELS)


def test_the_format_table_decides_every_dispatch():
    """`formats.FORMATS` alone says which kernels exist: the CPU tables, the generated
    kernels' names and source, the decode stack's branches (named constants, no raw type
    codes), the CUDA formats and the NumPy reference."""
    import inspect
    import re

    from workbench.kernels import cuda, decode, formats, quants

    table = formats.FORMATS
    cpu_types = [f.qtype for f in table if f.cpu]
    assert (list(cpu.GEMV_KERNELS) == list(cpu.GEMV2_KERNELS) == list(cpu.OUTER_KERNELS)
            == list(cpu.DEQUANT_KERNELS))
    assert list(cpu.GEMV_KERNELS) == cpu_types
    assert list(cpu.ROWS_KERNELS) == [f.qtype for f in table if f.rows]
    assert list(cuda.FORMATS) == [f.qtype for f in table if f.cuda]
    assert quants.SUPPORTED_TYPES == tuple(f.qtype for f in table)
    for f in table:
        if f.cpu:
            kernel = cpu.GEMV_KERNELS[f.qtype]
            assert kernel.__name__ == f"_gemv_{f.name}"
            assert f"blocks.dot_{f.name}(" in inspect.getsource(kernel.py_func)
            assert (cpu._table(f.qtype) is cpu.BF16_TO_F32) == f.bf16
    source = decode._matmul_source(tuple(sorted(int(t) for t in cpu_types)))
    assert not re.search(r"code == \d", source), source
    assert "code == Q4_1:" in source and "Q4_1 = 3  # GGMLQuantizationType.Q4_1" in source


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("T", [1, 3, 8, 17, 40, 65])
def test_matmul_matches_dequantized(qtype, T, monkeypatch):
    """N=37 (not a multiple of 4), K=768 (3 super-blocks); every kernel, whatever T.

    `matmul` picks `gemv` for T=1, `gemv_rows` (or `gemv_dequant_rows` for the
    formats without it) for T=3 and 8, `gemv_dequant_rows` for T=17, on CPUs with 32
    vector registers `gemv_outer` for T=40 (else `gemv_dequant_rows`), and the tiled
    dequantize + BLAS path for T=65 (> GEMV_MAX_T).
    """
    assert cpu.ROWS_MAX_T == 8 and cpu.GEMV_MAX_T < 65
    monkeypatch.setattr(cpu, "TILE_WEIGHTS", 16 * 768)  # 16-row tiles: 3 tiles, the last partial
    rng = np.random.default_rng(int(qtype) * 10 + T)
    n, k = 37, 768
    raw = random_weight(qtype, n, k, rng)
    x = rng.standard_normal((T, k)).astype(np.float32)
    ref = reference(x, dequantize(raw, qtype))
    assert_close(cpu.gemv(x, raw, qtype), ref)
    assert_close(cpu.gemv_dequant_rows(x, raw, qtype), ref)
    assert_close(cpu.gemv_outer(x, raw, qtype), ref)
    if qtype in cpu.ROWS_KERNELS:
        assert_close(cpu.gemv_rows(x, raw, qtype), ref)
    assert_close(cpu.matmul(x, raw, qtype), ref)
    assert_close(QuantizedWeight.from_gguf_tensor(raw, qtype, (n, k)).matmul(x), ref)


# T values around every switch of `matmul` (gemv, 4-row blocks of the two-stage
# kernel, its remainder rows, the outer-product kernel's 2, 3 and 4 vectors of rows,
# the tiled BLAS path).
AWKWARD_T = [1, 2, 3, 4, 5, 7, 8, 16, 17, 24, 25, 33, 63, 64, 65]


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_every_output_is_written(qtype, monkeypatch):
    """Outputs are poisoned with NaN before each call, so an element a kernel skips fails.

    N = 1, 6 and 39 rows (one row; not multiples of the 4-row groups), K = one
    block and three blocks (for 16-bit floats 1, 33 and 49 columns: no 16-wide step, two,
    three and a remainder), T over AWKWARD_T.
    """
    monkeypatch.setattr(cpu, "TILE_WEIGHTS", 16 * 768)  # several tiles, the last partial
    bs = GGML_QUANT_SIZES[qtype][0]
    rng = np.random.default_rng(int(qtype) + 101)
    for k in ([bs, 3 * bs] if bs > 1 else [1, 33, 49]):
        for n in (1, 6, 39):
            raw = random_weight(qtype, n, k, rng)
            full = dequantize(raw, qtype)
            for T in AWKWARD_T:
                x = rng.standard_normal((T, k)).astype(np.float32)
                ref = reference(x, full)
                kernels = [cpu.matmul, cpu.gemv_dequant_rows, cpu.gemv_outer]
                kernels += [cpu.gemv] if T <= 4 else []
                kernels += [cpu.gemv_rows] if qtype in cpu.ROWS_KERNELS else []
                for fn in kernels:
                    out = np.full((T, n), np.nan, np.float32)
                    assert fn(x, raw, qtype, out) is out
                    assert not np.isnan(out).any(), f"{fn.__name__} T={T} N={n} K={k}"
                    assert_close(out, ref)


@pytest.mark.parametrize("qtype", list(cpu.ROWS_KERNELS), ids=lambda t: t.name)
def test_rows_kernel_passes_and_groups(qtype):
    """`gemv_rows` over K = 4864 (Qwen's feed-forward width, 19 super-blocks), N = 13 and
    T from 3 to 12 (passes of 4 rows of x, of 8 with zero rows added, of 8 and then 4,
    as `workbench.kernels.loops.MOST_ROWS` allows): NaN-poisoned outputs."""
    rng = np.random.default_rng(int(qtype) + 303)
    n, k = 13, 4864
    raw = random_weight(qtype, n, k, rng)
    full = dequantize(raw, qtype)
    for T in (3, 4, 5, 8, 12):
        x = rng.standard_normal((T, k)).astype(np.float32)
        out = np.full((T, n), np.nan, np.float32)
        assert cpu.gemv_rows(x, raw, qtype, out) is out
        assert_close(out, reference(x, full))


def test_out_must_match():
    raw = random_weight(Q.Q8_0, 4, 64, np.random.default_rng(0))
    x = np.ones((2, 64), np.float32)
    with pytest.raises(ValueError, match=r"out must be .* shape \(2, 4\)"):
        cpu.matmul(x, raw, Q.Q8_0, np.empty((4, 2), np.float32))
    with pytest.raises(ValueError, match="out must be"):
        cpu.gemv(x, raw, Q.Q8_0, np.empty((2, 4), np.float64))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.F16], ids=lambda t: t.name)
def test_long_prefill(qtype, monkeypatch):
    """T=70 takes the (T, K) @ (K, rows) orientation of the tiled path."""
    monkeypatch.setattr(cpu, "TILE_WEIGHTS", 16 * 512)
    rng = np.random.default_rng(int(qtype) + 21)
    raw = random_weight(qtype, 37, 512, rng)
    x = rng.standard_normal((70, 512)).astype(np.float32)
    assert_close(cpu.matmul(x, raw, qtype), reference(x, dequantize(raw, qtype)))


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_long_rows(qtype):
    """K = 4864 (Qwen's feed-forward width, 19 super-blocks) at T=1."""
    rng = np.random.default_rng(int(qtype) + 7)
    n, k = 5, 4864
    raw = random_weight(qtype, n, k, rng)
    x = rng.standard_normal((1, k)).astype(np.float32)
    assert_close(cpu.gemv(x, raw, qtype), reference(x, dequantize(raw, qtype)))


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_dequant_kernels_bit_exact(qtype):
    rng = np.random.default_rng(int(qtype) + 3)
    raw = random_weight(qtype, 9, 512, rng)
    ref = dequantize(raw, qtype)
    assert_bits_equal(cpu.dequantize_rows(raw, qtype, 0, 9), ref)
    assert_bits_equal(cpu.dequantize_rows(raw, qtype, 4, 7), ref[4:7])


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_quantized_weight_every_type(qtype):
    """matmul, dequantize and rows for every storage format, with or without a kernel."""
    rng = np.random.default_rng(int(qtype) + 11)
    n, k = 13, 512
    raw = random_weight(qtype, n, k, rng)
    if qtype == Q.F32:
        raw = raw.view(np.float32)  # typed, as the readers give F32
    elif qtype == Q.F16:
        raw = raw.view(np.float16)
    weight = QuantizedWeight.from_gguf_tensor(raw, qtype, (n, k))
    full = dequantize(raw, qtype)
    assert weight.shape == (n, k) and weight.qtype == qtype
    assert weight.nbytes == n * k // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1]
    assert_bits_equal(weight.dequantize(), full)

    ids = [12, 0, 5, 5]
    assert_bits_equal(weight.rows(ids), full[ids])
    assert weight.rows([]).shape == (0, k)

    x = rng.standard_normal((3, k)).astype(np.float32)
    assert_close(weight.matmul(x), reference(x, full))
    assert_close(weight.matmul(x[0]), reference(x[:1], full)[0])  # (K,) -> (N,)
    assert_close(weight.matmul(x.reshape(3, 1, k)), reference(x, full).reshape(3, 1, n))
    x40 = rng.standard_normal((40, k)).astype(np.float32)  # prefill-sized
    assert_close(weight.matmul(x40), reference(x40, full))


def test_weight_stays_quantized():
    """Kernel formats never build an fp32 copy; read-only (mmap-like) data is used as is."""
    rng = np.random.default_rng(5)
    raw = random_blocks(Q.Q4_K, 8, 256, rng)
    raw.flags.writeable = False
    weight = QuantizedWeight.from_gguf_tensor(raw, Q.Q4_K, (8, 256))
    weight.matmul(rng.standard_normal((2, 256)).astype(np.float32))
    weight.matmul(rng.standard_normal((20, 256)).astype(np.float32))
    assert weight._fp32 is None
    assert np.shares_memory(weight.data, raw)
    assert weight.has_kernel


def test_errors():
    rng = np.random.default_rng(6)
    raw = random_blocks(Q.Q8_0, 4, 64, rng)
    weight = QuantizedWeight.from_gguf_tensor(raw, Q.Q8_0, (4, 64))
    with pytest.raises(ValueError, match=r"expected \(\.\.\., 64\)"):
        weight.matmul(np.zeros((2, 32), np.float32))
    with pytest.raises(IndexError, match="out of range"):
        weight.rows([4])
    with pytest.raises(IndexError, match="out of range"):
        weight.rows([-1])
    with pytest.raises(ValueError, match="needs 340 bytes, the data has 272"):
        QuantizedWeight.from_gguf_tensor(raw, Q.Q8_0, (5, 64))
    with pytest.raises(ValueError, match="block size"):
        QuantizedWeight.from_gguf_tensor(raw, Q.Q8_0, (4, 48))
    with pytest.raises(UnsupportedQuantError, match="IQ4_NL"):
        QuantizedWeight.from_gguf_tensor(np.zeros((1, 18), np.uint8), Q.IQ4_NL, (1, 32))
    with pytest.raises(ValueError, match="no multi-row kernel for F16"):
        cpu.gemv_rows(np.zeros((4, 32), np.float32), np.zeros((2, 64), np.uint8), Q.F16)


REAL_TYPES = [("smollm2-135m", "Q4_1"), ("smollm2-135m", "Q8_0"), ("qwen2.5-coder-0.5b", "Q5_0"),
              ("qwen2.5-coder-0.5b", "Q8_0"), ("qwen2.5-coder-0.5b", "Q4_K"),
              ("qwen2.5-coder-0.5b", "Q6_K")]


@pytest.mark.slow
@pytest.mark.parametrize("alias, qtype", REAL_TYPES)
def test_real_tensors(alias, qtype):
    """Kernels on real weights (mmap views): SmolLM2 Q4_1/Q8_0, Qwen2.5 Q5_0/Q8_0/Q4_K/Q6_K."""
    from workbench.engine.formats.gguf import open_gguf

    tensors = open_gguf(sources.pull(alias)).tensors.values()
    tensor = min((t for t in tensors if t.qtype.name == qtype and len(t.shape) == 2),
                 key=lambda t: t.shape[0])  # the smallest matrix of that type
    n, k = tensor.shape
    weight = QuantizedWeight.from_gguf_tensor(tensor.data, tensor.qtype, tensor.shape)
    full = dequantize(tensor.data, tensor.qtype)
    rng = np.random.default_rng(0)
    for T in (1, 8, 9):  # gemv, the multi-row kernel, the two-stage kernel
        x = rng.standard_normal((T, k)).astype(np.float32)
        assert_close(weight.matmul(x), reference(x, full))
    ids = rng.integers(0, n, size=5)
    assert_bits_equal(weight.rows(ids), full[ids])


def test_gated_activation_kernels():
    """`layers.silu_mul` (SwiGLU) and `layers.gelu_mul` (GeGLU with tanh-GELU, computed as
    g * sigmoid(2u)) against float64 formulas, over gates from -40 to 40, NaN-poisoned
    outputs of an odd width."""
    from workbench.kernels import layers

    rng = np.random.default_rng(11)
    gate = np.concatenate([np.linspace(-40, 40, 2001), rng.standard_normal(1001) * 3])
    gu = np.stack([np.concatenate([gate, rng.standard_normal(3002)])] * 2).astype(np.float32)
    g, up = gu[:, :3002].astype(np.float64), gu[:, 3002:].astype(np.float64)
    u = np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)
    for kernel, want in ((layers.gelu_mul, 0.5 * g * (1 + np.tanh(u)) * up),
                         (layers.silu_mul, g / (1 + np.exp(-g)) * up)):
        out = np.full((2, 3002), np.nan, np.float32)
        kernel(gu, out)
        np.testing.assert_allclose(out, want, rtol=2e-6, atol=1e-12)  # (e^-60 floor)


def test_exp_and_softmax_kernels():
    """`layers.exp_neg` (vectorizable float32 exp on [-60, 0]) within 3e-7 relative of
    float64 exp over its whole range, and clamped below it; `softmax_rows` equal to a float64
    softmax (with the same e^-60 floor), a masked -inf key included."""
    from numba import njit

    from workbench.kernels import layers

    @njit
    def exps(y, out):
        for i in range(y.shape[0]):
            out[i] = layers.exp_neg(y[i])

    y = -np.linspace(0.0, 70.0, 1_000_003).astype(np.float32)
    out = np.full_like(y, np.nan)
    exps(y, out)
    want = np.exp(np.maximum(y.astype(np.float64), -60.0))
    assert np.max(np.abs(out - want) / want) < 3e-7

    rng = np.random.default_rng(5)
    scores = (rng.standard_normal((7, 1500)) * 8).astype(np.float32)
    scores[3, 10] = -np.inf
    s64 = scores.astype(np.float64)
    e = np.exp(np.maximum(s64 - s64.max(axis=1, keepdims=True), -60.0))
    want = e / e.sum(axis=1, keepdims=True)
    got = scores.copy()
    layers.softmax_rows(got, got.max(axis=1))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)
    assert got[3, 10] > 0


def _attend_reference(qkv, n_head, n_kv, slots, pos, cos, sin, rope_dim, keys, values,
                      src, window, ring):
    """`layers.attend` in plain NumPy (interleaved RoPE pairs, no head norms), on copies:
    returns the output (N, n_head * hd) and the caches with the new keys and values."""
    keys, values = keys.copy(), values.copy()
    hd, group = keys.shape[3], n_head // n_kv
    out = np.zeros((len(pos), n_head * hd), np.float32)

    def rotate(v, p):  # (heads, hd) at position p
        v = v.copy()
        a, b = v[:, 0:rope_dim:2].copy(), v[:, 1:rope_dim:2].copy()
        v[:, 0:rope_dim:2] = a * cos[p] - b * sin[p]
        v[:, 1:rope_dim:2] = a * sin[p] + b * cos[p]
        return v

    for n, p in enumerate(pos):
        heads = qkv[n].reshape(n_head + 2 * n_kv, hd)
        q, k, v = rotate(heads[:n_head], p), rotate(heads[n_head : n_head + n_kv], p), \
            heads[n_head + n_kv :]
        at = p % ring if ring else p
        keys[slots[n], :, at], values[slots[n], :, at] = k, v
        lo = max(0, p - window + 1) if window else 0
        span = np.arange(lo, p + 1)
        where = [src[n, s] if src is not None else slots[n] for s in span]
        rows = span % ring if ring else span
        for h in range(n_head):
            kk = keys[where, h // group, rows].astype(np.float64)  # (S, hd)
            vv = values[where, h // group, rows].astype(np.float64)
            s = kk @ q[h] / np.sqrt(hd)
            w = np.exp(s - s.max())
            out[n, h * hd : (h + 1) * hd] = (w / w.sum()) @ vv
    return out, keys, values


# head sizes: one 8-lane step; one step and 4 single columns; three steps; one block of 64
# columns; a block of 64 and four steps, in tiles of 40 positions (the 41st in a tile alone)
@pytest.mark.parametrize("hd", [8, 12, 24, 64, 96])
@pytest.mark.parametrize("case", ["plain", "window", "ring", "forked"])
def test_attend_matches_numpy(hd, case):
    """Decode attention (one job per sequence and KV head; scores eight positions at a
    time, values 64 columns at a time) against NumPy in float64, for head sizes that are
    and are not multiples of 8 and 64, grouped queries (6 heads on 2 KV heads), sequences
    at different positions (1, 18 and 41 positions: whole groups of eight and the rest),
    sliding windows, rotating caches and forked sequences reading their prefix from other
    slots."""
    from workbench.kernels import layers

    rng = np.random.default_rng(hd)
    n_head, n_kv, L, N = 6, 2, 64, 3
    window = 9 if case in ("window", "ring") else 0
    ring = 16 if case == "ring" else 0
    slots = np.array([2, 0, 3], np.int64)
    pos = np.array([40, 0, 17], np.int64) if not ring else np.array([40, 5, 33], np.int64)
    keys = rng.standard_normal((4, n_kv, L, hd)).astype(np.float32)
    values = rng.standard_normal((4, n_kv, L, hd)).astype(np.float32)
    src = None
    if case == "forked":  # sequence 0 reads positions < 30 from slot 1
        src = np.repeat(slots[:, None], 41, axis=1)
        src[0, :30] = 1
    cos = rng.standard_normal((L, hd // 2)).astype(np.float32)
    sin = rng.standard_normal((L, hd // 2)).astype(np.float32)
    qkv = rng.standard_normal((N, (n_head + 2 * n_kv) * hd)).astype(np.float32)
    want, want_k, want_v = _attend_reference(qkv, n_head, n_kv, slots, pos, cos, sin, hd,
                                             keys, values, src, window, ring)
    out = np.full((N, n_head * hd), np.nan, np.float32)  # poisoned: every entry is written
    k, v = keys.copy(), values.copy()
    empty = np.zeros(0, np.float32)
    layers.attend(qkv.copy(), n_head, n_kv, slots, pos, cos, sin, hd, False, empty, empty,
                  1e-6, k, v, out, src, window, ring)
    np.testing.assert_allclose(k, want_k, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(v, want_v)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hd", [8, 64])
@pytest.mark.parametrize("n_head", [4, 3])  # query heads split evenly between 2 threads or not
def test_attend_splits_a_kv_head_between_threads(hd, n_head):
    """One sequence of a model with one KV head (Gemma 3 270M's shape): its query heads
    are split between the threads (on one thread, one job runs them all). Both give the
    NumPy reference, enough positions that the attention runs on the thread pool."""
    import numba

    from workbench.kernels import layers

    rng = np.random.default_rng(hd + n_head)
    L = 1500
    pos = np.array([L - 20], np.int64)
    assert 2 * n_head * hd * (pos[0] + 1) >= layers.PARALLEL_ATTENTION_MACS
    keys = rng.standard_normal((1, 1, L, hd)).astype(np.float32)
    values = rng.standard_normal((1, 1, L, hd)).astype(np.float32)
    cos = rng.standard_normal((L, hd // 2)).astype(np.float32)
    sin = rng.standard_normal((L, hd // 2)).astype(np.float32)
    qkv = rng.standard_normal((1, (n_head + 2) * hd)).astype(np.float32)
    slots = np.zeros(1, np.int64)
    want, _, _ = _attend_reference(qkv, n_head, 1, slots, pos, cos, sin, hd, keys, values,
                                   None, 0, 0)
    empty = np.zeros(0, np.float32)
    threads = numba.get_num_threads()
    if numba.config.NUMBA_NUM_THREADS < 2:  # a worker of `pytest -n 2` runs one thread
        child = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             f"{__file__}::test_attend_splits_a_kv_head_between_threads[{n_head}-{hd}]"],
            env={**os.environ, "NUMBA_NUM_THREADS": "2"}, capture_output=True, text=True)
        assert child.returncode == 0, child.stdout[-3000:]
        return
    assert threads >= 2, "this check needs at least 2 Numba threads"
    try:
        for n in (1, threads):
            numba.set_num_threads(n)
            out = np.full((1, n_head * hd), np.nan, np.float32)
            layers.attend(qkv.copy(), n_head, 1, slots, pos, cos, sin, hd, False, empty,
                          empty, 1e-6, keys.copy(), values.copy(), out)
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    finally:
        numba.set_num_threads(threads)


def test_compiled_kernels_can_be_cached_on_disk():
    """Every kernel compiled so far in this process (at least the attention on the thread
    pool and a gemv) can go to Numba's disk cache: a kernel that reads a dynamic global
    (numba.get_num_threads() called from compiled code, a ctypes pointer) silently
    recompiles in every process, minutes for the decode stack."""
    import numba
    from numba.core.caching import NullCache

    from workbench.kernels import decode, layers

    rng = np.random.default_rng(0)
    L, hd, n_head = 1500, 8, 4
    keys = rng.standard_normal((1, 1, L, hd)).astype(np.float32)
    cos = rng.standard_normal((L, hd // 2)).astype(np.float32)
    empty = np.zeros(0, np.float32)
    layers.attend(rng.standard_normal((1, (n_head + 2) * hd)).astype(np.float32), n_head, 1,
                  np.zeros(1, np.int64), np.array([L - 20]), cos, cos, hd, False, empty, empty,
                  1e-6, keys, keys.copy(), np.zeros((1, n_head * hd), np.float32))
    w = QuantizedWeight.from_gguf_tensor(random_blocks(Q.Q4_1, 8, 64, rng), Q.Q4_1, (8, 64))
    w.matmul(rng.standard_normal((1, 64)).astype(np.float32))
    w.matmul(rng.standard_normal((8, 64)).astype(np.float32))  # the multi-row kernel
    checked = []
    for module in (cpu, layers, decode):
        for name, f in vars(module).items():
            if isinstance(f, numba.core.registry.CPUDispatcher) and f.overloads:
                assert not isinstance(f._cache, NullCache), f"{name} is not cache=True"
                for compiled in f.overloads.values():
                    assert not compiled.library.has_dynamic_globals, name
                checked.append(name)
    assert {"attend_compiled", "_gemv_q4_1", "_rows_q4_1"} <= set(checked)


@pytest.mark.slow
def test_parallel_kernels_start_one_parallel_region():
    """Each gemv and multi-row kernel is one parallel loop (its prange). In a parallel
    function Numba also turns array expressions (np.zeros, a slice copy) into parallel
    loops, each a thread-pool start of its own: the multi-row kernels once started three,
    which cost 10 of 15 us per call at T = 8. Compiled afresh (not from the disk cache),
    which is where Numba keeps its count of them."""
    from numba import njit

    T, K = 5, 256
    x, y = np.ones((T, K), np.float32), np.empty((T, 4), np.float32)
    for kernels in (cpu.GEMV_KERNELS, cpu.ROWS_KERNELS):
        for qtype, kernel in kernels.items():
            bs, ts = GGML_QUANT_SIZES[qtype]
            fresh = njit(parallel=True, fastmath=cpu._FM)(kernel.py_func)
            fresh(x, np.zeros((4, K // bs * ts), np.uint8), cpu._table(qtype), y, cpu._INNER)
            report = fresh.get_metadata(fresh.signatures[0])["parfor_diagnostics"]
            assert len(report.initial_parfors) == 1, (kernel.__name__, report.initial_parfors)


def test_importing_workbench_first_sets_the_thread_pools_waits_before_numpy_loads():
    # OpenBLAS and libgomp read their variables when they load: workbench must set them
    # without loading NumPy itself, and keep what the user chose
    names = ("OPENBLAS_THREAD_TIMEOUT", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
    code = ("import os, sys; import workbench; print('numpy' in sys.modules, "
            f"*(os.environ.get(n) for n in {names!r}))")
    env = {k: v for k, v in os.environ.items() if k not in names}

    def imported(**chosen: str) -> list[str]:
        return subprocess.run([sys.executable, "-c", code], env={**env, **chosen},
                              capture_output=True, text=True, check=True).stdout.split()

    assert imported() == ["False", "16", "active", "300000", "200"]
    assert imported(OPENBLAS_THREAD_TIMEOUT="24", KMP_BLOCKTIME="0") == \
        ["False", "24", "active", "300000", "0"]
    # a wait policy of the user's own: the OpenMP runtimes' waits are left to it
    assert imported(OMP_WAIT_POLICY="passive") == ["False", "16", "passive", "None", "None"]


_BLAS_DURING_A_PROMPT = """
import sys
if sys.argv[1] == "numpy-first":
    import numpy
from workbench import LLM
from workbench.engine.models import llama
from threadpoolctl import threadpool_info

def blas_threads():
    return [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]

seen, attend = [], llama.causal_attention
def watched(*args, **kwargs):
    seen.append(blas_threads())
    return attend(*args, **kwargs)
llama.causal_attention = watched
m = LLM.load(sys.argv[2])
model = m._require_model()
before = blas_threads()
model.hidden(list(range(3, 23)), model.new_cache(64))  # a 20-token prompt
short = seen[:]
seen.clear()
model.hidden(list(range(3, 103)), model.new_cache(128))  # past the Numba kernels' rows
print(before, short[0], len(set(map(tuple, short))), seen[0], blas_threads())
"""


@pytest.mark.parametrize("order", ["numpy-first", "workbench-first"])
def test_a_short_prompt_keeps_openblas_quiet_where_numpy_came_first(order):
    """Where NumPy (OpenBLAS) was imported before workbench, OpenBLAS's workers spin
    ~0.1 s after each call (OPENBLAS_THREAD_TIMEOUT came too late) and hold the cores
    the Numba kernels' parallel regions need: a short prompt's forward pass then runs
    with OpenBLAS at one thread, and the limit is lifted after it; a long prompt's keeps
    every thread. Imported first, workbench leaves OpenBLAS's threads alone."""
    from tests import goldens
    from tests.goldens.make_tiny_llama import SPECULATIVE

    path = goldens.load(SPECULATIVE).file("target.gguf")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    out = subprocess.run([sys.executable, "-c", _BLAS_DURING_A_PROMPT, order, str(path)],
                         env={**env, "OPENBLAS_NUM_THREADS": "2"}, capture_output=True,
                         text=True, check=True).stdout.strip()
    quiet = "[1]" if order == "numpy-first" else "[2]"
    assert out == f"[2] {quiet} 1 [2] [2]", out
