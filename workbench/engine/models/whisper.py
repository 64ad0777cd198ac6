"""Whisper: audio encoder and text decoder (whisper.cpp `.bin` weights).

- Front end: the log-mel spectrogram, in `workbench.engine.audio.mel`.
- Encoder: two 3-wide convolutions (the second with stride 2) with GELU, the
  positional embedding, `n_audio_layer` pre-LN blocks (self-attention, MLP with
  GELU), a final LayerNorm: (3000 mel frames) -> (1500, n_state).
- Decoder: token + positional embedding, `n_text_layer` pre-LN blocks (causal
  self-attention over a KV cache, cross-attention over the encoder output,
  MLP), a final LayerNorm, logits against the token embedding (tied).

Attention scores are divided by sqrt(head size) (Whisper scales q and k by its
fourth root each). The key projections have no bias.

Weights: quantized matrices (Q4_0 ... Q8_0) stay in their format and run on the
shared kernels. F16 matrices, the usual whisper.cpp format, stay F16 in the
decoder, whose products have one row per beam: the F16 kernels convert halves
with the CPU's own instruction and read half the bytes of an F32 copy (the
51864 x 384 logits matrix of tiny.en: 2.2 ms per token against 4.5 ms with BLAS
on F32). The encoder's F16 matrices (and the convolutions) are widened to F32
once at load, since its 1500-row products are BLAS's.

On a GPU backend (`workbench.engine.runtime.backend`), `DeviceWhisper` runs the same network
on the device's arrays with the same `encode` / `new_cache` / `decode` contract.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from workbench.engine.audio.mel import N_FFT
from workbench.engine.cancel import CancelFlag, check_cancel
from workbench.engine.formats.whisper_file import WhisperFile, WhisperFileError, WhisperHParams
from workbench.engine.models.weights import linear, vector
from workbench.engine.runtime.warmup import KernelTask
from workbench.kernels import layers
from workbench.kernels.linear import QuantizedWeight

LN_EPS = 1e-5


# -- configuration --------------------------------------------------------------------------

@dataclass(frozen=True)
class WhisperConfig:
    n_vocab: int
    n_mels: int
    n_audio_ctx: int
    n_audio_state: int
    n_audio_head: int
    n_audio_layer: int
    n_text_ctx: int
    n_text_state: int
    n_text_head: int
    n_text_layer: int

    @classmethod
    def from_hparams(cls, h: WhisperHParams) -> WhisperConfig:
        if h.n_audio_state % h.n_audio_head or h.n_text_state % h.n_text_head:
            raise WhisperFileError(f"state sizes {h.n_audio_state}/{h.n_text_state} do not "
                                   f"split into {h.n_audio_head}/{h.n_text_head} heads")
        return cls(h.n_vocab, h.n_mels, h.n_audio_ctx, h.n_audio_state, h.n_audio_head,
                   h.n_audio_layer, h.n_text_ctx, h.n_text_state, h.n_text_head,
                   h.n_text_layer)


# -- building blocks ------------------------------------------------------------------------

class _Norm:
    def __init__(self, f: WhisperFile, name: str):
        self.weight, self.bias = vector(f, name + ".weight"), vector(f, name + ".bias")

    def __call__(self, x: np.ndarray) -> np.ndarray:
        out = np.empty_like(x)
        layers.layer_norm(x, self.weight, self.bias, LN_EPS, out)
        return out


def _widened(w: QuantizedWeight) -> QuantizedWeight:
    """`w`, or an F32 copy of it when it is F16 (see the module docstring)."""
    if w.qtype != GGMLQuantizationType.F16:
        return w
    return QuantizedWeight.from_gguf_tensor(w.dequantize(), GGMLQuantizationType.F32, w.shape)


def _matrix(f: WhisperFile, name: str) -> QuantizedWeight:
    """The matrix `name`; an F16 encoder matrix widened to F32 (see the module docstring)."""
    w = linear(f, name)
    return _widened(w) if name.startswith("encoder.") else w


class _Linear:
    def __init__(self, f: WhisperFile, name: str, bias: bool = True):
        self.w = _matrix(f, name + ".weight")
        self.b = vector(f, name + ".bias") if bias else None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = self.w.matmul(x)
        if self.b is not None:
            y += self.b
        return y


def _heads(x: np.ndarray, n_head: int) -> np.ndarray:
    """(B, T, D) -> (B, n_head, T, D // n_head), contiguous (the layout BLAS wants)."""
    B, T, D = x.shape
    return np.ascontiguousarray(x.reshape(B, T, n_head, D // n_head).transpose(0, 2, 1, 3))


ATTENTION_ROWS = 256  # queries per block: a block's scores (256 x 1500) stay in cache


def _attention(q: np.ndarray, kh: np.ndarray, vh: np.ndarray,
               causal_offset: int | None = None) -> np.ndarray:
    """Multi-head attention of q (B, T, D) over keys and values already split into heads,
    kh, vh (B, H, S, hd): (B, T, D).

    causal_offset: when set, query t (at position causal_offset + t) sees keys
    0 .. causal_offset + t only. Long query runs (the encoder's 1500 frames) go
    `ATTENTION_ROWS` at a time, so the softmax passes run on cached data: one
    encoder layer of tiny took 72 ms as one batched product, 50 ms in blocks.
    (Heads on two Python threads with one BLAS thread each measured 33 ms alone
    but slower inside the encoder, behind OpenBLAS's spinning workers.)
    """
    B, T, D = q.shape
    n_head, S, hd = kh.shape[1:]
    qh = _heads(q * np.float32(1.0 / np.sqrt(hd)), n_head)  # (B, H, T, hd), scaled
    kt = kh.transpose(0, 1, 3, 2)  # (B, H, hd, S)
    if T <= 16:  # decoding steps: all sequences and heads in one batched product
        scores = np.matmul(qh, kt)  # (B, H, T, S)
        if causal_offset is not None and T > 1:
            scores[:, :, _future(causal_offset, 0, T, S)] = -np.inf
        out = np.matmul(_softmax(scores), vh)  # (B, H, T, hd)
    else:  # the encoder: query blocks whose scores stay in cache
        out = np.empty_like(qh)
        for b in range(B):
            for h in range(n_head):
                for r0 in range(0, T, ATTENTION_ROWS):
                    r1 = min(T, r0 + ATTENTION_ROWS)
                    scores = qh[b, h, r0:r1] @ kt[b, h]  # (rows, S)
                    if causal_offset is not None:
                        scores[_future(causal_offset, r0, r1, S)] = -np.inf
                    np.matmul(_softmax(scores), vh[b, h], out=out[b, h, r0:r1])
    return np.ascontiguousarray(out.transpose(0, 2, 1, 3)).reshape(B, T, D)


def _future(offset: int, r0: int, r1: int, S: int) -> np.ndarray:
    """(r1 - r0, S) mask of the keys after each query's own position offset + t."""
    return np.arange(S)[None, :] > (offset + np.arange(r0, r1))[:, None]


def _softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis (in place when scores is C-contiguous float32). Weights
    below e^-60 of a row's largest become e^-60: subnormal weights would slow the products
    with the values after this ~10x, and peaky attention makes many of them."""
    scores = np.ascontiguousarray(scores, dtype=np.float32)
    rows = scores.reshape(-1, scores.shape[-1])  # a view: (all leading dims, S)
    layers.softmax_rows(rows, rows.max(axis=-1))
    return scores


class _Block:
    """A pre-LN transformer block: self-attention, optional cross-attention, MLP."""

    def __init__(self, f: WhisperFile, prefix: str, n_head: int, cross: bool):
        self.n_head = n_head
        self.attn_ln = _Norm(f, prefix + "attn_ln")
        self.q = _Linear(f, prefix + "attn.query")
        self.k = _Linear(f, prefix + "attn.key", bias=False)
        self.v = _Linear(f, prefix + "attn.value")
        self.out = _Linear(f, prefix + "attn.out")
        if cross:
            self.cross_ln = _Norm(f, prefix + "cross_attn_ln")
            self.cq = _Linear(f, prefix + "cross_attn.query")
            self.ck = _Linear(f, prefix + "cross_attn.key", bias=False)
            self.cv = _Linear(f, prefix + "cross_attn.value")
            self.cout = _Linear(f, prefix + "cross_attn.out")
        self.mlp_ln = _Norm(f, prefix + "mlp_ln")
        self.up = _matrix(f, prefix + "mlp.0.weight")
        self.b_up = vector(f, prefix + "mlp.0.bias")
        self.down = _Linear(f, prefix + "mlp.2")

    def mlp(self, x: np.ndarray) -> np.ndarray:
        """x (N, D) -> (N, D): Linear, GELU, Linear."""
        h = self.up.matmul(self.mlp_ln(x))
        layers.bias_gelu(h, self.b_up)
        return self.down(h)


# -- the model ------------------------------------------------------------------------------

class DecoderCache:
    """Self-attention keys and values of B decoding sequences, and the cross-attention
    keys and values of the encoder output they all share."""

    def __init__(self, cfg: WhisperConfig, batch: int, cross_k: list[np.ndarray],
                 cross_v: list[np.ndarray]):
        hd = cfg.n_text_state // cfg.n_text_head
        shape = (cfg.n_text_layer, batch, cfg.n_text_head, cfg.n_text_ctx, hd)
        self.k = np.zeros(shape, np.float32)  # per layer (B, H, positions, hd)
        self.v = np.zeros(shape, np.float32)
        self.cross_k, self.cross_v = cross_k, cross_v  # per layer (1, H, S, hd)
        self.length = 0  # positions filled (the same for every sequence)

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def reorder(self, rows: list[int] | np.ndarray) -> None:
        """Keep sequences `rows` (repeats allowed), in that order: beam search's step."""
        rows = np.asarray(rows, dtype=np.int64)
        n = self.length
        k = np.zeros((self.k.shape[0], len(rows)) + self.k.shape[2:], np.float32)
        v = np.zeros_like(k)
        k[:, :, :, :n] = self.k[:, rows, :, :n]
        v[:, :, :, :n] = self.v[:, rows, :, :n]
        self.k, self.v = k, v


class Whisper:
    """The Whisper network of a whisper.cpp file: mel frames in, token logits out."""

    def __init__(self, f: WhisperFile):
        cfg = self.config = WhisperConfig.from_hparams(f.hparams)
        if f.mel_filters.shape[0] != cfg.n_mels or f.mel_filters.shape[1] != N_FFT // 2 + 1:
            raise WhisperFileError(f"{f.path.name}: mel filters of shape "
                                   f"{f.mel_filters.shape}, expected ({cfg.n_mels}, "
                                   f"{N_FFT // 2 + 1})")
        self.mel_filters = f.mel_filters
        # encoder
        self.conv1, self.conv1_b = self._conv(f, "encoder.conv1", cfg.n_mels)
        self.conv2, self.conv2_b = self._conv(f, "encoder.conv2", cfg.n_audio_state)
        self.audio_pos = np.asarray(f.tensor("encoder.positional_embedding").data,
                                    dtype=np.float32)
        if self.audio_pos.shape != (cfg.n_audio_ctx, cfg.n_audio_state):
            raise WhisperFileError(f"{f.path.name}: encoder.positional_embedding has shape "
                                   f"{self.audio_pos.shape}")
        self.encoder_blocks = [_Block(f, f"encoder.blocks.{i}.", cfg.n_audio_head, cross=False)
                               for i in range(cfg.n_audio_layer)]
        self.ln_post = _Norm(f, "encoder.ln_post")
        # decoder
        self.token_embedding = _matrix(f, "decoder.token_embedding.weight")
        if self.token_embedding.shape != (cfg.n_vocab, cfg.n_text_state):
            raise WhisperFileError(f"{f.path.name}: decoder.token_embedding.weight has shape "
                                   f"{self.token_embedding.shape}")
        self.text_pos = np.asarray(f.tensor("decoder.positional_embedding").data,
                                   dtype=np.float32)
        self.decoder_blocks = [_Block(f, f"decoder.blocks.{i}.", cfg.n_text_head, cross=True)
                               for i in range(cfg.n_text_layer)]
        self.ln = _Norm(f, "decoder.ln")

    @staticmethod
    def _conv(f: WhisperFile, name: str, c_in: int) -> tuple[QuantizedWeight, np.ndarray]:
        """A kernel-3 Conv1d as a (c_out, c_in * 3) matrix over im2col columns, and its bias."""
        t = f.tensor(name + ".weight")
        if len(t.shape) != 3 or t.shape[1:] != (c_in, 3):
            raise WhisperFileError(f"{f.path.name}: {name}.weight has shape {t.shape}, "
                                   f"expected (out, {c_in}, 3)")
        w = QuantizedWeight.from_gguf_tensor(t.data, t.qtype, (t.shape[0], c_in * 3))
        return _widened(w), vector(f, name + ".bias")  # the bias is stored as (out, 1)

    # -- encoder ---------------------------------------------------------------------------
    def encode(self, mel: np.ndarray, cancel: CancelFlag | None = None) -> np.ndarray:
        """Encoder output (n_audio_ctx, n_audio_state) of one chunk of mel frames
        (n_mels, 2 * n_audio_ctx); `cancel` is looked at between layers."""
        mel = _check_mel(self.config, mel)
        x = _conv1d(mel, self.conv1, self.conv1_b, stride=1)  # (3000, D)
        layers.bias_gelu(x, np.zeros(x.shape[1], np.float32))
        x = _conv1d(np.ascontiguousarray(x.T), self.conv2, self.conv2_b, stride=2)  # (1500, D)
        layers.bias_gelu(x, np.zeros(x.shape[1], np.float32))
        x += self.audio_pos
        for block in self.encoder_blocks:
            check_cancel(cancel)
            h = block.attn_ln(x)
            n = block.n_head
            kh, vh = _heads(block.k(h)[None], n), _heads(block.v(h)[None], n)
            x += block.out(_attention(block.q(h)[None], kh, vh)[0])
            x += block.mlp(x)
        return self.ln_post(x)

    # -- decoder ---------------------------------------------------------------------------
    def new_cache(self, audio_features: np.ndarray, batch: int = 1) -> DecoderCache:
        """A decoder cache for `batch` sequences over one chunk's encoder output; the
        cross-attention keys and values are computed here, once."""
        cross_k = [_heads(b.ck(audio_features)[None], b.n_head) for b in self.decoder_blocks]
        cross_v = [_heads(b.cv(audio_features)[None], b.n_head) for b in self.decoder_blocks]
        return DecoderCache(self.config, batch, cross_k, cross_v)

    def decode(self, tokens: np.ndarray, cache: DecoderCache, all_logits: bool = False
               ) -> np.ndarray:
        """Append `tokens` (B, T) to every sequence of `cache`; return the logits of the
        last position (B, n_vocab), or of every position (B, T, n_vocab)."""
        tokens = _check_tokens(self.config, tokens, cache)
        B, T = tokens.shape
        start = cache.length
        D = self.config.n_text_state
        x = self.token_embedding.rows(tokens.reshape(-1)).reshape(B, T, D)
        x += self.text_pos[start : start + T]
        flat = x.reshape(B * T, D)  # a view of x
        for layer, block in enumerate(self.decoder_blocks):
            n = block.n_head
            h = block.attn_ln(flat)
            cache.k[layer, :, :, start : start + T] = _heads(block.k(h).reshape(B, T, D), n)
            cache.v[layer, :, :, start : start + T] = _heads(block.v(h).reshape(B, T, D), n)
            attn = _attention(block.q(h).reshape(B, T, D), cache.k[layer, :, :, : start + T],
                              cache.v[layer, :, :, : start + T], causal_offset=start)
            flat += block.out(attn.reshape(B * T, D))
            h = block.cross_ln(flat)
            ck, cv = cache.cross_k[layer], cache.cross_v[layer]
            ck = np.broadcast_to(ck, (B,) + ck.shape[1:])
            cv = np.broadcast_to(cv, (B,) + cv.shape[1:])
            flat += block.cout(_attention(block.cq(h).reshape(B, T, D), ck, cv).reshape(B * T, D))
            flat += block.mlp(flat)
        cache.length = start + T
        if all_logits:
            return self.token_embedding.matmul(self.ln(flat)).reshape(B, T, -1)
        last = np.ascontiguousarray(x[:, -1])  # (B, D)
        return self.token_embedding.matmul(self.ln(last))

    def kernel_tasks(self) -> list[KernelTask]:
        """The CPU kernels this model runs, as `KernelWarmup` steps: the encoder on one
        silent chunk, then the decoder on a prompt, one greedy step and one beam step."""
        cfg = self.config
        features: list[np.ndarray] = []

        def encoder() -> None:
            features.append(self.encode(np.zeros((cfg.n_mels, 2 * cfg.n_audio_ctx), np.float32)))

        def decoder() -> None:
            audio = features[0] if features else np.zeros((cfg.n_audio_ctx, cfg.n_audio_state),
                                                          np.float32)
            cache = self.new_cache(audio)
            self.decode(np.zeros((1, 4), np.int64), cache)  # a prompt
            self.decode(np.zeros((1, 1), np.int64), cache)  # greedy steps
            self.decode(np.zeros((5, 1), np.int64), self.new_cache(audio, batch=5))  # beams

        return [KernelTask(f"audio encoder ({cfg.n_audio_layer} layers)", encoder),
                KernelTask(f"text decoder ({cfg.n_text_layer} layers)", decoder)]


def _check_mel(cfg: WhisperConfig, mel: np.ndarray) -> np.ndarray:
    """One chunk of mel frames (n_mels, 2 * n_audio_ctx) as float32, or a ValueError."""
    mel = np.asarray(mel, dtype=np.float32)
    if mel.shape != (cfg.n_mels, 2 * cfg.n_audio_ctx):
        raise ValueError(f"mel of shape {mel.shape}, expected ({cfg.n_mels}, "
                         f"{2 * cfg.n_audio_ctx})")
    return mel


def _check_tokens(cfg: WhisperConfig, tokens, cache) -> np.ndarray:
    """Tokens (B, T) to append to `cache` as int64, or a ValueError saying what does not fit."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.ndim != 2 or not tokens.shape[1]:
        raise ValueError(f"tokens must be a (batch, tokens) array, not of shape {tokens.shape}")
    B, T = tokens.shape
    if B != cache.batch:
        raise ValueError(f"{B} sequences for a cache of {cache.batch}")
    if cache.length + T > cfg.n_text_ctx:
        raise ValueError(f"{cache.length + T} tokens exceed the decoder's "
                         f"{cfg.n_text_ctx} positions")
    if tokens.min() < 0 or tokens.max() >= cfg.n_vocab:
        raise ValueError(f"token ids must lie in [0, {cfg.n_vocab})")
    return tokens


def _conv1d(x: np.ndarray, w: QuantizedWeight, bias: np.ndarray, stride: int) -> np.ndarray:
    """Kernel-3, padding-1 Conv1d of x (C_in, L) as im2col + matmul: (L // stride, C_out)."""
    c_in, length = x.shape
    padded = np.zeros((c_in, length + 2), np.float32)
    padded[:, 1:-1] = x
    n_out = (length + 2 - 3) // stride + 1
    # cols[t, c, j] = padded[c, t * stride + j]: (n_out, C_in, 3) -> (n_out, C_in * 3)
    cols = np.lib.stride_tricks.as_strided(
        padded, shape=(n_out, c_in, 3),
        strides=(padded.strides[1] * stride, padded.strides[0], padded.strides[1]))
    y = w.matmul(np.ascontiguousarray(cols).reshape(n_out, c_in * 3))
    y += bias
    return y


# -- on a GPU backend -------------------------------------------------------------------------

class DeviceDecoderCache:
    """`DecoderCache` on a GPU backend: per layer, self-attention keys and values
    (B, H, n_text_ctx, hd) preallocated on the device and written in place, and the
    cross-attention keys and values (1, H, S, hd) of the chunk's encoder output."""

    def __init__(self, backend, cfg: WhisperConfig, batch: int, cross_k: list, cross_v: list):
        hd = cfg.n_text_state // cfg.n_text_head
        shape = (batch, cfg.n_text_head, cfg.n_text_ctx, hd)
        self.backend = backend
        self.k = [backend.zeros(shape) for _ in range(cfg.n_text_layer)]
        self.v = [backend.zeros(shape) for _ in range(cfg.n_text_layer)]
        self.cross_k, self.cross_v = cross_k, cross_v
        self.length = 0  # positions filled (the same for every sequence)

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    def reorder(self, rows: list[int] | np.ndarray) -> None:
        """Keep sequences `rows` (repeats allowed), in that order: a gather on the device."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if not rows.size or rows.min() < 0 or rows.max() >= self.batch:
            raise ValueError(f"rows {rows.tolist()} do not index a cache of {self.batch}")
        index = self.backend.asarray(rows.astype(np.int32))
        self.k = [k[index] for k in self.k]
        self.v = [v[index] for v in self.v]


class DeviceWhisper:
    """`Whisper` on a GPU backend's arrays (`workbench.engine.runtime.backend`): the same
    `encode` / `new_cache` / `decode` contract, the arrays on the device.

    Built from a loaded `Whisper`: every weight is uploaded once (matrices with
    `Backend.weight`, in the formats the CPU model holds them), and the host copies go
    with the CPU model. Per chunk the mel frames go up once; the encoder output, the
    cross-attention keys and values and the decoder's KV cache stay on the device, and
    beam search's `reorder` gathers there. Per decoding step the token ids go up and
    the logits (B, n_vocab) come back, for the search (greedy, beams, timestamp
    rules) that runs on the host.
    """

    def __init__(self, net: Whisper, backend):
        self.config, self.backend, self.xp = net.config, backend, backend.xp
        self.mel_filters = net.mel_filters  # the front end runs on the host
        self.conv1, self.conv1_b = backend.weight(net.conv1), backend.vector(net.conv1_b)
        self.conv2, self.conv2_b = backend.weight(net.conv2), backend.vector(net.conv2_b)
        self.audio_pos = backend.asarray(net.audio_pos)  # (n_audio_ctx, n_audio_state)
        self.encoder_blocks = [_DeviceBlock(b, backend) for b in net.encoder_blocks]
        self.ln_post = _DeviceNorm(net.ln_post, backend)
        self.token_embedding = backend.weight(net.token_embedding)  # (n_vocab, n_text_state)
        self.text_pos = backend.asarray(net.text_pos)  # (n_text_ctx, n_text_state)
        self.decoder_blocks = [_DeviceBlock(b, backend) for b in net.decoder_blocks]
        self.ln = _DeviceNorm(net.ln, backend)

    def encode(self, mel: np.ndarray, cancel: CancelFlag | None = None):
        """Encoder output (n_audio_ctx, n_audio_state), a device array, of one chunk of
        mel frames (n_mels, 2 * n_audio_ctx) on the host; `cancel` is looked at between
        layers."""
        be = self.backend
        x = be.asarray(_check_mel(self.config, mel)).T  # (3000, n_mels): time first
        x = _device_gelu(be, _device_conv1d(be.xp, x, self.conv1, self.conv1_b, stride=1))
        x = _device_gelu(be, _device_conv1d(be.xp, x, self.conv2, self.conv2_b, stride=2))
        x = x + self.audio_pos  # (1500, D)
        for block in self.encoder_blocks:
            check_cancel(cancel)
            h = block.attn_ln(x)
            n = block.n_head
            kh, vh = _device_heads(block.k(h)[None], n), _device_heads(block.v(h)[None], n)
            x = x + block.out(_device_attention(be, block.q(h)[None], kh, vh)[0])
            x = x + block.mlp(be, x)
        x = self.ln_post(x)
        be.eval(x)
        return x

    def new_cache(self, audio_features, batch: int = 1) -> DeviceDecoderCache:
        """A device decoder cache for `batch` sequences over one chunk's encoder output
        (a device array from `encode`); the cross-attention keys and values are computed
        here, once."""
        be = self.backend
        if isinstance(audio_features, np.ndarray):
            audio_features = be.asarray(audio_features.astype(np.float32))
        cross_k = [_device_heads(b.ck(audio_features)[None], b.n_head)
                   for b in self.decoder_blocks]
        cross_v = [_device_heads(b.cv(audio_features)[None], b.n_head)
                   for b in self.decoder_blocks]
        be.eval(*cross_k, *cross_v)
        return DeviceDecoderCache(be, self.config, batch, cross_k, cross_v)

    def decode(self, tokens: np.ndarray, cache: DeviceDecoderCache, all_logits: bool = False
               ) -> np.ndarray:
        """Append `tokens` (B, T) to every sequence of `cache`; return the logits of the
        last position (B, n_vocab), or of every position (B, T, n_vocab), as NumPy."""
        be = self.backend
        tokens = _check_tokens(self.config, tokens, cache)
        B, T = tokens.shape
        start, end = cache.length, cache.length + T
        D = self.config.n_text_state
        x = self.token_embedding.rows(be.asarray(tokens.reshape(-1).astype(np.int32)))
        x = (x.reshape(B, T, D) + self.text_pos[start:end]).reshape(B * T, D)
        for layer, block in enumerate(self.decoder_blocks):
            n = block.n_head
            h = block.attn_ln(x)
            keys, values = cache.k[layer], cache.v[layer]  # (B, H, n_text_ctx, hd)
            keys[:, :, start:end] = _device_heads(block.k(h).reshape(B, T, D), n)
            values[:, :, start:end] = _device_heads(block.v(h).reshape(B, T, D), n)
            attn = _device_attention(be, block.q(h).reshape(B, T, D), keys[:, :, :end],
                                     values[:, :, :end], causal_offset=start)
            x = x + block.out(attn.reshape(B * T, D))
            h = block.cross_ln(x)
            attn = _device_attention(be, block.cq(h).reshape(B, T, D), cache.cross_k[layer],
                                     cache.cross_v[layer])  # (1, H, S, hd) for every sequence
            x = x + block.cout(attn.reshape(B * T, D))
            x = x + block.mlp(be, x)
        cache.length = end
        if not all_logits:
            x = x.reshape(B, T, D)[:, -1]  # (B, D)
        logits = self.token_embedding.matmul(self.ln(x))
        be.eval(logits, *cache.k, *cache.v)
        logits = be.to_host(logits)
        return logits.reshape(B, T, -1) if all_logits else logits


class _DeviceNorm:
    """A LayerNorm's weight and bias on the device."""

    def __init__(self, norm: _Norm, backend):
        self.backend = backend
        self.weight, self.bias = backend.vector(norm.weight), backend.vector(norm.bias)

    def __call__(self, x):
        return self.backend.layer_norm(x, self.weight, self.bias, LN_EPS)


class _DeviceLinear:
    """A `_Linear`'s matrix and bias on the device."""

    def __init__(self, linear: _Linear, backend):
        self.w, self.b = backend.weight(linear.w), backend.vector(linear.b)

    def __call__(self, x):
        y = self.w.matmul(x)
        return y if self.b is None else y + self.b


class _DeviceBlock:
    """A `_Block`'s weights on the device."""

    def __init__(self, block: _Block, backend):
        self.n_head = block.n_head
        self.attn_ln = _DeviceNorm(block.attn_ln, backend)
        self.q, self.k = _DeviceLinear(block.q, backend), _DeviceLinear(block.k, backend)
        self.v, self.out = _DeviceLinear(block.v, backend), _DeviceLinear(block.out, backend)
        if hasattr(block, "cross_ln"):
            self.cross_ln = _DeviceNorm(block.cross_ln, backend)
            self.cq, self.ck = _DeviceLinear(block.cq, backend), _DeviceLinear(block.ck, backend)
            self.cv = _DeviceLinear(block.cv, backend)
            self.cout = _DeviceLinear(block.cout, backend)
        self.mlp_ln = _DeviceNorm(block.mlp_ln, backend)
        self.up, self.b_up = backend.weight(block.up), backend.vector(block.b_up)
        self.down = _DeviceLinear(block.down, backend)

    def mlp(self, be, x):
        """x (N, D) -> (N, D): Linear, GELU, Linear."""
        return self.down(_device_gelu(be, self.up.matmul(self.mlp_ln(x)) + self.b_up))


def _device_gelu(be, x):
    """The exact (erf) GELU, as `layers.bias_gelu`."""
    return 0.5 * x * (1.0 + be.erf(x * 0.7071067811865476))


def _device_conv1d(xp, x, w, bias, stride: int):
    """Kernel-3, padding-1 Conv1d of x (L, C_in), time first, as im2col + matmul with the
    (C_out, C_in * 3) matrix `w`: (L // stride, C_out)."""
    L, C = x.shape
    zero = xp.zeros((1, C), dtype=x.dtype)
    padded = xp.concatenate([zero, x, zero], axis=0)  # (L + 2, C)
    n_out = (L - 1) // stride + 1
    taps = [padded[j : j + stride * (n_out - 1) + 1 : stride] for j in range(3)]  # (n_out, C)
    cols = xp.stack(taps, axis=-1).reshape(n_out, C * 3)  # [t, c * 3 + j] = padded[t*s + j, c]
    return w.matmul(cols) + bias


def _device_heads(x, n_head: int):
    """(B, T, D) -> (B, n_head, T, D // n_head), a view where the array module allows."""
    B, T, D = x.shape
    return x.reshape(B, T, n_head, D // n_head).transpose(0, 2, 1, 3)


def _device_attention(be, q, kh, vh, causal_offset: int | None = None):
    """`_attention` on device arrays: q (B, T, D) over kh, vh (B or 1, H, S, hd) -> (B, T, D),
    all query rows in one batched product."""
    xp = be.xp
    B, T, D = q.shape
    n_head, S, hd = kh.shape[1:]
    qh = _device_heads(q * float(1.0 / np.sqrt(hd)), n_head)  # (B, H, T, hd), scaled
    scores = qh @ kh.swapaxes(-1, -2)  # (B, H, T, S)
    if causal_offset is not None and T > 1:  # query t sees keys up to causal_offset + t
        future = xp.arange(S)[None, :] > (xp.arange(T) + causal_offset)[:, None]
        scores = xp.where(future, -np.inf, scores)
    out = be.softmax(scores, axis=-1) @ vh  # (B, H, T, hd)
    return out.transpose(0, 2, 1, 3).reshape(B, T, D)
