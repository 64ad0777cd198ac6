"""Open GGUF model files: metadata as plain Python values, tensors as mmap views.

The file is memory-mapped with NumPy; nothing is copied or dequantized on open.
The header (metadata and tensor directory) is parsed here, with the `gguf`
package's type tables (`GGUFValueType`, `GGMLQuantizationType`,
`GGML_QUANT_SIZES`): `gguf.GGUFReader` builds one NumPy view per string, which
takes ~8 s on Qwen's 152k-token vocabulary, against ~0.3 s here. The tests
check this parser against `GGUFReader` on the real files.

On top of reading, this module gives clear errors for files that are missing,
truncated or not GGUF at all, and describes tensors in NumPy order (rows first)
with their raw, still-quantized data. Crafted headers fail with a `GGUFError`
before anything is allocated from them: every length and count is checked
against the bytes left in the file, arrays nest at most `MAX_ARRAY_DEPTH` deep,
tensors have 1 to `MAX_DIMS` positive dimensions and lie inside the file. The
architecture modules read their settings with `GGUFFile.get_int` / `get_float`,
which check type and range.
"""

from __future__ import annotations

import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from workbench.engine.text.tokenizers.base import token_texts

GGUF_MAGIC = b"GGUF"
MAX_INT = 2**31 - 1
"""Default upper bound of `GGUFFile.get_int`: sizes and counts past int32 are no real model's."""
_LAYER_NAME = re.compile(r"blk\.([0-9]+)\.")  # per-layer tensor names: blk.N.<name>


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
            self.metadata, directory, (data_start, alignment) = _parse_header(memoryview(mm))
        except (struct.error, IndexError, UnicodeDecodeError, ValueError, OverflowError) as exc:
            raise GGUFError(
                f"{path} is truncated or corrupt ({size} bytes): its header could not be read "
                f"({type(exc).__name__}: {exc})"
            ) from None
        _check_tokenizer_metadata(path, self.metadata)
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, type_id, offset in directory:
            if name in self.tensors:
                raise GGUFError(f"{path} is corrupt: the tensor {name!r} is listed twice")
            try:
                qtype = GGMLQuantizationType(type_id)
            except ValueError:
                raise UnsupportedTensorTypeError(
                    f"tensor {name!r} in {path.name} has unknown GGML type id {type_id}"
                ) from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            shape = tuple(reversed(dims))  # GGUF lists the fastest dim first
            if any(d < 1 for d in shape):
                raise GGUFError(f"{path} is corrupt: tensor {name!r} has shape {shape}")
            n_elements = math.prod(shape)  # Python ints: a crafted shape cannot overflow
            if shape[-1] % block:
                raise GGUFError(f"tensor {name!r}: row length {shape[-1]} is not a multiple "
                                f"of the {qtype.name} block size {block}")
            if offset % alignment:
                raise GGUFError(f"{path} is corrupt: tensor {name!r} starts at offset {offset}, "
                                f"not a multiple of the alignment {alignment}")
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

    def get_int(self, key: str, default: int | None = None, *, lo: int = 1,
                hi: int = MAX_INT) -> int:
        """The integer at `key` (or `default` when absent; None: required), checked to lie
        in [lo, hi]; a `GGUFError` naming the key, the value and the range otherwise."""
        value = self.metadata.get(key, default)
        if value is None:
            raise GGUFError(f"{self.path.name} lacks the metadata key {key!r}")
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise GGUFError(f"{self.path.name}: metadata key {key!r} holds {_describe(value)}, "
                            "not an integer; the file is damaged or was written wrongly")
        if not lo <= value <= hi:
            raise GGUFError(f"{self.path.name}: metadata key {key!r} is {value}, outside "
                            f"[{lo}, {hi}]; the file is damaged or was written wrongly")
        return int(value)

    def layer_count(self, key: str) -> int:
        """The layer count at `key` (`{arch}.block_count`), checked against the `blk.N.`
        tensors the file holds, before anything is sized or looped by it: a `GGUFError`
        naming the key and the layers the file has unless those are exactly 0 .. n-1."""
        n = self.get_int(key)
        layers = {int(m.group(1)) for name in self.tensors if (m := _LAYER_NAME.match(name))}
        if len(layers) == n and max(layers) == n - 1:  # n distinct ids >= 0: all of 0 .. n-1
            return n
        if not layers:
            has = "no per-layer (blk.N.) tensors"
        elif max(layers) == len(layers) - 1:
            has = f"tensors for {len(layers)} layers (blk.0 to blk.{max(layers)})"
        else:
            has = (f"tensors for {len(layers)} layers numbered {min(layers)} to "
                   f"{max(layers)}, with gaps")
        raise GGUFError(f"{self.path.name}: metadata key {key!r} is {n}, but the file holds "
                        f"{has}; the file is damaged or its metadata does not belong to its "
                        "weights")

    def get_float(self, key: str, default: float | None = None, *,
                  hi: float = math.inf) -> float:
        """The number at `key` (or `default` when absent; None: required), checked to be
        finite, > 0 and <= hi (epsilons, RoPE bases and factors); a `GGUFError` otherwise."""
        value = self.metadata.get(key, default)
        if value is None:
            raise GGUFError(f"{self.path.name} lacks the metadata key {key!r}")
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
            raise GGUFError(f"{self.path.name}: metadata key {key!r} holds {_describe(value)}, "
                            "not a number; the file is damaged or was written wrongly")
        value = float(value)
        if not (math.isfinite(value) and 0.0 < value <= hi):
            bound = f" and <= {hi}" if hi < math.inf else ""
            raise GGUFError(f"{self.path.name}: metadata key {key!r} is {value}; it must be "
                            f"finite and > 0{bound}; the file is damaged or was written wrongly")
        return value

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, arch={self.metadata.get('general.architecture')!r})"


