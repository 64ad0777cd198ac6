"""Llama-family decoders: llama (Llama 2/3, SmolLM2, Mistral-style), qwen2, qwen3.

One module serves all three; the differences are flags in `LlamaConfig`:

- llama: RoPE on interleaved pairs (llama.cpp's converter permutes the Q/K rows
  of Hugging Face checkpoints into that layout), optional Llama 3 frequency
  factors (`rope_freqs.weight`) or linear RoPE scaling;
- qwen2: biases on the Q, K and V projections, NEOX RoPE (rotate halves);
- qwen3: RMS norm on each head of Q and K before RoPE, NEOX RoPE, an explicit
  head size.

All use grouped-query attention, RMSNorm and a SwiGLU feed-forward; the output
matrix is `output.weight` or, when the file has none, the tied token embedding.
Weights stay in the file's format (`workbench.kernels.linear.QuantizedWeight`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workbench.engine.gguf import GGUFError, GGUFFile, UnsupportedTensorTypeError
from workbench.engine.kv_cache import KVCache
from workbench.kernels.linear import QuantizedWeight
from workbench.kernels.quants import UnsupportedQuantError

ARCHITECTURES = ("llama", "qwen2", "qwen3")


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

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> LlamaConfig:
        arch = g.architecture
        if arch not in ARCHITECTURES:
            raise GGUFError(f"{arch!r} is not a llama-family architecture")

        def key(name: str, default=None):
            value = g.get(f"{arch}.{name}", default)
            if value is None:
                raise GGUFError(f"{g.path.name} lacks the metadata key {arch}.{name}")
            return value

        n_embd = int(key("embedding_length"))
        n_head = int(key("attention.head_count"))
        head_dim = int(key("attention.key_length", n_embd // n_head))
        if int(key("attention.value_length", head_dim)) != head_dim:
            raise GGUFError("different key and value head sizes are not supported")
        scaling = g.get(f"{arch}.rope.scaling.type", "none")
        factor = float(g.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
        if scaling not in ("none", "linear") and factor != 1.0:
            raise GGUFError(f"RoPE scaling {scaling!r} is not supported (none, linear and "
                            "Llama 3 frequency factors are)")
        n_vocab = g.get(f"{arch}.vocab_size") or len(g.require("tokenizer.ggml.tokens"))
        return cls(
            arch=arch,
            n_layer=int(key("block_count")),
            n_embd=n_embd,
            n_ff=int(key("feed_forward_length")),
            n_head=n_head,
            n_head_kv=int(key("attention.head_count_kv", n_head)),
            head_dim=head_dim,
            n_vocab=int(n_vocab),
            n_ctx_train=int(key("context_length")),
            norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_base=float(key("rope.freq_base", 10000.0)),
            rope_dim=int(key("rope.dimension_count", head_dim)),
            rope_neox=arch != "llama",
            rope_linear_factor=factor if scaling == "linear" else 1.0,
            qk_norm=arch == "qwen3",
        )


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis."""
    ms = np.mean(np.square(x), axis=-1, keepdims=True)
    return x * (1.0 / np.sqrt(ms + eps)) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class Rope:
    """Rotary position embedding with cos/sin tables precomputed for `max_len` positions."""

    def __init__(self, cfg: LlamaConfig, max_len: int, freq_factors: np.ndarray | None):
        half = cfg.rope_dim // 2
        inv_freq = cfg.rope_base ** (-np.arange(half, dtype=np.float64) * 2.0 / cfg.rope_dim)
        if freq_factors is not None:  # Llama 3 long-context scaling, stored per dimension pair
            inv_freq = inv_freq / freq_factors.astype(np.float64)
        pos = np.arange(max_len, dtype=np.float64) / cfg.rope_linear_factor
        angles = np.outer(pos, inv_freq)  # (max_len, half)
        self.cos = np.cos(angles).astype(np.float32)
        self.sin = np.sin(angles).astype(np.float32)
        self.dim, self.neox = cfg.rope_dim, cfg.rope_neox

    def __call__(self, x: np.ndarray, start: int) -> np.ndarray:
        """Rotate x of shape (T, n_head, head_dim) for positions start .. start+T-1."""
        T = x.shape[0]
        cos = self.cos[start : start + T, None, :]  # (T, 1, half)
        sin = self.sin[start : start + T, None, :]
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
    def __init__(self, cfg: LlamaConfig, g: GGUFFile, i: int, rope: Rope):
        p = f"blk.{i}."
        self.cfg, self.rope = cfg, rope
        self.wq = _linear(g, p + "attn_q.weight")
        self.wk = _linear(g, p + "attn_k.weight")
        self.wv = _linear(g, p + "attn_v.weight")
        self.wo = _linear(g, p + "attn_output.weight")
        self.bq, self.bk, self.bv = (_vector(g, p + f"attn_{n}.bias", optional=True) for n in "qkv")
        self.q_norm = _vector(g, p + "attn_q_norm.weight", optional=not cfg.qk_norm)
        self.k_norm = _vector(g, p + "attn_k_norm.weight", optional=not cfg.qk_norm)

    def __call__(self, x: np.ndarray, cache, start: int) -> np.ndarray:
        cfg = self.cfg
        T = x.shape[0]
        n_head, n_kv, hd = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        q, k, v = self.wq.matmul(x), self.wk.matmul(x), self.wv.matmul(x)
        if self.bq is not None:
            q, k, v = q + self.bq, k + self.bk, v + self.bv
        q = q.reshape(T, n_head, hd)
        k = k.reshape(T, n_kv, hd)
        v = v.reshape(T, n_kv, hd)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, cfg.norm_eps)
            k = rms_norm(k, self.k_norm, cfg.norm_eps)
        q, k = self.rope(q, start), self.rope(k, start)
        keys, values = cache.update_and_fetch(k.transpose(1, 0, 2), v.transpose(1, 0, 2))
        S = keys.shape[1]  # keys, values: (n_kv, S, hd) with S = start + T
        group = n_head // n_kv
        q = q.reshape(T, n_kv, group, hd).transpose(1, 2, 0, 3)  # (n_kv, group, T, hd)
        scores = np.matmul(q, keys[:, None].transpose(0, 1, 3, 2))  # (n_kv, group, T, S)
        scores *= np.float32(1.0 / np.sqrt(hd))
        if T > 1:  # causal mask: query t sees keys up to start + t
            future = np.arange(S)[None, :] > (start + np.arange(T))[:, None]  # (T, S)
            scores[..., future] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        out = np.matmul(probs, values[:, None])  # (n_kv, group, T, hd)
        out = out.transpose(2, 0, 1, 3).reshape(T, n_head * hd)
        return self.wo.matmul(out)


