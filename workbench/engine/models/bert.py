"""BERT encoders (`general.architecture == "bert"`): MiniLM, BGE, E5 and kin.

A padded batch of token ids goes through

- embeddings: word + absolute position + token type 0, then LayerNorm;
- `n_layer` post-LN blocks: bidirectional multi-head attention over each
  sequence's own tokens (padding masked out), output projection, residual,
  LayerNorm; then up-projection, exact GELU, down-projection, residual,
  LayerNorm.

The result is the last hidden state of every token; pooling it into one vector
per text is the `Encoder`'s job. Tensor and metadata names are llama.cpp's
(`token_embd`, `blk.N.attn_q`, `bert.pooling_type` ...), so GGUFs made by
llama.cpp's converter load here as well as those of `workbench convert`.
Weights stay in the file's format (F32, F16, Q8_0 or any type the kernels run).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workbench.engine.formats.gguf import GGUFError, GGUFFile
from workbench.engine.models.sizes import TransformerSizes
from workbench.engine.models.weights import fused, linear, vector
from workbench.engine.runtime.warmup import KernelTask
from workbench.kernels import layers

ARCHITECTURES = ("bert",)

# `bert.pooling_type` values (llama.cpp's enum llama_pooling_type)
POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
MAX_NORM_EPS = 1.0  # a LayerNorm epsilon past this (real ones are 1e-12 to 1e-5) flattens it


@dataclass(frozen=True)
class BertConfig(TransformerSizes):
    """A BERT encoder's settings (`from_gguf`: from its `bert.*` metadata)."""

    n_vocab: int
    n_ctx_train: int  # longest input the model takes, in tokens, counting [CLS] and [SEP]
    max_seq_length: int  # where sentence-transformers truncates (<= n_ctx_train)
    norm_eps: float
    pooling: str  # "mean", "cls", "last" or "none" (the file did not say)

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> BertConfig:
        arch = g.architecture
        if arch not in ARCHITECTURES:
            raise GGUFError(f"{arch!r} is not a BERT architecture")
        name = g.path.name
        causal = g.get(f"{arch}.attention.causal", False)
        if not isinstance(causal, (bool, int)) or causal:
            raise GGUFError(f"{name}: a causal BERT is not an encoder this engine runs")
        pooling_id = g.get_int(f"{arch}.pooling_type", 0, lo=0)
        pooling = POOLING_TYPES.get(pooling_id)
        if pooling is None or pooling == "rank":
            raise GGUFError(f"{name}: pooling type {pooling_id} ({pooling or 'unknown'}) "
                            "is not supported (mean, cls and last are)")
        n_embd = g.get_int(f"{arch}.embedding_length")
        n_head = g.get_int(f"{arch}.attention.head_count")
        if n_embd % n_head:
            raise GGUFError(f"{name}: embedding_length {n_embd} does not split into "
                            f"{n_head} heads")
        tokens = g.require("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise GGUFError(f"{name}: tokenizer.ggml.tokens must be a non-empty list of strings")
        n_positions = g.tensor("position_embd.weight").shape[0]
        n_ctx = min(g.get_int(f"{arch}.context_length"), n_positions)
        max_seq = g.get_int("sentence_transformers.max_seq_length", n_ctx)
        return cls(
            arch=arch,
            n_layer=g.layer_count(f"{arch}.block_count"),  # checked against the blk.N tensors
            n_embd=n_embd,
            n_ff=g.get_int(f"{arch}.feed_forward_length"),
            n_head=n_head,
            n_vocab=len(tokens),
            n_ctx_train=n_ctx,
            max_seq_length=min(max_seq, n_ctx),
            norm_eps=g.get_float(f"{arch}.attention.layer_norm_epsilon", hi=MAX_NORM_EPS),
            pooling=pooling,
        )


def check_tensor_shapes(g: GGUFFile, cfg: BertConfig) -> None:
    """A `GGUFError` naming the first tensor whose shape does not fit `cfg`."""
    D, F = cfg.n_embd, cfg.n_ff
    expected: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (cfg.n_vocab, D), "token_types.weight": (None, D),
        "position_embd.weight": (None, D), "token_embd_norm.weight": (D,),
        "token_embd_norm.bias": (D,)}
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        for n in "qkv":
            expected[p + f"attn_{n}.weight"], expected[p + f"attn_{n}.bias"] = (D, D), (D,)
        expected.update({
            p + "attn_output.weight": (D, D), p + "attn_output.bias": (D,),
            p + "attn_output_norm.weight": (D,), p + "attn_output_norm.bias": (D,),
            p + "ffn_up.weight": (F, D), p + "ffn_up.bias": (F,),
            p + "ffn_down.weight": (D, F), p + "ffn_down.bias": (D,),
            p + "layer_output_norm.weight": (D,), p + "layer_output_norm.bias": (D,)})
    for name, shape in expected.items():
        t = g.tensors.get(name)
        if t is None:
            continue
        if len(t.shape) != len(shape) or any(s is not None and s != n
                                             for s, n in zip(shape, t.shape)):
            want = tuple("any" if s is None else s for s in shape)
            raise GGUFError(f"{g.path.name}: tensor {name!r} has shape {t.shape}, but the "
                            f"metadata makes it {want}; the file is damaged or its metadata "
                            "does not belong to its weights")


