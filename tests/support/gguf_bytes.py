"""GGUF files for hostile-input tests: a rewritten copy of a real file with chosen fields
changed, and headers written byte by byte (ones the `gguf` writer refuses to produce)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter
from gguf import GGUFValueType as VT


def rewrite_gguf(src: Path, dst: Path, changes: dict | None = None, drop: tuple = (),
                 tensors: dict | None = None, drop_tensors: tuple = ()) -> Path:
    """A copy of the GGUF `src` at `dst` with metadata `changes` ({key: (value, type[,
    item type])}), keys `drop`ped, tensors replaced ({name: fn(array) -> array}) and
    tensors `drop_tensors` left out."""
    r = GGUFReader(src)
    changes, tensors = changes or {}, tensors or {}
    w = GGUFWriter(os.fspath(dst), r.fields["general.architecture"].contents())
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" \
                or name in drop or name in changes:
            continue
        item = field.types[-1] if field.types[0] == VT.ARRAY else None
        w.add_key_value(name, field.contents(), field.types[0], sub_type=item)
    for name, (value, vtype, *item) in changes.items():
        w.add_key_value(name, value, vtype, sub_type=item[0] if item else None)
    for t in r.tensors:
        if t.name in drop_tensors:
            continue
        data = np.array(t.data)
        w.add_tensor(t.name, tensors[t.name](data) if t.name in tensors else data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def gguf_str(s: str | bytes) -> bytes:
    """A GGUF string: its length (uint64, little-endian), then its bytes."""
    s = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(s)) + s


def gguf_bytes(kvs: list[bytes], tensors: list[bytes] = (), n_kv: int | None = None,
               n_tensors: int | None = None, tail: bytes = b"") -> bytes:
    """A GGUF v3 file from raw metadata entries and tensor entries (see `kv` / `tensor`)."""
    return (b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if n_tensors is None else n_tensors,
                                  len(kvs) if n_kv is None else n_kv)
            + b"".join(kvs) + b"".join(tensors) + tail)


def kv(key: str, vtype: VT, payload: bytes) -> bytes:
    return gguf_str(key) + struct.pack("<I", vtype) + payload


def tensor(name: str, dims: tuple[int, ...], type_id: int = 0, offset: int = 0,
           n_dims: int | None = None) -> bytes:
    return (gguf_str(name) + struct.pack("<I", len(dims) if n_dims is None else n_dims)
            + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", type_id, offset))


ARCH = kv("general.architecture", VT.STRING, gguf_str("llama"))
