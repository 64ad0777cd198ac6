"""Devices, their array modules, and model weights resident on them.

`device="auto"` probes metal, cuda, cpu in that order:

- "cpu": the NumPy engine with the compiled kernels of `workbench.kernels` (the models'
  own classes; no `Backend` object is involved).
- "cuda": CuPy on an NVIDIA GPU. Weights are uploaded once in their GGUF formats and
  run by the RawKernels of `workbench/kernels/gguf.cu` (`workbench.kernels.cuda`).
  `Backend.capture` records a step as a CUDA graph (`CudaGraph`), which the LLM's
  decode step uses (`WORKBENCH_CUDA_GRAPHS=0` turns it off). A recorded step may not
  call cuBLAS (`cupy.matmul`, `@`): CuPy raises NotImplementedError for any cuBLAS
  call on a capturing stream. So its products are RawKernels: the gemv kernels (F32
  matrices included) and `Backend.attend_step`.
- "metal": MLX on Apple silicon. "mlx" forces the MLX backend on any platform (on
  macOS that is Metal; on Linux `pip install "mlx[cpu]"` runs it on the CPU, which is
  how its array code is tested without a Mac). Weights whose GGUF format has affine
  groups of 32 go to MLX's quantized matmul unchanged in value; F16 and BF16 stay as
  they are; Q6_K, Q2_K and Q3_K are dequantized once to float32, because float16
  would round their values (d * scale * q needs up to 20 bits; measured on Qwen2.5's
  Q6_K matrices: logits 1.6e-4 off fp32 in float16, 4e-6 in float32).

A `Backend` holds the array module `xp` (cupy or mlx.core) and the few operations
whose spelling differs between them; the device forward passes
(`workbench.engine.models.*.Device*`) are written once against it. Every array that
crosses between host and device goes through `asarray` (host to device) and
`to_host` (device to host), so a test can count the traffic by wrapping `xp`.
"""

from __future__ import annotations

import importlib.util
import os
import platform
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
from gguf import GGMLQuantizationType

from workbench.engine.runtime.formulas import glu_activation, rms_norm, rotate
from workbench.kernels import quants
from workbench.kernels.cuda import GEMV_MAX_T, STEP_MAX_T
from workbench.kernels.linear import QuantizedWeight

DEVICES = ("metal", "cuda", "mlx", "cpu")
PROBE_ORDER = ("metal", "cuda", "cpu")
Q = GGMLQuantizationType
GROUP = 32  # weights per MLX quantization group (every affine GGUF format has runs of 32)


class DeviceUnavailableError(RuntimeError):
    """The requested device is absent, or its array library is not installed."""


def _has_cuda() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no device, or a broken install: not usable
        return False


def _has_metal() -> bool:
    if platform.system() != "Darwin" or importlib.util.find_spec("mlx") is None:
        return False
    try:
        import mlx.core as mx

        return mx.metal.is_available()
    except Exception:
        return False


def available_devices() -> list[str]:
    """Devices present on this machine, in probe order ("mlx" when MLX imports; cpu last)."""
    found = [d for d, ok in (("metal", _has_metal), ("cuda", _has_cuda)) if ok()]
    if importlib.util.find_spec("mlx") is not None:
        found.append("mlx")
    found.append("cpu")
    return found


def resolve_device(device: str = "auto") -> str:
    """Turn "auto" or an explicit device name into the device the engine will use;
    `DeviceUnavailableError` (saying what to install) when an explicit one is absent."""
    if device == "auto":
        found = available_devices()
        return next(d for d in PROBE_ORDER if d in found)
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose one of auto, {', '.join(DEVICES)}")
    if device not in available_devices():
        hint = {"cuda": "an NVIDIA GPU with its driver and `pip install cupy-cuda12x` "
                        "(or cupy-cuda13x, matching the CUDA version)",
                "metal": "Apple silicon and `pip install mlx`",
                "mlx": '`pip install mlx` (on Linux: `pip install "mlx[cpu]"`)'}[device]
        raise DeviceUnavailableError(f"device {device!r} is not available on this machine; "
                                     f"it needs {hint}")
    return device


