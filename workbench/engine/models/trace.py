"""Inside the model: the residual stream after each layer, the logit lens and the
attention weights of one prompt (`LLM.trace`).

    >>> t = m.trace("The capital of France is", attention=True)
    >>> t.top_tokens(layer=-1)[-1]          # what the last layer predicts after "is"
    >>> t.attention[5].shape                # (heads, positions, positions)

What is recorded, for each requested layer L (0 .. n_layer - 1, counted from the first):

- `residual[L]` (T, n_embd): the residual stream after layer L, before any norm (layer
  n_layer - 1's is what the output norm reads);
- the logit lens: the model's output norm and output matrix applied to that residual,
  as if the model stopped after layer L; kept as the `top_k` most likely ids at each
  position (`top_ids`, `top_probs`) and the entropy of the whole distribution
  (`entropy`, nats). `Trace.lens_logits` recomputes a layer's full logits from the
  residual when one needs them (the last layer's equal the model's own logits, bit for
  bit: the same kernels on the same rows; the other layers' products may run through
  another fp32 kernel, the faster one for their row counts);
- with `attention`, `attention[L]` (heads, T, T): the attention weights after softmax,
  row = query position, column = key position, zero where the model does not look
  (later positions; in a sliding-window layer, positions `window` or more back). Head h
  reads the keys and values of KV head h // (n_head / n_head_kv), as grouped-query
  attention shares them (`Trace.kv_head`).

The trace runs the model's own NumPy forward pass (`workbench.engine.models.llama`: the
same blocks, norms, RoPE tables, matrix kernels and attention as a prefill, the attention
weights read as each chunk of queries is computed) on the host, whatever device the `LLM`
runs on: on a GPU backend a host copy of the model over the same memory-mapped file is built
on first use.

Memory is bounded: the trace keeps T x n_embd floats of residual and T x (2 top_k + 1)
numbers of lens per requested layer, and T x T floats per kept head and layer of
attention, and works on at most `LENS_ROWS` rows of logits and `QUERY_CHUNK` query rows
of attention scores at a time. `estimate_bytes` states the total before anything runs;
a request over `max_bytes` raises `TraceTooLargeError` with the size it would need.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from workbench.engine.models.llama import (
    QUERY_CHUNK,
    causal_attention,
    masked_keys,
    norm_rows,
    split_heads,
)
from workbench.engine.runtime.cores import quiet_blas
from workbench.kernels import cpu
from workbench.kernels.lens import lens_rows

if TYPE_CHECKING:
    from workbench.engine.llm import LLM
    from workbench.engine.models.llama import Block, LlamaModel

DEFAULT_MAX_BYTES = 512 * 2**20  # what one trace may hold and work in, unless told more
LENS_ROWS = 128  # rows of lens logits (rows x n_vocab floats) computed at once
TOP_K = 10


class TraceTooLargeError(ValueError):
    """A trace would need more memory than allowed; `needed` and `limit` in bytes."""

    def __init__(self, needed: int, limit: int, detail: str):
        self.needed, self.limit = needed, limit
        super().__init__(
            f"this trace would need {_mb(needed)} ({detail}), over the bound of {_mb(limit)}: "
            "ask for attention on fewer layers or heads (attention=[...], heads=[...]), fewer "
            "layers (layers=[...]) or a shorter prompt, or raise max_bytes")


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


@dataclass
class Trace:
    """What one prompt did inside the model; see the module's docstring.

    Arrays are indexed by the position of a layer in `layers` (`index(layer)` finds it);
    the methods take layer numbers (negative ones count from the end of the model).
    """

    ids: list[int]  # the prompt's token ids (T,)
    tokens: list[str]  # each token's text
    layers: tuple[int, ...]  # the traced layers, ascending
    n_layer: int  # the model's layer count
    residual: np.ndarray  # (len(layers), T, n_embd) float32
    top_ids: np.ndarray  # (len(layers), T, top_k) int32, most likely first
    top_probs: np.ndarray  # (len(layers), T, top_k) float32
    entropy: np.ndarray  # (len(layers), T) float32, nats
    attention: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> (heads, T, T)
    heads: tuple[int, ...] = ()  # the query heads kept in `attention`
    n_head: int = 0
    n_head_kv: int = 0
    windows: dict[int, int] = field(default_factory=dict)  # layer -> sliding window (0: none)
    _lens: Any = field(default=None, repr=False)  # (residual rows) -> logits, the model's head
    _piece: Any = field(default=None, repr=False)  # token id -> text

    @property
    def n_tokens(self) -> int:
        return len(self.ids)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays this trace holds."""
        return int(self.residual.nbytes + self.top_ids.nbytes + self.top_probs.nbytes
                   + self.entropy.nbytes + sum(a.nbytes for a in self.attention.values()))

    def layer_number(self, layer: int) -> int:
        """`layer` as 0 .. n_layer - 1 (negative: from the end)."""
        n = layer + self.n_layer if layer < 0 else layer
        if not 0 <= n < self.n_layer:
            raise IndexError(f"layer {layer} outside the model's {self.n_layer} layers")
        return n

    def index(self, layer: int) -> int:
        """Where `layer`'s rows are in the arrays (IndexError if it was not traced)."""
        n = self.layer_number(layer)
        try:
            return self.layers.index(n)
        except ValueError:
            raise IndexError(f"layer {n} was not traced (traced: {list(self.layers)})") from None

    def kv_head(self, head: int) -> int:
        """The KV head whose keys and values query head `head` reads."""
        return head // (self.n_head // self.n_head_kv)

    def top_tokens(self, layer: int = -1, k: int | None = None) -> list[list[tuple[str, float]]]:
        """At each position, the lens's k most likely (token text, probability) at `layer`."""
        i = self.index(layer)
        k = self.top_ids.shape[2] if k is None else k
        return [[(self._text(int(t)), float(p)) for t, p in zip(ids[:k], probs[:k])]
                for ids, probs in zip(self.top_ids[i], self.top_probs[i])]

    def lens_logits(self, layer: int = -1, positions: Sequence[int] | None = None) -> np.ndarray:
        """The lens's full logits (len(positions), n_vocab) at `layer`, recomputed from the
        residual (all positions by default: for the last layer, the model's own logits).
        Outside the trace's memory bound: positions x n_vocab floats, so pass `positions`
        for a long prompt."""
        if self._lens is None:
            raise RuntimeError("this trace no longer has its model (it was closed)")
        x = self.residual[self.index(layer)]
        if positions is not None:
            x = x[np.asarray(positions, dtype=np.int64)]
        return self._lens(x)

    def distribution(self, layer: int, position: int) -> np.ndarray:
        """The lens's probabilities (n_vocab,) float64 at `layer` and `position`."""
        z = self.lens_logits(layer, [position])[0].astype(np.float64)
        e = np.exp(z - z.max())
        return e / e.sum()

    def _text(self, token: int) -> str:
        return self._piece(token) if self._piece is not None else str(token)


