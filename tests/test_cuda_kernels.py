"""The CUDA kernels of workbench/kernels/gguf.cu and `cuda.STEP_SOURCE`, and their NumPy
stand-in.

- Here (nvcc, no GPU): gguf.cu and STEP_SOURCE compile for sm_80 and define every kernel;
  the dequantize kernels contain no FMA (each weight must round as the reference does).
- `ReferenceKernels` against `gguf.quants.dequantize` on random blocks of every format, and
  its decode attention against the definition.
- `CudaKernels` against the reference, every format, on a CUDA device (marker `gpu`;
  skipped with the reason where CuPy or a device is missing) and here on the CPU, with
  the CUDA source compiled by g++ over tests/support/cuda_emulator.hpp (each block's
  threads as coroutines, barriers and warp shuffles included) and NumPy arrays for CuPy's:
  dequantize bit for bit, matmul (gemv for T <= GEMV_MAX_T, tiles + cuBLAS above) and the
  fused step's products (norm before, bias, residual add or gated activation after) to
  1e-4 of the sum of |x_j * w_j|; the decode step's attention, its RoPE-and-store, RMSNorm,
  RoPE and GLU against the definitions and the host's formulas.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from tests.support import cuda_emulator
from tests.support.quant_blocks import F16_FIELDS, assert_bits_equal, random_blocks
from workbench.engine.models.feed_forward import glu_activation
from workbench.kernels import cuda, quants
from workbench.kernels.cuda import FORMATS, GEMV_MAX_T, SOURCE, ReferenceKernels, kernel_names

FLOATS = (Q.F32, Q.F16, Q.BF16)
# (N, K): N not a multiple of the 4 rows of a gemv block; K of 24 groups (fewer than the 32
# lanes of a warp) and of 72 groups (lanes take several groups each)
SHAPES = [(37, 768), (300, 2304)]


def random_weight(qtype: Q, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(N, row_bytes) uint8: the GGUF bytes of a random (N, K) matrix. Quantized formats
    get random bytes with finite fp16 scales; the first blocks' first scale is set to a
    positive subnormal, a negative subnormal and -0 (the hand-written fp16 decoding)."""
    if qtype == Q.F32:
        return rng.standard_normal((n, k)).astype(np.float32).view(np.uint8)
    if qtype == Q.F16:
        return rng.standard_normal((n, k)).astype(np.float16).view(np.uint8)
    if qtype == Q.BF16:
        bits = rng.standard_normal((n, k)).astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8)
    raw = random_blocks(qtype, n, k, rng)
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[qtype][1])  # a view: (n_blocks, type_size)
    off = F16_FIELDS[qtype][0]
    for i, bits in enumerate((0x0001, 0x83FF, 0x8000)):
        blocks[i, off : off + 2] = np.array([bits], np.uint16).view(np.uint8)
    return raw


def reference_matrix(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """gguf-py's dequantization of the (N, row_bytes) bytes: float32 (N, K)."""
    if qtype == Q.F32:
        return raw.view(np.float32).copy()
    if qtype == Q.F16:
        return raw.view(np.float16).astype(np.float32)
    return gguf.quants.dequantize(raw, qtype)


def check_matmul(y: np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    """y (T, N) against x @ w.T to 1e-4 of each output's sum of |x_j * w_j|."""
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    bound = 1e-4 * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T) + 1e-30
    err = np.abs(y.astype(np.float64) - exact)
    assert y.dtype == np.float32 and y.shape == exact.shape
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert (err <= bound).all(), (f"{(err > bound).sum()} of {y.size} outputs off, worst at "
                                  f"{worst}: {y[worst]} vs {exact[worst]}")


# -- gguf.cu itself ----------------------------------------------------------------------------

def test_every_supported_format_has_kernels():
    assert set(FORMATS) == set(quants.SUPPORTED_TYPES)
    source = SOURCE.read_text()
    for suffix in FORMATS.values():
        assert re.search(rf"^GGUF_KERNELS\({suffix}, \w+\)$", source, re.M), suffix
    assert re.search(rf"constexpr int GEMV_MAX_T = {GEMV_MAX_T};", source)
    assert "#include" not in source  # NVRTC compiles it without any header


def _nvcc() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found: install the CUDA toolkit (or put its bin/ on PATH) "
                    "to compile gguf.cu")
    return nvcc