class BertLayer:
    """One post-LN transformer block."""

    def __init__(self, cfg: BertConfig, g: GGUFFile, i: int):
        p = f"blk.{i}."
        self.n_head = cfg.n_head
        self.eps = cfg.norm_eps
        self.wqkv = fused(g, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"])
        self.bqkv = np.concatenate([vector(g, p + f"attn_{n}.bias") for n in "qkv"])
        self.wo, self.bo = linear(g, p + "attn_output.weight"), vector(g, p + "attn_output.bias")
        self.attn_norm = (vector(g, p + "attn_output_norm.weight"),
                          vector(g, p + "attn_output_norm.bias"))
        self.up, self.b_up = linear(g, p + "ffn_up.weight"), vector(g, p + "ffn_up.bias")
        self.down, self.b_down = linear(g, p + "ffn_down.weight"), vector(g, p + "ffn_down.bias")
        self.out_norm = (vector(g, p + "layer_output_norm.weight"),
                         vector(g, p + "layer_output_norm.bias"))

    def __call__(self, x: np.ndarray, lengths: np.ndarray) -> None:
        """Update x (B, T, D) in place."""
        B, T, D = x.shape
        flat = x.reshape(B * T, D)  # a view: the kernels below write through to x
        qkv = self.wqkv.matmul(flat)  # (B*T, 3D)
        qkv += self.bqkv
        attn = np.zeros((B, T, D), np.float32)
        layers.encoder_attend(qkv.reshape(B, T, 3 * D), lengths, self.n_head, attn)
        layers.add_layer_norm(flat, self.wo.matmul(attn.reshape(B * T, D)), self.bo,
                              *self.attn_norm, self.eps)
        h = self.up.matmul(flat)  # (B*T, F)
        layers.bias_gelu(h, self.b_up)
        layers.add_layer_norm(flat, self.down.matmul(h), self.b_down, *self.out_norm, self.eps)


class BertModel:
    """The BERT stack of a GGUF file: token ids in, last hidden states out."""

    def __init__(self, g: GGUFFile):
        cfg = self.config = BertConfig.from_gguf(g)
        check_tensor_shapes(g, cfg)
        self.embed = linear(g, "token_embd.weight")
        if self.embed.shape != (cfg.n_vocab, cfg.n_embd):
            raise GGUFError(f"{g.path.name}: token_embd.weight has shape {self.embed.shape}, "
                            f"expected ({cfg.n_vocab}, {cfg.n_embd})")
        self.positions = linear(g, "position_embd.weight").rows(np.arange(cfg.n_ctx_train))
        # token type 0 for every token ("sentence A"); a file without the table adds nothing
        self.token_type = (linear(g, "token_types.weight").rows([0])[0]
                           if "token_types.weight" in g.tensors
                           else np.zeros(cfg.n_embd, np.float32))
        self.embed_norm = (vector(g, "token_embd_norm.weight"), vector(g, "token_embd_norm.bias"))
        self.layers = [BertLayer(cfg, g, i) for i in range(cfg.n_layer)]

    def hidden(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Last hidden states (B, T, D) float32 of a padded batch.

        ids: (B, T) token ids; row b holds `lengths[b]` real tokens, then padding
        (any valid id). Hidden states at padded positions are meaningless.
        """
        cfg = self.config
        ids, lengths = _check_batch(cfg, ids, lengths)
        B, T = ids.shape
        x = self.embed.rows(ids.reshape(-1)).reshape(B, T, cfg.n_embd)
        x += self.positions[:T]
        x += self.token_type
        flat = x.reshape(B * T, cfg.n_embd)
        layers.layer_norm(flat, *self.embed_norm, cfg.norm_eps, flat)  # in place
        for layer in self.layers:
            layer(x, lengths)
        return x

    def kernel_tasks(self) -> list[KernelTask]:
        """The CPU kernels this model runs, as `KernelWarmup` steps: one pass over a padded
        batch of two short texts runs every one of them."""
        ids = np.zeros((2, 8), np.int64)
        return [KernelTask(f"encoder layers ({self.config.n_layer})",
                           lambda: self.hidden(ids, np.array([8, 3])))]


def _check_batch(cfg: BertConfig, ids, lengths) -> tuple[np.ndarray, np.ndarray]:
    """ids (B, T) and lengths (B,) as int64, or a ValueError saying what does not fit."""
    ids = np.asarray(ids, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if ids.ndim != 2:
        raise ValueError(f"ids must be a (batch, tokens) array, not of shape {ids.shape}")
    B, T = ids.shape
    if T > cfg.n_ctx_train:
        raise ValueError(f"{T} tokens exceed the model's {cfg.n_ctx_train}")
    if lengths.shape != (B,) or lengths.min(initial=1) < 1 or lengths.max(initial=0) > T:
        raise ValueError(f"lengths {lengths.tolist()} do not fit a batch of shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= cfg.n_vocab):
        raise ValueError(f"token ids must lie in [0, {cfg.n_vocab})")
    return ids, lengths


# -- on a GPU backend --------------------------------------------------------------------------

class DeviceBertModel:
    """`BertModel`'s forward pass on a GPU backend's arrays (`workbench.engine.runtime.backend`).

    Built from a loaded `BertModel`: every matrix is uploaded once (`Backend.weight`),
    vectors and the position table with `Backend.vector` / `asarray`; the CPU model can
    be dropped afterwards. Per batch only the token ids and lengths go to the device;
    `hidden` returns device arrays, so the `Encoder` pools and normalizes there and
    copies back one vector per text.
    """

    def __init__(self, model: BertModel, backend):
        self.config, self.backend, self.xp = model.config, backend, backend.xp
        self.embed = backend.weight(model.embed)
        self.positions = backend.asarray(np.asarray(model.positions, np.float32))  # (n_ctx, D)
        self.token_type = backend.vector(model.token_type)
        self.embed_norm = tuple(backend.vector(v) for v in model.embed_norm)
        self.layers = [_DeviceBertLayer(layer, backend) for layer in model.layers]

    def hidden(self, ids: np.ndarray, lengths: np.ndarray):
        """Last hidden states (B, T, D) float32 of a padded batch, as a device array.

        ids: (B, T) token ids; row b holds `lengths[b]` real tokens, then padding
        (any valid id). Hidden states at padded positions are meaningless.
        """
        cfg, be, xp = self.config, self.backend, self.xp
        ids, lengths = _check_batch(cfg, ids, lengths)
        B, T = ids.shape
        D = cfg.n_embd
        x = self.embed.rows(be.asarray(ids.reshape(-1).astype(np.int32))).reshape(B, T, D)
        x = be.layer_norm(x + self.positions[:T] + self.token_type, *self.embed_norm,
                        cfg.norm_eps)
        padding = None  # (B, 1, 1, T) True at the keys past each sequence's end
        if int(lengths.min()) < T:
            lens = be.asarray(lengths.astype(np.int32))
            padding = (xp.arange(T)[None, :] >= lens[:, None])[:, None, None, :]
        for layer in self.layers:
            x = layer(be, cfg, x, padding)
        return x


class _DeviceBertLayer:
    """One post-LN block's weights on the device, and its forward pass."""

    def __init__(self, layer: BertLayer, backend):
        self.wqkv, self.bqkv = backend.weight(layer.wqkv), backend.vector(layer.bqkv)
        self.wo, self.bo = backend.weight(layer.wo), backend.vector(layer.bo)
        self.attn_norm = tuple(backend.vector(v) for v in layer.attn_norm)
        self.up, self.b_up = backend.weight(layer.up), backend.vector(layer.b_up)
        self.down, self.b_down = backend.weight(layer.down), backend.vector(layer.b_down)
        self.out_norm = tuple(backend.vector(v) for v in layer.out_norm)

    def __call__(self, be, cfg: BertConfig, x, padding):
        """x (B, T, D) -> (B, T, D); padding: (B, 1, 1, T) bool keys to hide, or None."""
        xp = be.xp
        B, T, D = x.shape
        H = cfg.n_head
        hd = D // H
        flat = x.reshape(B * T, D)
        qkv = self.wqkv.matmul(flat) + self.bqkv  # (B*T, 3D)
        q, k, v = (qkv[:, i * D : (i + 1) * D].reshape(B, T, H, hd).transpose(0, 2, 1, 3)
                   for i in range(3))  # (B, H, T, hd) each
        scores = (q @ k.swapaxes(-1, -2)) * (1.0 / float(np.sqrt(hd)))  # (B, H, T, T)
        if padding is not None:
            scores = xp.where(padding, -np.inf, scores)
        a = (be.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(B * T, D)
        flat = be.layer_norm(flat + self.wo.matmul(a) + self.bo, *self.attn_norm, cfg.norm_eps)
        h = self.up.matmul(flat) + self.b_up  # (B*T, F)
        h = 0.5 * h * (1.0 + be.erf(h * 0.7071067811865476))  # exact GELU
        flat = be.layer_norm(flat + self.down.matmul(h) + self.b_down, *self.out_norm,
                           cfg.norm_eps)
        return flat.reshape(B, T, D)