def trace(llm: LLM, prompt: str | Sequence[int] | Sequence[Mapping[str, Any]], *,
          layers: Iterable[int] | None = None, attention: bool | Iterable[int] = False,
          heads: Iterable[int] | None = None, top_k: int = TOP_K, add_bos: bool | None = None,
          max_bytes: int = DEFAULT_MAX_BYTES) -> Trace:
    """Run `prompt` (text, token ids, or chat messages rendered with the chat template and
    its generation prompt) through `llm`'s host forward pass and record it (`Trace`).

    `layers`: the layers to record (default all; negative numbers count from the end).
    `attention`: True records the attention weights of every traced layer; a list of
    layer numbers records only those. `heads`: the query heads kept (default all).
    `top_k`: how many of the lens's most likely tokens to keep per position.
    `max_bytes`: the memory the trace may hold and work in; more raises
    `TraceTooLargeError` before anything runs.
    """
    model = host_model(llm)
    cfg = model.config
    ids = _prompt_ids(llm, prompt, add_bos)
    T = len(ids)
    if T > model.max_len:
        raise ValueError(f"the prompt has {T} tokens and the model was loaded for "
                         f"{model.max_len}; load with a larger kv_cache_size")
    traced = _layer_numbers(layers, cfg.n_layer)
    if attention is True:
        attn_layers = set(traced)
    elif attention is False or attention is None:
        attn_layers = set()
    else:
        asked = [attention] if isinstance(attention, (int, np.integer)) else list(attention)
        attn_layers = set(_layer_numbers(asked, cfg.n_layer)) if asked else set()
        traced = tuple(sorted(set(traced) | attn_layers))
    kept_heads = tuple(range(cfg.n_head)) if heads is None else _head_numbers(heads, cfg.n_head)
    top_k = int(top_k)
    if not 1 <= top_k <= cfg.n_vocab:
        raise ValueError(f"top_k must lie in [1, {cfg.n_vocab}]")
    needed, detail = estimate_bytes(cfg, T, len(traced), len(attn_layers), len(kept_heads), top_k)
    if needed > max_bytes:
        raise TraceTooLargeError(needed, int(max_bytes), detail)

    L = len(traced)
    residual = np.empty((L, T, cfg.n_embd), np.float32)
    top_ids = np.empty((L, T, top_k), np.int32)
    top_probs = np.empty((L, T, top_k), np.float32)
    entropy = np.empty((L, T), np.float32)
    weights: dict[int, np.ndarray] = {}

    def lens(x: np.ndarray) -> np.ndarray:
        return model.logits(norm_rows(x, model.norm, cfg.norm_eps))

    # The lens's Numba products follow each layer's BLAS calls (attention, and the layers'
    # products past GEMV_MAX_T rows), so OpenBLAS is kept quiet at any T: where its workers
    # spin, each lens product waited for them (a 64-token trace of SmolLM2: 2.8 s, quiet 0.72 s).
    with llm._busy, llm._forward_lock, quiet_blas(T, most=T):
        x = model._embed(np.asarray(ids, dtype=np.int64))  # (T, n_embd)
        last = traced[-1] if traced else -1
        for i, block in enumerate(model.blocks[: last + 1]):
            keep = i in attn_layers
            x, w = _layer(block, cfg, x, kept_heads if keep else None)
            if keep:
                weights[i] = w
            if i in traced:
                j = traced.index(i)
                residual[j] = x
                for rows in _row_chunks(T, exact=i == cfg.n_layer - 1):
                    lens_rows(lens(x[rows]), top_ids[j, rows], top_probs[j, rows],
                              entropy[j, rows])
    tokenizer = llm.tokenizer

    def piece(t: int) -> str:
        return tokenizer.token_bytes(t).decode("utf-8", errors="replace")

    return Trace(ids=list(ids), tokens=[piece(t) for t in ids], layers=traced,
                 n_layer=cfg.n_layer, residual=residual, top_ids=top_ids,
                 top_probs=top_probs, entropy=entropy, attention=weights, heads=kept_heads,
                 n_head=cfg.n_head, n_head_kv=cfg.n_head_kv,
                 windows={i: model.blocks[i].attn.window for i in traced},
                 _lens=lens, _piece=piece)


