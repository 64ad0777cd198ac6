"""The kernels' disk cache: compiled once per machine, never stale.

Numba's own cache (`njit(cache=True)`) checks only the modification time of
the file that defines a function. Our kernels inline code from other files
(`cpu.py` inlines `simd.py`'s vector steps, the decode stack inlines `cpu.py`
and `layers.py`), so an edit there would leave callers running old compiled
code. Here the cache of every function of ours is stamped with the contents
of its own module and of every workbench module it reaches through its
module's imports, plus the Python, Numba and llvmlite versions; Numba adds
the CPU's name and features to each entry's key. A change to any of them is
a different stamp, and the function is compiled again.

Kernels are written with this module's `njit` (Numba's, with that cache
registered first). The files live in `cache_dir()`.

The cache heals itself. Each file carries a SHA-256 of its contents: an entry
that fails to load (a truncated, garbled or empty file, a crash mid-write on a
file system without atomic renames) is deleted and compiled again, with one
`KernelCacheWarning` per process. A cache folder that cannot be written (read-only,
a file, a dangling link) leaves the kernels compiled in memory for this process,
with one warning too.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import os
import pickle
import sys
import tempfile
import threading
import types
import warnings
from pathlib import Path

import llvmlite
import numba
from numba.core.caching import CacheImpl, FunctionCache, IndexDataCacheFile, _CacheLocator

from workbench.kernels import gil

_PACKAGE = "workbench."


def cache_dir() -> Path:
    """Where compiled kernels are kept: `$NUMBA_CACHE_DIR/workbench` when that is set,
    else `~/.cache/workbench/kernels`."""
    numba_dir = os.environ.get("NUMBA_CACHE_DIR")
    if numba_dir:
        return Path(numba_dir).expanduser() / "workbench"
    return Path.home() / ".cache" / "workbench" / "kernels"


def _reached_modules(name: str) -> list[str]:
    """`name` and every workbench module its module reaches through its globals (imported
    modules, and functions or objects defined in another module), transitively."""
    seen: list[str] = []
    todo = [name]
    while todo:
        mod = sys.modules.get(todo.pop())
        if mod is None or mod.__name__ in seen or not mod.__name__.startswith(_PACKAGE):
            continue
        seen.append(mod.__name__)
        for value in list(vars(mod).values()):
            if isinstance(value, types.ModuleType):
                todo.append(value.__name__)
                continue
            # a function, a Numba dispatcher (py_func) or intrinsic (_defn), a class ...
            for obj in (value, getattr(value, "py_func", None), getattr(value, "_defn", None)):
                other = getattr(obj, "__module__", None)
                if isinstance(other, str) and other.startswith(_PACKAGE):
                    todo.append(other)
    return sorted(seen)


def source_key(module: str) -> str:
    """A hash of the sources a function of `module` can inline, and of the tools that
    compile it (see the module docstring)."""
    h = hashlib.sha256()
    h.update(f"{sys.version} numba {numba.__version__} llvmlite {llvmlite.__version__}".encode())
    for name in _reached_modules(module):
        path = getattr(sys.modules[name], "__file__", None)
        if path and os.path.isfile(path):
            h.update(name.encode() + b"\0" + Path(path).read_bytes() + b"\0")
    return h.hexdigest()


class SourceKeyedLocator(_CacheLocator):
    """Numba cache locator for workbench's functions: files in `cache_dir()`, stamped with
    `source_key` instead of the defining file's modification time."""

    def __init__(self, py_func, py_file: str):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._stamp = source_key(py_func.__module__)
        self._path = cache_dir() / py_func.__module__.replace(".", "_")

    def ensure_cache_path(self) -> None:
        # writability was checked by `from_function`; the folder may have been removed since
        self._path.mkdir(parents=True, exist_ok=True)

    def get_cache_path(self) -> str:
        return str(self._path)

    def get_source_stamp(self) -> str:
        return self._stamp

    def get_disambiguator(self) -> str:
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func, py_file: str) -> SourceKeyedLocator | None:
        module = getattr(py_func, "__module__", None) or ""
        if not module.startswith(_PACKAGE):
            return None
        locator = cls(py_func, py_file)
        if not _writable(locator._path):  # Numba's other locators are tried next
            return None
        return locator


_CHECKED: dict[Path, bool] = {}
_CHECKED_ERRORS: dict[Path, str] = {}


def writable() -> bool:
    """Whether kernels can be kept in `cache_dir()` (else they compile in memory)."""
    return _writable(cache_dir())


def _writable(path: Path) -> bool:
    """Whether the cache folder `path` can be made and written (checked once per folder)."""
    if path not in _CHECKED:
        try:
            path.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=path).close()
            _CHECKED[path] = True
        except OSError as e:
            _CHECKED[path] = False
            _CHECKED_ERRORS[path] = f"{type(e).__name__}: {e}"
    return _CHECKED[path]


if SourceKeyedLocator not in CacheImpl._locator_classes:
    CacheImpl._locator_classes.insert(0, SourceKeyedLocator)
gil.install()  # before any kernel compiles


# -- a cache that heals itself ------------------------------------------------------------------
class KernelCacheWarning(RuntimeWarning):
    """The kernel cache could not be used as it was: a damaged entry was compiled again
    (`kind` "damaged"), or the cache folder cannot be written and kernels are compiled in
    memory ("unusable")."""

    def __init__(self, message: str, kind: str = "damaged"):
        super().__init__(message)
        self.kind = kind


_WARNED: set[str] = set()
_WARNED_LOCK = threading.Lock()


