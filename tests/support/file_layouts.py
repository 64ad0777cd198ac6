"""The layouts of a PrefixCache file and a whisper.cpp `.bin` header: writing one from its
parts, reading the parts back, patching header fields."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from workbench.engine.runtime.prefix_cache import PrefixCache


def write_prefix(path: Path, header: dict | bytes, payload: bytes,
                 n_header: int | None = None, digest: bool = True) -> Path:
    """A prefix cache file from parts; `digest` appends the BLAKE2b-256 of what precedes."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    body = PrefixCache.MAGIC + struct.pack("<Q", len(raw) if n_header is None else n_header) \
        + raw + payload
    if digest:
        body += hashlib.blake2b(body, digest_size=32).digest()
    path.write_bytes(body)
    return path


def prefix_parts(path: Path) -> tuple[dict, bytes]:
    """A prefix cache file's JSON header and its payload (without the digest)."""
    data = path.read_bytes()
    (n,) = struct.unpack_from("<Q", data, 8)
    return json.loads(data[16 : 16 + n]), data[16 + n : -32]


# where each int32 hyperparameter of a whisper.cpp .bin header sits
HPARAM = {name: 4 + 4 * i for i, name in enumerate((
    "n_vocab", "n_audio_ctx", "n_audio_state", "n_audio_head", "n_audio_layer", "n_text_ctx",
    "n_text_state", "n_text_head", "n_text_layer", "n_mels", "ftype", "n_mel", "n_fft"))}


def patched(src: Path, dst: Path, **fields: int) -> Path:
    """A copy of the whisper.cpp file `src` at `dst` with header `fields` set (int32 each)."""
    data = bytearray(src.read_bytes())
    for name, value in fields.items():
        struct.pack_into("<i", data, HPARAM[name], value)
    dst.write_bytes(bytes(data))
    return dst
