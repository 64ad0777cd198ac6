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
the window (`workbench.engine.runtime.kv_cache`). `workbench.engine.models.gemma3`
builds on the classes here.

Where the pieces live: the settings and the tensor checks in `llama_config`, RoPE in
`rope`, the feed-forward in `feed_forward`, experts in `moe`, and the GPU twin of this
model in `llama_device` (it calls the same `rms_norm`, `split_heads`, `masked_keys` and
`rope.rotate` as the prefill here). Decoding on the CPU runs the Numba kernels of
`workbench.kernels.layers` (layer by layer) or `workbench.kernels.decode` (the fused
stack); the tests hold every path to transformers' logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q

from workbench.engine.formats.gguf import GGUFFile
from workbench.engine.models.feed_forward import FeedForward
from workbench.engine.models.llama_config import (  # noqa: F401  (importable from here)
    ARCHITECTURES,
    LlamaConfig,
    check_tensor_shapes,
)
from workbench.engine.models.moe import MoEFeedForward
from workbench.engine.models.rope import Rope, rope_factors
from workbench.engine.models.weights import fused, linear, vector
from workbench.engine.runtime.cores import quiet_blas
from workbench.engine.runtime.formulas import rms_norm
from workbench.engine.runtime.kv_cache import KVCache, KVPool, LayerKVCache
from workbench.engine.runtime.warmup import KernelTask
from workbench.kernels import cpu, layers
from workbench.kernels.decode import StackWeights, decode_stack, decode_stack_cached
from workbench.kernels.linear import QuantizedWeight


def split_heads(qkv, cfg: LlamaConfig, q_norm, k_norm, xp=np):
    """qkv (T, (n_head + 2 n_kv) head_dim), Q, K and V side by side -> q (T, n_head, hd),
    k and v (T, n_kv, hd); q and k RMS-normed per head where the family has those norms
    (Qwen3, Gemma 3: `q_norm`, `k_norm` (hd,), else None). NumPy, or a backend's `xp`."""
    n_head, n_kv, hd = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    T = qkv.shape[0]
    q = qkv[:, : n_head * hd].reshape(T, n_head, hd)
    k = qkv[:, n_head * hd : (n_head + n_kv) * hd].reshape(T, n_kv, hd)
    v = qkv[:, (n_head + n_kv) * hd :].reshape(T, n_kv, hd)
    if q_norm is not None and xp is np:  # the host kernel over the rows of every head
        q = norm_rows(q.reshape(-1, hd), q_norm, cfg.norm_eps).reshape(T, n_head, hd)
        k = norm_rows(k.reshape(-1, hd), k_norm, cfg.norm_eps).reshape(T, n_kv, hd)
    elif q_norm is not None:
        q = rms_norm(q, q_norm, cfg.norm_eps, xp)
        k = rms_norm(k, k_norm, cfg.norm_eps, xp)
    return q, k, v


def masked_keys(key_pos, query_pos, window: int):
    """True where a query at `query_pos` may not see the key at `key_pos` (arrays that
    broadcast): a later position or, in a sliding window, one `window` or more back."""
    hidden = key_pos > query_pos  # causal: a query sees the keys up to its own position
    if window:
        hidden = hidden | (key_pos <= query_pos - window)
    return hidden


def norm_rows(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of each row of x (T, D) on the host: the decode stack's kernel
    (`layers.rms_norm`), into a new array."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    layers.rms_norm(x, weight, eps, out)
    return out


QUERY_CHUNK = 64  # query rows whose attention scores are computed at once (prefill)


def causal_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int,
                     lo: int, window: int, seen: Callable | None = None) -> np.ndarray:
    """Attention of T queries at positions start .. start + T - 1 over the keys and values
    of positions lo .. start + T - 1: q (T, n_head, hd), rotated; keys, values (n_kv, S,
    hd) -> (T, n_head * hd). Each query sees the keys up to its own position (in a sliding
    `window`, the last `window` of them).

    The queries go `QUERY_CHUNK` at a time, each chunk over the keys one of them sees,
    so the work above the diagonal (hidden keys) is at most one chunk wide; a hidden key
    gets e^-60 of the largest weight (`layers.softmax_rows`). `seen(a, b, k0, weights)`, when
    given, is called with each chunk's softmax weights (n_kv, group, b - a, k1 - k0) of
    queries a .. b - 1 over keys k0 .. k1 - 1 (indices into keys)."""
    T, n_head, hd = q.shape
    n_kv = keys.shape[0]
    group = n_head // n_kv
    out = np.empty((T, n_head * hd), np.float32)
    scale = np.float32(1.0 / np.sqrt(hd))
    for a in range(0, T, QUERY_CHUNK):
        b = min(T, a + QUERY_CHUNK)
        n = b - a
        k0 = max(0, start + a - window + 1 - lo) if window else 0  # first key any query sees
        k1 = start + b - lo  # one past the last
        S = k1 - k0
        # (n, n_head, hd) -> (n_kv, group * n, hd): a kv head's queries as one matrix
        qc = np.ascontiguousarray(q[a:b].reshape(n, n_kv, group, hd).transpose(1, 2, 0, 3))
        scores = np.matmul(qc.reshape(n_kv, group * n, hd),
                           keys[:, k0:k1].transpose(0, 2, 1))  # (n_kv, group * n, S)
        scores *= scale
        rows = scores.reshape(-1, S)  # a view: (n_kv * group * n, S)
        # query i of the chunk sits at key start + a + i - lo - k0
        layers.hide_keys(rows, n, start + a - lo - k0, window)
        layers.softmax_rows(rows, rows.max(axis=1))  # in place
        if seen is not None:
            seen(a, b, k0, scores.reshape(n_kv, group, n, S))
        o = np.matmul(scores, values[:, k0:k1])  # (n_kv, group * n, hd)
        # (n_kv, group, n, hd) -> (n, n_head * hd), head h = kv * group + g
        out[a:b] = o.reshape(n_kv, group, n, hd).transpose(2, 0, 1, 3).reshape(n, n_head * hd)
    return out


