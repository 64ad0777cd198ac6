"""Signals, computeds, effects, batches, the busy counter and the widget bridge."""

from __future__ import annotations

import threading

import pytest
import traitlets

from workbench.signals import BusyCounter, Computed, Signal, batch, bind, effect


def test_signal_get_set_subscribe():
    s = Signal(1)
    seen = []
    unsubscribe = s.subscribe(seen.append)
    s.set(2)
    s.set(2)  # unchanged: no notification
    s.value = 3
    unsubscribe()
    s.set(4)
    assert seen == [2, 3] and s.get() == 4


def test_effect_reruns_on_change_and_stops_when_disposed():
    a, b = Signal(1), Signal(10)
    runs = []
    dispose = effect(lambda: runs.append(a.get() + b.get()))
    a.set(2)
    b.set(20)
    dispose()
    a.set(3)
    assert runs == [11, 12, 22]


def test_effect_follows_only_what_it_read_last():
    flag, a, b = Signal(True), Signal("a"), Signal("b")
    runs = []
    effect(lambda: runs.append(a.get() if flag.get() else b.get()))
    b.set("b2")  # not read yet: no run
    flag.set(False)
    a.set("a2")  # no longer read: no run
    b.set("b3")
    assert runs == ["a", "b2", "b3"]


def test_computed_derives_and_is_read_only():
    a, b = Signal(2), Signal(3)
    total = Computed(lambda: a.get() * b.get())
    seen = []
    effect(lambda: seen.append(total.get()))
    a.set(4)
    assert total.get() == 12 and seen == [6, 12]
    with pytest.raises(AttributeError, match="read-only"):
        total.set(1)


def test_diamond_runs_effect_once_with_fresh_values():
    a = Signal(1)
    double = Computed(lambda: a.get() * 2)
    triple = Computed(lambda: a.get() * 3)
    runs = []
    effect(lambda: runs.append((double.get(), triple.get())))
    a.set(2)
    assert runs == [(2, 3), (4, 6)]  # once, never a mix of old and new


def test_batch_defers_and_coalesces():
    a, b = Signal(0), Signal(0)
    runs = []
    effect(lambda: runs.append((a.get(), b.get())))
    with batch():
        a.set(1)
        b.set(1)
        assert runs == [(0, 0)]
    assert runs == [(0, 0), (1, 1)]


def test_signals_are_thread_safe():
    counter = Signal(0)
    seen = []
    effect(lambda: seen.append(counter.get()))

    def work():
        for _ in range(500):
            counter.update(lambda v: v + 1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counter.get() == 2000 and seen[-1] == 2000 and len(seen) == 2001


def test_busy_counter_nested_threads_and_exceptions():
    busy = Signal(False)
    changes = []
    busy.subscribe(changes.append)
    counter = BusyCounter(busy)
    with counter:
        with counter:
            assert busy.get()
        assert busy.get()  # the outer call is still running
    assert not busy.get() and changes == [True, False]

    gate, inside = threading.Barrier(4), threading.Barrier(4)

    def work():
        with counter:
            gate.wait()
            inside.wait()

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    gate.wait()
    assert busy.get()
    inside.wait()
    for t in threads:
        t.join()
    assert not busy.get()

    with pytest.raises(RuntimeError), counter:
        raise RuntimeError("boom")
    assert not busy.get()


class _Widget(traitlets.HasTraits):
    value = traitlets.Any()


def test_bind_both_ways_and_unbind():
    s, w = Signal(1), _Widget()
    unbind = bind(s, w, "value")
    assert w.value == 1
    s.set(2)
    assert w.value == 2
    w.value = 3
    assert s.get() == 3
    unbind()
    s.set(4)
    assert w.value == 3


def test_bind_one_way():
    s, w = Signal("cpu"), _Widget()
    bind(s, w, "value", direction="to_widget")
    w.value = "other"
    assert s.get() == "cpu"
    with pytest.raises(ValueError, match="direction"):
        bind(s, w, "value", direction="sideways")
    with pytest.raises(ValueError, match="Computed"):
        bind(Computed(lambda: s.get()), w, "value")