def get_backend(device: str) -> Backend | None:
    """The backend of a resolved device name; None for "cpu" (the NumPy engine)."""
    if device == "cpu":
        return None
    if device in ("metal", "mlx"):
        return MLXBackend(device)
    if device == "cuda":
        import cupy

        from workbench.kernels.cuda import CudaKernels

        return CupyBackend(cupy, CudaKernels(), name="cuda")
    raise ValueError(f"unknown device {device!r}")


def select_backend(device: str = "auto", backend: Backend | None = None
                   ) -> tuple[str, Backend | None]:
    """The device name a model reports and the backend it runs on: `backend` itself when
    given (the tests' stand-ins), else `device` resolved (None for the cpu)."""
    if backend is not None:
        return backend.name, backend
    name = resolve_device(device)
    return name, get_backend(name)


class DeviceWeight(Protocol):
    """A (N, K) weight matrix resident on a device."""

    shape: tuple[int, int]

    def matmul(self, x: Any) -> Any:
        """x (T, K) float32 -> x @ W.T (T, N) float32."""

    def rows(self, ids: Any) -> Any:
        """Rows `ids` (T,) int of W as float32 (T, K): the embedding lookup."""


# `dtype=` for device weights (binfer's `--dtype`): the float format quantized (and F32)
# matrices are widened to when uploaded, for the device's matrix units; None keeps the file's
WEIGHT_DTYPES = {"f16": Q.F16, "bf16": Q.BF16}
_CONVERT_ROWS = 8192  # rows widened on the host at a time (a vocabulary's embedding is large)


def check_weight_dtype(dtype: str | None, backend: Backend | None) -> None:
    """Refuse a `dtype` that is not one of `WEIGHT_DTYPES`, or any on the CPU (whose
    kernels run the file's own formats)."""
    if dtype is None:
        return
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(WEIGHT_DTYPES)} (or None: the "
                         f"file's formats), got {dtype!r}")
    if backend is None:
        raise ValueError(f"dtype={dtype!r} sets the precision of weights on a device (cuda, "
                         "metal); the CPU engine runs the file's own formats")


def widened(w: QuantizedWeight, dtype: str) -> QuantizedWeight:
    """`w` in the float format `dtype` names (`WEIGHT_DTYPES`): dequantized to float32,
    then rounded to F16 or BF16 by gguf's own writer (`gguf.quants.quantize`, as the
    converters write files); `w` itself when it is in that format."""
    from gguf.quants import quantize

    qtype = WEIGHT_DTYPES[dtype]
    if w.qtype == qtype:
        return w
    n, k = w.shape
    out = np.empty((n, 2 * k), np.uint8)  # (N, bytes per row): two bytes a weight
    for lo in range(0, n, _CONVERT_ROWS):
        rows = w.rows(np.arange(lo, min(n, lo + _CONVERT_ROWS)))  # (rows, K) float32
        out[lo : lo + len(rows)] = np.asarray(quantize(rows, qtype)).view(np.uint8)
    return QuantizedWeight.from_gguf_tensor(out, qtype, (n, k))


class BatchRow:
    """Row `index` of an array `batch` ((N, ...): one step's logits, one per sequence, or
    their picked ids, (N, 1)), kept as the pair instead of sliced. On a GPU each slice is
    an array object of its own, a few microseconds of Python each, so a step of N
    sequences that sliced its logits, stacked them again to pick, and sliced and
    concatenated the ids to feed them back cost O(N) of those per step; `stack_rows`
    gives the batch back whole when its rows come back in order."""

    __slots__ = ("batch", "index")

    def __init__(self, batch: Any, index: int):
        self.batch, self.index = batch, index

    def get(self) -> Any:
        """The row as an array of its own: batch[index]."""
        return self.batch[self.index]


def row_array(row: Any) -> Any:
    """A row as an array of its own: a `BatchRow`'s `get()`, or the array itself."""
    return row.get() if type(row) is BatchRow else row


def stack_rows(xp: Any, rows: list) -> Any:
    """Rows (`BatchRow`s or arrays of one shape) as one array (len(rows), ...): where they
    are rows 0 .. n-1 of one batch, in order, that batch's first n rows (a view: no copy,
    no launch); else a stack of each."""
    first = rows[0]
    if isinstance(first, BatchRow):
        batch = first.batch
        if len(rows) <= len(batch) and all(
                type(r) is BatchRow and r.batch is batch and r.index == i
                for i, r in enumerate(rows)):
            return batch if len(rows) == len(batch) else batch[: len(rows)]
    return xp.stack([row_array(r) for r in rows])