def estimate_bytes(cfg, T: int, n_traced: int, n_attention: int, n_heads: int,
                   top_k: int) -> tuple[int, str]:
    """The memory a trace needs (bytes) and what it is made of: what it keeps (residuals,
    lens, attention weights) plus the largest working set of one step (a layer's
    activations and attention scores, or a chunk of lens logits)."""
    f = 4  # bytes of a float32
    keep_residual = n_traced * T * cfg.n_embd * f
    keep_lens = n_traced * T * (2 * top_k + 1) * 4
    keep_attention = n_attention * n_heads * T * T * f
    qkv = (cfg.n_head + 2 * cfg.n_head_kv) * cfg.head_dim
    rows = min(T, QUERY_CHUNK)
    layer_work = T * (4 * cfg.n_embd + 2 * qkv + 3 * cfg.n_ff) * f \
        + 2 * cfg.n_head * rows * T * f
    lens_work = min(T, LENS_ROWS) * (cfg.n_vocab + cfg.n_embd) * f
    needed = keep_residual + keep_lens + keep_attention + max(layer_work, lens_work)
    detail = (f"residual {_mb(keep_residual)}, lens {_mb(keep_lens)}, attention "
              f"{_mb(keep_attention)} for {n_attention} layers x {n_heads} heads x {T}^2, "
              f"working {_mb(max(layer_work, lens_work))}")
    return needed, detail


_HOST_MODELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # device model -> host


def host_model(llm: LLM) -> LlamaModel:
    """The NumPy model of `llm`: its own on the CPU; on a GPU backend a host copy over the
    same memory-mapped file, built on first use and dropped with the device model (its
    matrices stay in the file's format and mostly in the file's memory; the Q/K/V
    matrices that share a format are joined into one, a copy)."""
    model = llm._require_model()
    if llm.backend is None:
        return model
    host = _HOST_MODELS.get(model)
    if host is None:
        from workbench.engine.models.families import DECODERS

        host = DECODERS[llm.config.arch](llm._gguf, llm.kv_cache_size)
        _HOST_MODELS[model] = host
    return host


def _prompt_ids(llm: LLM, prompt: Any, add_bos: bool | None) -> list[int]:
    if isinstance(prompt, Sequence) and not isinstance(prompt, (str, bytes)) and prompt \
            and isinstance(prompt[0], Mapping):
        return llm._chat_ids(prompt, None)
    ids, _ = llm._prompt_ids(prompt, add_bos, False)
    return ids


