"""The kernels' disk cache (`workbench.kernels.cache`) and their warm-up at load
(`workbench.engine.runtime.warmup`): compiled once, never stale, complete, with progress.

The cache tests run a copy of the package in child processes with their own kernel
cache, edit a kernel in the copy between runs and watch what Numba compiles.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from workbench.engine.runtime.warmup import KernelTask, KernelWarmup, Warming, show_progress
from workbench.signals import Signal

REPO = Path(__file__).resolve().parents[1]

# Loads the model (its kernels prepared in the background), waits for the warm-up, then
# chats and decodes a batch; prints which of our functions Numba compiled in each phase
# (a function loaded from the disk cache is not compiled) and numbers to compare.
CHILD = r"""
import json, sys
import numpy as np
from numba.core import event

compiled = []

class Watch(event.Listener):
    def on_start(self, ev):
        f = ev.data["dispatcher"].py_func
        if f.__module__.startswith("workbench."):
            compiled.append(f.__name__.lstrip("_"))
    def on_end(self, ev):
        pass

event.register("numba:compile", Watch())
import workbench
from workbench import LLM

m = LLM.load(sys.argv[1], kv_cache_size=64)
m.warmup.wait()
warmup, compiled[:] = list(compiled), []
c = m.generate([1, 2, 3, 4, 5, 6, 7], max_tokens=6, temperature=0)
c.wait()
batch = m.generate_batch([[1, 2], [3, 4, 5], [6]], max_tokens=3, temperature=0)
cache = m.model.new_cache(16)
m.model.hidden(np.array([1, 2, 3]), cache)
h = m.model.hidden(np.array([4]), cache)  # one decode step: the fused stack
print(json.dumps(dict(package=workbench.__file__, warmup=warmup, after=compiled,
                      tokens=c.token_ids, batch=[o.token_ids for o in batch],
                      hidden=h[0, :8].tolist())))
"""


@pytest.fixture(scope="module")
def tiny_q8_0(tmp_path_factory) -> Path:
    """A tiny qwen2 GGUF with Q8_0 matrices (every matrix has a packed kernel: fused stack)."""
    from tests.support.tiny_llama import Built

    return Built("qwen2-q8_0", tmp_path_factory.mktemp("tiny")).path


def _run(package: Path, cache: Path, model: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(package), "NUMBA_CACHE_DIR": str(cache)}
    run = subprocess.run([sys.executable, "-c", CHILD, str(model)], env=env, cwd=package,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["package"].startswith(str(package)), result["package"]
    return result


@pytest.mark.slow
def test_cache_is_complete_never_stale_and_recompiles_only_what_an_edit_reaches(
        tmp_path, tiny_q8_0):
    package = tmp_path / "pkg"
    shutil.copytree(REPO / "workbench", package / "workbench",
                    ignore=shutil.ignore_patterns("__pycache__"))
    cache = tmp_path / "kernels"

    cold = _run(package, cache, tiny_q8_0)
    # (the attention compiles in the warm-up's helper process, which these lists do not see)
    assert {"stack", "gemv_q8_0", "gemv2_q8_0"} <= set(cold["warmup"])
    # the warm-up prepared everything a chat and a batch use: nothing compiles after it
    assert cold["after"] == []

    warm = _run(package, cache, tiny_q8_0)
    assert warm["warmup"] == [] and warm["after"] == []  # all loaded from the disk cache
    assert (warm["tokens"], warm["batch"], warm["hidden"]) == (
        cold["tokens"], cold["batch"], cold["hidden"])

    # An edit to a kernel the decode stack inlines (layers.rms_norm): the stack and the
    # kernels of layers.py compile again and the new code runs; the matrix kernels (cpu.py,
    # which does not reach layers.py) still come from the cache.
    layers = package / "workbench" / "kernels" / "layers.py"
    text = layers.read_text()
    line = "            out[t, i] = x[t, i] * r * weight[i]\n"
    at = text.index(line, text.index("def rms_norm("))  # rms_norm's last line
    assert at < text.index("def add_rms_norm(")
    layers.write_text(text[:at] + line.replace("= x", "= 2 * x") + text[at + len(line):])
    edited = _run(package, cache, tiny_q8_0)
    # (rms_norm itself recompiles in the helper process; layers.py's softmax here)
    assert {"stack", "softmax_rows"} <= set(edited["warmup"]), edited["warmup"]
    assert not {"gemv_q8_0", "rows_q8_0", "gemv2_q8_0"} & set(edited["warmup"])
    assert edited["after"] == []
    assert not np.allclose(edited["hidden"], warm["hidden"])  # no stale stack served


def test_every_compiled_function_uses_the_source_keyed_cache():
    """Every Numba function of the package is cached through `SourceKeyedLocator`, and all
    compiled code lives in workbench/kernels (whose imports the cache stamp follows)."""
    import numba

    from workbench.kernels import cache, cpu, decode, layers

    stack = decode.stack_module((8,))
    for module in (cpu, layers, stack):
        for name, f in vars(module).items():
            if isinstance(f, numba.core.registry.CPUDispatcher) and f._cache is not None:
                locator = getattr(f._cache, "_impl", None)
                if locator is not None:  # a NullCache has no locator: inline-only helpers
                    assert isinstance(locator.locator, cache.SourceKeyedLocator), name
    for path in (REPO / "workbench").rglob("*.py"):
        if path.parent.name != "kernels":
            text = path.read_text()
            assert "@njit" not in text and "@intrinsic" not in text, path


def test_stamp_follows_the_modules_a_kernel_module_reaches():
    from workbench.kernels import cache, cpu, decode  # noqa: F401 (loaded: what is reached)

    # cache: the file format; gil: how parallel loops are launched
    assert cache._reached_modules("workbench.kernels.cpu") == [
        "workbench.kernels.blocks", "workbench.kernels.cache", "workbench.kernels.cpu",
        "workbench.kernels.formats", "workbench.kernels.gil", "workbench.kernels.loops",
        "workbench.kernels.simd"]
    reached = cache._reached_modules("workbench.kernels.decode")
    assert {"workbench.kernels.cpu", "workbench.kernels.layers",
            "workbench.kernels.simd"} <= set(reached)


def test_cache_dir_follows_numba_cache_dir(monkeypatch, tmp_path):
    from workbench.kernels import cache

    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    assert cache.cache_dir() == tmp_path / "workbench"
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    assert cache.cache_dir() == Path.home() / ".cache" / "workbench" / "kernels"


# -- a cache that heals itself -----------------------------------------------------------------
# Runs one small kernel (loops.group_sums) with the kernel cache in NUMBA_CACHE_DIR; prints
# its result and which of our functions Numba compiled (none: it came from the cache).
SMALL_CHILD = r"""
import json
import numpy as np
from numba.core import event

