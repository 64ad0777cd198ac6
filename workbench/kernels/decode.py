"""One decode step of a whole llama-family (or Gemma 3) layer stack in a single Numba call.

Decoding one token per sequence calls ~8 kernels per layer (Q/K/V, attention,
output projection, norm, gate/up, SwiGLU, down, norm); driven from Python that
is ~240 calls per token on a 30-layer model, and their dispatch (argument
checks, NumPy views, Numba's type matching) cost ~1.5 ms of a ~10 ms token on
SmolLM2-135M. `decode_stack` runs the same kernels in the same order from
compiled code: the layer loop, the per-format choice of matmul kernel and the
attention all stay inside Numba, and each parallel kernel is still one
parallel region of its own.

`StackWeights.build(blocks)` gathers what the loop needs once per model:
every projection matrix in a typed list with its GGML type code (a projection
whose parts differ in format, `weights.Stacked`, contributes one entry per
part, each writing its own output columns), the norms stacked by layer, the
optional Q/K/V biases, head norms and Gemma's post-attention and post-FFN
norms, each layer's sliding window and RoPE table. It returns None when some
matrix has no packed-block kernel (F32, or Q2_K/Q3_K kept as fp32 copies) or
the feed-forward is a mixture of experts; the model then keeps the per-kernel
path of `LlamaModel.decode`, which is also the reference that tests compare
this with.

The stack is compiled per model, with the matmul kernels of the formats its
layers use and no others: `stack_module(formats)` writes `_project` and
`_stack` below, with a `_matmul` that branches over those formats only, into
a module in the kernel cache (`cache.cache_dir()/stacks`) and imports it.
Compiling it with what it links takes ~16 s for SmolLM2 (one format) on one
core, once per machine and source version (`workbench.kernels.cache` keys the
disk cache on the sources of everything inlined); later processes load it in
well under a second.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import inspect
import os
import sys
import tempfile
import types as pytypes
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np
from gguf import GGMLQuantizationType
from numba import types
from numba.typed import List

from workbench.kernels import cache, cpu, layers
from workbench.kernels.formats import BY_TYPE
from workbench.kernels.linear import QuantizedWeight

Q = GGMLQuantizationType

# The four projections of a layer, in the order the step runs them.
QKV, OUT, GATE_UP, DOWN = 0, 1, 2, 3

_MATRIX = types.Array(types.uint8, 2, "C", readonly=True)


@dataclass
class StackWeights:
    """The weights of all layers, laid out for `decode_stack` (see the module docstring)."""

    formats: tuple[int, ...]  # the GGML type codes of the matrices, sorted
    mats: List  # typed list of (N, bytes_per_row) uint8 read-only matrices
    parts: np.ndarray  # (P, 4) int64: matrix index, GGML type code, first output column, rows
    first: np.ndarray  # (n_layer * 4 + 1,) int64: parts of projection p of layer l are
    #                    parts[first[4 l + p] : first[4 l + p + 1]]
    widths: np.ndarray  # (n_layer, 4) int64: output width of each projection
    attn_norm: np.ndarray  # (n_layer + 1, D) float32; row n_layer is the final norm
    ffn_norm: np.ndarray  # (n_layer, D) float32
    bqkv: np.ndarray  # (n_layer, W_qkv) float32 or (n_layer, 0) without biases
    q_norm: np.ndarray  # (n_layer, head_dim) float32 or (n_layer, 0) without Q/K norms
    k_norm: np.ndarray
    post_attn_norm: np.ndarray  # (n_layer, D) float32 or (n_layer, 0): Gemma's output norms
    post_ffn_norm: np.ndarray
    gelu: bool  # GeGLU instead of SwiGLU
    windows: np.ndarray  # (n_layer,) int64: each layer's sliding window (0: none)
    rope: np.ndarray  # (n_layer,) int64: each layer's row of cos / sin
    cos: np.ndarray  # (n_tables, max_len, rope_dim // 2) float32 RoPE tables
    sin: np.ndarray

    @classmethod
    def build(cls, blocks, final_norm: np.ndarray) -> StackWeights | None:
        """From `llama.Block`s (or `gemma3.Gemma3Block`s) and the output norm; None if a
        matrix has no packed kernel or a feed-forward has experts."""
        if not all(hasattr(b.ffn, "act") for b in blocks):  # experts
            return None
        mats = List.empty_list(_MATRIX)
        parts, first, widths = [], [], []
        for block in blocks:
            row = []
            for proj in (block.attn.wqkv, block.attn.wo, block.ffn.gate_up, block.ffn.down):
                first.append(len(parts))
                col = 0
                for w in getattr(proj, "parts", [proj]):
                    if not isinstance(w, QuantizedWeight) or w.qtype not in cpu.GEMV_KERNELS:
                        return None
                    parts.append((len(mats), int(w.qtype), col, w.shape[0]))
                    mats.append(w.data)
                    col += w.shape[0]
                row.append(col)
            widths.append(row)
        first.append(len(parts))
        n_layer = len(blocks)
        attn = blocks[0].attn

        def stacked(vectors: list, width: int) -> np.ndarray:
            if vectors[0] is None:
                return np.zeros((n_layer, 0), np.float32)
            return np.ascontiguousarray(np.stack(vectors), dtype=np.float32).reshape(-1, width)

        ropes = list({id(b.attn.rope): b.attn.rope for b in blocks}.values())
        D = final_norm.shape[0]

        return cls(
            formats=tuple(sorted({p[1] for p in parts})),
            mats=mats,
            parts=np.array(parts, np.int64).reshape(-1, 4),
            first=np.array(first, np.int64),
            widths=np.array(widths, np.int64),
            attn_norm=np.stack([b.attn_norm for b in blocks] + [final_norm]).astype(np.float32),
            ffn_norm=np.stack([b.ffn_norm for b in blocks]).astype(np.float32),
            bqkv=stacked([b.attn.bqkv for b in blocks], widths[0][QKV]),
            q_norm=stacked([b.attn.q_norm for b in blocks], attn.cfg.head_dim),
            k_norm=stacked([b.attn.k_norm for b in blocks], attn.cfg.head_dim),
            post_attn_norm=stacked([b.post_attn_norm for b in blocks], D),
            post_ffn_norm=stacked([b.post_ffn_norm for b in blocks], D),
            gelu=blocks[0].ffn.gelu,
            windows=np.array([b.attn.window for b in blocks], np.int64),
            rope=np.array([next(j for j, r in enumerate(ropes) if r is b.attn.rope)
                           for b in blocks], np.int64),
            cos=np.stack([r.cos for r in ropes]),
            sin=np.stack([r.sin for r in ropes]),
        )

    def first_layer(self) -> StackWeights:
        """The first layer alone, then the final norm: arrays of the same types, so
        `decode_stack` runs the same compiled code over one layer (a cheap warm-up)."""
        return dataclasses.replace(
            self, first=self.first[:5], widths=self.widths[:1],
            attn_norm=self.attn_norm[[0, -1]], ffn_norm=self.ffn_norm[:1],
            bqkv=self.bqkv[:1], q_norm=self.q_norm[:1], k_norm=self.k_norm[:1],
            post_attn_norm=self.post_attn_norm[:1], post_ffn_norm=self.post_ffn_norm[:1],
            windows=self.windows[:1], rope=self.rope[:1])


# `_project` and `_stack` are compiled in the module that `stack_module` generates, beside
# a `_matmul(code, x, w, f16, bf16, scratch, xt, rows, y, n)`: y = x @ W.T by the
# packed-block kernel of GGML type `code`, as `cpu.matmul` picks it (T <= 2: gemv; T <=
# `cpu.ROWS_MAX_T`: the multi-row kernel where the format has one; else the two-stage
# kernel with `scratch`, or its outer-product form with `xt` and `rows`);
# `n` is the run-time 16 of `cpu`.


def _project(mats, parts, lo, hi, width, x, f16, bf16, n_threads, n):
    """A projection applied to x (T, K): a new (T, width) array from the matrices
    parts[lo:hi]. lo, hi and width are read from arrays by the caller, so they are run-time
    integers: as literals (the constant QKV ...) each projection would be a specialization
    of its own, compiled four times."""
    T, K = x.shape
    y = np.empty((T, width), np.float32)
    # (threads, 4, K): the two-stage kernel's four dequantized rows per thread
    scratch = np.empty((n_threads if T > 2 else 0, 4, K), np.float32)
    # the outer-product kernel's x and y transposed, and its rows of W per thread
    outer = T >= cpu.OUTER_MIN_T and cpu.OUTER
    xt = np.empty(cpu.loops.outer_shared_floats(K, width) if outer else 0, np.float32)
    rows = np.empty((n_threads if outer else 0, cpu.loops.outer_floats(K)), np.float32)
    if hi - lo == 1:
        _matmul(parts[lo, 1], x, mats[parts[lo, 0]], f16, bf16, scratch, xt, rows, y, n)  # noqa: F821
        return y
    for i in range(lo, hi):  # parts of different formats, side by side in y
        part = np.empty((T, parts[i, 3]), np.float32)
        _matmul(parts[i, 1], x, mats[parts[i, 0]], f16, bf16, scratch, xt, rows,  # noqa: F821
                part, n)
        c0 = parts[i, 2]
        for t in range(T):  # element loops: a slice copy brings Numba's shape checks
            for j in range(parts[i, 3]):
                y[t, c0 + j] = part[t, j]
    return y


def _stack(x, mats, parts, first, widths, attn_norm, ffn_norm, bqkv, q_norm, k_norm,
           post_attn_norm, post_ffn_norm, gelu, windows, rope, eps, n_head, n_kv, head_dim,
           slots, pos, cos, sin, rope_dim, neox, keys, values, src, has_src, ring, f16, bf16,
           n_threads, active_threads, n):
    # n_threads: the pool's size (per-thread scratch, indexed by thread id);
    # active_threads: how many run now (how `attend_compiled` splits its jobs)
    T = x.shape[0]
    h = np.empty_like(x)  # the normed input of the next sub-layer
    layers.rms_norm(x, attn_norm[0], eps, h)
    att = np.empty((T, n_head * head_dim), np.float32)
    n_layer = ffn_norm.shape[0]
    for i in range(n_layer):
        qkv = _project(mats, parts, first[4 * i + QKV], first[4 * i + QKV + 1],
                       widths[i, QKV], h, f16, bf16, n_threads, n)
        if bqkv.shape[1]:
            for t in range(T):
                for j in range(bqkv.shape[1]):
                    qkv[t, j] += bqkv[i, j]
        ring_i = ring if windows[i] else 0  # a rotating layer: each fork has its own ring
        layers.attend_compiled(qkv, n_head, n_kv, slots, pos, cos[rope[i]], sin[rope[i]],
                               rope_dim, neox, q_norm[i], k_norm[i], eps, keys[i], values[i],
                               att, src, has_src and ring_i == 0, windows[i], ring_i,
                               active_threads)
        a = _project(mats, parts, first[4 * i + OUT], first[4 * i + OUT + 1],
                     widths[i, OUT], att, f16, bf16, n_threads, n)
        if post_attn_norm.shape[1]:
            layers.rms_norm(a, post_attn_norm[i], eps, a)
        layers.add_rms_norm(x, a, ffn_norm[i], eps, h)
        gu = _project(mats, parts, first[4 * i + GATE_UP], first[4 * i + GATE_UP + 1],
                      widths[i, GATE_UP], h, f16, bf16, n_threads, n)
        hf = np.empty((T, gu.shape[1] // 2), np.float32)
        if gelu:
            layers.gelu_mul(gu, hf)
        else:
            layers.silu_mul(gu, hf)
        f = _project(mats, parts, first[4 * i + DOWN], first[4 * i + DOWN + 1],
                     widths[i, DOWN], hf, f16, bf16, n_threads, n)
        if post_ffn_norm.shape[1]:
            layers.rms_norm(f, post_ffn_norm[i], eps, f)
        layers.add_rms_norm(x, f, attn_norm[i + 1], eps, h)
    return h


# their source, read once at import (a file edited or replaced since would not match the
# line numbers of the code running)
_TEMPLATES = ["@njit(cache=True)\n" + inspect.getsource(f) for f in (_project, _stack)]


def _matmul_source(formats: tuple[int, ...]) -> str:
    """`_matmul` for these GGML type codes only, one branch per format of the table
    `formats.FORMATS`, each code a named constant (`Q4_1 = 3`) of the generated module."""
    fmts = [BY_TYPE[Q(code)] for code in formats]
    lines = [f"{f.qtype.name} = {int(f.qtype)}  # GGMLQuantizationType.{f.qtype.name}"
             for f in fmts]
    lines += ["", "", "@njit(cache=True)",
              "def _matmul(code, x, w, f16, bf16, scratch, xt, rows, y, n):",
              "    T = x.shape[0]"]
    for i, f in enumerate(fmts):
        table = "bf16" if f.bf16 else "f16"
        lines.append(f"    {'if' if i == 0 else 'elif'} code == {f.qtype.name}:")
        lines.append(f"        if T <= {1 if f.rows else 2}:")
        lines.append(f"            cpu._gemv_{f.name}(x, w, {table}, y, n)")
        if f.rows:
            lines.append("        elif T <= cpu.ROWS_MAX_T:")
            lines.append(f"            cpu._rows_{f.name}(x, w, {table}, y, n)")
        lines.append("        elif T >= cpu.OUTER_MIN_T and cpu.OUTER:")
        lines.append(f"            cpu._outer_{f.name}(x, w, {table}, xt, rows, y, n)")
        lines.append("        else:")
        lines.append(f"            cpu._gemv2_{f.name}(x, w, {table}, scratch, y, n)")
    return "\n".join(lines) + "\n"


def _module_source(formats: tuple[int, ...]) -> str:
    names = ", ".join(Q(c).name for c in formats)
    parts = [f'"""The decode stack for {names} weights, generated by workbench.kernels.decode."""',
             "import numpy as np",
             "from workbench.kernels import cpu, layers",
             "from workbench.kernels.cache import njit",
             f"QKV, OUT, GATE_UP, DOWN = {QKV}, {OUT}, {GATE_UP}, {DOWN}",
             _matmul_source(formats)]
    return "\n\n".join(parts + _TEMPLATES)


_MODULES: dict[tuple[int, ...], pytypes.ModuleType] = {}


def stack_module(formats: tuple[int, ...]) -> pytypes.ModuleType:
    """The module holding `_stack` compiled for weights of these GGML type codes: written
    to the kernel cache once (named by a hash of its text), imported once per process."""
    if formats not in _MODULES:
        text = _module_source(formats)
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        stem = "stack_" + "_".join(Q(c).name.lower() for c in formats) + "_" + digest
        try:
            path = _write_module(cache.cache_dir() / "stacks", stem, text)
        except OSError:  # a read-only cache: the module goes to the temporary folder
            path = _write_module(Path(tempfile.gettempdir()) / "workbench-stacks", stem, text)
        name = f"workbench.kernels.stacks.{stem}"  # under workbench.: our cache locator
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        _MODULES[formats] = module
    return _MODULES[formats]


def _write_module(folder: Path, stem: str, text: str) -> Path:
    path = folder / f"{stem}.py"
    if not path.is_file() or path.read_text() != text:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)  # atomic: other processes see the whole file or none
    return path


def decode_stack_cached(weights: StackWeights) -> bool:
    """Whether the kernel cache holds `decode_stack` compiled for these weights' formats
    with the current sources (read from Numba's index of the stack's cache)."""
    stack = stack_module(weights.formats)._stack
    try:
        return bool(stack._cache._cache_file._load_index())
    except (AttributeError, OSError, EOFError, ValueError):  # Numba's internals moved
        return False


def decode_stack(weights: StackWeights, x: np.ndarray, eps: float, n_head: int, n_kv: int,
                 head_dim: int, slots: np.ndarray, pos: np.ndarray, rope_dim: int, neox: bool,
                 keys: np.ndarray, values: np.ndarray, src: np.ndarray | None,
                 ring: int = 0) -> np.ndarray:
    """All layers for one new token of each of N <= `cpu.GEMV_MAX_T` sequences.

    x: (N, D) float32 token embeddings, the residual stream (updated in place).
    slots, pos: (N,) int64 KV-pool slots and positions; keys, values: the pool's
    (n_layer, n_slots, n_kv, max_len, head_dim) arrays, written at each
    sequence's position; src: None or (N, L) slot of each earlier position
    (forked sequences); ring: the pool's rotating-cache length for the
    sliding-window layers, as in `layers.attend` (0: none). Returns the
    final-normed hidden states (N, D).
    """
    has_src = src is not None
    if src is None:
        src = layers.NO_SRC
    w = weights
    stack = stack_module(w.formats)._stack
    return stack(x, w.mats, w.parts, w.first, w.widths, w.attn_norm, w.ffn_norm, w.bqkv,
                 w.q_norm, w.k_norm, w.post_attn_norm, w.post_ffn_norm, w.gelu, w.windows,
                 w.rope, np.float32(eps), n_head, n_kv, head_dim, slots, pos, w.cos, w.sin,
                 rope_dim, neox, keys, values, src, has_src, ring, cpu.F16_TO_F32,
                 cpu.BF16_TO_F32, numba.config.NUMBA_NUM_THREADS, numba.get_num_threads(),
                 cpu._INNER)