class Backend:
    """An array module and what the device forward passes need beyond it."""

    name: str
    xp: Any
    records = False  # whether `capture` records (the CUDA backend: graphs)
    weight_dtype: str | None = None  # `WEIGHT_DTYPES`: matrices widened at upload

    # -- traffic ------------------------------------------------------------------------
    def asarray(self, a: Any, dtype: Any = None) -> Any:
        """A host array (or list) on the device: the one way in."""
        raise NotImplementedError

    def to_host(self, a: Any) -> np.ndarray:
        """A device array as NumPy: the one way out."""
        raise NotImplementedError

    def eval(self, *arrays: Any) -> None:
        """Force pending computation (MLX is lazy; CuPy runs eagerly)."""

    def capture(self, step: Callable[[], Any]) -> Callable[[], Any] | None:
        """Record `step` so that calling the result replays it at a fraction of its launch
        cost; None where this backend records nothing (the caller then runs `step` itself).

        `step` must be a function of device buffers only: a recording replays the same
        operations on the same memory, so it may not read a value on the host, copy
        between host and device, or decide anything from a Python value that changes
        between calls. Its result is the same device array on every replay (overwritten
        by the next one)."""
        return None

    # -- weights ------------------------------------------------------------------------
    def weight(self, w: Any) -> DeviceWeight:
        """Upload a `QuantizedWeight` (or a `weights.Stacked` of them) once (in
        `weight_dtype` when set)."""
        parts = getattr(w, "parts", None)
        if parts is not None:
            return StackedWeight([self.weight(p) for p in parts], self.xp)
        if self.weight_dtype is not None:
            w = widened(w, self.weight_dtype)
        return self._weight(w)

    def _weight(self, w: QuantizedWeight) -> DeviceWeight:
        raise NotImplementedError

    def vector(self, v: np.ndarray | None) -> Any:
        """A float32 vector (norm weight, bias) on the device; None stays None."""
        return None if v is None else self.asarray(np.asarray(v, np.float32))

    # -- operations that differ between array modules -------------------------------------
    def zeros(self, shape: tuple[int, ...], dtype: Any = None) -> Any:
        return self.xp.zeros(shape, dtype=dtype or self.xp.float32)

    def softmax(self, x: Any, axis: int = -1) -> Any:
        """Softmax in float32 (rows of -inf give NaN, as nowhere to attend is a bug)."""
        xp = self.xp
        e = xp.exp(x - x.max(axis=axis, keepdims=True))
        return e / e.sum(axis=axis, keepdims=True)

    def erf(self, x: Any) -> Any:
        raise NotImplementedError

    # -- the layers' elementwise work: the formulas over `xp`, one kernel each on CUDA ----
    def rms_norm(self, x: Any, weight: Any, eps: float, add: Any = None) -> Any:
        """RMSNorm over the last axis of x (..., n), times weight (n,). With `add` (x's
        shape): the residual sum x + add and its norm, as a pair."""
        if add is None:
            return rms_norm(x, weight, eps, self.xp)
        summed = x + add
        return summed, rms_norm(summed, weight, eps, self.xp)

    def rope(self, x: Any, cos: Any, sin: Any, pos: Any, dim: int, neox: bool) -> Any:
        """x (T, heads, hd), token t rotated by the angles of position pos[t] (pos: (T,)
        int32 on the device; cos, sin: the (max_len, dim / 2) tables): the leading `dim`
        entries of each head, in NEOX halves or interleaved pairs."""
        return rotate(self.xp, x, cos[pos][:, None, :], sin[pos][:, None, :], dim, neox)

    def glu(self, gu: Any, gelu: bool) -> Any:
        """gu (T, 2 n_ff), gate then up -> act(gate) * up (T, n_ff): SiLU, or tanh GELU."""
        return glu_activation(self.xp, gu, gelu)

    # how many sequences one recorded decode step takes (`attend_step` and the products)
    step_rows = 1
    # how many one fused recorded step takes (`rope_store` and the weights' `step_matmul`,
    # each product with the norm before it and the residual add or activation after it);
    # 0 where the backend has no such kernels
    fused_rows = 0

    def rope_store(self, qkv: Any, q_norm: Any, k_norm: Any, eps: float, cos: Any, sin: Any,
                   dim: int, neox: bool, keys: Any, values: Any, slots: Any, pos: Any,
                   n_head: int) -> Any:
        """The fused step's queries, keys and values from its QKV product qkv (B, (n_head
        + 2 n_kv) hd): q and k heads normed per head (where q_norm, k_norm are given) and
        turned by RoPE to position pos[b] ((B,) int32 on the device, with the (max_len,
        dim / 2) tables cos, sin), row b's keys and values written into slot slots[b] of
        one layer's keys and values (n_slots, n_kv, max_len, hd) at pos[b] -> the queries
        (B, n_head, hd). Where `fused_rows` > 0; NotImplementedError elsewhere."""
        raise NotImplementedError(f"the {self.name} backend has no rope_store kernel")

    def attend_step(self, q: Any, k: Any, v: Any, keys: Any, values: Any, slots: Any,
                    pos: Any, window: int, scale: float) -> Any:
        """A recorded decode step's attention in a kernel or two: row b's new key and value
        k[b], v[b] (n_kv, hd) are written at position pos[b] of slot slots[b] ((B,) int32
        device arrays) of one layer's keys and values (n_slots, n_kv, max_len, hd); then
        q[b] (n_head, hd) attends over that slot's positions up to pos[b] (with a window,
        after pos[b] - window) -> (B, n_head * hd). A backend that records provides it;
        NotImplementedError elsewhere."""
        raise NotImplementedError(f"the {self.name} backend has no attend_step kernel")

    def layer_norm(self, x: Any, weight: Any, bias: Any, eps: float) -> Any:
        """LayerNorm over the last axis (BERT's and Whisper's)."""
        xp = self.xp
        d = x - xp.mean(x, axis=-1, keepdims=True)
        var = xp.mean(d * d, axis=-1, keepdims=True)
        return d * (1.0 / xp.sqrt(var + eps)) * weight + bias


