"""Preparing a model's CPU kernels in the background, with progress people can see.

The CPU kernels are compiled by Numba on first use and then kept in the disk
cache (`workbench.kernels.cache`). On a new install, a new CPU or after an
upgrade that first use would stall the first answer for tens of seconds with
nothing on screen. So `LLM`, `Encoder` and `WhisperModel` start a
`KernelWarmup` when they load: a thread that runs the model's `kernel_tasks()`
(each compiles, or loads from the cache, the kernels of one step, in the order
the first call needs them) and publishes a `Warming` in the model's `warming`
signal while it works, None when it is done. A call that needs a kernel still
being compiled waits for it; the CLI and the notebook badges show the signal
meanwhile. With a warm cache the tasks only load what is cached.

Numba compiles one function at a time per process. Tasks marked `helper` (the
decode step's own kernels, which the first prompt does not need) therefore run
in a helper process, on another core, while the thread compiles the rest; it
writes them to the disk cache, where the thread finds them for the tasks that
come after (the fused decode stack, which links them). A model only asks for the
helper when its kernels are not in the cache. Should the helper fail, the
thread runs its tasks itself.
"""

from __future__ import annotations

import atexit
import contextlib
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from numba.core import event

from workbench.signals import Signal

QUIET_SECONDS = 1.0  # kernel tasks done sooner (read from a warm cache) go unmentioned in logs


@dataclass(frozen=True)
class Warming:
    """Progress of a model's kernel preparation: `done` of `total` tasks finished, `task`
    the one running (with the function being compiled, when one is)."""

    done: int
    total: int
    task: str

    def __str__(self) -> str:
        return f"preparing kernels for this CPU ({self.done}/{self.total}): {self.task}"


@dataclass(frozen=True)
class KernelTask:
    """One step of a model's kernels: `run()` calls them on small inputs. `helper`: it may
    run in the helper process (see the module docstring)."""

    label: str
    run: Callable[[], object]
    helper: bool = False


class _CompileWatcher(event.Listener):
    """Reports the name of the function of ours that Numba is compiling now (the innermost,
    when compiling one compiles its callees), or "" when none is."""

    def __init__(self, report: Callable[[str], None]):
        self.report = report
        self.names: list[str] = []

    @staticmethod
    def _name(ev: event.Event) -> str | None:
        func = getattr(ev.data.get("dispatcher"), "py_func", None)
        if func is None or not func.__module__.startswith("workbench."):
            return None
        return func.__name__.lstrip("_")

    def on_start(self, ev: event.Event) -> None:
        name = self._name(ev)
        if name:
            self.names.append(name)
            self.report(name)

    def on_end(self, ev: event.Event) -> None:
        name = self._name(ev)
        if name and self.names:
            self.names.pop()
            self.report(self.names[-1] if self.names else "")


