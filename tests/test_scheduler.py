"""Continuous batching on the real SmolLM2 (`workbench.engine.decoding.scheduler`): generations from
several threads decode together and give each the tokens it gets alone; a shared system
prompt is read once and held once; cancelled and abandoned requests free their places.
"""

from __future__ import annotations

import threading

import pytest

from tests.support.memory import resident_bytes
from workbench import LLM
from workbench.engine.cancel import Cancelled
from workbench.engine.decoding.grammar import Grammar, GrammarMatcher
from workbench.engine.decoding.scheduler import MIN_SHARED
from workbench.engine.formats.gguf import open_gguf
from workbench.engine.runtime.prefix_cache import common_prefix

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "max_tokens": 24}
QUESTIONS = ["Name a fruit.", "What is 2 + 2?", "Write a haiku about the sea.",
             "Who wrote Hamlet? Answer in one sentence, and say when it was written.",
             "List three colours.", "Explain what a CPU does, briefly, for a child of "
             "eight who has never seen a computer but likes trains and clocks.",
             "Say hello in French.", "What is the capital of Japan?"]


def _chat(question: str, system: str | None = None) -> list[dict]:
    messages = [{"role": "user", "content": question}]
    return [{"role": "system", "content": system}] + messages if system else messages


def _alone(m: LLM, conversations: list[list[dict]], **options) -> list[list[int]]:
    out = []
    for messages in conversations:
        m.reset()
        out.append(m.chat(messages, **options).token_ids)
    return out


def _together(m: LLM, conversations: list[list[dict]], **options) -> list[list[int]]:
    """Each conversation from its own thread, all released at once."""
    results: list[list[int] | BaseException] = [[] for _ in conversations]
    gate = threading.Barrier(len(conversations))

    def run(i: int) -> None:
        try:
            gate.wait()
            results[i] = m.chat(conversations[i], **options).token_ids
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(conversations))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def test_threads_decode_together_and_get_what_they_get_alone(smollm2):
    conversations = [_chat(q) for q in QUESTIONS]
    alone = _alone(smollm2, conversations, **GREEDY)
    smollm2.reset()
    steps = smollm2._scheduler.steps
    together = _together(smollm2, conversations, **GREEDY)
    assert together == alone
    # one step per token of the longest answer, a few to read the prompts: far fewer
    # than the tokens of all answers, which is what one-at-a-time would take
    taken = smollm2._scheduler.steps - steps
    assert taken < max(len(a) for a in alone) + 12 < sum(len(a) for a in alone), taken
    assert not smollm2.busy.get()


def test_generate_batch_wider_than_the_batch_waits_for_places(smollm2):
    """More prompts than `max_batch`: the rest join as places come free, and sampled
    sequences keep their own seeds (s + i)."""
    m = smollm2
    prompts = [f"Story {i}: once upon a time" for i in range(m.max_batch + 3)]
    batch = m.generate_batch(prompts, temperature=0.8, seed=7, max_tokens=12)
    alone = [m.generate(p, temperature=0.8, seed=7 + i, max_tokens=12).token_ids
             for i, p in enumerate(prompts)]
    assert [c.token_ids for c in batch] == alone


def test_a_shared_system_prompt_is_read_once_and_held_once(smollm2):
    system = " ".join(f"Rule {i}: answer politely, briefly and truthfully." for i in range(90))
    with LLM(open_gguf(smollm2.path), kv_cache_size=2048) as m:
        conversations = [_chat(q, system) for q in QUESTIONS]
        prompts = [m._chat_ids(c, None) for c in conversations]
        shared = min(common_prefix(prompts[0], p) for p in prompts[1:])
        assert 900 < shared < 1400 and shared > MIN_SHARED
        alone = _alone(m, conversations[:2], **GREEDY)
        m.reset()
        pool_before = sum(resident_bytes(a) for a in _pool_arrays(m))
        read_before = m.prefilled_tokens
        together = _together(m, conversations, **GREEDY)
        read = m.prefilled_tokens - read_before
        grown = sum(resident_bytes(a) for a in _pool_arrays(m)) - pool_before
        cfg = m.config
        per_position = 2 * cfg.n_layer * cfg.n_head_kv * cfg.head_dim * 4  # K and V, fp32
    assert together[:2] == alone
    own = sum(len(p) - shared for p in prompts)
    assert read < shared + own + 8 * 16, (read, shared, own)  # the system prompt once
    assert grown < 2 * shared * per_position, (grown, shared * per_position)