class StackedWeight:
    """Matrices of different formats standing in for one stacked matrix (Q, K, V of a
    Q4_K_M file, say): the outputs side by side."""

    def __init__(self, parts: list[DeviceWeight], xp: Any):
        self.parts, self.xp = parts, xp
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])

    def matmul(self, x: Any) -> Any:
        return self.xp.concatenate([p.matmul(x) for p in self.parts], axis=-1)

    def step_matmul(self, x: Any, out: Any, norm: Any = None, eps: float = 0.0,
                    bias: Any = None, epilogue: str = "store") -> None:
        """Each part's `step_matmul` into its block of out's columns ("store" and "add":
        a gated product needs gate and up in one matrix)."""
        if epilogue not in ("store", "add"):
            raise ValueError(f"stacked matrices take the store and add epilogues, not "
                             f"{epilogue!r}")
        start = 0
        for p in self.parts:
            end = start + p.shape[0]
            p.step_matmul(x, out[:, start:end], norm, eps,
                          None if bias is None else bias[start:end], epilogue)
            start = end


# -- CuPy -----------------------------------------------------------------------------------

class CupyBackend(Backend):
    """CuPy, with GGUF weights run by RawKernels.

    `xp` and `kernels` are parameters so that tests run this class with NumPy standing
    in for CuPy and `workbench.kernels.cuda.ReferenceKernels` for the RawKernels.
    """

    step_rows = GEMV_MAX_T  # the gemv kernels take up to this many rows; more go to cuBLAS
    fused_rows = STEP_MAX_T  # the step kernels' (`CudaKernels.step_matmul`, `rope_store`)

    def __init__(self, xp: Any, kernels: Any, name: str = "cuda", graphs: bool | None = None):
        """graphs: whether `capture` records CUDA graphs. None (the default): on CuPy
        unless the environment sets WORKBENCH_CUDA_GRAPHS=0. True with NumPy standing in
        for CuPy: `capture` returns `step` itself, so that the tests run the recorded
        path's Python code."""
        self.xp, self.kernels, self.name = xp, kernels, name
        if graphs is None:
            graphs = xp is not np and os.environ.get("WORKBENCH_CUDA_GRAPHS", "1") != "0"
        self.records = graphs
        self._erf = None

    def asarray(self, a: Any, dtype: Any = None) -> Any:
        return self.xp.asarray(a, dtype=dtype)

    def to_host(self, a: Any) -> np.ndarray:
        asnumpy = getattr(self.xp, "asnumpy", None)
        return asnumpy(a) if asnumpy is not None else np.asarray(a)

    def capture(self, step: Callable[[], Any]) -> Callable[[], Any] | None:
        if not self.records:
            return None
        if self.xp is np or not hasattr(self.xp, "cuda"):  # a stand-in: nothing to record
            return step
        return CudaGraph(self.xp, step)

    def attend_step(self, q: Any, k: Any, v: Any, keys: Any, values: Any, slots: Any,
                    pos: Any, window: int, scale: float) -> Any:
        # the kernels' launches: a recorded step may not call cuBLAS (cupy.matmul), which
        # CuPy refuses while a stream is being captured
        return self.kernels.attend_step(q, k, v, keys, values, slots, pos, window, scale)

    # one kernel each (`workbench.kernels.cuda.STEP_SOURCE`) for what is a dozen CuPy
    # operations: in a recorded step every launch costs more than the work it does
    def rms_norm(self, x: Any, weight: Any, eps: float, add: Any = None) -> Any:
        return self.kernels.rms_norm(x, weight, eps, add)

    def rope(self, x: Any, cos: Any, sin: Any, pos: Any, dim: int, neox: bool) -> Any:
        return self.kernels.rope(x, cos, sin, pos, dim, neox)

    def glu(self, gu: Any, gelu: bool) -> Any:
        return self.kernels.glu(gu, gelu)

    def rope_store(self, qkv: Any, q_norm: Any, k_norm: Any, eps: float, cos: Any, sin: Any,
                   dim: int, neox: bool, keys: Any, values: Any, slots: Any, pos: Any,
                   n_head: int) -> Any:
        return self.kernels.rope_store(qkv, q_norm, k_norm, eps, cos, sin, dim, neox, keys,
                                       values, slots, pos, n_head)

    def _weight(self, w: QuantizedWeight) -> DeviceWeight:
        # float rows that are not whole groups of 32, which the kernels cannot decode (a
        # 48-wide expert, say), go to cuBLAS as float32 / float16. F32 matrices go to the
        # kernels like the rest: their gemv runs the decode step (cuBLAS, which CuPy
        # refuses inside a CUDA graph capture, only multiplies prefill chunks)
        if w.qtype in (Q.F32, Q.F16, Q.BF16) and w.shape[1] % GROUP:
            return DenseWeight(self, w)
        return CupyWeight(self, w)

    def erf(self, x: Any) -> Any:
        if self._erf is None:
            if self.xp is np:
                self._erf = np.vectorize(_math_erf, otypes=[np.float32])
            else:
                from cupyx.scipy.special import erf

                self._erf = erf
        return self._erf(x)