def _check_tokenizer_metadata(path: Path, md: dict[str, Any]) -> None:
    """A `GGUFError` unless the `tokenizer.*` keys hold what the tokenizers read: the token
    list as distinct strings, scores and types as numeric arrays of one per token, special
    token ids as integers, text where text is expected."""
    def bad(key: str, what: str) -> GGUFError:
        return GGUFError(f"{path.name}: metadata key {key!r} holds {_describe(md[key])}; "
                         f"expected {what}; the file is damaged or was written wrongly")

    tokens = md.get("tokenizer.ggml.tokens")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        value = md.get(key)
        if value is not None and not (isinstance(value, list)
                                      and all(isinstance(v, str) for v in value)):
            raise bad(key, "an array of strings")
    n_tokens = len(tokens) if tokens is not None else None
    # compared as the tokenizer keys them: empty texts are renamed apart first
    if tokens is not None and len(set(token_texts(tokens))) != n_tokens:
        raise GGUFError(f"{path.name}: tokenizer.ggml.tokens holds the same token text twice; "
                        "the file is damaged or was written wrongly")
    for key, kind in (("tokenizer.ggml.scores", "fiu"), ("tokenizer.ggml.token_type", "iu")):
        value = md.get(key)
        if value is not None and not (isinstance(value, np.ndarray) and value.dtype.kind in kind
                                      and value.ndim == 1 and len(value) == n_tokens):
            raise bad(key, f"a numeric array of one value per token ({n_tokens})")
    for key, value in md.items():
        if not key.startswith("tokenizer."):
            continue
        if key.endswith("_token_id"):  # out of range is tolerated, as llama.cpp does
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise bad(key, "a token id")
        elif key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template") \
                and not isinstance(value, str):
            raise bad(key, "a string")
        elif key.startswith("tokenizer.ggml.add_") and not isinstance(value, (bool, int)):
            raise bad(key, "a boolean")


def _describe(value: Any) -> str:
    """A short description of a metadata value for error messages."""
    if isinstance(value, (str, list, np.ndarray)):
        return f"a {type(value).__name__} of length {len(value)}"
    return f"{value!r} ({type(value).__name__})"


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


