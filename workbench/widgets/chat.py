"""`ChatCell`: a chat widget for one model, generating on a worker thread.

    cell = ChatCell(m, temperature=0)
    cell                      # shows the widget in a notebook
    cell.send("Hi!")          # or type in the box and press Send
    cell.wait()
    cell.messages             # [{"role": "system", ...}, {"role": "user", ...},
                              #  {"role": "assistant", ...}]

Messages are rendered from Markdown to HTML in Python (markdown-it-py, raw HTML
disabled, so model output cannot inject markup) and sent to the browser in the
`log` trait. Generation runs on a `threading.Thread`; the streaming answer is
pushed to the widget at most ~20 times a second. `stop()` takes effect between
two tokens. Sending while a generation runs is refused: `send()` and
`regenerate()` raise `RuntimeError`, and a Send from the browser only sets the
`error` trait. An answer cut at `max_tokens` says so on the stats line, and
Continue (`continue_answer()`) carries on writing it where it stopped.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anywidget
import traitlets
from markdown_it import MarkdownIt

from workbench.engine.options import DEFAULTS
from workbench.widgets.worker import StoppableWorker

if TYPE_CHECKING:
    from workbench.engine.llm import LLM

STATIC = Path(__file__).parent / "static"
UPDATE_INTERVAL = 0.05  # seconds between widget updates while streaming (~20/s)
CHAT_TEMPERATURE = 0.8  # where the cell's temperature slider starts: a chat cell samples
CHAT_TOP_P = 0.95  # and its top_p slider: sampled chat keeps the nucleus (the API's is off)

_markdown = MarkdownIt("commonmark", {"html": False})
_markdown_lock = threading.Lock()


def render_markdown(text: str) -> str:
    """HTML of Markdown `text`; raw HTML in the text is escaped, not passed through."""
    with _markdown_lock:
        return _markdown.render(text)


BUSY_NOTICE = "a reply is being generated; wait() for it or stop() it first"


class ChatCell(StoppableWorker, anywidget.AnyWidget):
    """A chat with `model`: system prompt, sampling controls, a Markdown message log,
    an input box, Send / Stop / Regenerate / Clear, token statistics and a busy badge.

    Synced traits: `system`, `temperature`, `top_p`, `max_tokens` (editable in
    the browser), `log` (rendered messages), `generating`, `busy` (the model's
    busy signal), `warming` (the kernels the model is compiling, as text: the badge
    then reads "compiling 2/4"), `cut` (the last answer stopped at `max_tokens`, so
    Continue is offered), `stats`, `error`.
    """

    _esm = STATIC / "chat.js"
    _css = STATIC / "widgets.css"

    system = traitlets.Unicode("").tag(sync=True)
    # sampling controls: the sliders start at the cell's own CHAT_TEMPERATURE and
    # CHAT_TOP_P (the Python API is greedy, its filters off); max_tokens at the engine's
    temperature = traitlets.Float(CHAT_TEMPERATURE).tag(sync=True)
    top_p = traitlets.Float(CHAT_TOP_P).tag(sync=True)
    max_tokens = traitlets.Int(DEFAULTS.max_tokens).tag(sync=True)
    log = traitlets.List(traitlets.Dict()).tag(sync=True)
    generating = traitlets.Bool(False).tag(sync=True)
    busy = traitlets.Bool(False).tag(sync=True)
    warming = traitlets.Unicode("").tag(sync=True)
    cut = traitlets.Bool(False).tag(sync=True)
    stats = traitlets.Unicode("").tag(sync=True)
    error = traitlets.Unicode("").tag(sync=True)

    def __init__(self, model: LLM, system: str = "You are helpful and concise.",
                 temperature: float = CHAT_TEMPERATURE, top_p: float = CHAT_TOP_P,
                 max_tokens: int = DEFAULTS.max_tokens, **options: Any):
        """`options` are passed on to `model.chat` (e.g. `seed`, `top_k`, `stop`, or
        `options=` a `GenerationOptions`; the cell's controls override its fields)."""
        super().__init__(system=system, temperature=temperature, top_p=top_p,
                         max_tokens=max_tokens)
        self.model = model
        self.options: dict[str, Any] = dict(options)
        self.last_usage: dict[str, Any] = {}
        self._history: list[dict[str, str]] = []
        self._rendered: list[dict[str, Any]] = []  # rendered history, cached per message
        self._state_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._follow(model)
        self.on_msg(self._on_frontend_msg)

    # -- public API --------------------------------------------------------------------------
    @property
    def messages(self) -> list[dict[str, str]]:
        """The conversation as an OpenAI-style list: the system message (when the system
        prompt is not empty) first, then the user and assistant turns."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        with self._state_lock:
            return head + [dict(m) for m in self._history]

    @messages.setter
    def messages(self, messages: list[dict[str, str]]) -> None:
        self._require_idle()
        turns = [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
        if turns and turns[0]["role"] == "system":
            self.system = turns.pop(0)["content"]
        with self._state_lock:
            self._history = turns
            self._rendered = [self._render(m) for m in turns]
        self._push_log()

    def send(self, text: str) -> threading.Thread:
        """Add a user message and start answering it on a worker thread (returned).

        Raises RuntimeError while a previous answer is still being generated.
        """
        self._require_idle()
        message = {"role": "user", "content": str(text)}
        with self._state_lock:
            self._history.append(message)
            self._rendered.append(self._render(message))
        self._push_log()
        return self._start()

    def regenerate(self) -> threading.Thread:
        """Drop the last answer and generate a new one for the same conversation."""
        self._require_idle()
        with self._state_lock:
            if self._history and self._history[-1]["role"] == "assistant":
                self._history.pop()
                self._rendered.pop()
            if not self._history:
                raise ValueError("nothing to regenerate: the conversation is empty")
        self._push_log()
        return self._start()

    def continue_answer(self) -> threading.Thread:
        """Carry on writing the last answer where `max_tokens` cut it (the model
        continues the same text, it does not start a new turn); the continuation is
        added to that answer."""
        self._require_idle()
        with self._state_lock:
            if not self._history or self._history[-1]["role"] != "assistant":
                raise ValueError("nothing to continue: the conversation does not end with "
                                 "an answer")
        return self._start(continuing=True)

    def clear(self) -> None:
        """Stop any generation and forget the conversation (the system prompt stays)."""
        self.stop()
        self.wait()
        with self._state_lock:
            self._history = []
            self._rendered = []
        self.last_usage = {}
        self.stats = ""
        self.error = ""
        self.cut = False
        self._push_log()

    @property
    def log_html(self) -> str:
        """The message log's HTML as the browser shows it (for inspection and tests)."""
        return "".join(
            f'<div class="wb-msg wb-msg-{m["role"]}">{m["html"]}</div>' for m in self.log)

    # -- internals ---------------------------------------------------------------------------
    def _require_idle(self) -> None:
        if self.generating:
            raise RuntimeError(BUSY_NOTICE)

    @staticmethod
    def _render(message: dict[str, str], streaming: bool = False) -> dict[str, Any]:
        return {"role": message["role"], "html": render_markdown(message["content"]),
                "streaming": streaming}

    def _push_log(self, streaming: dict[str, Any] | None = None) -> None:
        with self._state_lock:
            log = list(self._rendered)
        self.log = log + [streaming] if streaming is not None else log

    def _chat_options(self) -> dict[str, Any]:
        return {**self.options, "temperature": float(self.temperature),
                "top_p": float(self.top_p), "max_tokens": int(self.max_tokens)}

    def _start(self, continuing: bool = False) -> threading.Thread:
        """Answer the conversation on a worker thread; `continuing`: carry on the last
        answer (taken out of the log, to come back with its continuation)."""
        messages = self.messages
        options = self._chat_options()
        start = ""
        if continuing:
            options["continue_final_message"] = True
            with self._state_lock:
                start = self._history.pop()["content"]
                self._rendered.pop()
        self._stop.clear()
        self.error = ""
        self.cut = False
        self.generating = True
        thread = threading.Thread(target=self._generate, args=(messages, options, start),
                                  name="workbench-chat", daemon=True)
        self._thread = thread
        thread.start()
        return thread

    def _generate(self, messages: list[dict[str, str]], options: dict[str, Any],
                  start_text: str = "") -> None:
        """Worker: stream an answer (after `start_text`, the answer it continues) into
        the log; always leaves `generating` False."""
        pieces: list[str] = [start_text] if start_text else []
        n_tokens = 0
        n_prompt = 0
        reason = "error"
        start = time.perf_counter()
        first = last = None
        completion = None
        try:
            completion = self.model.chat(messages, **options)
            n_prompt = len(completion.prompt_ids)  # 0 from a remote engine, until the end
            self.stats = f"{n_prompt} prompt tokens · generating…" if n_prompt \
                else "generating…"
            pushed = 0.0
            for event in completion.iter_events():
                now = time.perf_counter()
                if event.id is not None or event.piece:  # a token (remote: id unknown)
                    n_tokens += 1
                    first = now if first is None else first
                    last = now
                pieces.append(event.text)
                if self._stop.is_set():
                    reason = "stopped"
                    break
                if now - pushed >= UPDATE_INTERVAL:
                    pushed = now
                    self._push_log(self._render(
                        {"role": "assistant", "content": "".join(pieces)}, streaming=True))
                    self.stats = self._format_stats(n_prompt, n_tokens, start, first, last,
                                                    None)
            else:
                reason = completion.finish_reason
                usage = completion.usage  # a remote engine's counts arrive at the end
                n_prompt, n_tokens = usage.prompt_tokens, usage.completion_tokens
        except Exception as exc:  # shown in the cell, never raised in the kernel
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            if completion is not None:
                try:
                    completion.close()  # frees the model at once when stopped early
                except Exception:  # noqa: BLE001 - already reported or harmless
                    pass
            text = "".join(pieces)
            if text or reason != "error":
                answer = {"role": "assistant", "content": text}
                with self._state_lock:
                    self._history.append(answer)
                    self._rendered.append(self._render(answer))
            self.last_usage = {"prompt_tokens": n_prompt, "completion_tokens": n_tokens,
                               "finish_reason": reason,
                               "seconds": time.perf_counter() - start}
            self.cut = reason == "length"
            self.stats = self._format_stats(n_prompt, n_tokens, start, first, last, reason)
            self._push_log()
            if self.error == BUSY_NOTICE:  # a send refused while this reply ran: over now
                self.error = ""
            self.generating = False

    @staticmethod
    def _format_stats(n_prompt: int, n_tokens: int, start: float, first: float | None,
                      last: float | None, reason: str | None) -> str:
        parts = [f"{n_prompt} prompt tokens", f"{n_tokens} generated"]
        if first is not None and last is not None and n_tokens > 1 and last > first:
            parts.append(f"{(n_tokens - 1) / (last - first):.1f} tok/s")
        if first is not None:
            parts.append(f"first token {first - start:.2f}s")
        if reason == "length":
            parts.append("cut at max_tokens: Continue carries on")
        elif reason:
            parts.append(reason)
        return " · ".join(parts)

    def _on_frontend_msg(self, widget: Any, content: Any, buffers: Any) -> None:
        """Actions from the browser: {"type": "send", "text": ...}, "stop", "regenerate",
        "continue", "clear"."""
        if not isinstance(content, dict):
            return
        kind = content.get("type")
        try:
            if kind == "send":
                text = str(content.get("text", "")).strip()
                if text:
                    self.send(text)
            elif kind == "stop":
                self.stop()
            elif kind == "regenerate":
                self.regenerate()
            elif kind == "continue":
                self.continue_answer()
            elif kind == "clear":
                self.clear()
        except (RuntimeError, ValueError) as exc:
            self.error = str(exc)
