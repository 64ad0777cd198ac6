"""Gemma 3 decoders (`gemma3`), built from the llama-family classes.

What Gemma 3 does differently from `workbench.engine.models.llama`:

- the token embeddings are multiplied by sqrt(n_embd) before the first layer;
- four RMSNorms per layer: before and after attention, before and after the
  feed-forward (each sub-layer's output is normed before the residual add). The
  file holds Gemma's norm weights with their +1 already added, as llama.cpp's
  converter writes them, so they apply like any RMSNorm weight;
- a GeGLU feed-forward: down(gelu_tanh(gate(x)) * up(x));
- RMSNorm on each Q and K head before RoPE, NEOX RoPE, an explicit head size;
- local and global layers: every `SWA_PATTERN`-th layer (5, 11, 17, ...), unless
  the file says otherwise (`gemma3.attention.sliding_window_pattern`), attends
  to all earlier positions with the file's RoPE base (and its linear scaling);
  the others attend to a sliding window of `gemma3.attention.sliding_window`
  positions with RoPE base `LOCAL_ROPE_BASE` and no scaling, and keep a
  rotating KV cache once the context outgrows the window;
- the output matrix is the token embedding (tied).

Queries are scaled by 1/sqrt(head_dim); only Gemma 3 27B (62 layers) scales by
1/sqrt(n_embd / n_head), as llama.cpp does. That factor is folded into the Q
norm weights, which every Gemma 3 layer has.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from workbench.engine.formats.gguf import GGUFFile
from workbench.engine.models.feed_forward import FeedForward
from workbench.engine.models.llama import Attention, Block, LlamaModel, norm_rows
from workbench.engine.models.llama_config import LlamaConfig
from workbench.engine.models.rope import Rope
from workbench.engine.models.weights import vector
from workbench.engine.runtime.kv_cache import KVPool, LayerKVCache
from workbench.kernels import layers

ARCHITECTURES = ("gemma3",)
SWA_PATTERN = 6  # one global layer after every five local ones (llama.cpp's fixed pattern)
LOCAL_ROPE_BASE = 10000.0


class Gemma3Block(Block):
    """Norms around both sub-layers: h = x + norm(attn(norm(x))), h + norm(ffn(norm(h)))."""

    def __init__(self, cfg: LlamaConfig, g: GGUFFile, i: int, rope: Rope):
        p = f"blk.{i}."
        self.eps = cfg.norm_eps
        self.attn_norm = vector(g, p + "attn_norm.weight")
        self.post_attn_norm = vector(g, p + "post_attention_norm.weight")
        self.ffn_norm = vector(g, p + "ffn_norm.weight")
        self.post_ffn_norm = vector(g, p + "post_ffw_norm.weight")
        self.attn = Attention(cfg, g, i, rope)
        self.ffn = FeedForward(g, i, act="gelu")

    def __call__(self, x: np.ndarray, caches: Sequence[LayerKVCache],
                 counts: Sequence[int]) -> np.ndarray:
        """Prefill of one or more sequences, as `Block.__call__`, with the post-norms."""
        a = self.attn(norm_rows(x, self.attn_norm, self.eps), caches, counts)
        h = x + norm_rows(a, self.post_attn_norm, self.eps)
        f = self.ffn(norm_rows(h, self.ffn_norm, self.eps), counts)
        return h + norm_rows(f, self.post_ffn_norm, self.eps)

    def decode(self, x: np.ndarray, h: np.ndarray, pool: KVPool, layer: int,
               slots: np.ndarray, pos: np.ndarray, src: np.ndarray | None,
               next_norm: np.ndarray) -> None:
        a = self.attn.decode(h, pool, layer, slots, pos, src)
        layers.rms_norm(a, self.post_attn_norm, self.eps, a)
        layers.add_rms_norm(x, a, self.ffn_norm, self.eps, h)
        f = self.ffn(h)
        layers.rms_norm(f, self.post_ffn_norm, self.eps, f)
        layers.add_rms_norm(x, f, next_norm, self.eps, h)


class Gemma3Model(LlamaModel):
    """A Gemma 3 decoder over the weights of an open GGUF file."""

    def __init__(self, g: GGUFFile, max_len: int):
        super().__init__(g, max_len)
        self.embed_scale = math.sqrt(self.config.n_embd)

    @staticmethod
    def read_config(g: GGUFFile) -> LlamaConfig:
        cfg = LlamaConfig.from_gguf(g)
        if cfg.swa_pattern or cfg.swa_layers:  # the file says which layers are local
            return cfg
        return dataclasses.replace(cfg, swa_pattern=SWA_PATTERN)

    def build_blocks(self, g: GGUFFile, cfg: LlamaConfig, max_len: int) -> list[Block]:
        global_rope = Rope(cfg, max_len, None)
        local_rope = Rope(cfg, max_len, None, base=LOCAL_ROPE_BASE, linear_factor=1.0)
        blocks = [Gemma3Block(cfg, g, i, local_rope if cfg.is_local(i) else global_rope)
                  for i in range(cfg.n_layer)]
        if cfg.n_layer == 62:  # 27B: queries scaled by (n_embd / n_head)^-0.5
            fold = np.float32(math.sqrt(cfg.head_dim / (cfg.n_embd / cfg.n_head)))
            for b in blocks:
                b.attn.q_norm = b.attn.q_norm * fold
        return blocks