class KernelWarmup:
    """Runs `tasks` in a background thread, publishing progress in `signal` (see the module
    docstring), each task holding `lock` (the model's forward-pass lock: Numba's parallel
    kernels must not run from two threads at once). `helper`: the command line of a
    process that runs the tasks whose indices it is given (`python -m
    workbench.engine.models.kernel_helper ...`), for the tasks marked `helper`; None runs all here.
    `wait()` blocks until every task is done."""

    def __init__(self, tasks: Sequence[KernelTask], signal: Signal[Warming | None],
                 lock: threading.Lock | None = None, helper: list[str] | None = None):
        self.tasks = list(tasks)
        self.signal = signal
        self.helper = helper
        self.seconds: float | None = None  # how long the tasks took, once done
        self._lock = lock or contextlib.nullcontext()
        self._done = threading.Event()
        self._finished: set[int] = set()  # tasks done, here or in the helper
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> KernelWarmup:
        """Start the thread (with no tasks, be done at once)."""
        if not self.tasks:
            self._done.set()
            return self
        self.signal.set(Warming(0, len(self.tasks), self.tasks[0].label))
        self._thread = threading.Thread(target=self._run, name="workbench-kernel-warmup",
                                        daemon=True)
        _RUNNING.add(self)
        self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every task has run; False if `timeout` (seconds) passed first."""
        return self._done.wait(timeout)

    @property
    def done(self) -> bool:
        """True once every task has run."""
        return self._done.is_set()

    def _publish(self, task: str) -> None:
        self.signal.set(Warming(len(self._finished), len(self.tasks), task))

    def _run(self) -> None:
        start = time.perf_counter()
        helper = self._start_helper()
        try:
            for i in range(len(self.tasks)):
                if self._stopping:
                    break
                if helper is not None and i in helper.indices:
                    continue
                if helper is not None and any(j < i for j in helper.indices):
                    self._join(helper)  # this task links what the helper compiled
                    helper = None
                self._run_here(i)
            if helper is not None:
                self._join(helper)
        finally:
            self.seconds = time.perf_counter() - start
            self.signal.set(None)
            self._done.set()
            _RUNNING.discard(self)

    def _run_here(self, i: int) -> None:
        task = self.tasks[i]
        self._publish(task.label)

        def compiling(name: str) -> None:
            self._publish(f"{task.label}: {name}" if name else task.label)

        try:
            with self._lock, event.install_listener("numba:compile", _CompileWatcher(compiling)):
                task.run()
        except Exception as exc:  # the kernels then compile on first use
            warnings.warn(f"preparing kernels ({task.label}) failed: {exc!r}; they will be "
                          "compiled when first used", RuntimeWarning, stacklevel=1)
        self._finished.add(i)

    def _start_helper(self) -> _Helper | None:
        from workbench.kernels import cache

        indices = [i for i, t in enumerate(self.tasks) if t.helper]
        if not self.helper or not indices or not cache.writable():
            return None  # (what a helper compiles reaches this process through the cache)
        try:
            proc = subprocess.Popen([*self.helper, ",".join(map(str, indices))],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return None
        helper = _Helper(proc, set(indices))
        helper.reader = threading.Thread(target=self._follow, args=(helper,), daemon=True)
        helper.reader.start()
        return helper

    def _follow(self, helper: _Helper) -> None:
        """Read the helper's "done I" lines as it finishes its tasks, and its "warning KIND
        MESSAGE" lines about the kernel cache."""
        for line in helper.proc.stdout:
            word, _, index = line.partition(" ")
            if word == "warning":
                from workbench.kernels import cache

                kind, _, message = index.strip().partition(" ")
                cache.warn(kind, message)
            elif word == "done" and index.strip().isdigit():
                self._finished.add(int(index))
                pending = sorted(helper.indices - self._finished)
                if pending:
                    self._publish(self.tasks[pending[0]].label + " (in a helper process)")

    def _join(self, helper: _Helper) -> None:
        """Wait for the helper; run here whatever it did not finish."""
        pending = sorted(helper.indices - self._finished)
        if pending:
            self._publish(self.tasks[pending[0]].label + " (in a helper process)")
        helper.proc.wait()
        helper.reader.join()
        for i in sorted(helper.indices - self._finished):
            self._run_here(i)

    def stop(self, timeout: float | None = None) -> None:
        """Let the running task finish, skip the rest (used at interpreter exit)."""
        self._stopping = True
        if self._thread is not None:
            self._thread.join(timeout)


@dataclass
class _Helper:
    """The helper process, the tasks it runs and the thread reading its progress."""

    proc: subprocess.Popen
    indices: set[int]
    reader: threading.Thread | None = None


_RUNNING: set[KernelWarmup] = set()


@atexit.register
def _stop_running() -> None:
    # a thread stopped inside a compile while the interpreter shuts down can crash it
    for warmup in list(_RUNNING):
        warmup.stop(timeout=60)


def helper_command(kind: str, path: str, max_len: int) -> list[str]:
    """The command line of a helper process preparing kernels of the CPU model `kind`
    ("llm") read from `path` (the task indices follow as the last argument; the process
    is `workbench.engine.models.kernel_helper`)."""
    return [sys.executable, "-m", "workbench.engine.models.kernel_helper", kind, path,
            str(max_len)]


def show_progress(signal: Signal[Warming | None], *, file=None) -> None:
    """Block until `signal` is None, showing it on `file` (default stderr): a status line
    redrawn in place on a terminal, else (the CLI's view in a log) one line for each task
    still running after `QUIET_SECONDS`, so that a warm kernel cache prints nothing."""
    import sys

    from tqdm.auto import tqdm

    file = file or sys.stderr
    state = signal.peek()
    if state is None:
        return
    changed = threading.Event()
    unsubscribe = signal.subscribe(lambda _: changed.set())
    tty = getattr(file, "isatty", lambda: False)()
    shown, began = -1, time.monotonic()
    try:
        with tqdm(total=state.total, file=file, bar_format="{desc}  {elapsed}", leave=False,
                  disable=not tty) as bar:
            while state is not None:
                bar.n = state.done
                bar.set_description_str(str(state)[:100], refresh=True)
                if (not tty and state.done != shown
                        and time.monotonic() - began >= QUIET_SECONDS):
                    shown = state.done
                    print(state, file=file, flush=True)
                changed.wait(QUIET_SECONDS / 2)
                changed.clear()
                now = signal.peek()
                if now is None or now.done != state.done:
                    began = time.monotonic()
                state = now
    finally:
        unsubscribe()