def check_ids(ids, n_vocab: int) -> np.ndarray:
    """Token ids as a flat int64 array; ValueError where one lies outside [0, n_vocab)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= n_vocab):
        raise ValueError(f"token ids must lie in [0, {n_vocab})")
    return ids


def check_batch(ids, caches: Sequence, n_vocab: int) -> np.ndarray:
    """`check_ids`, and what decoding one token per sequence needs: one cache per token,
    all of one pool, each in its own slot (ValueError otherwise)."""
    ids = check_ids(ids, n_vocab)
    if len(caches) != ids.size or not caches:
        raise ValueError(f"decode needs one cache per token: {ids.size} ids, "
                         f"{len(caches)} caches")
    if any(c.pool is not caches[0].pool for c in caches):
        raise ValueError("caches decoded together must come from one KVPool")
    if len({c.slot for c in caches}) != len(caches):
        raise ValueError("each sequence decoded together needs its own KV-pool slot")
    return ids


def check_chunks(chunks: Sequence[tuple[Any, Any]], n_vocab: int
                 ) -> tuple[list[np.ndarray], list, list[int]]:
    """What `hidden_batch` needs of its (ids, cache) chunks: at least one token each, each
    cache its own sequence's (its own KV-pool slot) with room for its tokens (ValueError
    or ContextFullError before any cache is written). Returns the ids, caches and counts."""
    ids = [check_ids(t, n_vocab) for t, _ in chunks]
    caches = [c for _, c in chunks]
    counts = [t.size for t in ids]
    if min(counts) == 0:
        raise ValueError("hidden_batch needs at least one token per chunk")
    if len({(id(c.pool), c.slot) for c in caches}) != len(caches):
        raise ValueError("each chunk of hidden_batch needs its own sequence's cache "
                         "(its own KV-pool slot)")
    for c, n in zip(caches, counts):
        c.check_room(n)
    return ids, caches, counts


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

    def qkv(self, x: np.ndarray, counts: Sequence[int] | None = None) -> np.ndarray:
        """(T, n_embd) -> (T, (n_head + 2 n_kv) head_dim): Q, K, V side by side, biases added
        (`counts`: x's rows are chunks of several sequences, `QuantizedWeight.matmul`)."""
        y = self.wqkv.matmul(x, counts)
        if self.bqkv is not None:
            y += self.bqkv
        return y

    def __call__(self, x: np.ndarray, caches: Sequence[LayerKVCache],
                 counts: Sequence[int]) -> np.ndarray:
        """Prefill of one or more sequences in one pass: x (sum(counts), n_embd) holds
        `counts[i]` tokens of the sequence of `caches[i]`, at its next positions ->
        (sum(counts), n_embd). The projections run once over all the rows (each sequence's
        rows with the kernel its own count picks: the bits it gets alone); attention runs
        per sequence on its own rows (`attend`)."""
        q, k, v = split_heads(self.qkv(x, counts), self.cfg, self.q_norm, self.k_norm)
        outs, row = [], 0
        for cache, n in zip(caches, counts):
            rows = slice(row, row + n)
            outs.append(self.attend(q[rows], k[rows], v[rows], cache))
            row += n
        return self.wo.matmul(outs[0] if len(outs) == 1 else np.concatenate(outs), counts)

    def attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray,
               cache: LayerKVCache) -> np.ndarray:
        """One sequence's attention, before the output projection: q (T, n_head, hd) and
        k, v (T, n_kv, hd) of T tokens at the cache's next positions (start .. start + T
        - 1) -> (T, n_head * hd). Rotates q and k, writes k and v into the cache."""
        start = cache.seq.offset
        q, k = self.rope(q, start), self.rope(k, start)
        if self.window:
            keys, values, lo = cache.update_and_fetch_window(
                k.transpose(1, 0, 2), v.transpose(1, 0, 2), self.window)
        else:
            keys, values = cache.update_and_fetch(k.transpose(1, 0, 2), v.transpose(1, 0, 2))
            lo = 0
        # keys, values: (n_kv, S, hd), positions lo .. start + T - 1
        return causal_attention(q, keys, values, start, lo, self.window)

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


