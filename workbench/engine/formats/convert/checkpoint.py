"""Read the tensors of a Hugging Face checkpoint as NumPy arrays, without torch.

- `model.safetensors` (and sharded `model-0000N-of-0000M.safetensors`) through
  the `safetensors` package;
- `pytorch_model.bin` in torch's zip format (torch >= 1.6): the pickled state
  dict is read with an unpickler that knows only the handful of names a
  tensor dictionary needs (`torch._utils._rebuild_tensor_v2`, storage types,
  `OrderedDict`). Anything else in the pickle, such as a reference to `os.system`,
  raises `CheckpointError`: loading an untrusted `.bin` runs no code.
"""

from __future__ import annotations

import json
import pickle
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import numpy as np


class CheckpointError(ValueError):
    """The checkpoint is missing, unreadable, or holds something other than tensors."""


_STORAGE_DTYPES = {
    "FloatStorage": np.float32, "HalfStorage": np.float16, "DoubleStorage": np.float64,
    "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16,
    "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
    "BFloat16Storage": "bfloat16",
}


def checkpoint_files(folder: Path) -> list[Path]:
    """The weight files of a checkpoint folder: safetensors if present, else pytorch_model.bin
    (sharded checkpoints through their index file)."""
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        if (folder / single).is_file():
            return [folder / single]
        index = folder / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [folder / s for s in shards]
    raise CheckpointError(f"{folder} has no model.safetensors or pytorch_model.bin")


def read_tensors(folder: Path) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for every tensor of the checkpoint in `folder` (bfloat16 tensors of a
    torch checkpoint become float32)."""
    for path in checkpoint_files(folder):
        if path.suffix == ".safetensors":
            yield from _read_safetensors(path)
        else:
            yield from _read_torch_zip(path)


def _read_safetensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            names = list(f.keys())
            tensors = [(name, f.get_tensor(name)) for name in names]
    except Exception as exc:  # safetensors raises its own SafetensorError on a bad file
        raise CheckpointError(f"{path} could not be read as safetensors "
                              f"({type(exc).__name__}: {exc})") from exc
    yield from tensors


class _Storage:
    """A reference to one raw storage record of the zip, resolved after unpickling."""

    def __init__(self, dtype, key: str):
        self.dtype, self.key = dtype, key


class _TensorRef:
    def __init__(self, storage: _Storage, offset: int, size: tuple, stride: tuple):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride


def _rebuild_tensor(storage, offset, size, stride, *_):
    return _TensorRef(storage, int(offset), tuple(size), tuple(stride))


def _rebuild_parameter(data, *_):
    return data


class _StateDictUnpickler(pickle.Unpickler):
    """Unpickles a torch state dict into `_TensorRef`s; refuses every other global."""

    _GLOBALS = {
        ("collections", "OrderedDict"): OrderedDict,
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    }

    def find_class(self, module: str, name: str):
        if module == "torch" and name in _STORAGE_DTYPES:
            return name  # the storage type is only a dtype tag here
        if (module, name) in self._GLOBALS:
            return self._GLOBALS[(module, name)]
        raise CheckpointError(f"the checkpoint's pickle refers to {module}.{name}, which a "
                              "tensor dictionary never needs; refusing to load it")

    def persistent_load(self, pid):
        # ("storage", storage type, key, location, number of elements)
        if not isinstance(pid, tuple) or len(pid) < 3 or pid[0] != "storage":
            raise CheckpointError(f"unexpected persistent id in the checkpoint: {pid!r}")
        return _Storage(_STORAGE_DTYPES[pid[1]], str(pid[2]))


def _read_torch_zip(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path} is not a zip-format torch checkpoint (a legacy "
                              "torch.save file?); re-save it with safetensors")
    with zipfile.ZipFile(path) as zf:
        pkl = [n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl) != 1:
            raise CheckpointError(f"{path} has no single data.pkl record")
        root = pkl[0][: -len("data.pkl")]
        with zf.open(pkl[0]) as f:
            try:
                state = _StateDictUnpickler(f).load()
            except CheckpointError:
                raise
            except Exception as exc:
                raise CheckpointError(f"{path}: the pickle could not be read: {exc}") from exc
        if not isinstance(state, dict):
            raise CheckpointError(f"{path} holds a {type(state).__name__}, not a state dict")
        raw: dict[str, bytes] = {}
        for name, ref in state.items():
            if not isinstance(ref, _TensorRef):
                continue  # e.g. an int "_metadata" entry
            key = ref.storage.key
            if key not in raw:
                raw[key] = zf.read(f"{root}data/{key}")
            yield name, _materialize(ref, raw[key])


def _materialize(ref: _TensorRef, data: bytes) -> np.ndarray:
    dtype = ref.storage.dtype
    if dtype == "bfloat16":  # the high half of a float32
        bits = np.frombuffer(data, dtype=np.uint16).astype(np.uint32) << 16
        flat = bits.view(np.float32)
    else:
        flat = np.frombuffer(data, dtype=dtype)
    item = flat.itemsize
    return np.lib.stride_tricks.as_strided(
        flat[ref.offset:], shape=ref.size, strides=[s * item for s in ref.stride],
        writeable=False).copy()