def _pool_arrays(m: LLM) -> list:
    pool = m._scheduler._pool
    return [pool.keys, pool.values]


def test_cancelled_and_abandoned_requests_free_their_places(smollm2):
    m = smollm2
    conversations = [_chat(q) for q in QUESTIONS[:6]]
    alone = _alone(m, conversations, temperature=0, max_tokens=40)
    m.reset()
    flags = [threading.Event() for _ in conversations]
    outcomes: list = [None] * len(conversations)
    gate = threading.Barrier(len(conversations))

    def run(i: int) -> None:
        gate.wait()
        completion = m.chat(conversations[i], temperature=0, max_tokens=40, cancel=flags[i])
        try:
            for n, _ in enumerate(completion.iter_events()):
                if n == 3 and i in (1, 4):
                    flags[i].set()  # cancelled: the next token raises
                if n == 3 and i == 2:
                    break  # abandoned: the place frees at the next step
            outcomes[i] = completion.token_ids
        except Cancelled:
            outcomes[i] = "cancelled"

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(conversations))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert outcomes[1] == outcomes[4] == "cancelled"
    assert outcomes[2] == alone[2][:4]
    for i in (0, 3, 5):
        assert outcomes[i] == alone[i], i
    scheduler = m._scheduler
    with scheduler.paused():
        assert not scheduler._running and not scheduler._waiting
        assert all(owner is None for owner in scheduler._owner)
    assert not m.busy.get()


def test_reset_forgets_a_prompt_whose_generation_still_runs(smollm2):
    """`reset` while a generation runs (its caller has read one token): when it ends, its
    slot keeps nothing, so the next call reads the whole prompt again."""
    m = smollm2
    messages = _chat(QUESTIONS[3])
    m.reset()
    alone = m.chat(messages, temperature=0, max_tokens=40).token_ids
    m.reset()
    running = m.chat(messages, temperature=0, max_tokens=40)
    events = running.iter_events()
    next(events)
    m.reset()
    for _ in events:  # the running one ends after the reset, untouched by it
        pass
    assert running.token_ids == alone
    prompt = len(m.tokenize(m.apply_chat_template(messages)))
    read_before = m.prefilled_tokens
    assert m.chat(messages, temperature=0, max_tokens=4).token_ids == alone[:4]
    assert m.prefilled_tokens - read_before == prompt


def test_a_failing_request_leaves_the_others_running(smollm2):
    def explode(ids, logits):
        if len(ids) > 40:
            raise RuntimeError("processor exploded")
        return logits

    m = smollm2
    ok = m.chat(_chat(QUESTIONS[0]), **GREEDY)
    bad = m.chat(_chat(QUESTIONS[1]), logits_processors=[explode], **GREEDY)
    it_ok, it_bad = iter(ok), iter(bad)
    next(it_ok)
    with pytest.raises(RuntimeError, match="exploded"):
        list(it_bad)
    list(it_ok)
    m.reset()
    assert ok.token_ids == m.chat(_chat(QUESTIONS[0]), **GREEDY).token_ids


def test_a_late_grammar_mask_holds_back_only_its_own_sequence(smollm2, monkeypatch):
    """Grammar masks are computed on worker threads beside the forward pass. While one is
    late (here held until the test lets it go; a grammar whose parser work blows up holds
    it for seconds), its sequence sits the steps out and the others run to their end;
    then it goes on, and both answers are what each gets alone."""
    m = smollm2
    yes_no = Grammar.from_gbnf('root ::= ("yes" | "no") ", because " [a-z ]{4,40} "."')
    constrained = {"grammar": yes_no, "temperature": 0, "max_tokens": 24}
    question = _chat("Is the sea salty?")
    alone = _alone(m, [question], **constrained)[0]
    other_alone = _alone(m, [_chat(QUESTIONS[1])], **GREEDY)[0]
    m.reset()

    released = threading.Event()
    compute = GrammarMatcher._compute

    def held(self):
        released.wait(60)
        return compute(self)

    monkeypatch.setattr(GrammarMatcher, "_compute", held)
    held_ids: list = []
    other_ids: list = []
    slow = threading.Thread(target=lambda: held_ids.append(
        m.chat(question, **constrained).token_ids))
    slow.start()
    other = threading.Thread(target=lambda: other_ids.append(
        m.chat(_chat(QUESTIONS[1]), **GREEDY).token_ids))
    other.start()
    other.join(30)
    try:
        assert not other.is_alive(), "the unconstrained request waited for the held mask"
        assert slow.is_alive() and not held_ids
    finally:
        released.set()
        slow.join(60)
        other.join(60)
    assert other_ids == [other_alone]
    assert held_ids == [alone]
    assert len(alone) > 3