compiled = []

class Watch(event.Listener):
    def on_start(self, ev):
        f = ev.data["dispatcher"].py_func
        if f.__module__.startswith("workbench."):
            compiled.append(f.__name__)
    def on_end(self, ev):
        pass

event.register("numba:compile", Watch())
from workbench.kernels import loops

x = np.arange(12, dtype=np.float32).reshape(2, 6)
print(json.dumps({"sums": loops.group_sums(x, 3).tolist(), "compiled": compiled}))
"""


def _small_run(cache: Path) -> tuple[list[str], int]:
    """What Numba compiled, and how many KernelCacheWarnings the run printed; the answer
    is checked."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    run = subprocess.run([sys.executable, "-c", SMALL_CHILD], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["sums"] == [[3.0, 12.0], [21.0, 30.0]]
    return result["compiled"], run.stderr.count("KernelCacheWarning")


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory) -> Path:
    """A kernel cache holding loops.group_sums."""
    cache = tmp_path_factory.mktemp("small-cache")
    assert _small_run(cache) == (["group_sums"], 0)
    assert _small_run(cache) == ([], 0)
    return cache


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    middle = len(data) // 2
    path.write_bytes({"truncated": data[:middle],
                      "garbled": data[:middle] + bytes(b ^ 0x5A for b in data[middle:middle + 16])
                      + data[middle + 16:],
                      "empty": b""}[how])


@pytest.mark.parametrize("how", ["truncated", "garbled", "empty"])
@pytest.mark.parametrize("suffix", [".nbi", ".nbc"])
def test_a_damaged_cache_entry_is_compiled_again_with_one_warning(small_cache, tmp_path,
                                                                  suffix, how):
    """A damaged index (.nbi) or compiled code (.nbc) ended every run with an
    UnpicklingError or EOFError; now the entry is removed and compiled again, once."""
    cache = tmp_path / "kernels"
    shutil.copytree(small_cache, cache)
    [entry] = cache.rglob(f"loops.group_sums-*{suffix}")
    _damage(entry, how)
    assert _small_run(cache) == (["group_sums"], 1)
    assert _small_run(cache) == ([], 0)  # healed: from the cache, quietly


@pytest.mark.parametrize("where", ["a file", "a dangling link", "a read-only folder"])
def test_an_unusable_cache_location_compiles_in_memory_with_one_warning(tmp_path, where):
    """These ended with "cannot cache function ...: no locator available"; now the kernels
    compile in memory with one warning, and the cache fills once the location is fixed."""
    location = tmp_path / "kernels"
    if where == "a file":
        location.write_text("not a folder")
    elif where == "a dangling link":
        location.symlink_to(tmp_path / "missing")
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only folders")
        location.mkdir()
        location.chmod(0o555)
    assert _small_run(location) == (["group_sums"], 1)
    if where == "a file":
        location.unlink()
    elif where == "a dangling link":
        (tmp_path / "missing").mkdir()
    else:
        location.chmod(0o755)
    assert _small_run(location) == (["group_sums"], 0)
    assert list(location.rglob("loops.group_sums-*.nbc"))


