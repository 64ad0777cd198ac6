"""The rooms of `workbench/` import only the rooms below them (docs/architecture.md), and
the HTTP client reaches only the engine's light modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "workbench"
BASE = {"signals", "registry", "version"}
# room -> the rooms it may import ("top" is workbench/__init__.py, cli.py, batch.py, bench.py)
ALLOWED = {
    "base": set(),
    "kernels": set(),
    "engine": {"base", "kernels"},
    "server": {"base", "engine"},
    "widgets": {"base", "engine", "server"},
    "top": {"base", "kernels", "engine", "server", "widgets"},
}
REMOTE_REACHES = {"workbench.engine.results", "workbench.engine.options",
                  "workbench.engine.lifecycle", "workbench.signals"}


def room(module: str) -> str:
    """The room of a dotted module name under workbench."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("__init__", "cli", "batch", "bench"):
        return "top"
    return "base" if parts[1] in BASE else parts[1]


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def imported(path: Path) -> set[str]:
    """Every workbench module `path` imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("workbench")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.startswith("workbench"):
            if node.module == "workbench":  # `from workbench import registry` or `LLM`
                names |= {f"workbench.{a.name}" if a.name in BASE else "workbench"
                          for a in node.names}
            else:
                names.add(node.module)
    return names


def test_rooms_import_only_the_rooms_below_them():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        mine = room(name)
        for other in sorted(imported(path)):
            theirs = room(other)
            if theirs != mine and theirs not in ALLOWED[mine]:
                wrong.append(f"{name} ({mine}) imports {other} ({theirs})")
    assert not wrong, "\n".join(wrong)


def test_the_remote_client_reaches_only_the_light_engine_modules():
    path = PACKAGE / "server" / "remote.py"
    assert {m for m in imported(path) if room(m) != "server"} <= REMOTE_REACHES
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys; from workbench.server.remote import RemoteEngine; "
         "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
         "('numba', 'llvmlite', 'fastapi') or m.startswith('workbench.kernels'))))"],
        capture_output=True, text=True, check=True, cwd=PACKAGE.parent).stdout.split()
    assert loaded == []