class Block:
    """Pre-norm residual layer: x + attn(norm(x)), then h + ffn(norm(h)).

    A family whose layers norm each sub-layer's output too sets `post_attn_norm` and
    `post_ffn_norm` (Gemma 3: `workbench.engine.models.gemma3.Gemma3Block`, which runs
    them); the fused decode stack and the device twin read them from here."""

    post_attn_norm: np.ndarray | None = None  # (n_embd,): norm(attn(...)) before the add
    post_ffn_norm: np.ndarray | None = None  # (n_embd,): norm(ffn(...)) before the add

    def __init__(self, cfg: LlamaConfig, g: GGUFFile, i: int, rope: Rope):
        self.eps = cfg.norm_eps
        self.attn_norm = vector(g, f"blk.{i}.attn_norm.weight")
        self.ffn_norm = vector(g, f"blk.{i}.ffn_norm.weight")
        self.attn = Attention(cfg, g, i, rope)
        if cfg.n_expert:
            self.ffn = MoEFeedForward(g, i, cfg.n_expert_used, cfg.expert_weights_norm)
        else:
            self.ffn = FeedForward(g, i)

    def __call__(self, x: np.ndarray, caches: Sequence[LayerKVCache],
                 counts: Sequence[int]) -> np.ndarray:
        """Prefill: x (sum(counts), n_embd), `counts[i]` tokens of the sequence of
        `caches[i]` (one sequence, or several in one pass: see `Attention.__call__`)."""
        h = x + self.attn(norm_rows(x, self.attn_norm, self.eps), caches, counts)
        return h + self.ffn(norm_rows(h, self.ffn_norm, self.eps), counts)

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
        factors = rope_factors(g, cfg, max_len)  # Llama 3's or Phi-3's LongRoPE
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

    def hidden(self, ids: np.ndarray, cache: KVCache) -> np.ndarray:
        """Run tokens `ids` (T,) at the cache's next positions; return the final-normed
        hidden states (T, n_embd) and append the tokens' keys and values to the cache."""
        ids = check_ids(ids, self.config.n_vocab)
        if ids.size == 1:
            return self.decode(ids, [cache])
        cache.check_room(ids.size)  # ContextFullError before any write if T won't fit
        with quiet_blas(ids.size, cpu.GEMV_MAX_T):
            x = self._embed(ids)  # (T, n_embd)
            for block, layer_cache in zip(self.blocks, cache.layers):
                x = block(x, [layer_cache], [ids.size])
        cache.advance(ids)
        return norm_rows(x, self.norm, self.config.norm_eps)

    def hidden_batch(self, chunks: Sequence[tuple[np.ndarray, KVCache]]) -> list[np.ndarray]:
        """Prefill several sequences in one forward pass: `chunks` holds (ids (T_i,), cache)
        pairs, each cache of its own sequence (no two in one slot of a pool). The embedding,
        the norms and every matrix product run once over all sum(T_i) rows; attention
        runs per sequence on its own rows. Returns each chunk's final-normed hidden states
        (T_i, n_embd) and appends its tokens to its cache. Bound each T_i as `hidden`'s
        callers do (`workbench.engine.llm.PREFILL_CHUNK`): attention's scores take
        n_head * T_i * positions floats per sequence."""
        if not chunks:
            return []
        ids, caches, counts = check_chunks(chunks, self.config.n_vocab)
        with quiet_blas(sum(counts), cpu.GEMV_MAX_T):
            x = self._embed(np.concatenate(ids))  # (sum T_i, n_embd)
            for i, block in enumerate(self.blocks):
                x = block(x, [c.layers[i] for c in caches], counts)
        for c, t in zip(caches, ids):
            c.advance(t)
        h = norm_rows(x, self.norm, self.config.norm_eps)
        return np.split(h, np.cumsum(counts)[:-1])  # [(T_i, n_embd)]

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
        ids = check_batch(ids, caches, self.config.n_vocab)
        pool = caches[0].pool
        slots = np.array([c.slot for c in caches], dtype=np.int64)
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
        # the multi-row kernels, and the short prompts' outer-product ones where they run
        # (the stack links both; a chat prompt of 25 to 64 tokens runs the second)
        batch_rows = (4, cpu.OUTER_MIN_T) if cpu.OUTER else (4,)
        tasks += [KernelTask(f"{Q(qtype).name} batch kernels",
                             partial(_run_matmuls, runs[qtype][0], batch_rows), helper)
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
            self.blocks[0](x, [self.new_cache(n).layers[0]], [n])

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
