"""Widgets: badges, ChatCell and LogitsCell, driven from Python (no browser)."""

from __future__ import annotations

import time
from io import BytesIO

import pytest

from workbench.signals import Signal
from workbench.widgets import (
    BusyBadge,
    ChatCell,
    DeviceBadge,
    LogitsCell,
    MemoryBadge,
    TokenView,
    render_markdown,
)
from workbench.widgets.badges import STATIC


class FakeModel:
    """Just the signals a badge reads."""

    def __init__(self):
        self.busy = Signal(False)
        self.device = Signal("cpu")


def frontend(widget, content):
    """Deliver a custom message as the browser would."""
    widget._handle_custom_msg(content, [])


# -- static assets and badges ----------------------------------------------------------------

def test_static_assets_are_local_and_define_classes():
    js = "".join(p.read_text() for p in STATIC.glob("*.js"))
    css = (STATIC / "widgets.css").read_text()
    assert "http://" not in js and "https://" not in js  # works offline
    for cls in ("wb-chat-input", "wb-chat-send", "wb-chat-stop", "wb-chat-regenerate",
                "wb-chat-clear", "wb-chat-log", "wb-chat-stats", "wb-msg", "wb-error",
                "wb-busy", "wb-token", "wb-alternatives", "wb-alt"):
        assert cls in js, cls
    assert ".wb-badge" in css and ".wb-token" in css


def test_busy_badge_follows_signal():
    m = FakeModel()
    badge = BusyBadge(m)
    assert badge.busy is False and badge.state == "idle" and badge.label == "○ idle"
    m.busy.set(True)
    assert badge.busy is True and badge.state == "busy" and badge.label == "● busy"
    badge.close()
    m.busy.set(False)
    assert badge.busy is True  # unbound after close


def test_device_badge_follows_signal_or_model():
    sig = Signal("cpu")
    badge = DeviceBadge(sig)
    assert badge.device == "cpu" and badge.state == "cpu"
    sig.set("cuda")
    assert badge.device == "cuda" and badge.label == "cuda"
    assert DeviceBadge(FakeModel()).device == "cpu"
    with pytest.raises(TypeError):
        BusyBadge(object())


def test_memory_badge_follows_the_models_kv_cache(smollm2):
    """m.memory() counts the positions the scheduler's slots hold (a finished chat's
    prompt and answer stay cached for reuse), and the badge reads it when busy changes."""
    smollm2.reset()
    before = smollm2.memory()
    assert before.kv_tokens_used == 0 and before.kv_tokens_free == \
        before.kv_slots * smollm2.kv_cache_size
    cfg = smollm2.config
    assert before.kv_bytes_per_token == 2 * cfg.n_layer * cfg.n_head_kv * cfg.head_dim * 4
    assert 80 * 2**20 < before.weights_bytes < smollm2.path.stat().st_size
    badge = MemoryBadge(smollm2)
    assert badge.label.startswith("KV 0 / ") and badge.state == "ok"
    c = smollm2.chat([{"role": "user", "content": "Name a colour."}], max_tokens=8)
    n = len(c.prompt_ids) + len(c.token_ids)
    after = smollm2.memory()
    assert after.kv_tokens_running == 0 and n - 1 <= after.kv_tokens_cached <= n
    assert after.kv_bytes == after.kv_tokens_used * after.kv_bytes_per_token
    assert badge.label.startswith(f"KV {after.kv_tokens_used} / ")  # refreshed on idle
    assert "cached" in badge.detail and str(after) == badge.detail
    badge.close()
    assert MemoryBadge(FakeModel()).label == "KV ?"


def test_markdown_rendering_escapes_html():
    html = render_markdown("**bold** <script>alert(1)</script>")
    assert "<strong>bold</strong>" in html
    assert "<script>" not in html and "&lt;script&gt;" in html


# -- ChatCell --------------------------------------------------------------------------------

@pytest.mark.slow
def test_chat_send_matches_model_chat(smollm2):
    cell = ChatCell(smollm2, temperature=0, max_tokens=24)
    frontend(cell, {"type": "send", "text": "What is 2+2?"})
    assert cell.wait(timeout=60)
    messages = cell.messages
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    expected = smollm2.chat(messages[:2], temperature=0, top_p=0.95, max_tokens=24)
    assert messages[2]["content"] == expected.text
    assert cell.log[-1]["role"] == "assistant"
    assert cell.log[-1]["html"] == render_markdown(expected.text)
    assert render_markdown(expected.text) in cell.log_html
    n = expected.usage.completion_tokens
    assert f"{n} generated" in cell.stats
    assert f"{expected.usage.prompt_tokens} prompt tokens" in cell.stats
    assert cell.last_usage["completion_tokens"] == n
    assert not cell.generating and cell.error == ""
    assert smollm2.busy.get() is False and cell.busy is False


