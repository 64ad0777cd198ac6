"""Prefix caches: the keys and values of a prompt's first positions, kept in memory or in
a file (`PrefixCache.save` / `load`, format below) to skip their prefill later. A damaged,
foreign or hostile file is refused with `PrefixCacheError` before any of it reaches the
model. `KVCache.snapshot` and `restore` copy between a sequence and a `PrefixCache`; a
branch's snapshot (`Branch.save`) is a prefix cache that also holds the branch's state
(flat numbers and names) and arrays (its next-token logits, its tokens, its grammar).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixCacheError(ValueError):
    """A prefix cache file is not one this model can use: foreign, damaged, of another
    format version or made for another model shape."""


class PrefixCache:
    """The keys and values of a prompt prefix, kept to skip its prefill later.

    Made by `LLM.prefix(text)` / `LLM.prefix_chat(messages)`; pass it as
    `prefix=` to `generate` / `chat` (a prompt that starts with its tokens
    copies them into the sequence's cache instead of running them), save it
    with `save(path)` and read it back with `PrefixCache.load(path, model)`.

        keys, values: (n_layer, n_kv_head, n_tokens, head_dim) float32

    `local_from`: the first position held for the sliding-window layers, when the
    prefix was cut from a rotating cache (0 otherwise). `state` and `arrays` are a
    branch snapshot's (None for a prompt's prefix): the branch's state as a flat dict of
    numbers, plain ASCII names and None, and its arrays by name (1-D, of `ARRAY_TYPES`).

    The file (format `VERSION`): `MAGIC`, the header's length (uint64 LE), the header
    (JSON: version, model_sha256, shape, dtype, tokens, local_from; for a branch, state
    and arrays: name -> [type, length]), keys and values (float32 LE), a branch's arrays
    in name order (LE), then a BLAKE2b-256 digest of everything before it. `load` checks
    the header against the model before reading the payload, and the digest before
    using it.
    """

    MAGIC = b"WBPREFIX"
    VERSION = 2
    DIGEST_SIZE = 32
    MAX_HEADER_DEPTH = 3  # the header is an object holding flat lists and flat objects
    ARRAY_TYPES = {"f4": "<f4", "f8": "<f8", "i4": "<i4", "u1": "u1"}

    def __init__(self, tokens: list[int], keys: np.ndarray, values: np.ndarray,
                 model_sha256: str, local_from: int = 0, *, state: dict | None = None,
                 arrays: dict[str, np.ndarray] | None = None):
        if keys.shape != values.shape or keys.ndim != 4 or keys.shape[2] != len(tokens):
            raise ValueError(f"keys {keys.shape} and values {values.shape} do not hold "
                             f"{len(tokens)} positions")
        self.tokens = [int(t) for t in tokens]
        self.keys = keys
        self.values = values
        self.model_sha256 = model_sha256
        self.local_from = int(local_from)
        self.state = state
        self.arrays = arrays

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def __repr__(self) -> str:
        return f"<PrefixCache {len(self)} tokens, {self.nbytes / 2**20:.1f} MiB>"

    def common_prefix(self, ids: list[int]) -> int:
        """How many of `ids`' first tokens this prefix holds."""
        return common_prefix(self.tokens, ids)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the prefix to `path` atomically (a temporary file renamed into place)."""
        path = Path(path)
        fields = {"version": self.VERSION, "model_sha256": self.model_sha256,
                  "shape": list(self.keys.shape), "dtype": "float32", "tokens": self.tokens,
                  "local_from": self.local_from}
        arrays = []
        if self.state is not None:
            codes = {np.dtype(v): k for k, v in self.ARRAY_TYPES.items()}
            layout = {}  # name -> [type code, length], in file order
            for name, a in sorted((self.arrays or {}).items()):
                code = codes[np.dtype(a.dtype).newbyteorder("<")]
                arrays.append(np.ascontiguousarray(a, dtype=self.ARRAY_TYPES[code]).reshape(-1))
                layout[name] = [code, int(a.size)]
            fields.update(state=self.state, arrays=layout)
        # ASCII with no escapes: what load's header check accepts
        header = json.dumps(fields, ensure_ascii=True).encode()
        if b"\\" in header:
            raise ValueError("a snapshot's state must hold plain names (no characters that "
                             "JSON escapes)")
        digest = hashlib.blake2b(digest_size=self.DIGEST_SIZE)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                for part in (self.MAGIC + struct.pack("<Q", len(header)) + header,
                             np.ascontiguousarray(self.keys, dtype="<f4").tobytes(),
                             np.ascontiguousarray(self.values, dtype="<f4").tobytes(),
                             *(a.tobytes() for a in arrays)):
                    digest.update(part)
                    f.write(part)
                f.write(digest.digest())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, model: Any) -> PrefixCache:
        """Read a prefix saved by `save`; `model` (an `LLM`) must be the very file it was
        made with (checked by SHA-256). The header is checked against the model (layers,
        KV heads, head size, at most `model.kv_cache_size` tokens, token ids in its
        vocabulary) before the payload is read, and the payload against the file's digest
        before it is used. Anything else raises `PrefixCacheError` saying why."""
        path = Path(path)
        size = path.stat().st_size
        lead = len(cls.MAGIC) + 8
        with open(path, "rb") as f:
            head = f.read(lead)
            if len(head) < lead or head[: len(cls.MAGIC)] != cls.MAGIC:
                raise PrefixCacheError(f"{path} is not a workbench prefix cache")
            (n_header,) = struct.unpack("<Q", head[len(cls.MAGIC):])
            # ids print as at most 10 digits and ", "; the rest of the header is small
            limit = 4096 + 12 * int(model.kv_cache_size)
            if n_header > min(limit, size - lead):
                raise PrefixCacheError(
                    f"{path}: the prefix cache's header is damaged (it claims {n_header} "
                    f"bytes; the file has {size - lead} after its start, a prefix for this "
                    f"model at most {limit})")
            raw = f.read(n_header)
            header = _parse_prefix_header(path, raw, cls.MAX_HEADER_DEPTH)
            version = header.get("version")
            if version != cls.VERSION:
                raise PrefixCacheError(
                    f"{path}: prefix cache format version {version!r} is not supported (this "
                    f"version of workbench reads version {cls.VERSION}); make the prefix "
                    "again with LLM.prefix / prefix_chat and save it")
            if header.get("model_sha256") != model.file_sha256:
                raise PrefixCacheError(f"{path} was made with another model file than "
                                       f"{model.path.name}; make the prefix again with this "
                                       "model")
            shape, tokens, local_from = _check_prefix_header(path, header, model)
            state, layout = _check_branch_header(path, header, model)
            count = math.prod(shape)
            extra = sum(np.dtype(t).itemsize * n for _, t, n in layout)
            expected = lead + n_header + 2 * 4 * count + extra + cls.DIGEST_SIZE
            if size != expected:
                raise PrefixCacheError(f"{path} is truncated or damaged: {size} bytes where "
                                       f"{expected} were expected")
            digest = hashlib.blake2b(head + raw, digest_size=cls.DIGEST_SIZE)
            keys = np.empty(shape, dtype="<f4")
            values = np.empty(shape, dtype="<f4")
            arrays = {name: np.empty(n, dtype=t) for name, t, n in layout}
            for arr in (keys, values, *arrays.values()):
                view = memoryview(arr).cast("B")
                if f.readinto(view) != len(view):
                    raise PrefixCacheError(f"{path} is truncated")
                digest.update(view)
            if not hmac.compare_digest(f.read(cls.DIGEST_SIZE), digest.digest()):
                raise PrefixCacheError(f"{path} is damaged: its checksum does not match its "
                                       "contents; make the prefix again")
        if not (np.isfinite(keys).all() and np.isfinite(values).all()):
            raise PrefixCacheError(f"{path} holds NaN or infinite keys or values; make the "
                                   "prefix again")
        if any(a.dtype.kind == "f" and np.isnan(a).any() for a in arrays.values()):
            raise PrefixCacheError(f"{path} holds NaN numbers; save the branch again")
        return cls(tokens, keys, values, header["model_sha256"], local_from, state=state,
                   arrays=arrays if state is not None else None)


def _parse_prefix_header(path: Path, raw: bytes, max_depth: int) -> dict:
    """The JSON header of a prefix cache file as a dict, its nesting checked before it is
    parsed (headers are written by `PrefixCache.save`: ASCII, no escapes)."""
    data = np.frombuffer(raw, dtype=np.uint8)
    if data.size and (data.max() >= 0x80 or (data == ord("\\")).any()):
        raise PrefixCacheError(f"{path}: the prefix cache's header is damaged (not the "
                               "plain JSON that save writes)")
    outside = np.cumsum(data == ord('"')) % 2 == 0  # no escapes: quotes pair up
    opens = (data == ord("[")) | (data == ord("{"))
    closes = (data == ord("]")) | (data == ord("}"))
    depth = np.cumsum(np.where(outside, opens.astype(np.int64) - closes, 0))
    if depth.size and depth.max() > max_depth:
        raise PrefixCacheError(f"{path}: the prefix cache's header is damaged (nested "
                               f"{int(depth.max())} deep)")
    try:
        header = json.loads(raw)
    except ValueError:
        raise PrefixCacheError(f"{path}: the prefix cache's header is damaged") from None
    if not isinstance(header, dict):
        raise PrefixCacheError(f"{path}: the prefix cache's header is damaged")
    return header


def _check_prefix_header(path: Path, header: dict, model: Any
                         ) -> tuple[tuple[int, ...], list[int], int]:
    """(shape, tokens, local_from) of a prefix header, checked against `model`."""
    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    shape, tokens = header.get("shape"), header.get("tokens")
    local_from = header.get("local_from", 0)
    if not (isinstance(shape, list) and len(shape) == 4 and all(map(is_int, shape))
            and isinstance(tokens, list) and all(map(is_int, tokens)) and is_int(local_from)
            and header.get("dtype") == "float32"):
        raise PrefixCacheError(f"{path}: the prefix cache's header is damaged (its shape, "
                               "tokens, dtype or local_from are not what save writes)")
    cfg = model.config
    want = (cfg.n_layer, cfg.n_head_kv, len(tokens), cfg.head_dim)
    if tuple(shape) != want:
        raise PrefixCacheError(f"{path}: keys and values of shape {tuple(shape)} do not fit "
                               f"this model, which needs {want} for {len(tokens)} tokens")
    if len(tokens) > model.kv_cache_size:
        raise PrefixCacheError(f"{path} holds {len(tokens)} tokens, more than the model's "
                               f"kv_cache_size {model.kv_cache_size}; load the model with a "
                               "larger kv_cache_size")
    if tokens and not (0 <= min(tokens) and max(tokens) < cfg.n_vocab):
        raise PrefixCacheError(f"{path} holds token ids outside this model's vocabulary of "
                               f"{cfg.n_vocab}")
    if not 0 <= local_from <= len(tokens):
        raise PrefixCacheError(f"{path}: local_from {local_from} lies outside its "
                               f"{len(tokens)} tokens")
    return tuple(shape), tokens, local_from


def _check_branch_header(path: Path, header: dict, model: Any
                         ) -> tuple[dict | None, list[tuple[str, str, int]]]:
    """(state, [(name, dtype, length)] of the arrays, in file order) of a branch
    snapshot's header ((None, []) for a prompt's prefix): the state a flat dict of
    numbers, names and None; at most MAX_ARRAY_BYTES of arrays in all."""
    state, arrays = header.get("state"), header.get("arrays")
    if state is None and arrays is None:
        return None, []
    if not (isinstance(state, dict) and all(
            isinstance(v, (int, float, str, type(None))) for v in state.values())
            and isinstance(arrays, dict)):
        raise PrefixCacheError(f"{path}: the branch state in its header is damaged (not "
                               "the flat object save writes)")
    layout = []
    for name, spec in sorted(arrays.items()):
        if not (isinstance(spec, list) and len(spec) == 2
                and spec[0] in PrefixCache.ARRAY_TYPES and isinstance(spec[1], int)
                and not isinstance(spec[1], bool) and spec[1] >= 0):
            raise PrefixCacheError(f"{path}: the branch's array {name!r} is damaged in its "
                                   "header")
        layout.append((name, PrefixCache.ARRAY_TYPES[spec[0]], spec[1]))
    limit = MAX_ARRAY_BYTES + 16 * (model.config.n_vocab + model.kv_cache_size)
    size = sum(np.dtype(t).itemsize * n for _, t, n in layout)
    if size > limit:
        raise PrefixCacheError(f"{path}: the branch's arrays claim {size:,} bytes, more "
                               f"than a branch of this model holds (at most {limit:,})")
    return state, layout


# A saved branch's arrays beyond its logits and tokens: its grammar's text, a logit bias
MAX_ARRAY_BYTES = 1 << 24
