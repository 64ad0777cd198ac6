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
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import types
from pathlib import Path

import llvmlite
import numba
from numba.core.caching import CacheImpl, _CacheLocator

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


def _writable(path: Path) -> bool:
    """Whether the cache folder `path` can be made and written (checked once per folder)."""
    if path not in _CHECKED:
        try:
            path.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=path).close()
            _CHECKED[path] = True
        except OSError:
            _CHECKED[path] = False
    return _CHECKED[path]


if SourceKeyedLocator not in CacheImpl._locator_classes:
    CacheImpl._locator_classes.insert(0, SourceKeyedLocator)

njit = numba.njit  # re-exported: kernels import it from here, after the locator is in place
