"""The phase recorder behind --profile and --trace."""

from __future__ import annotations

import threading

from workbench.engine.runtime import profiling
from workbench.engine.runtime.profiling import recording, span


def test_spans_are_free_while_nothing_records():
    assert profiling.active() is None
    assert span("prefill", tokens=3) is span("decode")  # one shared no-op
    with span("prefill") as args:
        args["id"] = 1  # bodies may still add args


def test_recording_from_several_threads():
    def work():
        with span("decode", tokens=2):
            pass
        with span("token", cat="token", id=5):
            with span("sample"):
                pass

    with recording() as rec:
        assert profiling.active() is rec
        with recording() as inner:  # nested: the outer recorder goes on
            assert inner is rec
        with span("prefill", tokens=7):
            pass
        t = threading.Thread(target=work, name="worker")
        t.start()
        t.join()
    assert profiling.active() is None
    with span("decode"):  # after the end: not recorded
        pass
    assert {(s.name, s.thread) for s in rec.spans} == {
        ("prefill", threading.current_thread().name), ("decode", "worker"),
        ("token", "worker"), ("sample", "worker")}
    phases = rec.phases()
    assert list(phases) == ["prefill", "decode", "sample"]  # table order; no "token"
    assert phases["prefill"][1:] == (1, 7) and phases["decode"][1:] == (1, 2)
    assert rec.generated_tokens() == 1
    table = rec.table()
    assert "prefill: 7 prompt tokens" in table and "decode: 1 generated tokens" in table
    events = rec.trace_events()["traceEvents"]
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"worker", threading.current_thread().name} <= names
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events if e["ph"] == "X")