def _layer_numbers(layers: Iterable[int] | None, n_layer: int) -> tuple[int, ...]:
    if layers is None:
        return tuple(range(n_layer))
    if isinstance(layers, (int, np.integer)):
        layers = [layers]
    out = set()
    for layer in layers:
        n = int(layer) + n_layer if int(layer) < 0 else int(layer)
        if not 0 <= n < n_layer:
            raise ValueError(f"layer {layer} outside the model's {n_layer} layers")
        out.add(n)
    if not out:
        raise ValueError("layers must name at least one layer")
    return tuple(sorted(out))


def _head_numbers(heads: Iterable[int], n_head: int) -> tuple[int, ...]:
    if isinstance(heads, (int, np.integer)):
        heads = [heads]
    out = tuple(sorted({int(h) for h in heads}))
    if not out or out[0] < 0 or out[-1] >= n_head:
        raise ValueError(f"heads must be a non-empty list of heads in [0, {n_head})")
    return out


def _row_chunks(T: int, exact: bool) -> list[slice]:
    """Row slices for the lens's matrix products, of equal size give or take one.

    `exact` (the last layer): chunks of at most LENS_ROWS that pick the kernel all T rows
    would (`workbench.kernels.cpu.kernel_for` goes by the row count: one chunk when
    T <= LENS_ROWS, else chunks of over LENS_ROWS / 2 rows, all past the small-T kernels),
    so that the last layer's lens has the bits of the model's own logits. Otherwise chunks
    of at most `cpu.GEMV_MAX_T` rows: on quantized matrices the kernel for those counts
    (dequantize a row, multiply it with every x row) costs about half what the tiled
    BLAS path for longer inputs does per row (SmolLM2's head, 2 cores)."""
    size = LENS_ROWS if exact else cpu.GEMV_MAX_T
    n = max(1, math.ceil(T / size))
    bounds = np.linspace(0, T, n + 1).round().astype(int)
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def _layer(block: Block, cfg, x: np.ndarray, heads: tuple[int, ...] | None
           ) -> tuple[np.ndarray, np.ndarray | None]:
    """One layer over the whole prompt x (T, n_embd) from position 0, as `Block.__call__`
    computes it (the family's post-norms included) -> (the new residual (T, n_embd), the
    attention weights of `heads` (len(heads), T, T), or None without heads)."""
    eps, attn = block.eps, block.attn
    T = x.shape[0]
    q, k, v = split_heads(attn.qkv(norm_rows(x, block.attn_norm, eps), [T]), cfg,
                          attn.q_norm, attn.k_norm)
    out, w = _attend(attn, cfg, q, k, v, heads)
    a = attn.wo.matmul(out, [T])
    if block.post_attn_norm is not None:
        a = norm_rows(a, block.post_attn_norm, eps)
    h = x + a
    f = block.ffn(norm_rows(h, block.ffn_norm, eps), [T])
    if block.post_ffn_norm is not None:
        f = norm_rows(f, block.post_ffn_norm, eps)
    return h + f, w


def _attend(attn, cfg, q: np.ndarray, k: np.ndarray, v: np.ndarray,
            heads: tuple[int, ...] | None) -> tuple[np.ndarray, np.ndarray | None]:
    """`Attention.attend` of a whole prompt from position 0, without a cache, in chunks of
    QUERY_CHUNK query rows: q (T, n_head, hd), k and v (T, n_kv, hd) -> (T, n_head * hd)
    and, for `heads`, the weights (len(heads), T, T) with exact zeros where keys are
    hidden (the engine's softmax gives them e^-60 of the row's largest)."""
    T = q.shape[0]
    n_head = cfg.n_head
    q, k = attn.rope(q, 0), attn.rope(k, 0)
    keys = np.ascontiguousarray(k.transpose(1, 0, 2))  # (n_kv, T, hd), as a cache holds them
    values = np.ascontiguousarray(v.transpose(1, 0, 2))
    weights = None if heads is None else np.zeros((len(heads), T, T), np.float32)
    pick = None if heads is None else np.asarray(heads)
    window = attn.window

    def seen(a, b, k0, w):  # w: (n_kv, group, b - a, S), head h = kv * group + g
        w = w.reshape(n_head, b - a, -1)[pick]
        S = w.shape[2]
        hidden = masked_keys(k0 + np.arange(S)[None, :], np.arange(a, b)[:, None], window)
        weights[:, a:b, k0 : k0 + S] = np.where(hidden, np.float32(0.0), w)

    out = causal_attention(q, keys, values, 0, 0, window,
                           None if heads is None else seen)
    return out, weights
