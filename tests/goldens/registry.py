"""The producers of the goldens (`GOLDENS` in each `tests/goldens/make_*.py`), and the
comparison of a live peer run with a stored golden."""

from __future__ import annotations

import importlib
import json
import pkgutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tests.goldens import DATA, Golden

# A live peer run may differ from the stored one in the last bits of its floats (another
# CPU kind takes other kernel paths in torch); the tests' own tolerances are 1e-4 relative
# or looser, so a drift ten times below the tightest of them is still the same golden.
FLOAT_DRIFT = 1e-5


def producers() -> dict[str, Callable[[], Golden]]:
    """Every golden's name and its producer, from the `make_*` modules (which import their
    peers only when a producer runs)."""
    folder = Path(__file__).resolve().parent
    found: dict[str, Callable[[], Golden]] = {}
    for info in sorted(pkgutil.iter_modules([str(folder)]), key=lambda i: i.name):
        if info.name.startswith("make_"):
            module = importlib.import_module(f"tests.goldens.{info.name}")
            for name, make in module.GOLDENS.items():
                assert name not in found, f"two producers for the golden {name}"
                found[name] = make
    return found


def load_stored(name: str) -> Golden:
    """The stored golden with its files' bytes read (for a byte-for-byte comparison)."""
    from tests.goldens import load

    golden = load(name)
    golden.files = {f: (DATA / name / f).read_bytes() for f in golden.files}
    return golden


def compare(stored: Golden, live: Golden) -> list[str]:
    """What differs between a stored golden and a live peer run: inputs, JSON outputs and
    files must be equal; integer arrays equal; float arrays within FLOAT_DRIFT of the
    stored array's largest magnitude. A changed peer version is reported too."""
    problems = []
    if stored.peer != live.peer:
        problems.append(f"peer {stored.peer} -> {live.peer}")
    for what in ("inputs", "outputs"):
        a = json.loads(json.dumps(getattr(stored, what)))
        b = json.loads(json.dumps(getattr(live, what)))
        if a != b:
            keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            problems.append(f"{what} differ at {keys}")
    if set(stored.arrays) != set(live.arrays):
        problems.append(f"arrays {sorted(stored.arrays)} -> {sorted(live.arrays)}")
    for key in sorted(set(stored.arrays) & set(live.arrays)):
        a, b = stored.arrays[key], np.asarray(live.arrays[key])
        if a.shape != b.shape or a.dtype != b.dtype:
            problems.append(f"{key}: {a.dtype}{a.shape} -> {b.dtype}{b.shape}")
        elif np.issubdtype(a.dtype, np.floating):
            scale = float(np.max(np.abs(a))) if a.size else 0.0
            err = float(np.max(np.abs(a.astype(np.float64) - b))) if a.size else 0.0
            if err > FLOAT_DRIFT * max(scale, 1e-30):
                problems.append(f"{key}: max diff {err:.3e} > {FLOAT_DRIFT} * {scale:.3e}")
        elif not np.array_equal(a, b):
            problems.append(f"{key}: values differ")
    if set(stored.files) != set(live.files):
        problems.append(f"files {sorted(stored.files)} -> {sorted(live.files)}")
    for f in sorted(set(stored.files) & set(live.files)):
        if stored.files[f] != live.files[f]:
            problems.append(f"file {f} differs")
    return problems