class CudaGraph:
    """`step` captured into a CUDA graph; calling the object launches the graph on the
    current stream and returns the step's result array.

    The capture runs on a stream of its own (capture is not allowed on the legacy
    default stream), in relaxed mode, with a memory pool of its own: the intermediates
    the step allocates keep their addresses for every replay, and nothing else is
    given that memory while the graph lives. The step should have run once eagerly
    before (to compile kernels and create library handles outside the capture).
    """

    def __init__(self, cp: Any, step: Callable[[], Any]):
        self.cp = cp
        self.pool = cp.cuda.MemoryPool()
        stream = cp.cuda.Stream(non_blocking=True)
        with cp.cuda.using_allocator(self.pool.malloc), stream:
            stream.begin_capture()
            try:
                self.out = step()
            except BaseException:
                try:  # end the broken capture; its error is the one to report
                    stream.end_capture()
                except Exception:
                    pass
                raise
            self.graph = stream.end_capture()

    def __call__(self) -> Any:
        self.graph.launch(stream=self.cp.cuda.get_current_stream())
        return self.out


def _math_erf(v: float) -> float:
    import math

    return math.erf(v)


class CupyWeight:
    """A weight matrix on the GPU in its GGUF format (the file's bytes, uploaded once)."""

    def __init__(self, backend: CupyBackend, w: QuantizedWeight):
        self.kernels, self.qtype, self.shape = backend.kernels, w.qtype, w.shape
        if not self.kernels.supports(w.qtype):
            raise DeviceUnavailableError(f"no CUDA kernel for {w.qtype.name} weights")
        self.data = backend.asarray(np.ascontiguousarray(w.data))

    def matmul(self, x: Any) -> Any:
        return self.kernels.matmul(self.data, self.qtype, self.shape, x)

    def step_matmul(self, x: Any, out: Any, norm: Any = None, eps: float = 0.0,
                    bias: Any = None, epilogue: str = "store") -> None:
        """The fused decode step's product into out (`CudaKernels.step_matmul`): x
        RMS-normed times `norm` first where given, + bias, then stored, added (the
        residual), or gate and up rows paired into act(gate) * up ("silu", "gelu")."""
        self.kernels.step_matmul(self.data, self.qtype, self.shape, x, out, norm, eps, bias,
                                 epilogue)

    def rows(self, ids: Any) -> Any:
        return self.kernels.dequantize(self.data, self.qtype, self.shape, ids)


