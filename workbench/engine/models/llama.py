"""Llama-family decoders: llama (Llama 2/3, SmolLM2, Mistral, Mixtral), qwen2, qwen3,
their mixture-of-experts variants qwen2moe and qwen3moe, and phi3.

One module serves them all; the differences are flags in `LlamaConfig`:

- llama: RoPE on interleaved pairs (llama.cpp's converter permutes the Q/K rows
  of Hugging Face checkpoints into that layout), optional Llama 3 frequency
  factors (`rope_freqs.weight`) or linear RoPE scaling; Mistral is a llama
  whose file sets `llama.attention.sliding_window`, Mixtral a llama with experts;
- qwen2: biases on the Q, K and V projections, NEOX RoPE (rotate halves);
- qwen3: RMS norm on each head of Q and K before RoPE, NEOX RoPE, an explicit
  head size;
- qwen2moe / qwen3moe: qwen2 / qwen3 with a mixture-of-experts feed-forward
  (`workbench.engine.models.moe`; qwen2moe adds a gated shared expert);
- phi3: NEOX RoPE, the Q/K/V projections stored as one matrix (`attn_qkv`) and
  gate/up as one (`ffn_up`, gate rows first), an optional sliding window, and
  LongRoPE (Phi-3.5, Phi-4-mini): per-pair frequency divisors `rope_factors_long`
  when the context is longer than `rope.scaling.original_context_length`, else
  `rope_factors_short`, and cos/sin scaled by `rope.scaling.attn_factor`
  (chosen once from the context length, as llama.cpp does).

All use grouped-query attention, RMSNorm and a SwiGLU feed-forward (or experts);
the output matrix is `output.weight` or, when the file has none, the tied token
embedding. Weights stay in the file's format
(`workbench.kernels.linear.QuantizedWeight`).

Sliding-window layers attend to their last `sliding_window` positions (the
token itself included); their KV cache rotates when the context is longer than
the window (`workbench.engine.kv_cache`). `workbench.engine.models.gemma3`
builds on the classes here.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
from gguf import GGMLQuantizationType as Q

from workbench.engine.gguf import GGUFError, GGUFFile
from workbench.engine.kv_cache import KVCache, KVPool, LayerKVCache
from workbench.engine.models.moe import DeviceMoEFeedForward, MoEFeedForward
from workbench.engine.models.weights import fused, linear, vector
from workbench.engine.warmup import KernelTask
from workbench.kernels import cpu, layers
from workbench.kernels.decode import StackWeights, decode_stack, decode_stack_cached
from workbench.kernels.linear import QuantizedWeight

ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "phi3")
_NEOX = ("qwen2", "qwen3", "qwen2moe", "qwen3moe", "phi3", "gemma3")
_QK_NORM = ("qwen3", "qwen3moe", "gemma3")
# whether the chosen experts' weights are rescaled to sum to 1, when the file does not say
_EXPERT_NORM = {"llama": True, "qwen2moe": False, "qwen3moe": True}

MAX_NORM_EPS = 1.0  # an RMS-norm epsilon past this (real ones are ~1e-6) would flatten every norm

STEP_SPAN = 256
"""A recorded decode step attends over the cache's positions up to the next multiple of
STEP_SPAN (those after the token masked), so one recording serves STEP_SPAN positions."""
MAX_RECORDINGS = 8
"""Recorded decode steps kept per KV-pool slot (the least recently used is dropped)."""
_RECORDING_ERRORS = (RuntimeError,)  # what CuPy raises when a CUDA graph cannot be made


@dataclass(frozen=True)
class LlamaConfig:
    arch: str
    n_layer: int
    n_embd: int  # model width
    n_ff: int  # feed-forward width
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx_train: int  # context length the model was trained for
    norm_eps: float
    rope_base: float
    rope_dim: int  # leading dims of each head that RoPE rotates
    rope_neox: bool  # rotate (x[i], x[i + d/2]) pairs instead of (x[2i], x[2i+1])
    rope_linear_factor: float  # positions are divided by this (1.0: no scaling)
    qk_norm: bool
    rope_attn_factor: float = 1.0  # cos and sin are multiplied by this (LongRoPE)
    rope_orig_ctx: int = 0  # LongRoPE: contexts longer than this use the long factors
    sliding_window: int = 0  # local layers see this many positions, themselves included
    # with a window: every `swa_pattern`-th layer is global, the others local (0: all local),
    # unless `swa_layers` flags each layer (True: local)
    swa_pattern: int = 0
    swa_layers: tuple[bool, ...] = ()
    n_expert: int = 0  # mixture of experts: experts per layer (0: a dense feed-forward)
    n_expert_used: int = 0  # experts each token is routed to
    expert_weights_norm: bool = True  # the chosen experts' weights are rescaled to sum to 1

    def is_local(self, layer: int) -> bool:
        """Whether `layer` attends through the sliding window."""
        if not self.sliding_window:
            return False
        if self.swa_layers:
            return self.swa_layers[layer]
        return not self.swa_pattern or (layer + 1) % self.swa_pattern != 0

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> LlamaConfig:
        """The settings in `{arch}.*` metadata, each checked to be of the right type, finite
        and in range, and consistent with the others (a `GGUFError` naming the key)."""
        arch = g.architecture
        if arch not in ARCHITECTURES + ("gemma3",):
            raise GGUFError(f"{arch!r} is not a llama-family architecture")
        name = g.path.name

        def get_int(key: str, default: int | None = None, lo: int = 1) -> int:
            return g.get_int(f"{arch}.{key}", default, lo=lo)

        def get_float(key: str, default: float | None = None, hi: float = math.inf) -> float:
            return g.get_float(f"{arch}.{key}", default, hi=hi)

        n_embd = get_int("embedding_length")
        n_head = get_int("attention.head_count")
        n_head_kv = get_int("attention.head_count_kv", n_head)
        if n_head % n_head_kv:
            raise GGUFError(f"{name}: {n_head} query heads do not share {n_head_kv} KV heads "
                            f"evenly ({arch}.attention.head_count_kv must divide head_count)")
        if f"{arch}.attention.key_length" not in g.metadata and n_embd % n_head:
            raise GGUFError(f"{name}: embedding_length {n_embd} does not split into {n_head} "
                            f"heads and the file gives no {arch}.attention.key_length")
        head_dim = get_int("attention.key_length", n_embd // n_head)
        if get_int("attention.value_length", head_dim) != head_dim:
            raise GGUFError("different key and value head sizes are not supported")
        rope_dim = get_int("rope.dimension_count", head_dim)
        if rope_dim > head_dim or rope_dim % 2:
            raise GGUFError(f"{name}: {arch}.rope.dimension_count {rope_dim} must be even and "
                            f"at most the head size {head_dim}")

        def unset(key: str) -> bool:  # absent, or 0 (some converters write 0 for "none")
            value = g.get(f"{arch}.{key}")
            return value is None or (isinstance(value, (int, float)) and value == 0)

        scaling = g.get(f"{arch}.rope.scaling.type", "none")
        if not isinstance(scaling, str):
            raise GGUFError(f"{name}: {arch}.rope.scaling.type must be a string")
        factor = 1.0 if unset("rope.scaling.factor") else get_float("rope.scaling.factor")
        if scaling not in ("none", "linear") and factor != 1.0:
            raise GGUFError(f"RoPE scaling {scaling!r} is not supported (none, linear and "
                            "Llama 3 frequency factors are)")
        n_vocab = _vocab_size(g, arch)
        n_layer = g.layer_count(f"{arch}.block_count")  # checked against the blk.N tensors
        n_expert = get_int("expert_count", 0, lo=0)
        pattern = g.get(f"{arch}.attention.sliding_window_pattern", 0)
        if np.isscalar(pattern):
            swa_pattern, swa_layers = get_int("attention.sliding_window_pattern", 0, lo=0), ()
        elif len(pattern) == n_layer:
            swa_pattern, swa_layers = 0, tuple(bool(v) for v in pattern)
        else:
            raise GGUFError(f"{name}: {arch}.attention.sliding_window_pattern flags "
                            f"{len(pattern)} layers of {n_layer}")
        if arch in ("qwen2moe", "qwen3moe") and not n_expert:
            raise GGUFError(f"{name} lacks the metadata key {arch}.expert_count")
        n_expert_used = get_int("expert_used_count", None, lo=1) if n_expert else 0
        if n_expert_used > n_expert:
            raise GGUFError(f"{name}: {arch}.expert_used_count {n_expert_used} is more than "
                            f"the {n_expert} experts")
        norm_experts = g.get(f"{arch}.expert_weights_norm", _EXPERT_NORM.get(arch, True))
        if not isinstance(norm_experts, (bool, int)):
            raise GGUFError(f"{name}: {arch}.expert_weights_norm must be a boolean")
        return cls(
            arch=arch,
            n_layer=n_layer,
            n_embd=n_embd,
            n_ff=get_int("feed_forward_length"),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_vocab=n_vocab,
            n_ctx_train=get_int("context_length"),
            norm_eps=get_float("attention.layer_norm_rms_epsilon", hi=MAX_NORM_EPS),
            rope_base=get_float("rope.freq_base", 10000.0),
            rope_dim=rope_dim,
            rope_neox=arch in _NEOX,
            rope_linear_factor=factor if scaling == "linear" else 1.0,
            qk_norm=arch in _QK_NORM,
            rope_attn_factor=(1.0 if unset("rope.scaling.attn_factor")
                              else get_float("rope.scaling.attn_factor")),
            rope_orig_ctx=get_int("rope.scaling.original_context_length", 0, lo=0),
            sliding_window=get_int("attention.sliding_window", 0, lo=0),
            swa_pattern=swa_pattern,
            swa_layers=swa_layers,
            n_expert=n_expert,
            n_expert_used=n_expert_used,
            expert_weights_norm=bool(norm_experts),
        )


def _vocab_size(g: GGUFFile, arch: str) -> int:
    """The number of tokens: the tokenizer's, which `{arch}.vocab_size` (when given) and the
    rows of `token_embd.weight` must match, so that every token id has an embedding."""
    tokens = g.require("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise GGUFError(f"{g.path.name}: tokenizer.ggml.tokens must be a non-empty list of "
                        "strings")
    n_vocab = g.get_int(f"{arch}.vocab_size", len(tokens))
    rows = g.tensor("token_embd.weight").shape[0]
    if not n_vocab == len(tokens) == rows:
        raise GGUFError(f"{g.path.name}: the vocabulary does not add up: {len(tokens)} tokens, "
                        f"{arch}.vocab_size {n_vocab}, {rows} rows in token_embd.weight")
    return n_vocab


def check_tensor_shapes(g: GGUFFile, cfg: LlamaConfig) -> None:
    """A `GGUFError` naming the first tensor whose shape does not fit `cfg` (the kernels
    index the weights by the config's sizes, so a mismatch must stop the load)."""
    D, hd, F = cfg.n_embd, cfg.head_dim, cfg.n_ff
    q, kv = cfg.n_head * hd, cfg.n_head_kv * hd
    # the query projection (or phi3's fused one) must be there to check the head sizes
    # against, before the RoPE tables are sized by them
    if "blk.0.attn_qkv.weight" not in g.tensors:
        g.tensor("blk.0.attn_q.weight")
    expected: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (cfg.n_vocab, D), "output.weight": (cfg.n_vocab, D),
        "output_norm.weight": (D,)}
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        expected.update({
            p + "attn_norm.weight": (D,), p + "ffn_norm.weight": (D,),
            p + "post_attention_norm.weight": (D,), p + "post_ffw_norm.weight": (D,),
            p + "attn_q.weight": (q, D), p + "attn_k.weight": (kv, D),
            p + "attn_v.weight": (kv, D), p + "attn_qkv.weight": (q + 2 * kv, D),
            p + "attn_output.weight": (D, q), p + "attn_q.bias": (q,),
            p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,),
            p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)})
        if not cfg.n_expert:
            gated = p + "ffn_gate.weight" in g.tensors  # phi3: gate and up in one ffn_up
            expected.update({p + "ffn_gate.weight": (F, D),
                             p + "ffn_up.weight": (F, D) if gated else (2 * F, D),
                             p + "ffn_down.weight": (D, F)})
            continue
        E = cfg.n_expert
        down = g.tensors.get(p + "ffn_down_exps.weight")
        F_e = down.shape[-1] if down is not None else 0
        expected.update({
            p + "ffn_gate_inp.weight": (E, D), p + "ffn_down_exps.weight": (E, D, F_e),
            p + "ffn_gate_exps.weight": (E, F_e, D), p + "ffn_up_exps.weight": (E, F_e, D),
            p + "ffn_gate_up_exps.weight": (E, 2 * F_e, D)})
        shared = g.tensors.get(p + "ffn_down_shexp.weight")
        F_s = shared.shape[-1] if shared is not None else 0
        expected.update({
            p + "ffn_gate_shexp.weight": (F_s, D), p + "ffn_up_shexp.weight": (F_s, D),
            p + "ffn_down_shexp.weight": (D, F_s), p + "ffn_gate_inp_shexp.weight": (D,)})
    for name, shape in expected.items():
        t = g.tensors.get(name)
        if t is not None and t.shape != shape:
            raise GGUFError(f"{g.path.name}: tensor {name!r} has shape {t.shape}, but the "
                            f"metadata makes it {shape}; the file is damaged or its "
                            "metadata does not belong to its weights")


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis."""
    ms = np.mean(np.square(x), axis=-1, keepdims=True)
    return x * (1.0 / np.sqrt(ms + eps)) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class Rope:
    """Rotary position embedding with cos/sin tables precomputed for `max_len` positions."""

    def __init__(self, cfg: LlamaConfig, max_len: int, freq_factors: np.ndarray | None,
                 base: float | None = None, linear_factor: float | None = None,
                 scale: float = 1.0):
        """`base` and `linear_factor` override the config's (Gemma 3's local layers);
        `freq_factors` divide the frequencies pair by pair (Llama 3, LongRoPE); `scale`
        multiplies cos and sin (LongRoPE's attention factor)."""
        base = cfg.rope_base if base is None else base
        factor = cfg.rope_linear_factor if linear_factor is None else linear_factor
        half = cfg.rope_dim // 2
        inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2.0 / cfg.rope_dim)
        if freq_factors is not None:  # Llama 3 long-context scaling, stored per dimension pair
            inv_freq = inv_freq / freq_factors.astype(np.float64)
        pos = np.arange(max_len, dtype=np.float64) / factor
        angles = np.outer(pos, inv_freq)  # (max_len, half)
        self.cos = (np.cos(angles) * scale).astype(np.float32)
        self.sin = (np.sin(angles) * scale).astype(np.float32)
        self.dim, self.neox = cfg.rope_dim, cfg.rope_neox
        self._inv_freq = inv_freq / factor

    def __call__(self, x: np.ndarray, start: int) -> np.ndarray:
        """Rotate x of shape (T, n_head, head_dim) for positions start .. start+T-1."""
        T = x.shape[0]
        return self._rotate(x, self.cos[start : start + T, None, :],  # (T, 1, half)
                            self.sin[start : start + T, None, :])

    def shift(self, x: np.ndarray, delta: int) -> np.ndarray:
        """Move already rotated x (..., head_dim) by `delta` positions (negative: back);
        rotations add up, so this equals rotating at the new positions (a pure rotation:
        `scale` was applied once, when x was rotated first)."""
        angles = delta * self._inv_freq  # (half,)
        return self._rotate(x, np.cos(angles).astype(np.float32),
                            np.sin(angles).astype(np.float32))

    def _rotate(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        out = x.copy()
        if self.neox:
            half = self.dim // 2
            a, b = x[..., :half], x[..., half : self.dim]
            out[..., :half] = a * cos - b * sin
            out[..., half : self.dim] = a * sin + b * cos
        else:
            a, b = x[..., 0 : self.dim : 2], x[..., 1 : self.dim : 2]
            out[..., 0 : self.dim : 2] = a * cos - b * sin
            out[..., 1 : self.dim : 2] = a * sin + b * cos
        return out


class Attention:
    """Grouped-query self-attention with RoPE (and Qwen's Q/K/V biases or Q/K norms),
    over all earlier positions or, in a local layer, over a sliding window.

    The Q, K and V projections are fused into one matrix when they share a
    format (one matmul per token instead of three).
    """

    def __init__(self, cfg: LlamaConfig, g: GGUFFile, i: int, rope: Rope):
        p = f"blk.{i}."
        self.cfg, self.rope = cfg, rope
        self.window = cfg.sliding_window if cfg.is_local(i) else 0
        if p + "attn_qkv.weight" in g.tensors:  # phi3: stored as one matrix
            self.wqkv = linear(g, p + "attn_qkv.weight")
        else:
            self.wqkv = fused(g, [p + "attn_q.weight", p + "attn_k.weight",
                                  p + "attn_v.weight"])
        self.wo = linear(g, p + "attn_output.weight")
        widths = [cfg.n_head * cfg.head_dim] + [cfg.n_head_kv * cfg.head_dim] * 2
        biases = [vector(g, p + f"attn_{n}.bias", optional=True) for n in "qkv"]
        self.bqkv = None  # Q, K, V biases side by side (a missing one counts as zeros)
        if any(b is not None for b in biases):
            self.bqkv = np.concatenate([np.zeros(n, np.float32) if b is None else b
                                        for b, n in zip(biases, widths)])
        self.q_norm = vector(g, p + "attn_q_norm.weight", optional=not cfg.qk_norm)
        self.k_norm = vector(g, p + "attn_k_norm.weight", optional=not cfg.qk_norm)

    def qkv(self, x: np.ndarray) -> np.ndarray:
        """(T, n_embd) -> (T, (n_head + 2 n_kv) head_dim): Q, K, V side by side, biases added."""
        y = self.wqkv.matmul(x)
        if self.bqkv is not None:
            y += self.bqkv
        return y

    def __call__(self, x: np.ndarray, cache: LayerKVCache, start: int) -> np.ndarray:
        """Prefill: T tokens of one sequence at positions start .. start + T - 1."""
        cfg = self.cfg
        T = x.shape[0]
        n_head, n_kv, hd = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        qkv = self.qkv(x)
        q = qkv[:, : n_head * hd].reshape(T, n_head, hd)
        k = qkv[:, n_head * hd : (n_head + n_kv) * hd].reshape(T, n_kv, hd)
        v = qkv[:, (n_head + n_kv) * hd :].reshape(T, n_kv, hd)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, cfg.norm_eps)
            k = rms_norm(k, self.k_norm, cfg.norm_eps)
        q, k = self.rope(q, start), self.rope(k, start)
        if self.window:
            keys, values, lo = cache.update_and_fetch_window(
                k.transpose(1, 0, 2), v.transpose(1, 0, 2), self.window)
        else:
            keys, values = cache.update_and_fetch(k.transpose(1, 0, 2), v.transpose(1, 0, 2))
            lo = 0
        S = keys.shape[1]  # keys, values: (n_kv, S, hd), positions lo .. start + T - 1
        group = n_head // n_kv
        q = q.reshape(T, n_kv, group, hd).transpose(1, 2, 0, 3)  # (n_kv, group, T, hd)
        scores = np.matmul(q, keys[:, None].transpose(0, 1, 3, 2))  # (n_kv, group, T, S)
        scores *= np.float32(1.0 / np.sqrt(hd))
        key_pos = lo + np.arange(S)[None, :]  # (1, S)
        query_pos = (start + np.arange(T))[:, None]  # (T, 1)
        hidden = key_pos > query_pos  # causal: query t sees keys up to start + t
        if self.window:  # ... and not those `window` or more positions back
            hidden |= key_pos <= query_pos - self.window
        if hidden.any():
            scores += np.where(hidden, np.float32(-np.inf), np.float32(0.0))
        rows = scores.reshape(-1, S)  # a view: (n_kv * group * T, S)
        layers.softmax_rows(rows, rows.max(axis=1))  # in place
        out = np.matmul(scores, values[:, None])  # (n_kv, group, T, hd)
        out = out.transpose(2, 0, 1, 3).reshape(T, n_head * hd)
        return self.wo.matmul(out)

    def decode(self, x: np.ndarray, pool: KVPool, layer: int, slots: np.ndarray,
               pos: np.ndarray, src: np.ndarray | None = None) -> np.ndarray:
        """One token for each of N sequences: x (N, n_embd), the sequences' pool slots and
        positions (N,) -> (N, n_embd). Norms, RoPE, cache writes and attention run in
        one kernel (`workbench.kernels.layers.attend`)."""
        cfg = self.cfg
        qkv = self.qkv(x)
        out = np.empty((x.shape[0], cfg.n_head * cfg.head_dim), np.float32)
        ring = pool.ring if self.window else 0
        layers.attend(qkv, cfg.n_head, cfg.n_head_kv, slots, pos, self.rope.cos, self.rope.sin,
                      self.rope.dim, self.rope.neox,
                      _NONE if self.q_norm is None else self.q_norm,
                      _NONE if self.k_norm is None else self.k_norm,
                      cfg.norm_eps, pool.keys[layer], pool.values[layer], out,
                      None if ring else src,  # a fork has its own copy of a ring
                      self.window, ring)
        return self.wo.matmul(out)


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
        self.act = layers.gelu_mul if act == "gelu" else layers.silu_mul

    def __call__(self, x: np.ndarray) -> np.ndarray:
        gu = self.gate_up.matmul(x)  # (T, 2 n_ff): gate, then up
        h = np.empty((x.shape[0], gu.shape[1] // 2), np.float32)
        self.act(gu, h)
        return self.down.matmul(h)


class Block:
    """Pre-norm residual layer: x + attn(norm(x)), then h + ffn(norm(h))."""

    def __init__(self, cfg: LlamaConfig, g: GGUFFile, i: int, rope: Rope):
        self.eps = cfg.norm_eps
        self.attn_norm = vector(g, f"blk.{i}.attn_norm.weight")
        self.ffn_norm = vector(g, f"blk.{i}.ffn_norm.weight")
        self.attn = Attention(cfg, g, i, rope)
        if cfg.n_expert:
            self.ffn = MoEFeedForward(g, i, cfg.n_expert_used, cfg.expert_weights_norm)
        else:
            self.ffn = FeedForward(g, i)

    def __call__(self, x: np.ndarray, cache: LayerKVCache, start: int) -> np.ndarray:
        h = x + self.attn(rms_norm(x, self.attn_norm, self.eps), cache, start)
        return h + self.ffn(rms_norm(h, self.ffn_norm, self.eps))

    def decode(self, x: np.ndarray, h: np.ndarray, pool: KVPool, layer: int,
               slots: np.ndarray, pos: np.ndarray, src: np.ndarray | None,
               next_norm: np.ndarray) -> None:
        """One token per sequence: x (N, D) the residual stream and h = attn_norm(x), both
        updated in place; h ends as `next_norm` of the new x (the next layer's input)."""
        a = self.attn.decode(h, pool, layer, slots, pos, src)
        layers.add_rms_norm(x, a, self.ffn_norm, self.eps, h)
        f = self.ffn(h)
        layers.add_rms_norm(x, f, next_norm, self.eps, h)


class LlamaModel:
    """A llama-family decoder over the weights of an open GGUF file."""

    embed_scale = 1.0  # token embeddings are multiplied by this (Gemma: sqrt(n_embd))

    def __init__(self, g: GGUFFile, max_len: int):
        self.config = cfg = self.read_config(g)
        check_tensor_shapes(g, cfg)
        self.max_len = max_len
        self.embed = linear(g, "token_embd.weight")
        self.blocks = self.build_blocks(g, cfg, max(max_len, 1))
        self.norm = vector(g, "output_norm.weight")
        self.output = linear(g, "output.weight") if "output.weight" in g.tensors else self.embed
        # decode runs all layers in one compiled call when every matrix has a packed
        # kernel and no layer has experts; set `fused_decode = False` for the per-kernel
        # path (the reference in the tests)
        self._stack = StackWeights.build(self.blocks, self.norm)
        self.fused_decode = self._stack is not None

    @staticmethod
    def read_config(g: GGUFFile) -> LlamaConfig:
        """The architecture's settings from the file's metadata."""
        return LlamaConfig.from_gguf(g)

    def build_blocks(self, g: GGUFFile, cfg: LlamaConfig, max_len: int) -> list[Block]:
        """The layers, with RoPE tables for `max_len` positions."""
        factors = vector(g, "rope_freqs.weight", optional=True)
        if "rope_factors_long.weight" in g.tensors or "rope_factors_short.weight" in g.tensors:
            if not cfg.rope_orig_ctx:
                raise GGUFError(f"{g.path.name} has LongRoPE factors but no "
                                f"{cfg.arch}.rope.scaling.original_context_length")
            which = "long" if max_len > cfg.rope_orig_ctx else "short"
            factors = vector(g, f"rope_factors_{which}.weight")
        if factors is not None and factors.size != cfg.rope_dim // 2:
            raise GGUFError(f"{g.path.name}: {factors.size} RoPE frequency factors for "
                            f"{cfg.rope_dim // 2} rotated pairs")
        if factors is not None and not (np.all(np.isfinite(factors)) and np.all(factors > 0)):
            raise GGUFError(f"{g.path.name}: the RoPE frequency factors must be finite and > 0")
        rope = Rope(cfg, max_len, factors, scale=cfg.rope_attn_factor)
        return [Block(cfg, g, i, rope) for i in range(cfg.n_layer)]

    def new_pool(self, n_slots: int, max_len: int | None = None) -> KVPool:
        """KV-cache room for `n_slots` sequences of up to `max_len` positions each."""
        cfg = self.config
        max_len = min(max_len or self.max_len, self.max_len)
        local = np.array([cfg.is_local(i) for i in range(cfg.n_layer)])
        return KVPool(cfg.n_layer, n_slots, cfg.n_head_kv, cfg.head_dim, max_len,
                      window=cfg.sliding_window, local=local)

    def new_cache(self, max_len: int | None = None) -> KVCache:
        """An empty KV cache for one sequence."""
        return self.new_pool(1, max_len).caches()[0]

    def _check_ids(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.n_vocab):
            raise ValueError(f"token ids must lie in [0, {self.config.n_vocab})")
        return ids

    def hidden(self, ids: np.ndarray, cache: KVCache) -> np.ndarray:
        """Run tokens `ids` (T,) at the cache's next positions; return the final-normed
        hidden states (T, n_embd) and append the tokens' keys and values to the cache."""
        ids = self._check_ids(ids)
        if ids.size == 1:
            return self.decode(ids, [cache])
        start = cache.offset  # layer 0 raises ContextFullError before any write if T won't fit
        x = self._embed(ids)  # (T, n_embd)
        for block, layer_cache in zip(self.blocks, cache.layers):
            x = block(x, layer_cache, start)
        cache.advance(ids)
        return rms_norm(x, self.norm, self.config.norm_eps)

    def _embed(self, ids: np.ndarray) -> np.ndarray:
        x = self.embed.rows(ids)  # (T, n_embd)
        if self.embed_scale != 1.0:
            x *= np.float32(self.embed_scale)
        return x

    def decode(self, ids: np.ndarray, caches: Sequence[KVCache]) -> np.ndarray:
        """One token for each of N sequences in one forward pass.

        ids: (N,) the next token of each sequence; caches: N `KVCache`s of one
        pool (distinct slots), each at its own position. Returns the
        final-normed hidden states (N, n_embd) and appends each token to its cache.
        """
        ids = self._check_ids(ids)
        if len(caches) != ids.size or not caches:
            raise ValueError(f"decode needs one cache per token: {ids.size} ids, "
                             f"{len(caches)} caches")
        pool = caches[0].pool
        if any(c.pool is not pool for c in caches):
            raise ValueError("caches decoded together must come from one KVPool")
        slots = np.array([c.slot for c in caches], dtype=np.int64)
        if len(set(slots.tolist())) != len(caches):
            raise ValueError("each sequence decoded together needs its own KV-pool slot")
        pos = np.array([c.offset for c in caches], dtype=np.int64)
        for c in caches:
            c.check_room(1)
        src = None  # forked sequences read their shared prefix from other slots
        if any(c.shared_until for c in caches):
            src = np.stack([c.sources[: int(pos.max()) + 1] for c in caches])  # (N, L)
        eps = self.config.norm_eps
        x = self._embed(ids)  # (N, n_embd): the residual stream
        if self.fused_decode and ids.size <= cpu.GEMV_MAX_T:
            cfg, rope = self.config, self.blocks[0].attn.rope
            h = decode_stack(self._stack, x, eps, cfg.n_head, cfg.n_head_kv, cfg.head_dim,
                             slots, pos, rope.dim, rope.neox, pool.keys, pool.values, src,
                             pool.ring)
        else:
            h = self._decode_layers(x, pool, slots, pos, src)
        for c, t in zip(caches, ids):
            c.advance([t])
        return h

    def _decode_layers(self, x: np.ndarray, pool: KVPool, slots: np.ndarray, pos: np.ndarray,
                       src: np.ndarray | None) -> np.ndarray:
        """`decode`'s layers one kernel call at a time (x: (N, n_embd), updated in place)."""
        h = np.empty_like(x)  # normed input of the next sub-layer
        layers.rms_norm(x, self.blocks[0].attn_norm, self.config.norm_eps, h)
        for i, block in enumerate(self.blocks):
            nxt = self.blocks[i + 1].attn_norm if i + 1 < len(self.blocks) else self.norm
            block.decode(x, h, pool, i, slots, pos, src, nxt)
        return h

    def kv_remove(self, cache: KVCache, start: int, end: int) -> None:
        """Forget positions start .. end - 1 of `cache`: later positions move back by
        end - start, their keys re-rotated to their new positions (llama.cpp's
        `seq_rm` followed by `seq_add`), as if the removed tokens had never been there."""
        cache.check_span(start, end)
        n = cache.offset
        if cache.shared_until:
            cache.materialize()  # the moved positions must be this cache's own
        if start == end:
            return
        if end == n:  # nothing moves (a rotating cache that lacks the window starts over)
            cache.trim(start)
            return
        shift = end - start
        ring, floor = cache.pool.ring, cache.ring_floor
        if ring and floor > start and max(floor, end) > n - cache.pool.window + 1:
            raise ValueError(f"positions [{start}, {end}) cannot be removed: the sliding-window "
                             f"layers no longer hold the positions before {start} that would "
                             "come into their window; run the remaining tokens again instead")
        for i, block in enumerate(self.blocks):
            keys, values = cache.pool.keys[i, cache.slot], cache.pool.values[i, cache.slot]
            # keys, values: (n_kv_head, max_len, head_dim)
            rope = block.attn.rope
            if ring and block.attn.window:  # a rotating cache holds positions floor .. n - 1
                first = max(floor, end)
                old, new = np.arange(first, n) % ring, np.arange(first - shift, n - shift) % ring
                keys[:, new] = rope.shift(keys[:, old], -shift)
                values[:, new] = values[:, old]
            else:
                keys[:, start : n - shift] = rope.shift(keys[:, end:n], -shift)
                values[:, start : n - shift] = values[:, end:n].copy()
        if ring and floor > start:
            cache.ring_floor = max(floor, end) - shift
        cache.offset = n - shift
        del cache.tokens[start:end]

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """(T, n_embd) final hidden states -> (T, n_vocab) logits."""
        return self.output.matmul(np.ascontiguousarray(hidden, dtype=np.float32))

    def forward(self, ids: np.ndarray, cache: KVCache) -> np.ndarray:
        """Logits (T, n_vocab) at every position of `ids`, appending them to `cache`."""
        return self.logits(self.hidden(ids, cache))

    def kernel_tasks(self) -> list[KernelTask]:
        """The CPU kernels this model runs, as `KernelWarmup` steps in the order a first
        chat needs them: each matrix format's kernels for prompts (the layers' formats for
        any number of rows, the output's for one row, the embedding's row lookup) and
        prefill; then, for the fused decode stack, the kernels it links (each layer
        format's multi-row kernels, the attention and the norms: `helper` tasks when the
        stack is not in the kernel cache yet) and the stack itself."""
        # format: (a matrix of it, the row counts to run it with)
        runs: dict[int, tuple[QuantizedWeight, tuple[int, ...]]] = {}
        for b in self.blocks:
            ffn = (b.ffn.gate_up, b.ffn.down) if isinstance(b.ffn, FeedForward) else ()
            for proj in (b.attn.wqkv, b.attn.wo, *ffn):
                for w in getattr(proj, "parts", [proj]):
                    runs.setdefault(w.qtype, (w, (1, 16, 80)))
        layer_formats = list(runs)
        runs.setdefault(self.output.qtype, (self.output, (1,)))
        runs.setdefault(self.embed.qtype, (self.embed, ()))
        tasks = [KernelTask(f"{Q(qtype).name} matrix kernels", partial(_run_matmuls, w, rows))
                 for qtype, (w, rows) in runs.items() if qtype in cpu.GEMV_KERNELS]
        tasks.append(KernelTask("prefill", self._warm_prefill))
        if not self.fused_decode:
            return [*tasks, KernelTask("decode", self._warm_decode)]
        helper = not decode_stack_cached(self._stack)
        tasks += [KernelTask(f"{Q(qtype).name} batch kernels",
                             partial(_run_matmuls, runs[qtype][0], (4,)), helper)
                  for qtype in layer_formats if qtype in cpu.ROWS_KERNELS]
        tasks.append(KernelTask("attention", self._warm_layers, helper))
        tasks.append(KernelTask(f"decode stack ({self.config.n_layer} layers)",
                                self._warm_decode))
        return tasks

    # The warm-up runs the first layer only: the kernels are the same for every layer, and
    # with a warm cache the tasks then cost next to nothing.

    def _warm_prefill(self) -> None:
        # 16 tokens: attention's softmax and the activations (the matrix kernels for long
        # prompts are compiled on a slice by the format tasks); fewer in a shorter context
        n = min(16, self.max_len)
        if n > 1:
            x = self._embed(np.arange(n) % self.config.n_vocab)
            self.blocks[0](x, self.new_cache(n).layers[0], 0)

    def _warm_decode(self) -> None:
        cfg, rope = self.config, self.blocks[0].attn.rope
        pool = self.new_pool(1, 8)
        x = self._embed(np.array([1]))
        slots = pos = np.zeros(1, np.int64)
        if self.fused_decode:  # the stack over the first layer: the same compiled code
            decode_stack(self._stack.first_layer(), x, cfg.norm_eps, cfg.n_head, cfg.n_head_kv,
                         cfg.head_dim, slots, pos, rope.dim, rope.neox, pool.keys,
                         pool.values, None, pool.ring)
        else:
            h = np.empty_like(x)
            layers.rms_norm(x, self.blocks[0].attn_norm, cfg.norm_eps, h)
            self.blocks[0].decode(x, h, pool, 0, slots, pos, None, self.norm)

    def _warm_layers(self) -> None:
        # the attention and norms the fused stack links, with the types it passes (eps
        # as float32), on zeros
        cfg, attn = self.config, self.blocks[0].attn
        eps, rope, pool = np.float32(cfg.norm_eps), attn.rope, self.new_pool(1, 8)
        qkv = np.zeros((1, (cfg.n_head + 2 * cfg.n_head_kv) * cfg.head_dim), np.float32)
        out = np.empty((1, cfg.n_head * cfg.head_dim), np.float32)
        layers.attend(qkv, cfg.n_head, cfg.n_head_kv, np.zeros(1, np.int64),
                      np.zeros(1, np.int64), rope.cos, rope.sin, rope.dim, rope.neox, _NONE,
                      _NONE, eps, pool.keys[0], pool.values[0], out)
        x, w = np.ones((2, cfg.n_embd), np.float32), np.ones(cfg.n_embd, np.float32)
        layers.rms_norm(x[:1], w, eps, x[1:])
        layers.add_rms_norm(x[:1], x[1:], w, eps, np.empty_like(x[:1]))
        gu, hf = np.zeros((1, 2 * 32), np.float32), np.empty((1, 32), np.float32)
        layers.silu_mul(gu, hf)
        layers.gelu_mul(gu, hf)


def _run_matmuls(w: QuantizedWeight, rows: tuple[int, ...]) -> None:
    """Compile (or load) the kernels `w.matmul` picks for inputs of these many rows, and its
    row lookup; on the first 16 rows of the matrix only."""
    part = QuantizedWeight(w.data[:16], w.qtype, (min(16, w.shape[0]), w.shape[1]))
    for T in rows:
        part.matmul(np.zeros((T, w.shape[1]), np.float32))
    part.rows([0])


_NONE = np.zeros(0, np.float32)  # "no per-head norm" for `layers.attend`


class DeviceLlamaModel:
    """The llama-family forward pass (Gemma 3 included) on a GPU backend's arrays.

    Built from a loaded `LlamaModel`: every weight is uploaded once
    (`Backend.weight`), and the host copies are dropped with the CPU model. The
    caches are a `DeviceKVPool`'s. A decode step moves nothing between host and
    device: in `hidden` positions are Python ints that slice the device's RoPE tables
    and caches, and `hidden` / `device_logits` return device arrays. `step_logits`,
    the generation loop's step, reads the token and its position from device buffers
    instead, so that the backend can record it once and replay it (CUDA graphs:
    one launch per token instead of a few hundred). `logits` returns NumPy, for the
    callers that read every logit (branches, speculative decoding, `LLM.forward`).
    Mixture-of-experts layers copy their routing to the host (`DeviceMoEFeedForward`),
    so their steps are never recorded.
    """

    def __init__(self, model: LlamaModel, backend):
        self.config = model.config
        self.backend, self.xp, self.max_len = backend, backend.xp, model.max_len
        self.embed_scale = float(model.embed_scale)
        self.embed = backend.weight(model.embed)
        self.output = self.embed if model.output is model.embed else backend.weight(model.output)
        self.norm = backend.vector(model.norm)
        self.ropes = [b.attn.rope for b in model.blocks]  # host tables, for kv_remove
        tables = {}  # one device copy of each distinct RoPE table (Gemma: local and global)
        for rope in self.ropes:
            if id(rope) not in tables:
                tables[id(rope)] = (backend.asarray(rope.cos), backend.asarray(rope.sin))
        self.layers = [_DeviceLayer(b, backend, *tables[id(b.attn.rope)]) for b in model.blocks]
        self.gelu = isinstance(model.blocks[0].ffn, FeedForward) and \
            model.blocks[0].ffn.act is layers.gelu_mul
        self.positions = backend.asarray(np.arange(model.max_len, dtype=np.int32))
        # recorded decode steps: where the backend records, for models without experts
        # (their routing goes through the host), until a recording fails
        self._recording = backend.records and all(layer.moe is None for layer in self.layers)

    # -- caches -----------------------------------------------------------------------------
    def new_pool(self, n_slots: int, max_len: int | None = None):
        """Device KV-cache room for `n_slots` sequences of up to `max_len` positions."""
        from workbench.engine.kv_cache import DeviceKVPool

        cfg = self.config
        max_len = min(max_len or self.max_len, self.max_len)
        return DeviceKVPool(self.backend, cfg.n_layer, n_slots, cfg.n_head_kv, cfg.head_dim,
                            max_len)

    def new_cache(self, max_len: int | None = None):
        """An empty device KV cache for one sequence."""
        return self.new_pool(1, max_len).caches()[0]

    # -- forward ----------------------------------------------------------------------------
    def _check_ids(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.n_vocab):
            raise ValueError(f"token ids must lie in [0, {self.config.n_vocab})")
        return ids

    def _embed(self, ids) -> object:
        """ids: host ints or a device int array (a token sampled on the device) -> (T, D)."""
        if isinstance(ids, np.ndarray):
            ids = self.backend.asarray(ids.astype(np.int32))
        x = self.embed.rows(ids)
        return x * self.embed_scale if self.embed_scale != 1.0 else x

    def hidden(self, ids, cache, device_ids=None):
        """Run tokens `ids` (T,) at the cache's next positions; return the final-normed
        hidden states (T, n_embd) on the device. `device_ids`: the same tokens already on
        the device (a sampled token), which saves uploading them."""
        ids = self._check_ids(ids)
        if not ids.size:
            raise ValueError("hidden needs at least one token")
        cache.check_room(ids.size)
        x = self._embed(ids if device_ids is None else device_ids)  # (T, D)
        h = self._layers(x, [cache], [ids.size])
        cache.advance(ids)
        return h

    def decode(self, ids, caches, device_ids=None):
        """One token for each of N caches (of one pool): final-normed hidden states (N, D).
        `device_ids`: the same N tokens already on the device (sampled there)."""
        ids = self._check_ids(ids)
        if len(caches) != ids.size or not caches:
            raise ValueError(f"decode needs one cache per token: {ids.size} ids, "
                             f"{len(caches)} caches")
        if len({id(c.pool) for c in caches}) > 1:
            raise ValueError("caches decoded together must come from one pool")
        if len({c.slot for c in caches}) != len(caches):
            raise ValueError("each sequence decoded together needs its own KV-pool slot")
        for c in caches:
            c.check_room(1)
        h = self._layers(self._embed(ids if device_ids is None else device_ids), caches,
                         [1] * len(caches))
        for c, t in zip(caches, ids):
            c.advance([int(t)])
        return h

    def _layers(self, x, caches, counts):
        """x (sum(counts), D): `counts[i]` tokens of `caches[i]`, each at its next positions."""
        cfg, be = self.config, self.backend
        return self._stack(x, lambda i, layer, h: layer.attention(be, cfg, h, caches, counts, i))

    def _stack(self, x, attend):
        """The layers and the final norm; `attend(i, layer, h)` is layer i's attention of
        its normed input h."""
        cfg, be = self.config, self.backend
        for i, layer in enumerate(self.layers):
            h = _rms(be, x, layer.attn_norm, cfg.norm_eps)
            a = attend(i, layer, h)
            if layer.post_attn_norm is not None:
                a = _rms(be, a, layer.post_attn_norm, cfg.norm_eps)
            x = x + a
            h = _rms(be, x, layer.ffn_norm, cfg.norm_eps)
            f = layer.moe(h) if layer.moe is not None else self._feed_forward(layer, h)
            if layer.post_ffn_norm is not None:
                f = _rms(be, f, layer.post_ffn_norm, cfg.norm_eps)
            x = x + f
        return _rms(be, x, self.norm, cfg.norm_eps)

    def _feed_forward(self, layer, h):
        gu = layer.gate_up.matmul(h)  # (T, 2 n_ff): gate, then up
        n_ff = gu.shape[1] // 2
        gate, up = gu[:, :n_ff], gu[:, n_ff:]
        if self.gelu:  # tanh GELU
            act = 0.5 * gate * (1.0 + self.xp.tanh(0.7978845608028654 * (
                gate + 0.044715 * gate * gate * gate)))
        else:
            act = gate / (1.0 + self.xp.exp(-gate))
        return layer.down.matmul(act * up)

    # -- decoding one sequence, recorded ---------------------------------------------------
    def step_logits(self, token: int, cache, device_token):
        """Feed one sampled token (`token` on the host, `device_token` the same id still
        on the device, shape (1,)) at the cache's next position; return the logits
        (n_vocab,) on the device.

        Where the backend records (`Backend.capture`: CUDA graphs), the step runs from a
        recording of its kernels, one per slot and span of `STEP_SPAN` positions
        (`_StepRecordings`); else, and for mixture-of-experts models, it is `hidden`
        then `device_logits`."""
        if not self._recording:
            return self._direct_step(token, cache, device_token)
        self._check_ids([token])
        cache.check_room(1)
        pool = cache.pool
        recordings = pool.recordings.get(cache.slot)
        if recordings is None:
            recordings = pool.recordings[cache.slot] = _StepRecordings(self, pool, cache.slot)
        try:
            logits = recordings.run(device_token, cache.offset)
        except _RECORDING_ERRORS as e:  # the backend could not record it: run unrecorded
            warnings.warn(f"recording the decode step failed ({e}); decoding without it",
                          RuntimeWarning, stacklevel=2)
            self._recording = False
            pool.recordings.clear()
            return self._direct_step(token, cache, device_token)
        cache.advance([token])
        return logits

    def _direct_step(self, token: int, cache, device_token):
        """`step_logits` unrecorded: `hidden` at the cache's positions, then the logits."""
        return self.device_logits(self.hidden(np.asarray([token]), cache, device_token))[0]

    def _recorded_step(self, token, pos, keys, values, length: int):
        """The decode step as `Backend.capture` records it: token (1,) and pos (1,) int32
        device buffers, the slot's keys and values per layer ((n_kv, max_len, hd) views
        into the pool), attention over the first `length` positions (those past `pos`
        masked). Nothing here depends on the position as a Python value."""
        cfg, be = self.config, self.backend
        x = self._embed(token)  # (1, D)
        h = self._stack(x, lambda i, layer, h: layer.attend_at(
            be, cfg, h, keys[i], values[i], pos, self.positions[:length]))
        return self.device_logits(h)  # (1, n_vocab)

    def device_logits(self, hidden):
        """(T, n_embd) device hidden states -> (T, n_vocab) device logits."""
        return self.output.matmul(hidden)

    def logits(self, hidden) -> np.ndarray:
        """(T, n_embd) hidden states -> (T, n_vocab) logits as NumPy."""
        if isinstance(hidden, np.ndarray):
            hidden = self.backend.asarray(hidden.astype(np.float32))
        return self.backend.to_host(self.device_logits(hidden))

    def forward(self, ids, cache) -> np.ndarray:
        """Logits (T, n_vocab), as NumPy, at every position of `ids`."""
        return self.logits(self.hidden(ids, cache))

    def kv_remove(self, cache, start: int, end: int) -> None:
        """`LlamaModel.kv_remove` on a device cache: the moved keys are re-rotated on the
        host (a rare edit, not the decode path)."""
        cache.check_span(start, end)
        n, shift = cache.offset, end - start
        if shift and end < n:
            be = self.backend
            for i, rope in enumerate(self.ropes):
                keys, values = cache.pool.keys[i], cache.pool.values[i]
                moved = be.to_host(keys[cache.slot, :, end:n])  # (n_kv, n - end, hd)
                keys[cache.slot, :, start : n - shift] = be.asarray(rope.shift(moved, -shift))
                values[cache.slot, :, start : n - shift] = values[cache.slot, :, end:n] + 0.0
        cache.offset = n - shift
        del cache.tokens[start:end]


class _StepRecordings:
    """The recorded decode steps of one KV-pool slot, one per span of `STEP_SPAN`
    positions, in least-recently-used order. The token and its position reach a
    recording through two device buffers, written before each replay (a device copy
    and a fill: nothing crosses from the host but a kernel argument)."""

    def __init__(self, model: DeviceLlamaModel, pool, slot: int):
        xp = model.xp
        self.model, self.max_len = model, pool.max_len
        self.token = xp.zeros((1,), dtype=xp.int32)
        self.pos = xp.zeros((1,), dtype=xp.int32)
        self.keys = [k[slot] for k in pool.keys]  # (n_kv, max_len, hd) views, per layer
        self.values = [v[slot] for v in pool.values]
        self.steps: OrderedDict[int, object] = OrderedDict()

    def run(self, device_token, offset: int):
        """Logits (n_vocab,) on the device of the token `device_token` (1,) at `offset`."""
        self.token[...] = device_token
        self.pos.fill(offset)
        length = min(self.max_len, (offset // STEP_SPAN + 1) * STEP_SPAN)
        step = self.steps.get(length)
        if step is not None:
            self.steps.move_to_end(length)
            return step()[0].copy()  # the recording's output is overwritten by its next replay

        def unrecorded():
            return self.model._recorded_step(self.token, self.pos, self.keys, self.values,
                                             length)

        logits = unrecorded()  # this step, run directly: kernels compile before the capture
        recorded = self.model.backend.capture(unrecorded) or unrecorded
        if recorded is not unrecorded:
            self._check(recorded(), logits)
        self.steps[length] = recorded
        if len(self.steps) > MAX_RECORDINGS:
            self.steps.popitem(last=False)
        return logits[0]

    def _check(self, replayed, direct) -> None:
        """A new recording replayed once (the same token at the same position: it writes
        what the direct run wrote) must give the direct run's logits; else RuntimeError
        (`step_logits` then stops recording). One float comes to the host per recording."""
        xp = self.model.xp
        err = float(xp.abs(replayed - direct).max())
        scale = float(xp.abs(direct).max())
        if not err <= 1e-4 * scale:  # also catches NaN
            raise RuntimeError(f"the recorded decode step disagrees with the direct one "
                               f"(max |difference| {err:.3g}, logits up to {scale:.3g})")


def _rms(be, x, weight, eps: float):
    """RMSNorm over the last axis on device arrays."""
    xp = be.xp
    return x * (1.0 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + eps)) * weight


class _DeviceLayer:
    """One layer's weights on the device, and its attention."""

    def __init__(self, block: Block, backend, cos, sin):
        attn = block.attn
        self.attn_norm = backend.vector(block.attn_norm)
        self.ffn_norm = backend.vector(block.ffn_norm)
        self.post_attn_norm = backend.vector(getattr(block, "post_attn_norm", None))
        self.post_ffn_norm = backend.vector(getattr(block, "post_ffn_norm", None))
        self.wqkv = backend.weight(attn.wqkv)
        self.bqkv = backend.vector(attn.bqkv)
        self.wo = backend.weight(attn.wo)
        self.q_norm, self.k_norm = backend.vector(attn.q_norm), backend.vector(attn.k_norm)
        self.moe = None
        if isinstance(block.ffn, MoEFeedForward):
            self.moe = DeviceMoEFeedForward(block.ffn, backend)
        else:
            self.gate_up = backend.weight(block.ffn.gate_up)
            self.down = backend.weight(block.ffn.down)
        self.window = attn.window
        self.cos, self.sin = cos, sin  # (max_len, rope_dim / 2)
        self.rope_dim, self.neox = attn.rope.dim, attn.rope.neox

    def _rope(self, xp, x, cos, sin):
        """Rotate x (T, heads, head_dim) by the angles' cos and sin (T, 1, rope_dim / 2)."""
        d = self.rope_dim
        if self.neox:
            a, b = x[..., : d // 2], x[..., d // 2 : d]
            parts = [a * cos - b * sin, a * sin + b * cos]
        else:  # interleaved pairs (x[2i], x[2i+1]): rotate, then interleave back
            a, b = x[..., 0:d:2], x[..., 1:d:2]
            pairs = xp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1)  # (T, H, d/2, 2)
            parts = [pairs.reshape(*x.shape[:-1], d)]
        if d < x.shape[-1]:
            parts.append(x[..., d:])
        return xp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]

    def _qkv(self, be, cfg: LlamaConfig, h):
        """h (T, D) normed input -> q (T, n_head, hd), k and v (T, n_kv, hd), before RoPE."""
        n_head, n_kv, hd = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        qkv = self.wqkv.matmul(h)
        if self.bqkv is not None:
            qkv = qkv + self.bqkv
        T = qkv.shape[0]
        q = qkv[:, : n_head * hd].reshape(T, n_head, hd)
        k = qkv[:, n_head * hd : (n_head + n_kv) * hd].reshape(T, n_kv, hd)
        v = qkv[:, (n_head + n_kv) * hd :].reshape(T, n_kv, hd)
        if self.q_norm is not None:
            q = _rms(be, q, self.q_norm, cfg.norm_eps)
            k = _rms(be, k, self.k_norm, cfg.norm_eps)
        return q, k, v

    def _attend(self, be, cfg: LlamaConfig, q, kk, vv, hidden):
        """q (T, n_head, hd) over keys and values kk, vv (n_kv, S, hd), with `hidden`
        (T, S) or (S,) True where a query may not look (None: nowhere) -> (T, n_head * hd)."""
        xp = be.xp
        T, (n_head, n_kv, hd) = q.shape[0], (cfg.n_head, cfg.n_head_kv, cfg.head_dim)
        qg = q.reshape(T, n_kv, n_head // n_kv, hd).transpose(1, 2, 0, 3)  # (n_kv, group, T, hd)
        scores = (qg @ kk[:, None].swapaxes(-1, -2)) * (1.0 / float(np.sqrt(hd)))
        if hidden is not None:  # scores: (n_kv, group, T, S)
            scores = xp.where(hidden, -np.inf, scores)
        out = be.softmax(scores, axis=-1) @ vv[:, None]  # (n_kv, group, T, hd)
        return out.transpose(2, 0, 1, 3).reshape(T, n_head * hd)

    def attention(self, be, cfg: LlamaConfig, h, caches, counts, layer: int):
        """h (sum(counts), D) normed input -> (sum(counts), D) attention output; writes each
        sequence's new keys and values into its cache."""
        xp = be.xp
        q, k, v = self._qkv(be, cfg, h)
        outs, row = [], 0
        for cache, count in zip(caches, counts):  # each sequence at its own positions
            span = slice(row, row + count)
            outs.append(self._attend_one(be, cfg, q[span], k[span], v[span], cache, layer))
            row += count
        out = outs[0] if len(outs) == 1 else xp.concatenate(outs, axis=0)
        return self.wo.matmul(out)

    def _attend_one(self, be, cfg: LlamaConfig, q, k, v, cache, layer: int):
        """One sequence: q (T, n_head, hd), k, v (T, n_kv, hd) at positions start ..
        start + T - 1 -> (T, n_head * hd)."""
        xp = be.xp
        start, T = cache.offset, q.shape[0]
        end = start + T
        cos, sin = self.cos[start:end, None, :], self.sin[start:end, None, :]
        q, k = self._rope(xp, q, cos, sin), self._rope(xp, k, cos, sin)
        keys, values = cache.pool.keys[layer], cache.pool.values[layer]
        keys[cache.slot, :, start:end] = k.transpose(1, 0, 2)
        values[cache.slot, :, start:end] = v.transpose(1, 0, 2)
        lo = max(0, start - self.window + 1) if self.window else 0
        hidden = None
        if T > 1:  # query t at start + t sees keys up to it
            key_pos = xp.arange(lo, end)[None, :]
            query_pos = xp.arange(start, end)[:, None]
            hidden = key_pos > query_pos
            if self.window:
                hidden = hidden | (key_pos <= query_pos - self.window)
        return self._attend(be, cfg, q, keys[cache.slot, :, lo:end],
                            values[cache.slot, :, lo:end], hidden)

    def attend_at(self, be, cfg: LlamaConfig, h, keys, values, pos, key_pos):
        """The recorded step's attention: one token h (1, D) at position `pos` (1,) int32
        on the device, writing into keys and values ((n_kv, max_len, hd) views of one
        slot) and attending over the positions `key_pos` (S,), with those after `pos`
        (and, in a sliding window, those too far behind it) masked -> (1, D)."""
        q, k, v = self._qkv(be, cfg, h)
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]  # (1, 1, rope_dim / 2)
        q, k = self._rope(be.xp, q, cos, sin), self._rope(be.xp, k, cos, sin)
        keys[:, pos] = k.transpose(1, 0, 2)  # (n_kv, 1, hd) into position pos
        values[:, pos] = v.transpose(1, 0, 2)
        S = key_pos.shape[0]
        # one kernel where the backend has it (CUDA: cupy.matmul calls cuBLAS, which
        # CuPy refuses while a CUDA graph is being captured)
        out = be.attend_step(q[0], keys, values, pos, S, self.window,
                             1.0 / float(np.sqrt(cfg.head_dim)))
        if out is not None:
            return self.wo.matmul(out.reshape(1, -1))
        hidden = key_pos > pos
        if self.window:
            hidden = hidden | (key_pos <= pos - self.window)
        out = self._attend(be, cfg, q, keys[:, :S], values[:, :S], hidden)
        return self.wo.matmul(out)
