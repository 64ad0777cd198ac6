"""Read whisper.cpp model files (`ggml-*.bin`, the legacy ggml container).

Layout, all little-endian:

    uint32  magic 0x67676d6c ("ggml")
    int32   n_vocab, n_audio_ctx, n_audio_state, n_audio_head, n_audio_layer,
            n_text_ctx, n_text_state, n_text_head, n_text_layer, n_mels, ftype
    int32   n_mel, n_fft; then n_mel * n_fft float32: the mel filterbank
    int32   n_tokens; then per token: uint32 length, that many bytes (the
            byte-level BPE tokens; special tokens are not stored)
    tensors to the end of the file, each:
        int32 n_dims, int32 name length, int32 ggml type,
        int32 dims[n_dims] (fastest first), the name, the raw data

The file is memory-mapped; tensors are described as in `workbench.engine.formats.gguf`
(NumPy order, raw quantized rows), so the same kernels run them. A file with
no tensors (whisper.cpp's header-only test files) reads fine; loading a model
from it is what fails, naming the missing tensor.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from workbench.engine.formats.gguf import TensorInfo

GGML_MAGIC = 0x67676D6C
HPARAMS = ("n_vocab", "n_audio_ctx", "n_audio_state", "n_audio_head", "n_audio_layer",
           "n_text_ctx", "n_text_state", "n_text_head", "n_text_layer", "n_mels", "ftype")
# ggml types whisper.cpp files use
TENSOR_TYPES = {0: GGMLQuantizationType.F32, 1: GGMLQuantizationType.F16,
                2: GGMLQuantizationType.Q4_0, 3: GGMLQuantizationType.Q4_1,
                6: GGMLQuantizationType.Q5_0, 7: GGMLQuantizationType.Q5_1,
                8: GGMLQuantizationType.Q8_0}


# Bounds on the hyperparameters, well above every Whisper (large-v3: 1500 audio positions,
# 448 text positions, width 1280, 20 heads, 32 layers, 128 mels, 51866 tokens), so that a
# damaged header fails here rather than in an allocation sized by it.
MAX_N_VOCAB = 1 << 20
MAX_N_CTX = 1 << 16
MAX_N_STATE = 1 << 14
MAX_N_LAYER = 1024
MAX_N_MELS = 512
MAX_N_FFT = 4096


class WhisperFileError(ValueError):
    """Not a readable whisper.cpp model file (wrong magic, truncated, inconsistent)."""


@dataclass(frozen=True)
class WhisperHParams:
    n_vocab: int
    n_audio_ctx: int  # encoder positions (1500 for 30 s)
    n_audio_state: int
    n_audio_head: int
    n_audio_layer: int
    n_text_ctx: int  # decoder positions (448)
    n_text_state: int
    n_text_head: int
    n_text_layer: int
    n_mels: int
    ftype: int  # tensor type id, plus 1000 x the quantization version for quantized files


class WhisperFile:
    """A whisper.cpp `.bin` model opened read-only with mmap.

    Attributes:
        path, hparams (`WhisperHParams`), mel_filters ((n_mel, n_fft) float32),
        tokens (list of bytes, the stored vocabulary), tensors (name -> `TensorInfo`).
    """

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"model file not found: {path}")
        size = path.stat().st_size
        self.path = path
        mm = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        buf = memoryview(mm)
        if size < 4 or struct.unpack_from("<I", buf, 0)[0] != GGML_MAGIC:
            head = bytes(buf[:4])
            hint = " (a GGUF file: load it with LLM or Encoder)" if head == b"GGUF" else ""
            raise WhisperFileError(f"{path} is not a whisper.cpp ggml model (starts with "
                                   f"{head!r}, expected the magic 'lmgg'){hint}")
        try:
            self._parse(buf, mm, size)
        except (struct.error, ValueError, IndexError) as exc:
            if isinstance(exc, WhisperFileError):
                raise
            raise WhisperFileError(f"{path} is truncated or corrupt ({size} bytes): "
                                   f"{type(exc).__name__}: {exc}") from None

    def _parse(self, buf: memoryview, mm: np.ndarray, size: int) -> None:
        values = struct.unpack_from("<11i", buf, 4)
        self.hparams = WhisperHParams(*values)
        _check_hparams(self.path, self.hparams)
        pos = 4 + 44
        n_mel, n_fft = struct.unpack_from("<2i", buf, pos)
        pos += 8
        if n_mel != self.hparams.n_mels or not 0 < n_fft <= MAX_N_FFT:
            raise WhisperFileError(f"{self.path}: a mel filter bank of {n_mel} x {n_fft} for "
                                   f"n_mels {self.hparams.n_mels}; the file is damaged")
        count = n_mel * n_fft
        if pos + 4 * count > size:
            raise WhisperFileError(f"{self.path} is truncated inside the mel filters")
        self.mel_filters = np.frombuffer(buf, np.float32, count, pos).reshape(n_mel, n_fft).copy()
        if not np.isfinite(self.mel_filters).all():
            raise WhisperFileError(f"{self.path}: the mel filter bank holds NaN or infinite "
                                   "values; the file is damaged")
        pos += 4 * count
        (n_tokens,) = struct.unpack_from("<i", buf, pos)
        pos += 4
        if not 0 <= n_tokens <= self.hparams.n_vocab:
            raise WhisperFileError(f"{self.path}: {n_tokens} stored tokens for n_vocab "
                                   f"{self.hparams.n_vocab}")
        if pos + 4 * n_tokens > size:
            raise WhisperFileError(f"{self.path} is truncated inside the vocabulary")
        tokens = []
        for _ in range(n_tokens):
            (length,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            if pos + length > size:
                raise WhisperFileError(f"{self.path} is truncated inside the vocabulary")
            tokens.append(bytes(buf[pos : pos + length]))
            pos += length
        self.tokens: list[bytes] = tokens
        self.tensors: dict[str, TensorInfo] = {}
        while pos < size:
            n_dims, name_len, type_id = struct.unpack_from("<3i", buf, pos)
            pos += 12
            if not 1 <= n_dims <= 4 or not 0 < name_len < 512:
                raise WhisperFileError(f"{self.path}: corrupt tensor header at byte {pos - 12}")
            dims = struct.unpack_from(f"<{n_dims}i", buf, pos)
            pos += 4 * n_dims
            name = bytes(buf[pos : pos + name_len]).decode("utf-8", "replace")
            pos += name_len
            if min(dims) < 1:
                raise WhisperFileError(f"{self.path}: tensor {name!r} has dimensions {dims}")
            if name in self.tensors:
                raise WhisperFileError(f"{self.path}: tensor {name!r} is stored twice")
            qtype = TENSOR_TYPES.get(type_id)
            if qtype is None:
                known = ", ".join(t.name for t in TENSOR_TYPES.values())
                raise WhisperFileError(f"{self.path}: tensor {name!r} has ggml type {type_id}, "
                                       f"which whisper models do not use (supported: {known})")
            shape = tuple(int(d) for d in reversed(dims))  # NumPy order: slowest first
            block, type_size = GGML_QUANT_SIZES[qtype]
            if shape[-1] % block:
                raise WhisperFileError(f"{self.path}: tensor {name!r} rows of {shape[-1]} do not "
                                       f"fill {qtype.name} blocks")
            n_bytes = math.prod(shape) // block * type_size
            if pos + n_bytes > size:
                raise WhisperFileError(f"{self.path} is truncated: tensor {name!r} ends at byte "
                                       f"{pos + n_bytes}, the file has {size}")
            raw = mm[pos : pos + n_bytes]
            if qtype == GGMLQuantizationType.F32:
                data = raw.view(np.float32).reshape(shape)
            elif qtype == GGMLQuantizationType.F16:
                data = raw.view(np.float16).reshape(shape)
            else:
                data = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
            self.tensors[name] = TensorInfo(name, qtype, shape, data, pos)
            pos += n_bytes
        _check_tensor_shapes(self.path, self.hparams, self.tensors)

    @property
    def multilingual(self) -> bool:
        """True for multilingual models (n_vocab >= 51865), False for English-only ones."""
        return self.hparams.n_vocab >= 51865

    def tensor(self, name: str) -> TensorInfo:
        """The tensor `name`; a `WhisperFileError` naming the file when it is absent."""
        try:
            return self.tensors[name]
        except KeyError:
            what = "holds no tensors (a header-only file?)" if not self.tensors else \
                f"has no tensor {name!r}"
            raise WhisperFileError(f"{self.path.name} {what}") from None

    def __repr__(self) -> str:
        h = self.hparams
        return (f"WhisperFile({str(self.path)!r}, n_vocab={h.n_vocab}, "
                f"layers={h.n_audio_layer}+{h.n_text_layer}, width={h.n_audio_state}, "
                f"tensors={len(self.tensors)})")


def _check_hparams(path: Path, h: WhisperHParams) -> None:
    """A `WhisperFileError` unless every hyperparameter lies in its range and the widths
    split into the head counts."""
    bounds = {"n_vocab": MAX_N_VOCAB, "n_audio_ctx": MAX_N_CTX, "n_audio_state": MAX_N_STATE,
              "n_audio_head": MAX_N_STATE, "n_audio_layer": MAX_N_LAYER,
              "n_text_ctx": MAX_N_CTX, "n_text_state": MAX_N_STATE,
              "n_text_head": MAX_N_STATE, "n_text_layer": MAX_N_LAYER, "n_mels": MAX_N_MELS}
    for field, hi in bounds.items():
        value = getattr(h, field)
        if not 1 <= value <= hi:
            raise WhisperFileError(f"{path}: implausible hyperparameter {field} = {value} "
                                   f"(expected 1 to {hi}); the file is damaged")
    for state, head in (("n_audio_state", "n_audio_head"), ("n_text_state", "n_text_head")):
        if getattr(h, state) % getattr(h, head):
            raise WhisperFileError(f"{path}: {state} {getattr(h, state)} does not split into "
                                   f"{head} {getattr(h, head)} heads; the file is damaged")
    if not 0 <= h.ftype < 1 << 16:  # a ggml_ftype plus 1000 x the quantization version
        raise WhisperFileError(f"{path}: implausible ftype {h.ftype}; the file is damaged")


def _check_tensor_shapes(path: Path, h: WhisperHParams, tensors: dict[str, TensorInfo]) -> None:
    """A `WhisperFileError` naming the first tensor whose shape does not fit the
    hyperparameters (the model sizes its buffers and loops by them)."""
    A, T = h.n_audio_state, h.n_text_state
    expected: dict[str, tuple[int, ...]] = {
        "encoder.conv1.weight": (A, h.n_mels, 3), "encoder.conv1.bias": (A, 1),
        "encoder.conv2.weight": (A, A, 3), "encoder.conv2.bias": (A, 1),
        "encoder.positional_embedding": (h.n_audio_ctx, A),
        "encoder.ln_post.weight": (A,), "encoder.ln_post.bias": (A,),
        "decoder.token_embedding.weight": (h.n_vocab, T),
        "decoder.positional_embedding": (h.n_text_ctx, T),
        "decoder.ln.weight": (T,), "decoder.ln.bias": (T,)}
    for side, D, n_layer in (("encoder", A, h.n_audio_layer), ("decoder", T, h.n_text_layer)):
        for i in range(n_layer):
            p = f"{side}.blocks.{i}."
            mlps = [p + "mlp.0.weight", p + "mlp.2.weight"]
            F = tensors[mlps[0]].shape[0] if mlps[0] in tensors else 0
            expected.update({mlps[0]: (F, D), p + "mlp.0.bias": (F,), mlps[1]: (D, F),
                             p + "mlp.2.bias": (D,)})
            for attn in ("attn", "cross_attn") if side == "decoder" else ("attn",):
                expected[p + attn + "_ln.weight"] = expected[p + attn + "_ln.bias"] = (D,)
                for proj in ("query", "key", "value", "out"):
                    expected[f"{p}{attn}.{proj}.weight"] = (D, D)
                    expected[f"{p}{attn}.{proj}.bias"] = (D,)
            expected[p + "mlp_ln.weight"] = expected[p + "mlp_ln.bias"] = (D,)
    for name, shape in expected.items():
        t = tensors.get(name)
        if t is not None and t.shape != shape:
            raise WhisperFileError(f"{path}: tensor {name!r} has shape {t.shape}, but the "
                                   f"hyperparameters make it {shape}; the file is damaged or "
                                   "its header does not belong to its weights")