def test_the_helper_process_cache_warnings_are_warned_here_once(monkeypatch):
    """The warm-up's helper process reports the cache's warnings on its output (its
    stderr goes nowhere); the thread warns each kind once."""
    from workbench.kernels import cache

    monkeypatch.setattr(cache, "_WARNED", set())
    monkeypatch.setattr(cache, "writable", lambda: True)  # (no helper without a cache)
    lines = ["warning damaged the kernel cache entry x could not be read",
             "warning damaged the kernel cache entry y could not be read", "done 0"]
    helper = [sys.executable, "-c", "\n".join(f"print({line!r})" for line in lines)]
    tasks = [KernelTask("decode kernels", lambda: None, helper=True)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert KernelWarmup(tasks, Signal(None), helper=helper).start().wait(60)
    assert [str(w.message) for w in caught if w.category is cache.KernelCacheWarning] == [
        "the kernel cache entry x could not be read"]


# -- the warm-up and its progress --------------------------------------------------------------

def _record(signal: Signal) -> list:
    seen = [signal.peek()]
    signal.subscribe(seen.append)
    return seen


def test_progress_signal_moves_through_the_tasks_and_ends(tiny_q8_0):
    from workbench import LLM

    m = LLM.load(tiny_q8_0, kv_cache_size=64, prepare_kernels=False)
    assert m.warming.peek() is None and m.warmup.done  # nothing started
    tasks = m.model.kernel_tasks()
    labels = [t.label for t in tasks]
    assert labels[0] == "Q8_0 matrix kernels" and labels[-1].startswith("decode stack")
    signal: Signal[Warming | None] = Signal(None)
    seen = _record(signal)
    warmup = KernelWarmup(tasks, signal, m._forward_lock).start()
    assert warmup.wait(600)
    states = [s for s in seen if s is not None]
    assert seen[-1] is None and signal.peek() is None  # it ends
    assert {s.total for s in states} == {len(tasks)}
    done = [s.done for s in states]
    assert done == sorted(done) and set(done) == set(range(len(tasks)))  # it moves
    for s in states:
        assert s.task.startswith(labels[s.done])
        assert str(s).startswith(f"preparing kernels for this CPU ({s.done}/{len(tasks)}): ")
    assert warmup.seconds is not None and warmup.seconds >= 0


def test_a_failing_task_warns_and_the_rest_still_run():
    ran = []
    signal: Signal[Warming | None] = Signal(None)
    tasks = [KernelTask("broken", lambda: 1 / 0), KernelTask("fine", lambda: ran.append(1))]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        KernelWarmup(tasks, signal).start().wait(10)
    assert ran == [1] and signal.peek() is None
    assert any("preparing kernels (broken) failed" in str(w.message) for w in caught)


def test_no_tasks_is_done_at_once():
    signal: Signal[Warming | None] = Signal(None)
    warmup = KernelWarmup([], signal).start()
    assert warmup.done and signal.peek() is None


def test_show_progress_without_a_terminal_prints_one_line_per_slow_task():
    """In a log (no terminal) a task gets its line once it has run `QUIET_SECONDS`:
    kernels read from a warm cache print nothing, a compile says what it is doing."""
    from workbench.engine.runtime.warmup import QUIET_SECONDS

    signal: Signal[Warming | None] = Signal(None)
    out = io.StringIO()
    release = []
    tasks = [KernelTask(f"step {i}", lambda: release.append(1)) for i in range(3)]
    KernelWarmup(tasks, signal).start()
    show_progress(signal, file=out)  # returns once the signal is None
    assert len(release) == 3 and signal.peek() is None and out.getvalue() == ""
    slow = [KernelTask("quick", lambda: None),
            KernelTask("slow", lambda: time.sleep(QUIET_SECONDS * 2.5))]
    KernelWarmup(slow, signal).start()
    show_progress(signal, file=out)
    assert out.getvalue().splitlines() == ["preparing kernels for this CPU (1/2): slow"]


def test_busy_badge_and_chat_cell_show_the_compiling_state(tiny_q8_0):
    from workbench import LLM
    from workbench.widgets import BusyBadge, ChatCell

    m = LLM.load(tiny_q8_0, kv_cache_size=64, prepare_kernels=False)
    badge, cell = BusyBadge(m), ChatCell(m)
    assert (badge.state, badge.label, cell.warming) == ("idle", "○ idle", "")
    m.warming.set(Warming(2, 4, "decode stack (2 layers): attend_group"))
    assert badge.state == "compiling" and badge.label == "⚙ compiling 2/4"
    assert cell.warming == badge.warming == (
        "preparing kernels for this CPU (2/4): decode stack (2 layers): attend_group")
    m.warming.set(None)
    assert (badge.state, cell.warming) == ("idle", "")
    badge.close()
    cell.close()
    m.warming.set(Warming(0, 1, "x"))  # closed widgets no longer follow the signal
    assert badge.warming == "" and cell.warming == ""
