"""Where the time goes: spans of the engines' phases, recorded while a `Recorder` is on.

    >>> from workbench.engine.runtime import profiling
    >>> with profiling.recording() as rec:
    ...     m.generate("Once upon a time", max_tokens=32).wait()
    >>> print(rec.table())                 # time per phase and tokens/s
    >>> rec.write_trace("trace.json")      # Chrome trace-event JSON: open it in Perfetto

The engine marks its work with `with span("prefill", tokens=n):` where it happens:
load, tokenize and chat_template (the caller's thread), prefill, decode, sample,
grammar and detokenize (the scheduler's thread), one "token" span around each
sequence's sampling step and one "step" span per scheduler step; Whisper adds mel,
encode and decode. Phases (category "phase") do not nest in one another, so their
times add up; "token" and "step" spans enclose phases and are left out of the table.

While no recorder is on, `span` costs one global read and returns a shared no-op
context manager. The recorder is process-wide (the scheduler runs in its own thread)
and appends under a lock, noting each span's thread.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PHASES = ("load", "warmup", "tokenize", "chat_template", "prefill", "decode", "sample",
          "grammar", "detokenize", "mel", "encode")  # table order; others follow
_NOOP = nullcontext({})  # its dict: scratch for bodies that add args while nothing records
_active: Recorder | None = None


@dataclass(frozen=True)
class Span:
    """One timed piece of work: `start_ns` (perf_counter_ns) and `dur_ns`, on thread `tid`
    (its native id) named `thread`; `args`: what it worked on (e.g. `tokens`)."""

    name: str
    cat: str
    start_ns: int
    dur_ns: int
    tid: int
    thread: str
    args: dict[str, Any] = field(default_factory=dict)


class _Timed:
    """The context manager `span` returns while recording."""

    __slots__ = ("rec", "name", "cat", "args", "start")

    def __init__(self, rec: Recorder, name: str, cat: str, args: dict[str, Any]):
        self.rec, self.name, self.cat, self.args = rec, name, cat, args

    def __enter__(self) -> dict[str, Any]:
        self.start = time.perf_counter_ns()
        return self.args  # the body may add to its span's args

    def __exit__(self, *exc) -> None:
        end = time.perf_counter_ns()
        t = threading.current_thread()
        self.rec.add(Span(self.name, self.cat, self.start, end - self.start,
                          t.native_id or 0, t.name, self.args))


def span(name: str, cat: str = "phase", **args: Any):
    """A context manager timing its body as span `name` while a recorder is on (a no-op
    otherwise). `cat`: "phase" (summed in the table), or "token" / "step" for spans that
    enclose phases. `args` go into the trace (`tokens=n` feeds the tokens/s lines);
    `with span(...) as args:` lets the body add to them."""
    rec = _active
    if rec is None:
        return _NOOP
    return _Timed(rec, name, cat, args)


def active() -> Recorder | None:
    """The recorder that is on, if any."""
    return _active


@contextmanager
def recording() -> Iterator[Recorder]:
    """Turn a fresh process-wide `Recorder` on for the block (nested: the outer one
    keeps recording)."""
    global _active
    if _active is not None:
        yield _active
        return
    rec = Recorder()
    _active = rec
    try:
        yield rec
    finally:
        _active = None
        rec.stop()


class Recorder:
    """The spans recorded from any thread between its start and `stop`."""

    def __init__(self):
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        self.start_ns = time.perf_counter_ns()
        self.end_ns: int | None = None

    def add(self, s: Span) -> None:
        with self._lock:
            self.spans.append(s)

    def stop(self) -> None:
        if self.end_ns is None:
            self.end_ns = time.perf_counter_ns()

    @property
    def wall_s(self) -> float:
        """Seconds from start to stop (to now while still recording)."""
        end = self.end_ns if self.end_ns is not None else time.perf_counter_ns()
        return (end - self.start_ns) / 1e9

    def phases(self) -> dict[str, tuple[float, int, int]]:
        """Per phase: (total seconds, spans, tokens), in `PHASES` order then first seen."""
        out: dict[str, list] = {}
        with self._lock:
            spans = list(self.spans)
        for s in spans:
            if s.cat == "phase":
                row = out.setdefault(s.name, [0.0, 0, 0])
                row[0] += s.dur_ns / 1e9
                row[1] += 1
                row[2] += int(s.args.get("tokens", 0))
        order = [p for p in PHASES if p in out] + [p for p in out if p not in PHASES]
        return {p: tuple(out[p]) for p in order}

    def generated_tokens(self) -> int:
        """Tokens sampled (one "token" span each; end tokens not counted)."""
        with self._lock:
            return sum(1 for s in self.spans if s.cat == "token" and s.args.get("id") is not None)

    def table(self) -> str:
        """Time per phase (total ms, count, share of the wall time) and tokens/s."""
        wall = self.wall_s
        lines = [f"{'phase':<14}{'total ms':>11}{'count':>8}{'share':>8}"]
        phases = self.phases()
        for name, (seconds, count, _) in phases.items():
            share = seconds / wall if wall > 0 else 0.0
            lines.append(f"{name:<14}{seconds * 1e3:>11.1f}{count:>8}{share:>8.1%}")
        lines.append(f"{'wall':<14}{wall * 1e3:>11.1f}")
        if "prefill" in phases:
            seconds, _, tokens = phases["prefill"]
            lines.append(f"prefill: {tokens} prompt tokens, {_rate(tokens, seconds)}")
        # tokens sampled by the LLM's scheduler, else (Whisper) those its decode spans count
        generated = self.generated_tokens() or phases.get("decode", (0.0, 0, 0))[2]
        if "decode" in phases or generated:
            seconds = phases.get("decode", (0.0, 0, 0))[0]
            lines.append(f"decode: {generated} generated tokens, {_rate(generated, seconds)} "
                         f"(decode passes), {_rate(generated, wall)} (wall)")
        return "\n".join(lines)

    def trace_events(self) -> dict[str, Any]:
        """Chrome trace-event JSON (as a dict): one complete ("X") event per span, times
        in microseconds from the recorder's start, and thread_name metadata ("M")."""
        pid = os.getpid()
        with self._lock:
            spans = list(self.spans)
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
             "args": {"name": "workbench"}}]
        threads: dict[int, str] = {}
        for s in spans:
            threads.setdefault(s.tid, s.thread)
        events += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                    "args": {"name": name}} for tid, name in threads.items()]
        for s in sorted(spans, key=lambda s: s.start_ns):
            events.append({"ph": "X", "name": s.name, "cat": s.cat, "pid": pid, "tid": s.tid,
                           "ts": (s.start_ns - self.start_ns) / 1e3, "dur": s.dur_ns / 1e3,
                           "args": {k: _jsonable(v) for k, v in s.args.items()}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write_trace(self, path: str | os.PathLike) -> Path:
        """Write `trace_events` to `path` (open it at ui.perfetto.dev or chrome://tracing)."""
        path = Path(path)
        path.write_text(json.dumps(self.trace_events()), encoding="utf-8")
        return path


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.1f} tok/s" if seconds > 0 else "- tok/s"


def _jsonable(v: Any) -> Any:
    return v if isinstance(v, (str, int, float, bool, type(None))) else str(v)