def _compile(tmp_path, kind: str) -> bytes:
    out = tmp_path / f"gguf.{kind}"
    run = subprocess.run([_nvcc(), "-arch=sm_80", f"--{kind}", "-o", str(out), str(SOURCE)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "warning" not in run.stderr.lower(), run.stderr[-4000:]
    return out.read_bytes()


def test_nvcc_compiles_a_cubin_with_every_kernel(tmp_path):
    cubin = _compile(tmp_path, "cubin")
    assert cubin[:4] == b"\x7fELF"
    names = kernel_names()
    assert len(names) == 3 * len(FORMATS)
    for name in names:  # the symbol names, NUL-terminated in the ELF string table
        assert b"\0" + name.encode() + b"\0" in cubin, name


def test_ptx_entries_and_no_fma_when_dequantizing(tmp_path):
    """Every kernel is an entry point; the dequantize kernels round each product and sum
    on its own (an FMA would round differently from the NumPy reference)."""
    ptx = _compile(tmp_path, "ptx").decode()
    bodies = dict(re.findall(r"\.entry (\w+)\((.*?)\n}", ptx, re.S))
    assert sorted(bodies) == sorted(kernel_names())
    for name, body in bodies.items():
        if name.startswith("dequantize_"):
            assert "fma" not in body, name
    assert "fma" in bodies["gemv_q4_k"]  # the check above does look at the bodies


def test_nvcc_compiles_the_step_kernels(tmp_path):
    """`STEP_SOURCE` (the decode step's attention, norms, RoPE and GLU) compiles without a
    header or a warning and exports every kernel of `STEP_KERNELS`."""
    assert "#include" not in cuda.STEP_SOURCE
    source = tmp_path / "step.cu"
    source.write_text(cuda.STEP_SOURCE)
    out = tmp_path / "step.cubin"
    run = subprocess.run([_nvcc(), "-arch=sm_80", "--std=c++17", "--cubin", "-o", str(out),
                          str(source)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "warning" not in run.stderr.lower(), run.stderr[-4000:]
    cubin = out.read_bytes()
    for name in cuda.STEP_KERNELS:
        assert b"\0" + name.encode() + b"\0" in cubin, name


# (n_head, n_kv, hd, max_len, pos, window): GQA groups, a sliding window, the first and last
# position, head sizes from 12 (not a multiple of 4: no float4 loads) to the largest the
# kernel takes, 80 (256 threads are 3 groups of 80 and 16 idle), and positions over several
# of the kernel's 1,024-position tiles, a window among them
ATTEND_CASES = [(9, 3, 64, 263, 200, 0), (9, 3, 64, 263, 0, 0), (9, 3, 64, 256, 255, 0),
                (4, 2, 16, 615, 599, 8), (14, 2, 64, 307, 150, 0), (8, 4, 256, 263, 100, 16),
                (4, 2, 32, 23, 5, 1), (8, 8, 128, 519, 511, 4096), (6, 3, 12, 40, 33, 0),
                (9, 3, 64, 2600, 2500, 0), (4, 2, 80, 2600, 2100, 1500)]


def _attend_by_head(q, keys, values, pos, window, scale) -> np.ndarray:
    """One query token's attention, head by head in float64: the definition."""
    n_head, hd = q.shape
    group = n_head // keys.shape[0]
    lo = max(0, pos - window + 1) if window else 0
    out = np.empty((n_head, hd))
    for h in range(n_head):
        k, v = keys[h // group, lo : pos + 1], values[h // group, lo : pos + 1]
        s = k.astype(np.float64) @ q[h] * scale
        w = np.exp(s - s.max())
        out[h] = (w / w.sum()) @ v
    return out.reshape(-1)


def _attend_inputs(case, rng):
    """Three rows over a pool of three slots: the case's position in slot 2, a position
    half as far in slot 0, and the first row again (a padded row of a recorded step)."""
    n_head, n_kv, hd, max_len, pos, window = case
    q = rng.standard_normal((3, n_head, hd)).astype(np.float32)
    k = rng.standard_normal((3, n_kv, hd)).astype(np.float32)
    v = rng.standard_normal((3, n_kv, hd)).astype(np.float32)
    q[2], k[2], v[2] = q[0], k[0], v[0]
    keys = rng.standard_normal((3, n_kv, max_len, hd)).astype(np.float32)
    values = rng.standard_normal((3, n_kv, max_len, hd)).astype(np.float32)
    slots, positions = np.array([2, 0, 2], np.int32), np.array([pos, pos // 2, pos], np.int32)
    return q, k, v, keys, values, slots, positions, window, 1.0 / np.sqrt(hd)


def _attend_want(q, k, v, keys, values, slots, positions, window, scale):
    """The caches with each row's key and value written, and each row's attention."""
    keys, values = keys.copy(), values.copy()
    for b, (s, p) in enumerate(zip(slots, positions)):
        keys[s, :, p], values[s, :, p] = k[b], v[b]
    out = np.stack([_attend_by_head(q[b], keys[s], values[s], p, window, scale)
                    for b, (s, p) in enumerate(zip(slots, positions))])
    return keys, values, out


@pytest.mark.parametrize("case", ATTEND_CASES, ids=str)
def test_reference_attend_step(case):
    args = _attend_inputs(case, np.random.default_rng(1))
    keys, values, want = _attend_want(*args)
    out = ReferenceKernels().attend_step(*args)
    assert out.dtype == np.float32 and out.shape == (3, args[0][0].size)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    assert_bits_equal(args[3], keys)
    assert_bits_equal(args[4], values)


def test_attend_step_refuses_rows_that_do_not_fit():
    q, k, v, keys, values, slots, positions, window, scale = _attend_inputs(
        ATTEND_CASES[0], np.random.default_rng(1))
    ref = ReferenceKernels()
    with pytest.raises(ValueError, match="slots and pos must have shape"):
        ref.attend_step(q, k, v, keys, values, slots[:2], positions, window, scale)
    with pytest.raises(ValueError, match="k and v must have shape"):
        ref.attend_step(q, k[:2], v, keys, values, slots, positions, window, scale)
    with pytest.raises(ValueError, match="does not fit"):
        ref.attend_step(q[..., :8], k, v, keys, values, slots, positions, window, scale)


# -- ReferenceKernels ------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda t: t.name)
def test_reference_dequantize(qtype):
    rng = np.random.default_rng(int(qtype))
    n, k = 9, 512
    raw = random_weight(qtype, n, k, rng)
    w = reference_matrix(raw, qtype)
    ref = ReferenceKernels()
    assert ref.supports(qtype) and ref.supports(int(qtype))
    assert_bits_equal(ref.dequantize(raw, qtype, (n, k)), w)
    assert_bits_equal(ref.dequantize(raw, qtype, (n, k), None), w)
    ids = np.array([8, 0, 3, 3], np.int32)
    assert_bits_equal(ref.dequantize(raw, qtype, (n, k), ids), w[ids])
    assert_bits_equal(ref.dequantize(raw.reshape(-1), qtype, (n, k), ids.astype(np.int64)),
                      w[ids])  # any shape of the bytes
    assert ref.dequantize(raw, qtype, (n, k), np.zeros(0, np.int64)).shape == (0, k)


@pytest.mark.parametrize("T", [1, 3, 20])
@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda t: t.name)
def test_reference_matmul(qtype, T):
    rng = np.random.default_rng(10 * int(qtype) + T)
    n, k = 11, 768
    raw = random_weight(qtype, n, k, rng)
    w = reference_matrix(raw, qtype)
    x = rng.standard_normal((T, k)).astype(np.float32)
    y = ReferenceKernels().matmul(raw, qtype, (n, k), x)
    check_matmul(y, x, w)
    y2 = ReferenceKernels().matmul(raw, qtype, (n, k), np.asfortranarray(x))
    np.testing.assert_array_equal(y2, y)


def test_reference_f32_as_float32_data():
    """F32 weights arrive as float32 (N, K) arrays (`QuantizedWeight.data`)."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((5, 64)).astype(np.float32)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    ref = ReferenceKernels()
    assert_bits_equal(ref.dequantize(w, Q.F32, w.shape, [4, 1]), w[[4, 1]])
    check_matmul(ref.matmul(w, Q.F32, w.shape, x), x, w)


def test_bad_inputs_raise_clear_errors():
    ref = ReferenceKernels()
    raw = np.zeros((4, 2 * 144), np.uint8)  # 4 rows of Q4_K with K = 512
    assert not ref.supports(Q.IQ2_XXS) and not ref.supports(999)
    with pytest.raises(quants.UnsupportedQuantError, match="IQ2_XXS"):
        ref.dequantize(raw, Q.IQ2_XXS, (4, 512))
    with pytest.raises(ValueError, match="multiple of 256"):
        ref.dequantize(raw, Q.Q4_K, (8, 256 + 32))
    with pytest.raises(ValueError, match="needs 1152 bytes, the data has 1008"):
        ref.dequantize(raw[:, :252], Q.Q4_K, (4, 512))
    with pytest.raises(ValueError, match="multiple of 32"):
        ref.matmul(np.zeros((2, 40), np.float32), Q.F32, (2, 40), np.zeros((1, 40), np.float32))
    with pytest.raises(ValueError, match=r"shape \(T, 512\)"):
        ref.matmul(raw, Q.Q4_K, (4, 512), np.zeros((1, 256), np.float32))
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        ref.dequantize(raw, Q.Q4_K, (4, 512), [4])


# -- CudaKernels on a GPU --------------------------------------------------------------------

@pytest.fixture(scope="module", params=["cuda", "emulated"])
def cp(request):
    """CuPy on a CUDA device, or the CPU emulator's stand-in for it."""
    if request.param == "emulated":
        return cuda_emulator.emulated_cupy()
    try:
        import cupy
    except ImportError as exc:
        pytest.skip(f"cupy is not installed ({exc})")
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, or a driver too old for this CuPy
        pytest.skip(f"no CUDA device: {exc}")
    if not n:
        pytest.skip("no CUDA device")
    return cupy


@pytest.fixture(scope="module")
def kernels(cp):
    return cuda.CudaKernels(cp)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ATTEND_CASES, ids=str)
def test_cuda_attend_step(cp, kernels, case):
    """The recorded decode step's attention kernels against the definition: each row's key
    and value written into its slot, then its attention; slots and positions are read on
    the device."""
    args = _attend_inputs(case, np.random.default_rng(1))
    keys, values, want = _attend_want(*args)
    on_device = [cp.asarray(a) for a in args[:7]]
    out = kernels.attend_step(*on_device, *args[7:])
    assert out.shape == (3, args[0][0].size)
    np.testing.assert_allclose(cp.asnumpy(out), want, rtol=1e-5, atol=1e-5)
    assert_bits_equal(cp.asnumpy(on_device[3]), keys)
    assert_bits_equal(cp.asnumpy(on_device[4]), values)


@pytest.mark.gpu
def test_cuda_attend_step_over_stored_keys(cp, kernels):
    """Without k and v (the fused step's `rope_store` wrote them), attend_step writes
    nothing and attends as it does after writing them."""
    args = _attend_inputs(ATTEND_CASES[0], np.random.default_rng(1))
    keys, values, want = _attend_want(*args)
    q, slots, positions = (cp.asarray(a) for a in (args[0], args[5], args[6]))
    on_keys, on_values = cp.asarray(keys), cp.asarray(values)
    out = kernels.attend_step(q, None, None, on_keys, on_values, slots, positions, *args[7:])
    np.testing.assert_allclose(cp.asnumpy(out), want, rtol=1e-5, atol=1e-5)
    assert_bits_equal(cp.asnumpy(on_keys), keys)
    assert_bits_equal(cp.asnumpy(on_values), values)


def _glu_bound(r, bound, gelu):
    """Error bound of act(gate) * up from gate and up each within `bound` of r's halves:
    the activation's slope is below 1.2 (SiLU) or 1.13 (tanh GELU), plus float32
    rounding of the terms."""
    gate, up = np.split(r, 2, axis=1)
    g_bound, u_bound = np.split(bound, 2, axis=1)
    act = glu_activation(np, np.concatenate([gate, np.ones_like(up)], axis=1), gelu)
    return 1.2 * np.abs(up) * g_bound + np.abs(act) * u_bound + 1e-6 * (1 + np.abs(act * up))


# (T, epilogue, norm before, bias): one token and a full 64-row step, chunks of 8 tokens
# with a remainder, every epilogue with and without the norm
STEP_CASES = [(1, "store", True, True), (3, "add", False, False), (9, "silu", True, False),
              (64, "gelu", True, True), (40, "store", False, True), (20, "add", True, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", STEP_CASES, ids=str)
@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda t: t.name)
def test_cuda_step_matmul(cp, kernels, qtype, case):
    """The fused step's product against float64: x RMS-normed times the norm weight where
    given, the product with W, the bias; then stored, added to what was there, or gate
    and up rows paired into act(gate) * up; into a block of a wider array's columns,
    the columns around it untouched."""
    t, epilogue, normed, biased = case
    n, k = 38, 768
    rng = np.random.default_rng(1000 * int(qtype) + t)
    raw = random_weight(qtype, n, k, rng)
    w = reference_matrix(raw, qtype).astype(np.float64)
    x = rng.standard_normal((t, k)).astype(np.float32) * 2
    norm = rng.standard_normal(k).astype(np.float32) if normed else None
    bias = rng.standard_normal(n).astype(np.float32) if biased else None
    xn = x.astype(np.float64)
    if normed:
        xn = xn / np.sqrt(np.mean(xn * xn, axis=1, keepdims=True) + 1e-5) * norm
    r = xn @ w.T + (0 if bias is None else bias)
    bound = 1e-4 * (np.abs(xn) @ np.abs(w).T) + 1e-30
    gated = epilogue in ("silu", "gelu")
    width = n // 2 if gated else n
    before = rng.standard_normal((t, width + 7)).astype(np.float32)
    out = cp.asarray(before)
    kernels.step_matmul(cp.asarray(raw), qtype, (n, k), cp.asarray(x), out[:, 3 : 3 + width],
                        None if norm is None else cp.asarray(norm), 1e-5,
                        None if bias is None else cp.asarray(bias), epilogue)
    got = cp.asnumpy(out)
    assert_bits_equal(got[:, :3], before[:, :3])
    assert_bits_equal(got[:, 3 + width :], before[:, 3 + width :])
    got = got[:, 3 : 3 + width].astype(np.float64)
    if epilogue == "store":
        want = r
    elif epilogue == "add":
        want = before[:, 3 : 3 + width] + r
        bound = bound + 1e-7 * np.abs(want)
    else:
        with np.errstate(over="ignore"):  # exp(-gate) of a large negative gate: SiLU -> -0
            want = glu_activation(np, r, epilogue == "gelu")
            bound = _glu_bound(r, bound, epilogue == "gelu")
    worst = np.max(np.abs(got - want) / bound)
    assert worst <= 1, worst


@pytest.mark.gpu
@pytest.mark.parametrize("neox", [False, True], ids=["pairs", "neox"])
@pytest.mark.parametrize("head_norms", [False, True], ids=["plain", "qk-norm"])
def test_cuda_rope_store(cp, kernels, head_norms, neox):
    """The fused step's `rope_store` against the reference (the per-head norms, RoPE as
    `rope`, the stores): three rows, the last the first again, a partial rotary dim."""
    rng = np.random.default_rng(5)
    b, n_head, n_kv, hd, max_len, dim = 3, 6, 2, 64, 40, 48
    qkv = rng.standard_normal((b, (n_head + 2 * n_kv) * hd)).astype(np.float32)
    qkv[2] = qkv[0]
    angles = rng.uniform(0, 100, (max_len, dim // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    q_norm, k_norm = (rng.standard_normal((2, hd)).astype(np.float32) if head_norms
                      else (None, None))
    keys = rng.standard_normal((3, n_kv, max_len, hd)).astype(np.float32)
    values = rng.standard_normal((3, n_kv, max_len, hd)).astype(np.float32)
    slots, pos = np.array([2, 0, 2], np.int32), np.array([39, 7, 39], np.int32)
    want_keys, want_values = keys.copy(), values.copy()
    want = ReferenceKernels().rope_store(qkv, q_norm, k_norm, 1e-6, cos, sin, dim, neox,
                                         want_keys, want_values, slots, pos, n_head)
    on_keys, on_values = cp.asarray(keys), cp.asarray(values)
    got = kernels.rope_store(cp.asarray(qkv), *(None if a is None else cp.asarray(a)
                                                for a in (q_norm, k_norm)),
                             1e-6, cp.asarray(cos), cp.asarray(sin), dim, neox, on_keys,
                             on_values, cp.asarray(slots), cp.asarray(pos), n_head)
    np.testing.assert_allclose(cp.asnumpy(got), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cp.asnumpy(on_keys), want_keys, rtol=1e-5, atol=1e-6)
    assert_bits_equal(cp.asnumpy(on_values), want_values)


# (x shape, with a residual): model rows, per-head rows (Qwen3's q/k norms), a row longer
# than the block's threads take at once, a row shorter than a warp
NORM_CASES = [((3, 576), False), ((3, 576), True), ((2, 5, 64), False), ((1, 4100), True),
              ((4, 12), False)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape, residual", NORM_CASES, ids=str)
def test_cuda_rms_norm(cp, kernels, shape, residual):
    """`rms_norm` (the residual add first, where given) against the host formula."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal(shape).astype(np.float32) * 3
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    add = rng.standard_normal(shape).astype(np.float32) if residual else None
    want = ReferenceKernels().rms_norm(x, w, 1e-5, add)
    got = kernels.rms_norm(cp.asarray(x), cp.asarray(w), 1e-5,
                           None if add is None else cp.asarray(add))
    if residual:
        assert_bits_equal(cp.asnumpy(got[0]), want[0])  # the sum: one float32 add
        want, got = want[1], got[1]
    np.testing.assert_allclose(cp.asnumpy(got), want, rtol=1e-5, atol=1e-6)


# (T, heads, hd, rope_dim, neox): both layouts, all of each head or its leading part
ROPE_CASES = [(3, 9, 64, 64, False), (3, 9, 64, 64, True), (2, 4, 96, 32, False),
              (2, 4, 96, 32, True), (1, 2, 16, 16, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", ROPE_CASES, ids=str)
def test_cuda_rope(cp, kernels, case):
    """`rope` at positions read on the device against `rope.rotate` (the host's)."""
    t, heads, hd, dim, neox = case
    rng = np.random.default_rng(3)
    x = rng.standard_normal((t, heads, hd)).astype(np.float32)
    angles = rng.uniform(0, 100, (50, dim // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    pos = rng.integers(0, 50, t).astype(np.int32)
    want = ReferenceKernels().rope(x, cos, sin, pos, dim, neox)
    got = kernels.rope(*(cp.asarray(a) for a in (x, cos, sin, pos)), dim, neox)
    np.testing.assert_allclose(cp.asnumpy(got), want, rtol=1e-5, atol=1e-6)
    assert_bits_equal(cp.asnumpy(got)[..., dim:], x[..., dim:])


@pytest.mark.gpu
@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu"])
@pytest.mark.parametrize("shape", [(3, 2 * 1536), (1, 2 * 12)], ids=str)
def test_cuda_glu(cp, kernels, shape, gelu):
    """`glu` (gate then up in one row) against the host formula."""
    gu = np.random.default_rng(4).standard_normal(shape).astype(np.float32) * 4
    got = kernels.glu(cp.asarray(gu), gelu)
    # float32 rounding of each term, relative to the terms' size: tanh GELU's 1 + tanh(..)
    # cancels for negative gates, where any float32 evaluation (the host's too) is off by
    # an ulp of |gate * up|
    exact = glu_activation(np, gu.astype(np.float64), gelu)
    gate, up = np.split(gu.astype(np.float64), 2, axis=1)
    bound = 1e-6 * (1.0 + np.abs(gate * up))
    for out in (cp.asnumpy(got), ReferenceKernels().glu(gu, gelu)):
        assert np.all(np.abs(out - exact) <= bound), np.max(np.abs(out - exact) / bound)


@pytest.mark.gpu
def test_cuda_module_has_every_kernel(kernels):
    module = cuda._module(kernels.cp)
    for name in kernel_names():
        module.get_function(name)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda t: t.name)
def test_cuda_dequantize(cp, kernels, qtype, shape):
    n, k = shape
    rng = np.random.default_rng(int(qtype) + n)
    raw = random_weight(qtype, n, k, rng)
    want = ReferenceKernels().dequantize(raw, qtype, shape)
    data = cp.asarray(raw)
    assert_bits_equal(cp.asnumpy(kernels.dequantize(data, qtype, shape)), want)
    ids = rng.integers(0, n, size=50)
    ids[:3] = [n - 1, 0, n - 1]
    for dtype in (np.int32, np.int64):
        got = kernels.dequantize(data, qtype, shape, cp.asarray(ids.astype(dtype)))
        assert_bits_equal(cp.asnumpy(got), want[ids])
    assert_bits_equal(cp.asnumpy(kernels.dequantize(data, qtype, shape, ids[:2])), want[ids[:2]])
    assert kernels.dequantize(data, qtype, shape, cp.zeros(0, cp.int32)).shape == (0, k)
    bad = cp.asnumpy(kernels.dequantize(data, qtype, shape, cp.asarray([n, -1, 1])))
    assert np.isnan(bad[:2]).all()  # out of range: NaN rows, never a read past W
    assert_bits_equal(bad[2], want[1])


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5, 8, 9, 40])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda t: t.name)
def test_cuda_matmul(cp, kernels, qtype, shape, T):
    n, k = shape
    rng = np.random.default_rng(100 * int(qtype) + T + n)
    raw = random_weight(qtype, n, k, rng)
    w = ReferenceKernels().dequantize(raw, qtype, shape)
    x = rng.standard_normal((T, k)).astype(np.float32)
    data = cp.asarray(raw)
    y = cp.asnumpy(kernels.matmul(data, qtype, shape, cp.asarray(x)))
    check_matmul(y, x, w)
    check_matmul(ReferenceKernels().matmul(raw, qtype, shape, x), x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [3, 40])
def test_cuda_matmul_layouts_of_x_and_w(cp, kernels, monkeypatch, T):
    """x transposed or at an offset not 16-byte aligned; F32 W as float32 (N, K);
    prefill in several tiles of W."""
    n, k, qtype = 300, 512, Q.Q4_K
    rng = np.random.default_rng(T)
    raw = random_weight(qtype, n, k, rng)
    w = ReferenceKernels().dequantize(raw, qtype, (n, k))
    x = rng.standard_normal((T, k)).astype(np.float32)
    data = cp.asarray(raw)
    flat = cp.zeros(T * k + 1, cp.float32)
    flat[1:] = cp.asarray(x).reshape(-1)
    for xs in (cp.asarray(np.asfortranarray(x)), flat[1:].reshape(T, k)):
        check_matmul(cp.asnumpy(kernels.matmul(data, qtype, (n, k), xs)), x, w)
    monkeypatch.setattr(cuda, "TILE_WEIGHTS", 64 * k)  # 5 tiles: 4 of 64 rows, one of 44
    check_matmul(cp.asnumpy(kernels.matmul(data, qtype, (n, k), cp.asarray(x))), x, w)
    check_matmul(cp.asnumpy(kernels.matmul(cp.asarray(w), Q.F32, (n, k), cp.asarray(x))), x, w)
    assert kernels.matmul(data, qtype, (n, k), cp.zeros((0, k), cp.float32)).shape == (0, n)


@pytest.mark.gpu
def test_cuda_f16_special_values(cp, kernels):
    """Subnormals, signed zeros, infinities and NaN decode as NumPy's fp16 -> fp32 does."""
    bits = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x8001, 0x0400, 0x7BFF, 0xFBFF,
                     0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE00, 0x3C00, 0xBC00, 0x3555],
                    np.uint16)
    raw = np.tile(bits, 4).reshape(2, 32)  # (N=2, K=32)
    want = raw.view(np.float16).astype(np.float32)
    got = kernels.dequantize(cp.asarray(raw.view(np.uint8)), Q.F16, (2, 32))
    assert_bits_equal(cp.asnumpy(got), want)


@pytest.mark.gpu
def test_cuda_weight_past_2_gib(cp, kernels):
    """Byte offsets of rows beyond 2**31: the last row of a 2.1 GB Q8_0 matrix."""
    if getattr(cp, "emulated", False):
        pytest.skip("half a million rows are too many for the CPU emulator")
    k = 4096
    row_bytes = quants.row_bytes(Q.Q8_0, k)
    n = (2**31 + row_bytes - 1) // row_bytes + 4  # rows n - 4.. start past 2 GiB
    data = cp.zeros(n * row_bytes, cp.uint8)  # all-zero blocks: weights 0
    last = np.zeros((k // 32, 34), np.uint8)
    last[:, :2] = np.array([0.5], np.float16).view(np.uint8)
    last[:, 2:] = np.arange(-16, 16, dtype=np.int8).view(np.uint8)
    data[(n - 1) * row_bytes :] = cp.asarray(last.reshape(-1))
    want = np.tile(0.5 * np.arange(-16, 16, dtype=np.float32), k // 32)
    rows = cp.asnumpy(kernels.dequantize(data, Q.Q8_0, (n, k), cp.asarray([n - 1, 0])))
    np.testing.assert_array_equal(rows, np.stack([want, np.zeros(k, np.float32)]))
    x = np.random.default_rng(0).standard_normal((2, k)).astype(np.float32)
    y = cp.asnumpy(kernels.matmul(data, Q.Q8_0, (n, k), cp.asarray(x)))  # (2, n)
    assert not y[:, : n - 1].any()
    check_matmul(y[:, n - 1 :], x, want[None])
    del data
    cp.get_default_memory_pool().free_all_blocks()
