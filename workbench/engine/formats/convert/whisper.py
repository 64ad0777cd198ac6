"""CTranslate2 (faster-whisper) Whisper folder -> whisper.cpp `ggml-*.bin`.

    >>> from workbench.engine.formats.convert import ct2_whisper_to_bin
    >>> ct2_whisper_to_bin("faster-whisper-tiny.en/", "ggml-tiny.en.bin")

The folder holds `model.bin` (CTranslate2's own container), `config.json` and
`vocabulary.txt`. CTranslate2's `model.bin`, all little-endian:

    uint32 version (6); uint16 length + spec name ("WhisperSpec\\0"); uint32 revision
    uint32 n_variables; each: uint16 length + name (NUL-terminated), uint8 rank,
        uint32 dims[rank], uint8 dtype (4 = float16, 3 = float32, 2 = int16, 1 = int8),
        uint32 byte count, the data
    uint32 n_aliases; each: two length-prefixed names (alias, target)

Its attention projections are fused (self-attention Q|K|V, cross-attention
K|V) and are split here; the key bias part is zero and dropped (Whisper's
keys have no bias). Names become openai-whisper's, which whisper.cpp reads;
matrices and conv kernels are written F16 (or F32), everything else F32, and
conv biases as (out, 1), as whisper.cpp's own converter does. The mel
filterbank, which the folder does not carry, is computed (Slaney-scale,
area-normalized, as openai-whisper ships it). The vocabulary's byte-level
unicode spelling is turned back into bytes.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from workbench.engine.audio.mel import N_FFT
from workbench.engine.audio.pcm import SAMPLE_RATE
from workbench.engine.formats.convert.bert import ConversionError

GGML_MAGIC = 0x67676D6C
_DTYPES = {4: np.float16, 3: np.float32, 2: np.int16, 1: np.int8}
# CTranslate2 sub-module -> openai-whisper name, within a layer
_SUBLAYERS = {
    "self_attention/layer_norm": "attn_ln", "self_attention/linear_1": "attn.out",
    "attention/layer_norm": "cross_attn_ln", "attention/linear_0": "cross_attn.query",
    "attention/linear_2": "cross_attn.out",
    "ffn/layer_norm": "mlp_ln", "ffn/linear_0": "mlp.0", "ffn/linear_1": "mlp.2",
}


def ct2_whisper_to_bin(src: str | os.PathLike, dst: str | os.PathLike, *,
                       f16: bool = True) -> Path:
    """Convert the CTranslate2 Whisper folder `src` to the whisper.cpp file `dst`.

    f16: store matrices as float16 (the source's precision) rather than float32.
    Raises `ConversionError` when the folder is not a CTranslate2 Whisper model.
    """
    src, dst = Path(src), Path(dst)
    model_bin = src / "model.bin"
    if not model_bin.is_file():
        raise ConversionError(f"{src} has no model.bin (expected a CTranslate2 Whisper folder)")
    tensors = dict(_read_ct2(model_bin))
    tokens = _read_vocabulary(src / "vocabulary.txt")
    n_vocab, n_state = tensors["decoder/embeddings/weight"].shape
    n_audio_layer = _count_layers(tensors, "encoder")
    n_text_layer = _count_layers(tensors, "decoder")
    n_mels = tensors["encoder/conv1/weight"].shape[1]
    if len(tokens) < n_vocab:
        raise ConversionError(f"vocabulary.txt has {len(tokens)} tokens, the model {n_vocab}")
    hparams = (n_vocab, tensors["encoder/position_encodings/encodings"].shape[0], n_state,
               int(tensors["encoder/num_heads"]), n_audio_layer,
               tensors["decoder/position_encodings/encodings"].shape[0], n_state,
               int(tensors["decoder/num_heads"]), n_text_layer, n_mels, 1 if f16 else 0)
    n_stored = 50257  # whisper.cpp stores the ordinary tokens (and, English-only, <|endoftext|>)
    partial = dst.with_name(dst.name + ".partial")
    try:
        with open(partial, "wb") as out:
            out.write(struct.pack("<I", GGML_MAGIC))
            out.write(struct.pack("<11i", *hparams))
            filters = mel_filters(n_mels)
            out.write(struct.pack("<2i", *filters.shape))
            out.write(filters.astype(np.float32).tobytes())
            out.write(struct.pack("<i", n_stored))
            for token in tokens[:n_stored]:
                out.write(struct.pack("<I", len(token)) + token)
            for name, array in _openai_tensors(tensors, n_audio_layer, n_text_layer):
                _write_tensor(out, name, array, f16)
        os.replace(partial, dst)
    finally:
        partial.unlink(missing_ok=True)
    return dst


def mel_filters(n_mels: int, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Slaney-scale mel filterbank (n_mels, n_fft // 2 + 1), each filter divided by its
    width in Hz (area normalization), computed in float64, returned as float32."""

    def hz_to_mel(f):
        f = np.asarray(f, dtype=np.float64)
        linear = f / (200.0 / 3)
        log = 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (np.log(6.4) / 27.0)
        return np.where(f >= 1000.0, log, linear)

    def mel_to_hz(m):
        m = np.asarray(m, dtype=np.float64)
        linear = m * (200.0 / 3)
        log = 1000.0 * np.exp((np.log(6.4) / 27.0) * (m - 15.0))
        return np.where(m >= 15.0, log, linear)

    fft_freqs = np.fft.rfftfreq(n_fft, 1.0 / sample_rate)
    mel_points = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(sample_rate / 2), n_mels + 2))
    widths = np.diff(mel_points)
    ramps = mel_points[:, None] - fft_freqs[None, :]
    # the triangles are rounded to float32 before the normalization, as openai-whisper's
    # filters were made (that order reproduces them bit for bit)
    weights = np.zeros((n_mels, len(fft_freqs)), np.float32)
    for i in range(n_mels):
        rising = -ramps[i] / widths[i]
        falling = ramps[i + 2] / widths[i + 1]
        weights[i] = np.maximum(0.0, np.minimum(rising, falling))
    weights *= (2.0 / (mel_points[2 : n_mels + 2] - mel_points[:n_mels]))[:, None]
    return weights