class FeedForward:
    def __init__(self, g: GGUFFile, i: int):
        p = f"blk.{i}."
        self.gate = _linear(g, p + "ffn_gate.weight")
        self.up = _linear(g, p + "ffn_up.weight")
        self.down = _linear(g, p + "ffn_down.weight")

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.down.matmul(silu(self.gate.matmul(x)) * self.up.matmul(x))


class Block:
    def __init__(self, cfg: LlamaConfig, g: GGUFFile, i: int, rope: Rope):
        self.eps = cfg.norm_eps
        self.attn_norm = _vector(g, f"blk.{i}.attn_norm.weight")
        self.ffn_norm = _vector(g, f"blk.{i}.ffn_norm.weight")
        self.attn = Attention(cfg, g, i, rope)
        self.ffn = FeedForward(g, i)

    def __call__(self, x: np.ndarray, cache, start: int) -> np.ndarray:
        h = x + self.attn(rms_norm(x, self.attn_norm, self.eps), cache, start)
        return h + self.ffn(rms_norm(h, self.ffn_norm, self.eps))


class LlamaModel:
    """A llama-family decoder over the weights of an open GGUF file."""

    def __init__(self, g: GGUFFile, max_len: int):
        self.config = cfg = LlamaConfig.from_gguf(g)
        self.max_len = max_len
        freq_factors = _vector(g, "rope_freqs.weight", optional=True)
        rope = Rope(cfg, max(max_len, 1), freq_factors)
        self.embed = _linear(g, "token_embd.weight")
        self.blocks = [Block(cfg, g, i, rope) for i in range(cfg.n_layer)]
        self.norm = _vector(g, "output_norm.weight")
        self.output = _linear(g, "output.weight") if "output.weight" in g.tensors else self.embed

    def new_cache(self, max_len: int | None = None) -> KVCache:
        cfg = self.config
        return KVCache(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, max_len or self.max_len)

    def hidden(self, ids: np.ndarray, cache: KVCache) -> np.ndarray:
        """Run tokens `ids` (T,) at the cache's next positions; return the final-normed
        hidden states (T, n_embd) and append the tokens' keys and values to the cache."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.n_vocab):
            raise ValueError(f"token ids must lie in [0, {self.config.n_vocab})")
        start = cache.offset
        x = self.embed.rows(ids)  # (T, n_embd)
        for block, layer_cache in zip(self.blocks, cache.layers):
            x = block(x, layer_cache, start)
        cache.tokens.extend(int(i) for i in ids)
        return rms_norm(x, self.norm, self.config.norm_eps)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """(T, n_embd) final hidden states -> (T, n_vocab) logits."""
        return self.output.matmul(np.ascontiguousarray(hidden, dtype=np.float32))

    def forward(self, ids: np.ndarray, cache: KVCache) -> np.ndarray:
        """Logits (T, n_vocab) at every position of `ids`, appending them to `cache`."""
        return self.logits(self.hidden(ids, cache))


def _linear(g: GGUFFile, name: str) -> QuantizedWeight:
    t = g.tensor(name)
    try:
        return QuantizedWeight.from_gguf_tensor(t.data, t.qtype, t.shape)
    except UnsupportedQuantError as exc:
        raise UnsupportedTensorTypeError(f"{g.path.name}: tensor {name!r}: {exc}") from None


def _vector(g: GGUFFile, name: str, optional: bool = False) -> np.ndarray | None:
    if optional and name not in g.tensors:
        return None
    return np.asarray(g.tensor(name).data, dtype=np.float32).reshape(-1)