MAX_ARRAY_DEPTH = 4
"""Deepest nesting of arrays in metadata values (real files nest none; llama.cpp takes 1)."""
MAX_DIMS = 4
"""Most dimensions a tensor may have (GGML_MAX_DIMS)."""
# Fewest bytes one item takes in the file, used to refuse a count that cannot fit in what
# is left before allocating anything for it: a string is at least its 8-byte length, a
# nested array its 4-byte type and 8-byte count, a metadata entry a key and a type, a
# tensor entry a name, n_dims, a type and an offset.
_MIN_STRING, _MIN_ARRAY, _MIN_KV, _MIN_TENSOR = 8, 12, 8 + 4, 8 + 4 + 4 + 8


class _Cursor:
    """Sequential little-endian reads from the mapped header; every length and count is
    checked against the bytes left before anything is allocated for it."""

    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def left(self) -> int:
        return len(self.buf) - self.pos

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def count(self, what: str, item_bytes: int) -> int:
        """A uint64 count of items of at least `item_bytes` each, checked to fit."""
        n = self.unpack("<Q")
        if n * item_bytes > self.left():
            raise GGUFError(f"{what} claims {n} items, more than the {self.left()} bytes "
                            "left in the file can hold")
        return n

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > self.left():
            raise GGUFError(f"a string of {n} bytes runs past the end of the file")
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        try:
            vtype = GGUFValueType(vtype)
        except ValueError:
            raise GGUFError(f"metadata key {key!r} has unknown value type {vtype}") from None
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype != GGUFValueType.ARRAY:
            return self.unpack(_SCALARS[vtype])
        if depth >= MAX_ARRAY_DEPTH:
            raise GGUFError(f"metadata key {key!r} nests arrays deeper than {MAX_ARRAY_DEPTH}")
        item_id = self.unpack("<I")
        try:
            item_type = GGUFValueType(item_id)
        except ValueError:
            raise GGUFError(f"metadata key {key!r} is an array of unknown type {item_id}") \
                from None
        if item_type == GGUFValueType.STRING:
            return [self.string() for _ in range(self.count(f"array {key!r}", _MIN_STRING))]
        if item_type == GGUFValueType.ARRAY:
            n = self.count(f"array {key!r}", _MIN_ARRAY)
            return [self.value(item_type, key, depth + 1) for _ in range(n)]
        dtype = _ARRAY_DTYPES[item_type]
        n = self.count(f"array {key!r}", dtype.itemsize)
        end = self.pos + n * dtype.itemsize
        arr = np.frombuffer(self.buf[self.pos : end], dtype=dtype).copy()
        self.pos = end
        return arr


def _parse_header(buf: memoryview) -> tuple[dict[str, Any], list, tuple[int, int]]:
    """Parse magic, metadata and the tensor directory.

    Returns (metadata, [(name, dims fastest-first, type id, offset)],
    (data start, alignment)).
    """
    cur = _Cursor(buf)
    cur.pos = 4  # magic, checked by the caller
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise GGUFError(f"GGUF version {version} is not supported (2 and 3 are)"
                        + (" - a big-endian file?" if version > 0xFFFF else ""))
    n_tensors = cur.unpack("<Q")
    n_kv = cur.count("the metadata", _MIN_KV)
    if n_tensors * _MIN_TENSOR > cur.left():
        raise GGUFError(f"the header claims {n_tensors} tensors, more than the file can hold")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        if key in metadata:
            raise GGUFError(f"the metadata key {key!r} appears twice")
        metadata[key] = cur.value(cur.unpack("<I"), key)
    directory = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} are "
                            "possible)")
        dims = tuple(cur.unpack("<Q") for _ in range(n_dims))
        directory.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
    alignment = metadata.get("general.alignment", 32)
    if isinstance(alignment, bool) or not isinstance(alignment, (int, np.integer)) \
            or alignment < 1 or alignment & (alignment - 1):
        raise GGUFError(f"general.alignment is {alignment!r}; it must be a power of two")
    alignment = int(alignment)
    data_start = -(-cur.pos // alignment) * alignment
    return metadata, directory, (data_start, alignment)