def test_chat_stop_mid_stream(smollm2):
    cell = ChatCell(smollm2, temperature=0, max_tokens=200)
    seen = []
    cell.observe(lambda change: seen.append(change["new"]), names="log")
    cell.send("Write a long story about a dragon.")
    deadline = time.time() + 30
    while time.time() < deadline and not any(
            log and log[-1].get("streaming") for log in list(seen)):
        time.sleep(0.005)
    cell.stop()
    assert cell.wait(timeout=30)
    assert cell.last_usage["finish_reason"] == "stopped"
    assert 0 < cell.last_usage["completion_tokens"] < 200
    assert smollm2.busy.get() is False
    assert cell.messages[-1]["role"] == "assistant"
    assert "stopped" in cell.stats


def test_chat_says_an_answer_was_cut_and_continues_it(smollm2):
    """An answer cut at max_tokens says so and offers Continue; Continue from the browser
    carries the same answer on (the cut answer and its continuation are the uncut one)."""
    cell = ChatCell(smollm2, temperature=0, max_tokens=10)
    cell.send("Tell me about Paris in three sentences.")
    assert cell.wait(timeout=60)
    assert cell.cut and "cut at max_tokens" in cell.stats
    assert cell.last_usage["finish_reason"] == "length"
    cell.max_tokens = 14
    frontend(cell, {"type": "continue"})
    assert cell.wait(timeout=60)
    assert cell.error == ""
    messages = cell.messages
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    whole = smollm2.chat(messages[:2], temperature=0, top_p=0.95, max_tokens=24)
    assert messages[2]["content"] == whole.text
    assert cell.last_usage["completion_tokens"] == 14
    assert cell.log[-1]["html"] == render_markdown(whole.text)
    cell.clear()
    assert not cell.cut
    with pytest.raises(ValueError, match="nothing to continue"):
        cell.continue_answer()


@pytest.mark.slow
def test_chat_refuses_send_while_busy_regenerate_and_clear(smollm2):
    cell = ChatCell(smollm2, temperature=0, max_tokens=12)
    cell.send("Name a colour.")
    with pytest.raises(RuntimeError):
        cell.send("again")
    frontend(cell, {"type": "send", "text": "again"})  # refused, shown in the cell
    assert "generated" in cell.error or not cell.generating
    cell.wait()
    assert cell.error == ""  # the refusal is over once the reply is
    first = cell.messages[-1]["content"]
    cell.temperature = 1.5
    cell.options["seed"] = 7
    frontend(cell, {"type": "regenerate"})
    cell.wait()
    msgs = cell.messages
    assert [m["role"] for m in msgs] == ["system", "user", "assistant"]
    expected = smollm2.chat(msgs[:2], temperature=1.5, top_p=0.95, max_tokens=12, seed=7).text
    assert msgs[-1]["content"] == expected
    assert first is not None
    frontend(cell, {"type": "clear"})
    assert cell.messages == [{"role": "system", "content": "You are helpful and concise."}]
    assert cell.log == [] and cell.stats == ""


def test_chat_markdown_and_script_escaped():
    class Echo(FakeModel):
        """A model whose answer is fixed markdown with a script tag."""

        def chat(self, messages, **options):
            return FakeCompletion(["# Title\n\n", "<script>alert('x')</script>", " *done*"])

    cell = ChatCell(Echo(), temperature=0)
    cell.send("hi")
    cell.wait()
    html = cell.log[-1]["html"]
    assert "<h1>Title</h1>" in html and "<em>done</em>" in html
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert cell.messages[-1]["content"].startswith("# Title")


def test_chat_error_shows_in_cell():
    class Broken(FakeModel):
        def chat(self, messages, **options):
            raise RuntimeError("boom")

    m = Broken()
    cell = ChatCell(m)
    cell.send("hi")
    cell.wait()
    assert "boom" in cell.error and not cell.generating
    assert m.busy.get() is False
    assert [x["role"] for x in cell.messages] == ["system", "user"]


@pytest.mark.slow
def test_chat_error_from_real_model(smollm2, monkeypatch):
    def fail(*args, **kwargs):
        raise ValueError("generation failed")

    monkeypatch.setattr(smollm2, "chat", fail)
    cell = ChatCell(smollm2)
    frontend(cell, {"type": "send", "text": "hi"})
    cell.wait()
    assert "generation failed" in cell.error
    assert smollm2.busy.get() is False and not cell.generating


class FakeCompletion:
    """The part of `Completion` ChatCell uses, for a fixed list of pieces."""

    def __init__(self, pieces):
        from workbench.engine.llm import TokenEvent

        self.prompt_ids = [1, 2, 3]
        self._events = [TokenEvent(i, p, p) for i, p in enumerate(pieces)]
        self.finish_reason = "stop"

    def iter_events(self):
        yield from self._events

    def close(self):
        pass


