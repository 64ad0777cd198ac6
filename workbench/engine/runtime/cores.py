"""Sharing the cores: how many compute threads the CPU engine's next step may use.

A decode step runs over a hundred parallel regions, and each ends when its slowest
thread is done. While another program keeps a core busy (the notebook's browser, a
video call, an IDE's indexer), one of our threads waits for its turn on every region:
on 2 cores, beside one busy process, decoding with both threads kept about a third of
its speed. With one thread fewer than there are busy cores, nothing waits for a
descheduled thread, and the thread we keep has a core to itself.

`CoreShare` decides between steps, from Linux's count of runnable threads
(`procs_running` in /proc/stat, which the kernel keeps current): those not ours are
other work, and we use the cores they leave, at least one. It goes down after two
readings in a row see the cores taken and back up after `UP_READINGS` see them free,
so a moment's spike does not flap it. Elsewhere (no /proc/stat) it keeps every thread.
The kernels' results do not depend on how many threads run them, so neither does the
output: only its speed changes.

NumPy's OpenBLAS has a pool of its own, whose workers spin after each call for as long
as OPENBLAS_THREAD_TIMEOUT says. workbench/__init__.py shortens that, but OpenBLAS reads
it when NumPy loads: in a program that imported NumPy first, the workers spin ~0.1 s
after every product, and the Numba kernels' parallel regions wait behind them for a
core. The small products of a short prompt's attention then keep them awake through the
whole prompt: a 40-token Qwen2.5-Coder-0.5B prompt read in 800 ms instead of 210 (2-core
AVX-512 host). There, `quiet_blas` keeps OpenBLAS to one thread (its workers asleep) for
the forward passes that run parallel kernels on few rows (decode steps, short prompts),
whose BLAS products are small; long prompts keep every BLAS thread.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

READ_EVERY_S = 0.1  # seconds between readings of /proc/stat while steps run
DOWN_READINGS = 2  # readings in a row that see fewer free cores before using fewer
UP_READINGS = 5  # readings in a row that see more before using more again
PROC_STAT = "/proc/stat"
ENABLED = os.environ.get("WORKBENCH_SHARE_CORES", "1") != "0"  # off: always every thread


def runnable_threads(path: str = PROC_STAT) -> int | None:
    """The threads runnable on the machine right now (the reader included), or None where
    the system does not say."""
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.startswith(b"procs_running "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _usable_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class CoreShare:
    """The number of compute threads for the next step, out of a pool of `pool` (Numba's
    NUMBA_NUM_THREADS), on a machine of `cores` cores for this process."""

    def __init__(self, pool: int, cores: int | None = None, path: str = PROC_STAT,
                 clock=time.monotonic):
        self.pool = max(1, int(pool))
        self.cores = cores or _usable_cores()
        self.path, self.clock = path, clock
        self.threads = self.pool  # what the steps use now
        self._last_read = -1e9
        self._streak = 0  # readings in a row that want another number (signed: up > 0)
        self.enabled = ENABLED and runnable_threads(path) is not None

    def set_enabled(self, on: bool) -> None:
        """Share the cores (on, where /proc/stat says how busy they are) or always use the
        whole pool (off)."""
        self.enabled = bool(on) and runnable_threads(self.path) is not None
        if not self.enabled:
            self.threads, self._streak = self.pool, 0

    def next_step(self) -> int:
        """The threads the next step should use (a reading of /proc/stat at most every
        `READ_EVERY_S`; in between, the last decision)."""
        if not self.enabled or self.pool == 1:
            return self.threads
        now = self.clock()
        if now - self._last_read < READ_EVERY_S:
            return self.threads
        self._last_read = now
        running = runnable_threads(self.path)
        if running is None:
            return self.threads
        # ours: this thread and the team's workers (working, or spinning between regions)
        others = max(0, running - self.threads)
        want = max(1, min(self.pool, self.cores - others))
        if want < self.threads:
            self._streak = min(self._streak, 0) - 1
            if -self._streak >= DOWN_READINGS:
                self.threads, self._streak = want, 0
        elif want > self.threads:
            self._streak = max(self._streak, 0) + 1
            if self._streak >= UP_READINGS:
                self.threads, self._streak = want, 0
        else:
            self._streak = 0
        return self.threads


# -- process-wide settings that blocks in several threads share --------------------------

class _SharedOverride:
    """A process-wide setting that blocks in several threads (or nested ones) change
    together: the first block in applies it, the last one out undoes it. `apply()`
    changes the setting and returns what undoes the change."""

    def __init__(self, apply: Callable[[], Callable[[], None]]):
        self._apply = apply
        self._lock = threading.Lock()
        self._users = 0  # blocks inside now, in any thread
        self._undo: Callable[[], None] | None = None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                self._undo = self._apply()
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0 and self._undo is not None:
                    self._undo()
                    self._undo = None


# -- NumPy's OpenBLAS pool ------------------------------------------------------------------

_blas_spins = False  # OpenBLAS loaded before workbench could shorten its workers' spin
_blas_pools = None  # threadpoolctl's controller, made once: making one looks through every
#                     library the process has loaded (~2 ms in a process with a model)


def blas_loaded_first() -> None:
    """Note that NumPy (and its OpenBLAS) was imported before workbench set
    OPENBLAS_THREAD_TIMEOUT (workbench/__init__.py calls this), so `quiet_blas` acts."""
    global _blas_spins
    _blas_spins = True


def _blas_at_one_thread() -> Callable[[], None]:
    global _blas_pools
    if _blas_pools is None:
        from threadpoolctl import ThreadpoolController

        _blas_pools = ThreadpoolController()
    return _blas_pools.limit(limits=1, user_api="blas").restore_original_limits


_blas_quiet = _SharedOverride(_blas_at_one_thread)


def quiet_blas(rows: int, most: int) -> contextlib.AbstractContextManager[None]:
    """A forward pass over `rows` rows: where OpenBLAS's workers spin long
    (`blas_loaded_first`) and rows <= `most` (the Numba kernels' share of the pass), with
    OpenBLAS at one thread for its duration; else nothing. Passes in several threads at
    once share one limit, lifted when the last ends."""
    if not _blas_spins or rows > most:
        return contextlib.nullcontext()
    return _blas_quiet.held()


# -- the GIL between the steps' kernel calls ---------------------------------------------

# Python's switch interval while steps run (`prompt_gil`). A step hands the GIL to other
# threads and takes it back many times: around each kernel call (the kernels release it,
# `workbench.kernels.cache.njit`), and around llguidance's masks and the sampler's NumPy
# calls. A thread waiting for the GIL gets it only after the switch interval. Beside
# another thread of the process running Python (a notebook cell, while a chat streams or
# `serve()` answers), each wait was the default 5 ms. Before the kernels' parallel loops
# stopped taking the GIL (`workbench.kernels.gil`), greedy SmolLM2 decoded 0.7 tok/s there
# instead of 189, and 24 tok/s at 0.1 ms, the other thread keeping ~80% of its speed; with
# them, 23 tok/s at 5 ms and ~60 at 0.1 ms (quiet ~120-160; 2-vCPU AVX-512 host).
STEP_SWITCH_INTERVAL_S = 1e-4


def _short_switch_interval() -> Callable[[], None]:
    before = sys.getswitchinterval()
    if before > STEP_SWITCH_INTERVAL_S:
        sys.setswitchinterval(STEP_SWITCH_INTERVAL_S)
    return lambda: sys.setswitchinterval(before)


_prompt_gil = _SharedOverride(_short_switch_interval)


def prompt_gil() -> contextlib.AbstractContextManager[None]:
    """Python's switch interval at STEP_SWITCH_INTERVAL_S (where it was longer) for the
    duration, so that the engine's thread gets the GIL back soon after each kernel call
    while other threads run Python. Blocks in several threads at once share it;
    the interval before the first is restored when the last ends."""
    return _prompt_gil.held()