# -- sharing the cores (workbench.engine.runtime.cores) --------------------------------------------

class _Stat:
    """A stand-in /proc/stat whose `procs_running` the test sets, and a clock."""

    def __init__(self, tmp_path):
        self.path, self.now = tmp_path / "stat", 0.0

    def running(self, n: int) -> None:
        self.path.write_text(f"cpu  1 2 3 4\nprocs_running {n}\nprocs_blocked 0\n")

    def clock(self) -> float:
        return self.now


def test_quiet_blas_holds_openblas_at_one_thread_across_nested_passes(monkeypatch):
    """Where NumPy came first (OpenBLAS's workers spin), short passes run with OpenBLAS at
    one thread, nested or in several threads under one limit, lifted when the last ends;
    long passes leave it alone."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from workbench.engine.runtime import cores

    def blas_threads() -> list[int]:
        return [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]

    monkeypatch.setattr(cores, "_blas_spins", True)
    with threadpool_limits(limits=2, user_api="blas"):  # two, whatever the gate set
        before = blas_threads()
        assert before and set(before) == {2}, f"NumPy's BLAS pools: {before}"
        with cores.quiet_blas(40, 64):
            assert blas_threads() == [1] * len(before)
            with cores.quiet_blas(8, 64):
                assert blas_threads() == [1] * len(before)
            assert blas_threads() == [1] * len(before)  # the outer pass still runs
        assert blas_threads() == before
        with cores.quiet_blas(40, 64):  # a second time: the same controller, same effect
            assert blas_threads() == [1] * len(before)
        assert blas_threads() == before
        with cores.quiet_blas(512, 64):
            assert blas_threads() == before


def test_core_share_uses_the_cores_other_work_leaves(tmp_path):
    from workbench.engine.runtime.cores import DOWN_READINGS, READ_EVERY_S, UP_READINGS, CoreShare

    stat = _Stat(tmp_path)
    stat.running(2)  # our two threads alone
    share = CoreShare(pool=2, cores=2, path=str(stat.path), clock=stat.clock)

    def readings(n: int) -> int:
        for _ in range(n):
            stat.now += 2 * READ_EVERY_S
            threads = share.next_step()
        return threads

    assert share.enabled and readings(3) == 2
    stat.running(3)  # one busy process beside them
    assert readings(DOWN_READINGS - 1) == 2  # a single reading does not flap it
    assert readings(1) == 1
    stat.running(2)  # our one thread and the busy process: still taken
    assert readings(10) == 1
    stat.running(3)  # two busy processes: still one thread, the least
    assert readings(3) == 1
    stat.running(1)  # the others are gone
    assert readings(UP_READINGS - 1) == 1 and readings(1) == 2
    assert share.next_step() == 2  # between readings: the last decision
    share.set_enabled(False)
    stat.running(5)
    assert readings(5) == 2
    assert CoreShare(pool=2, path=str(tmp_path / "none")).enabled is False


def test_steps_run_with_a_short_switch_interval_and_restore_it(smollm2):
    """Numba takes the GIL back after each parallel region, ~240 times a decode step;
    beside another thread running Python each of those waited the switch interval (5 ms:
    0.7 tok/s instead of ~160). Steps run at STEP_SWITCH_INTERVAL_S, and the interval the
    program had is back after them, also when several users overlap."""
    import sys

    from workbench.engine.runtime.cores import STEP_SWITCH_INTERVAL_S, prompt_gil

    before = sys.getswitchinterval()
    seen: list[float] = []

    def look(ids, logits):
        seen.append(sys.getswitchinterval())
        return logits

    text = smollm2.generate("Once upon a time", max_tokens=4, temperature=0,
                            logits_processors=[look]).text
    assert text
    short = pytest.approx(STEP_SWITCH_INTERVAL_S)
    assert before > 2 * STEP_SWITCH_INTERVAL_S  # Python's default, 5 ms
    assert seen and all(s == short for s in seen), seen
    assert sys.getswitchinterval() == before
    with prompt_gil():
        with prompt_gil():
            assert sys.getswitchinterval() == short
        assert sys.getswitchinterval() == short
    assert sys.getswitchinterval() == before
