"""Open GGUF model files: metadata as plain Python values, tensors as mmap views.

The file is memory-mapped with NumPy; nothing is copied or dequantized on open.
The header (metadata and tensor directory) is parsed here, with the `gguf`
package's type tables (`GGUFValueType`, `GGMLQuantizationType`,
`GGML_QUANT_SIZES`): `gguf.GGUFReader` builds one NumPy view per string, which
takes ~8 s on Qwen's 152k-token vocabulary, against ~0.3 s here. The tests
check this parser against `GGUFReader` on the real files.

On top of reading, this module gives clear errors for files that are missing,
truncated or not GGUF at all, and describes tensors in NumPy order (rows first)
with their raw, still-quantized data.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"


class GGUFError(ValueError):
    """The file is not a readable GGUF model (wrong magic, truncated, inconsistent)."""


class UnsupportedArchitectureError(GGUFError):
    """`general.architecture` names a model family the engine does not implement."""


class UnsupportedTensorTypeError(GGUFError):
    """A tensor is stored in a GGML type the engine cannot compute with."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file.

    `shape` is in NumPy order (GGUF stores dims fastest-first, so a weight with
    GGUF dims [K, N] is shape (N, K) here: N output rows of K inputs).
    `data` is the reader's view on the mapped file: typed for F32/F16, raw
    uint8 blocks of shape (rows, bytes_per_row) for quantized types.
    """

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray
    offset: int = 0  # byte offset of the data in the file

    def read(self, path: str | os.PathLike) -> np.ndarray:
        """A private copy of the raw bytes (1-D uint8), read with file I/O rather than
        through the memory map, so the mapped pages stay untouched (and out of RSS)."""
        return np.fromfile(path, dtype=np.uint8, count=self.data.nbytes, offset=self.offset)


class GGUFFile:
    """A GGUF file opened read-only with mmap.

    Attributes:
        path: the file.
        metadata: key -> value; strings as `str`, scalars as int/float/bool,
            string arrays as `list[str]`, numeric arrays as NumPy arrays.
        tensors: name -> `TensorInfo`, in file order.
    """

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"model file not found: {path}")
        if not path.is_file():
            raise GGUFError(f"{path} is not a file")
        size = path.stat().st_size
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise GGUFError(
                f"{path} is not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})"
            )
        self.path = path
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        try:
            self.metadata, directory, data_start = _parse_header(memoryview(mm))
        except (struct.error, IndexError, UnicodeDecodeError, ValueError) as exc:
            raise GGUFError(
                f"{path} is truncated or corrupt ({size} bytes): its header could not be read "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, type_id, offset in directory:
            try:
                qtype = GGMLQuantizationType(type_id)
            except ValueError:
                raise UnsupportedTensorTypeError(
                    f"tensor {name!r} in {path.name} has unknown GGML type id {type_id}"
                ) from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            shape = tuple(reversed(dims))  # GGUF lists the fastest dim first
            n_elements = int(np.prod(shape))
            if shape[-1] % block:
                raise GGUFError(f"tensor {name!r}: row length {shape[-1]} is not a multiple "
                                f"of the {qtype.name} block size {block}")
            n_bytes = n_elements // block * type_size
            begin = data_start + offset
            if begin + n_bytes > size:
                raise GGUFError(
                    f"{path} is truncated: tensor {name!r} ends at byte {begin + n_bytes}, "
                    f"the file has {size}"
                )
            raw = mm[begin : begin + n_bytes]
            if qtype == GGMLQuantizationType.F32:
                data = raw.view(np.float32).reshape(shape)
            elif qtype == GGMLQuantizationType.F16:
                data = raw.view(np.float16).reshape(shape)
            else:  # (rows, bytes per row), as gguf.GGUFReader gives it
                data = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
            self.tensors[name] = TensorInfo(name, qtype, shape, data, begin)

    @property
    def architecture(self) -> str:
        """`general.architecture`, e.g. "llama" or "qwen2"."""
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path} has no general.architecture key")
        return arch

    def tensor(self, name: str) -> TensorInfo:
        """The tensor `name`; a `GGUFError` naming the file when it is absent."""
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path.name} has no tensor {name!r}") from None

    def get(self, key: str, default: Any = None) -> Any:
        """Metadata value for `key`, or `default`."""
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        """Metadata value for `key`; a `GGUFError` naming the key when it is absent."""
        if key not in self.metadata:
            raise GGUFError(f"{self.path.name} lacks the metadata key {key!r}")
        return self.metadata[key]

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, arch={self.metadata.get('general.architecture')!r})"


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open a GGUF file (mmap, nothing is copied or dequantized)."""
    return GGUFFile(path)


_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_ARRAY_DTYPES = {t: np.dtype(f) for t, f in _SCALARS.items()}


class _Cursor:
    """Sequential little-endian reads from the mapped header."""

    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("string runs past the end of the file")
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, vtype: int) -> Any:
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype != GGUFValueType.ARRAY:
            return self.unpack(_SCALARS[vtype])
        item_type, count = GGUFValueType(self.unpack("<I")), self.unpack("<Q")
        if item_type == GGUFValueType.STRING:
            return [self.string() for _ in range(count)]
        if item_type == GGUFValueType.ARRAY:
            return [self.value(item_type) for _ in range(count)]
        dtype = _ARRAY_DTYPES[item_type]
        end = self.pos + count * dtype.itemsize
        if end > len(self.buf):
            raise ValueError("array runs past the end of the file")
        arr = np.frombuffer(self.buf[self.pos : end], dtype=dtype).copy()
        self.pos = end
        return arr


def _parse_header(buf: memoryview) -> tuple[dict[str, Any], list, int]:
    """Parse magic, metadata and the tensor directory.

    Returns (metadata, [(name, dims fastest-first, type id, offset)], data start).
    """
    cur = _Cursor(buf)
    cur.pos = 4  # magic, checked by the caller
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise GGUFError(f"GGUF version {version} is not supported (2 and 3 are)"
                        + (" - a big-endian file?" if version > 0xFFFF else ""))
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
    directory = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("<I")
        dims = tuple(cur.unpack("<Q") for _ in range(n_dims))
        directory.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-cur.pos // alignment) * alignment
    return metadata, directory, data_start