def warn(kind: str, message: str) -> None:
    """Warn about the cache once per process and `kind` ("damaged" or "unusable"); the
    warm-up's helper process reports its own warnings through this."""
    with _WARNED_LOCK:
        if kind in _WARNED:
            return
        _WARNED.add(kind)
    warnings.warn(KernelCacheWarning(message, kind), stacklevel=2)


def _damaged(path: str, problem: object) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
    warn("damaged", f"the kernel cache entry {path} could not be read ({problem}); it was "
                    f"removed and the kernel is compiled again")


def _unusable(problem: object) -> None:
    warn("unusable", f"the kernel cache {cache_dir()} cannot be written ({problem}); kernels "
                     f"are compiled in memory for this process only (set NUMBA_CACHE_DIR to "
                     f"a writable folder to keep them)")


# Our files: this magic, the SHA-256 of the rest, then the pickled payload.
MAGIC = b"WBKC1\n"
_DIGEST = 32


class _NoGlobals(pickle.Unpickler):
    """Reads pickles of plain data only (the version string of an old index)."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")


class CheckedCacheFile(IndexDataCacheFile):
    """Numba's index and data files with a checksum: a file that does not check out is
    deleted and reads as missing (the kernel compiles again and is saved anew), and a
    save that fails (a full disk, a folder made read-only since) is skipped."""

    def _load_index(self) -> dict:
        try:
            with open(self._index_path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return {}
        except OSError as e:  # unreadable: as if missing; the save will say more
            _unusable(e)
            return {}
        body = _checked(raw)
        if body is None:
            if not _numba_index(raw):  # Numba's own index from before: stale, not damaged
                _damaged(self._index_path, "bad checksum" if raw else "empty file")
            return {}
        try:
            version, stamp, overloads = pickle.loads(body)
        except Exception as e:  # checked, yet unreadable: another Numba's pickles
            _damaged(self._index_path, repr(e))
            return {}
        if version != self._version or stamp != self._source_stamp:
            return {}  # stale: overwritten by the next save
        return overloads

    def _save_index(self, overloads: dict) -> None:
        data = self._dump((self._version, self._source_stamp, overloads))
        with self._open_for_write(self._index_path) as f:
            f.write(MAGIC + hashlib.sha256(data).digest() + data)

    def _load_data(self, name: str):
        path = self._data_path(name)
        with open(path, "rb") as f:  # OSError: Numba reads the entry as missing
            raw = f.read()
        body = _checked(raw)
        try:
            if body is None:
                raise ValueError("bad checksum" if raw else "empty file")
            return pickle.loads(body)
        except Exception as e:
            _damaged(path, e)
            return None

    def _save_data(self, name: str, data) -> None:
        data = self._dump(data)
        with self._open_for_write(self._data_path(name)) as f:
            f.write(MAGIC + hashlib.sha256(data).digest() + data)

    def save(self, key, data) -> None:
        try:
            super().save(key, data)
        except OSError as e:
            _unusable(e)


def _checked(raw: bytes) -> bytes | None:
    """The payload of one of our files, or None where it does not check out."""
    start = len(MAGIC) + _DIGEST
    if not raw.startswith(MAGIC) or len(raw) < start:
        return None
    body = raw[start:]
    return body if hashlib.sha256(body).digest() == raw[len(MAGIC):start] else None


def _numba_index(raw: bytes) -> bool:
    """Whether `raw` starts as an index in Numba's own format (a pickled version string):
    one written before this cache format, which is stale, not damaged."""
    try:
        return isinstance(_NoGlobals(io.BytesIO(raw)).load(), str)
    except Exception:
        return False


class CheckedFunctionCache(FunctionCache):
    """Numba's function cache over `CheckedCacheFile`; an entry that checks out but still
    cannot be rebuilt (a different LLVM) is dropped and compiled again."""

    def load_overload(self, sig, target_context):
        try:
            return super().load_overload(sig, target_context)
        except Exception as e:
            warn("damaged", f"a kernel cache entry of {self._name} could not be loaded "
                            f"({e!r}); it is compiled again")
            try:
                self._cache_file.flush()  # forget this function's entries
            except OSError:
                pass
            return None

    def save_overload(self, sig, data) -> None:
        try:
            super().save_overload(sig, data)
        except OSError as e:
            _unusable(e)


def njit(*args, **kwargs):
    """Numba's `njit`, with `nogil=True` unless told otherwise (parallel loops then run
    without touching the GIL: `workbench.kernels.gil`); with `cache=True`, cached in
    `cache_dir()` through `SourceKeyedLocator` and `CheckedFunctionCache`, or compiled in
    memory where that folder cannot be written (one `KernelCacheWarning`)."""
    if args and inspect.isfunction(args[0]):
        return _njit(args[0], args[1:], kwargs)
    return lambda func: _njit(func, args, kwargs)


def _njit(func, args: tuple, kwargs: dict):
    kwargs = {"nogil": True, **kwargs}
    if kwargs.get("cache") and func.__module__.startswith(_PACKAGE):
        folder = cache_dir() / func.__module__.replace(".", "_")  # SourceKeyedLocator's
        if not _writable(folder):  # rather than Numba's other locators, or its error
            _unusable(_CHECKED_ERRORS[folder])
            kwargs = {**kwargs, "cache": False}
    dispatcher = numba.njit(*args, **kwargs)(func)
    cache = getattr(dispatcher, "_cache", None)
    if (type(cache) is FunctionCache
            and isinstance(cache._impl.locator, SourceKeyedLocator)):
        # the same objects, with the checks: a new cache would hash the sources again
        cache.__class__ = CheckedFunctionCache
        cache._cache_file.__class__ = CheckedCacheFile
    return dispatcher