def _read_ct2(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    data = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(data)
    try:
        pos = 0
        (version,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        (length,) = struct.unpack_from("<H", buf, pos)
        spec = bytes(buf[pos + 2 : pos + 2 + length]).rstrip(b"\0").decode()
        pos += 2 + length + 4  # name, then the revision
        if spec != "WhisperSpec":
            raise ConversionError(f"{path} holds a {spec!r} model, not Whisper")
        if version < 5:
            raise ConversionError(f"{path}: CTranslate2 model version {version} is too old")
        (count,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        for _ in range(count):
            (length,) = struct.unpack_from("<H", buf, pos)
            name = bytes(buf[pos + 2 : pos + 2 + length]).rstrip(b"\0").decode()
            pos += 2 + length
            rank = buf[pos]
            dims = struct.unpack_from(f"<{rank}I", buf, pos + 1)
            pos += 1 + 4 * rank
            dtype_id = buf[pos]
            (n_bytes,) = struct.unpack_from("<I", buf, pos + 1)
            pos += 5
            if dtype_id not in _DTYPES:
                raise ConversionError(f"{path}: variable {name!r} has dtype {dtype_id} "
                                      "(quantized CTranslate2 models are not supported)")
            array = np.frombuffer(buf, _DTYPES[dtype_id], n_bytes // np.dtype(
                _DTYPES[dtype_id]).itemsize, pos).reshape(dims)
            pos += n_bytes
            yield name, array
    except (struct.error, ValueError, IndexError) as exc:
        if isinstance(exc, ConversionError):
            raise
        raise ConversionError(f"{path} is truncated or not a CTranslate2 model: {exc}") from None


def _read_vocabulary(path: Path) -> list[bytes]:
    """vocabulary.txt (GPT-2's byte-to-unicode spelling, one token per line) as raw bytes."""
    if not path.is_file():
        raise ConversionError(f"{path.parent} has no vocabulary.txt")
    decode = {ch: b for b, ch in _bytes_to_unicode().items()}
    lines = path.read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the final newline; an empty line before it is a token (multilingual 50256)
    tokens = []
    for line in lines:
        try:
            tokens.append(bytes(decode[ch] for ch in line))
        except KeyError:  # special tokens such as <|endoftext|> are plain ASCII anyway
            tokens.append(line.encode())
    return tokens


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 byte values to printable characters."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _count_layers(tensors: dict[str, np.ndarray], side: str) -> int:
    n = 0
    while f"{side}/layer_{n}/ffn/linear_0/weight" in tensors:
        n += 1
    if not n:
        raise ConversionError(f"the model has no {side} layers")
    return n


def _openai_tensors(t: dict[str, np.ndarray], n_audio_layer: int, n_text_layer: int
                    ) -> Iterator[tuple[str, np.ndarray]]:
    """(openai-whisper name, array) in whisper.cpp's order."""
    yield "encoder.positional_embedding", t["encoder/position_encodings/encodings"]
    for conv in ("conv1", "conv2"):
        yield f"encoder.{conv}.weight", t[f"encoder/{conv}/weight"]
        yield f"encoder.{conv}.bias", t[f"encoder/{conv}/bias"].reshape(-1, 1)
    for side, n_layer in (("encoder", n_audio_layer), ("decoder", n_text_layer)):
        for i in range(n_layer):
            ct2, ours = f"{side}/layer_{i}/", f"{side}.blocks.{i}."
            w = t[ct2 + "self_attention/linear_0/weight"]  # Q | K | V stacked
            b = t[ct2 + "self_attention/linear_0/bias"]
            d = w.shape[1]
            yield ours + "attn.query.weight", w[:d]
            yield ours + "attn.query.bias", b[:d]
            yield ours + "attn.key.weight", w[d : 2 * d]
            yield ours + "attn.value.weight", w[2 * d :]
            yield ours + "attn.value.bias", b[2 * d :]
            if side == "decoder":
                w = t[ct2 + "attention/linear_1/weight"]  # cross-attention K | V stacked
                b = t[ct2 + "attention/linear_1/bias"]
                yield ours + "cross_attn.key.weight", w[:d]
                yield ours + "cross_attn.value.weight", w[d:]
                yield ours + "cross_attn.value.bias", b[d:]
            for sub, name in _SUBLAYERS.items():
                if ct2 + sub + "/weight" not in t and ct2 + sub + "/gamma" not in t:
                    continue
                if sub.endswith("layer_norm"):
                    yield ours + name + ".weight", t[ct2 + sub + "/gamma"]
                    yield ours + name + ".bias", t[ct2 + sub + "/beta"]
                else:
                    yield ours + name + ".weight", t[ct2 + sub + "/weight"]
                    yield ours + name + ".bias", t[ct2 + sub + "/bias"]
        norm = "encoder.ln_post" if side == "encoder" else "decoder.ln"
        yield norm + ".weight", t[f"{side}/layer_norm/gamma"]
        yield norm + ".bias", t[f"{side}/layer_norm/beta"]
    yield "decoder.token_embedding.weight", t["decoder/embeddings/weight"]
    yield "decoder.positional_embedding", t["decoder/position_encodings/encodings"]


def _write_tensor(out, name: str, array: np.ndarray, f16: bool) -> None:
    matrix = array.ndim >= 2 and "positional" not in name and not name.endswith("conv1.bias") \
        and not name.endswith("conv2.bias")
    half = f16 and matrix
    data = np.ascontiguousarray(array, dtype=np.float16 if half else np.float32)
    encoded = name.encode()
    out.write(struct.pack("<3i", data.ndim, len(encoded), 1 if half else 0))
    out.write(struct.pack(f"<{data.ndim}i", *reversed(data.shape)))
    out.write(encoded)
    out.write(data.tobytes())
