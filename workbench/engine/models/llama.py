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

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from workbench.engine.gguf import GGUFError, GGUFFile
from workbench.engine.kv_cache import KVCache, KVPool, LayerKVCache
from workbench.engine.models.weights import fused, linear, vector
from workbench.kernels import cpu, layers
from workbench.kernels.decode import StackWeights, decode_stack

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
        self._inv_freq = inv_freq / cfg.rope_linear_factor

    def __call__(self, x: np.ndarray, start: int) -> np.ndarray:
        """Rotate x of shape (T, n_head, head_dim) for positions start .. start+T-1."""
        T = x.shape[0]
        return self._rotate(x, self.cos[start : start + T, None, :],  # (T, 1, half)
                            self.sin[start : start + T, None, :])

    def shift(self, x: np.ndarray, delta: int) -> np.ndarray:
        """Move already rotated x (..., head_dim) by `delta` positions (negative: back);
        rotations add up, so this equals rotating at the new positions."""
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
    """Grouped-query self-attention with RoPE (and Qwen's Q/K/V biases or Q/K norms).

    The Q, K and V projections are fused into one matrix when they share a
    format (one matmul per token instead of three).
    """

    def __init__(self, cfg: LlamaConfig, g: GGUFFile, i: int, rope: Rope):
        p = f"blk.{i}."
        self.cfg, self.rope = cfg, rope
        self.wqkv = fused(g, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"])
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

    def decode(self, x: np.ndarray, pool: KVPool, layer: int, slots: np.ndarray,
               pos: np.ndarray, src: np.ndarray | None = None) -> np.ndarray:
        """One token for each of N sequences: x (N, n_embd), the sequences' pool slots and
        positions (N,) -> (N, n_embd). Norms, RoPE, cache writes and attention run in
        one kernel (`workbench.kernels.layers.attend`)."""
        cfg = self.cfg
        qkv = self.qkv(x)
        out = np.empty((x.shape[0], cfg.n_head * cfg.head_dim), np.float32)
        layers.attend(qkv, cfg.n_head, cfg.n_head_kv, slots, pos, self.rope.cos, self.rope.sin,
                      self.rope.dim, self.rope.neox,
                      _NONE if self.q_norm is None else self.q_norm,
                      _NONE if self.k_norm is None else self.k_norm,
                      cfg.norm_eps, pool.keys[layer], pool.values[layer], out, src)
        return self.wo.matmul(out)


class FeedForward:
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused when they share a format."""

    def __init__(self, g: GGUFFile, i: int):
        p = f"blk.{i}."
        self.gate_up = fused(g, [p + "ffn_gate.weight", p + "ffn_up.weight"])
        self.down = linear(g, p + "ffn_down.weight")

    def __call__(self, x: np.ndarray) -> np.ndarray:
        gu = self.gate_up.matmul(x)  # (T, 2 n_ff): gate, then up
        h = np.empty((x.shape[0], gu.shape[1] // 2), np.float32)
        layers.silu_mul(gu, h)
        return self.down.matmul(h)


class Block:
    def __init__(self, cfg: LlamaConfig, g: GGUFFile, i: int, rope: Rope):
        self.eps = cfg.norm_eps
        self.attn_norm = vector(g, f"blk.{i}.attn_norm.weight")
        self.ffn_norm = vector(g, f"blk.{i}.ffn_norm.weight")
        self.attn = Attention(cfg, g, i, rope)
        self.ffn = FeedForward(g, i)

    def __call__(self, x: np.ndarray, cache: LayerKVCache, start: int) -> np.ndarray:
        h = x + self.attn(rms_norm(x, self.attn_norm, self.eps), cache, start)
        return h + self.ffn(rms_norm(h, self.ffn_norm, self.eps))


class LlamaModel:
    """A llama-family decoder over the weights of an open GGUF file."""

    def __init__(self, g: GGUFFile, max_len: int):
        self.config = cfg = LlamaConfig.from_gguf(g)
        self.max_len = max_len
        freq_factors = vector(g, "rope_freqs.weight", optional=True)
        rope = Rope(cfg, max(max_len, 1), freq_factors)
        self.embed = linear(g, "token_embd.weight")
        self.blocks = [Block(cfg, g, i, rope) for i in range(cfg.n_layer)]
        self.norm = vector(g, "output_norm.weight")
        self.output = linear(g, "output.weight") if "output.weight" in g.tensors else self.embed
        # decode runs all layers in one compiled call when every matrix has a packed kernel;
        # set `fused_decode = False` for the per-kernel path (the reference in the tests)
        self._stack = StackWeights.build(self.blocks, self.norm)
        self.fused_decode = self._stack is not None

    def new_pool(self, n_slots: int, max_len: int | None = None) -> KVPool:
        """KV-cache room for `n_slots` sequences of up to `max_len` positions each."""
        cfg = self.config
        max_len = min(max_len or self.max_len, self.max_len)
        return KVPool(cfg.n_layer, n_slots, cfg.n_head_kv, cfg.head_dim, max_len)

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
        x = self.embed.rows(ids)  # (T, n_embd)
        for block, layer_cache in zip(self.blocks, cache.layers):
            x = block(x, layer_cache, start)
        cache.offset = start + ids.size
        cache.tokens.extend(int(i) for i in ids)
        return rms_norm(x, self.norm, self.config.norm_eps)

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
        x = self.embed.rows(ids)  # (N, n_embd): the residual stream
        if self.fused_decode and ids.size <= cpu.GEMV_MAX_T:
            cfg, rope = self.config, self.blocks[0].attn.rope
            h = decode_stack(self._stack, x, eps, cfg.n_head, cfg.n_head_kv, cfg.head_dim,
                             slots, pos, rope.cos, rope.sin, rope.dim, rope.neox, pool.keys,
                             pool.values, src)
        else:
            h = self._decode_layers(x, pool, slots, pos, src)
        for c, t in zip(caches, ids):
            c.offset += 1
            c.tokens.append(int(t))
        return h

    def _decode_layers(self, x: np.ndarray, pool: KVPool, slots: np.ndarray, pos: np.ndarray,
                       src: np.ndarray | None) -> np.ndarray:
        """`decode`'s layers one kernel call at a time (x: (N, n_embd), updated in place)."""
        eps = self.config.norm_eps
        h = np.empty_like(x)  # normed input of the next sub-layer
        layers.rms_norm(x, self.blocks[0].attn_norm, eps, h)
        for i, block in enumerate(self.blocks):
            a = block.attn.decode(h, pool, i, slots, pos, src)
            layers.add_rms_norm(x, a, block.ffn_norm, eps, h)
            f = block.ffn(h)
            nxt = self.blocks[i + 1].attn_norm if i + 1 < len(self.blocks) else self.norm
            layers.add_rms_norm(x, f, nxt, eps, h)
        return h

    def kv_remove(self, cache: KVCache, start: int, end: int) -> None:
        """Forget positions start .. end - 1 of `cache`: later positions move back by
        end - start, their keys re-rotated to their new positions (llama.cpp's
        `seq_rm` followed by `seq_add`), as if the removed tokens had never been there."""
        n = cache.offset
        if not 0 <= start <= end <= n:
            raise ValueError(f"cannot remove positions [{start}, {end}) of {n} cached")
        if cache.shared_until:
            cache.materialize()  # the moved positions must be this cache's own
        if start == end:
            return
        shift = end - start
        keys, values = cache.pool.keys[:, cache.slot], cache.pool.values[:, cache.slot]
        # keys, values: (n_layer, n_kv_head, max_len, head_dim)
        keys[:, :, start : n - shift] = self.blocks[0].attn.rope.shift(keys[:, :, end:n], -shift)
        values[:, :, start : n - shift] = values[:, :, end:n].copy()
        cache.offset = n - shift
        del cache.tokens[start:end]

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """(T, n_embd) final hidden states -> (T, n_vocab) logits."""
        return self.output.matmul(np.ascontiguousarray(hidden, dtype=np.float32))

    def forward(self, ids: np.ndarray, cache: KVCache) -> np.ndarray:
        """Logits (T, n_vocab) at every position of `ids`, appending them to `cache`."""
        return self.logits(self.hidden(ids, cache))


_NONE = np.zeros(0, np.float32)  # "no per-head norm" for `layers.attend`
