"""The rooms of `workbench/` import only the rooms below them (docs/architecture.md), no
module imports itself through others, and the HTTP client reaches only the engine's light
modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "workbench"
BASE = {"signals", "registry", "version"}
# room -> the rooms it may import ("top": workbench/__init__.py, cli.py, lab.py, batch.py, bench.py)
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

# The parts of engine/ (docs/architecture.md) and the parts each may import. "light" are
# the plain-data modules at engine/'s top that every part reads; "front" the rest of its
# top: the three engines, what they share and `load_engine`.
ENGINE_LIGHT = {"options", "results", "cancel", "lifecycle"}
ENGINE_PARTS = {
    "light": set(),
    "runtime": {"light"},
    "text": {"light", "runtime"},
    "audio": {"light"},
    "formats": {"light", "text", "audio"},
    "models": {"light", "runtime", "formats", "audio"},
    "decoding": {"light", "runtime", "text"},
    "front": {"light", "runtime", "text", "audio", "formats", "models", "decoding"},
    "explore": {"light", "runtime", "text", "audio", "formats", "models", "decoding",
                "front"},
}
ENGINE_TOP_MOST = 16  # entries at engine/'s top, so that a newcomer finds a room by name


def room(module: str) -> str:
    """The room of a dotted module name under workbench."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("__init__", "cli", "lab", "batch", "bench"):
        return "top"
    return "base" if parts[1] in BASE else parts[1]


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
        or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _run_time_nodes(node: ast.AST):
    """The nodes under `node` that run: all but the body of `if TYPE_CHECKING:` blocks."""
    for child in ast.iter_child_nodes(node):
        if _is_type_checking(child):
            for other in child.orelse:
                yield other
                yield from _run_time_nodes(other)
            continue
        yield child
        yield from _run_time_nodes(child)


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


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def import_graph() -> dict[str, set[str]]:
    """module -> the workbench modules it imports when it runs: at the top or inside a
    function, not under `if TYPE_CHECKING:`. `from package import name` points at the
    submodule `package.name` where there is one, else at the package."""
    graph = {}
    for name, path in MODULES.items():
        edges = set()
        for node in _run_time_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                edges |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES
                          else node.module for a in node.names}
        graph[name] = edges & MODULES.keys()
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of `graph` that hold a cycle (Tarjan's
    algorithm, iterative): each is a set of modules that import each other in a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph[node]:
                        cycles.append(sorted(component))
    return cycles


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"d"}}
    assert sorted(import_cycles(graph)) == [["a", "b", "c"], ["e"]]


def test_no_module_imports_itself_through_others():
    cycles = import_cycles(import_graph())
    graph = import_graph()
    shown = [" <-> ".join(c) + "\n    " + "; ".join(
        f"{m} -> {', '.join(sorted(graph[m] & set(c)))}" for m in c) for c in cycles]
    assert not cycles, f"{len(cycles)} import cycles:\n" + "\n".join(shown)


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


def engine_part(module: str) -> str:
    """The part of engine/ that a dotted module name under workbench.engine is in."""
    parts = module.split(".")
    if len(parts) == 2:
        return "front"  # (workbench/engine/__init__.py)
    if (ENGINE / parts[2]).is_dir():
        return parts[2]
    return "light" if parts[2] in ENGINE_LIGHT else "front"


ENGINE = PACKAGE / "engine"


def test_engine_parts_import_only_the_parts_below_them():
    wrong = []
    graph = import_graph()
    for name in sorted(MODULES):
        if room(name) != "engine":
            continue
        mine = engine_part(name)
        for other in sorted(graph[name]):
            if room(other) != "engine":
                continue
            theirs = engine_part(other)
            if theirs != mine and theirs not in ENGINE_PARTS[mine]:
                wrong.append(f"{name} ({mine}) imports {other} ({theirs})")
    assert not wrong, "\n".join(wrong)


def test_every_engine_part_is_placed_and_the_top_stays_small():
    top = sorted(p.name for p in ENGINE.iterdir() if p.name != "__pycache__")
    assert len(top) <= ENGINE_TOP_MOST, top
    folders = {p.name for p in ENGINE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(ENGINE_PARTS) - {"light", "front"}
    assert all((ENGINE / p).with_suffix(".py").exists() for p in ENGINE_LIGHT)


def test_the_remote_client_reaches_only_the_light_engine_modules():
    path = PACKAGE / "server" / "remote.py"
    assert {m for m in imported(path) if room(m) != "server"} <= REMOTE_REACHES
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys; from workbench.server.remote import RemoteEngine; "
         "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
         "('numba', 'llvmlite', 'fastapi') or m.startswith('workbench.kernels'))))"],
        capture_output=True, text=True, check=True, cwd=PACKAGE.parent).stdout.split()
    assert loaded == []


def test_every_public_name_resolves_and_the_errors_a_caller_catches_are_among_them():
    """`workbench.__all__` is what `from workbench import *` and the docs promise: each
    name resolves (most lazily, on first use), and every error the engine raises for a
    caller to handle is one of them, not only in its module."""
    import workbench

    for name in workbench.__all__:
        assert getattr(workbench, name) is not None, name
    for name in ("ContextFullError", "IncompleteOutputError", "TooManyTokensError",
                 "GrammarError", "GrammarBudgetError", "UnsupportedSchemaError",
                 "ChatTemplateError", "PrefixCacheError", "GGUFError",
                 "UnsupportedArchitectureError", "WhisperFileError", "AudioError",
                 "DeviceUnavailableError", "TraceTooLargeError", "ModelNotFoundError",
                 "PullError", "TruncationWarning", "ClosedEarlyWarning"):
        assert name in workbench.__all__ and issubclass(getattr(workbench, name), Exception)