# -- MLX ------------------------------------------------------------------------------------

class MLXBackend(Backend):
    """MLX (`mlx.core`): Metal on Apple silicon, the CPU elsewhere."""

    def __init__(self, name: str = "mlx"):
        import mlx.core as mx

        self.xp, self.name = mx, name

    def asarray(self, a: Any, dtype: Any = None) -> Any:
        arr = self.xp.array(np.asarray(a))
        return arr if dtype is None else arr.astype(dtype)

    def to_host(self, a: Any) -> np.ndarray:
        return np.array(a)

    def eval(self, *arrays: Any) -> None:
        self.xp.eval(*arrays)

    def _weight(self, w: QuantizedWeight) -> DeviceWeight:
        if w.qtype in quants.AFFINE_BITS:
            return MLXQuantizedWeight(self, w)
        return DenseWeight(self, w)

    def erf(self, x: Any) -> Any:
        return self.xp.erf(x)


class MLXQuantizedWeight:
    """A GGUF matrix with affine groups of 32 as MLX quantized weights: 4-bit codes for
    the 4-bit formats, 8-bit codes for Q8_0 and the 5-bit ones (exact either way)."""

    def __init__(self, backend: MLXBackend, w: QuantizedWeight):
        mx = backend.xp
        self.mx, self.shape = mx, w.shape
        codes, scales, biases = quants.affine_groups(w.data, w.qtype)  # (N, K), (N, K/32) x2
        self.bits = 4 if quants.AFFINE_BITS[w.qtype] == 4 else 8
        per_word = 32 // self.bits
        n, k = w.shape
        # MLX packs code i of a row into bits [bits * (i % per_word), ...) of word i // per_word
        shifts = (np.arange(per_word, dtype=np.uint32) * self.bits)[None, None, :]
        words = (codes.reshape(n, k // per_word, per_word).astype(np.uint32) << shifts).sum(
            axis=2, dtype=np.uint32)  # (N, K / per_word)
        self.w = mx.array(words)
        self.scales, self.biases = mx.array(scales), mx.array(biases)

    def matmul(self, x: Any) -> Any:
        return self.mx.quantized_matmul(x, self.w, self.scales, self.biases, transpose=True,
                                        group_size=GROUP, bits=self.bits)

    def rows(self, ids: Any) -> Any:
        return self.mx.dequantize(self.w[ids], self.scales[ids], self.biases[ids],
                                  group_size=GROUP, bits=self.bits)


class DenseWeight:
    """A matrix in a float format on the device: F16, and BF16 where the array module has
    bfloat16 (MLX), as they are (products in float32); the rest as float32 (MLX: Q6_K,
    Q2_K, Q3_K; CuPy: F32, and F16/BF16 rows the kernels cannot decode)."""

    def __init__(self, backend: Backend, w: QuantizedWeight):
        xp = self.xp = backend.xp
        self.shape = w.shape
        if w.qtype == Q.F16:
            self.w = backend.asarray(np.asarray(w.data).reshape(-1).view(np.float16)
                                     .reshape(w.shape))
        elif w.qtype == Q.BF16 and hasattr(xp, "bfloat16"):  # MLX: widen on the host,
            # narrow on the device (NumPy and CuPy have no bfloat16: they keep float32)
            self.w = backend.asarray(w.dequantize()).astype(xp.bfloat16)
        else:
            self.w = backend.asarray(w.dequantize())

    def matmul(self, x: Any) -> Any:
        w = self.w if self.w.dtype == self.xp.float32 else self.w.astype(self.xp.float32)
        return x @ w.T

    def rows(self, ids: Any) -> Any:
        return self.w[ids].astype(self.xp.float32)