# -- LogitsCell ------------------------------------------------------------------------------

@pytest.mark.slow
def test_logits_cell_tokens(smollm2):
    cell = LogitsCell(smollm2, "The capital of France is", max_tokens=8, top_k=5)
    assert cell.wait(timeout=60)
    tokens = cell.tokens
    assert 0 < len(tokens) <= 8
    expected = smollm2.generate("The capital of France is", max_tokens=8, temperature=0)
    assert [t["id"] for t in tokens] == expected.token_ids
    for t in tokens:
        assert 0 < t["prob"] <= 1
        probs = [a["prob"] for a in t["top"]]
        assert len(probs) == 5 and probs == sorted(probs, reverse=True)
        assert t["id"] == t["top"][0]["id"]  # greedy takes the most likely token
        assert t["entropy"] >= 0
    assert isinstance(cell.view, TokenView)
    assert [t["id"] for t in cell.view.tokens] == expected.token_ids
    assert not cell.view.running and cell.view.error == ""
    assert len(cell.output.outputs) == 2  # entropy + distribution figures
    assert cell.output.outputs[0]["data"]["image/png"]


def test_logits_cell_choose_alternative(smollm2):
    cell = LogitsCell(smollm2, "The capital of France is", max_tokens=8, top_k=5)
    cell.wait()
    before = cell.tokens
    i = 2
    alt = before[i]["top"][1]
    frontend(cell.view, {"type": "choose", "index": i, "token_id": alt["id"]})
    assert cell.wait(timeout=60)
    after = cell.tokens
    assert [t["id"] for t in after[:i]] == [t["id"] for t in before[:i]]
    assert after[i]["id"] == alt["id"] and after[i]["chosen"]
    assert after[i]["prob"] == pytest.approx(alt["prob"])
    prompt_ids = smollm2.tokenize("The capital of France is")
    prefix = prompt_ids + [t["id"] for t in before[:i]] + [alt["id"]]
    cont = smollm2.generate(prefix, max_tokens=8 - i - 1, temperature=0).token_ids
    assert [t["id"] for t in after[i + 1:]] == cont
    assert cell.view.selected == i


@pytest.mark.slow
def test_logits_choose_token_outside_top_k(smollm2):
    cell = LogitsCell(smollm2, "Hello", max_tokens=3, top_k=2)
    cell.wait()
    top_ids = {a["id"] for a in cell.tokens[0]["top"]}
    other = next(t for t in range(100, 200) if t not in top_ids)
    cell.choose(0, other)
    cell.wait()
    assert cell.tokens[0]["id"] == other and 0 < cell.tokens[0]["prob"] <= 1
    with pytest.raises(IndexError):
        cell.choose(99, other)


def test_logits_figures_render(smollm2):
    cell = LogitsCell(smollm2, "One, two,", max_tokens=4, top_k=3, color_by="surprisal")
    cell.wait()
    assert cell.color_by == "surprisal"
    fig = cell.entropy_figure()
    assert "bits" in fig.axes[0].get_ylabel()
    fig.savefig(BytesIO(), format="png")
    fig = cell.distribution_figure(1)
    assert len(fig.axes[0].patches) == 3
    fig.savefig(BytesIO(), format="png")
    with pytest.raises(IndexError):
        cell.distribution_figure(10)
    cell.view.selected = 2  # selecting a token redraws the distribution
    assert len(cell.output.outputs) == 2


def test_logits_cell_rejects_bad_arguments():
    with pytest.raises(ValueError):
        LogitsCell(FakeModel(), color_by="rainbow", autorun=False)
    with pytest.raises(TypeError, match="local model's token ids"):  # e.g. a RemoteEngine
        LogitsCell(FakeModel(), autorun=False)


@pytest.mark.slow
def test_logits_cell_compares_alternatives_through_branches(smollm2):
    cell = LogitsCell(smollm2, "The capital of France is", max_tokens=8, top_k=3)
    assert cell.wait(timeout=60)
    rows = cell.compare(0, k=3, max_tokens=6)
    assert len(rows) == 3
    assert sorted(r["id"] for r in rows) == sorted(a["id"] for a in cell.tokens[0]["top"])
    assert [r["perplexity"] for r in rows] == sorted(r["perplexity"] for r in rows)
    prompt = smollm2.tokenize("The capital of France is")
    for r in rows:  # each continuation is the greedy one after its token
        smollm2.reset()
        fresh = smollm2.generate(prompt + [r["id"]], temperature=0, max_tokens=5)
        assert r["text"] == fresh.text
    assert "perplexity" in cell.comparison.value and rows[0]["text"] in cell.comparison.value
    cell.close()
