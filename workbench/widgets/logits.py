"""`TokenView` and `LogitsCell`: look at a generation token by token.

    cell = LogitsCell(m, "The capital of France is", max_tokens=16)
    cell                       # token view (coloured by probability) + figures below
    cell.wait()
    cell.tokens[0]             # {"id": ..., "text": ..., "prob": ..., "entropy": ..., "top": [...]}
    cell.choose(2, cell.tokens[2]["top"][1]["id"])   # branch: take the 2nd best token at step 2
    cell.wait()
    cell.compare(2, k=3)       # the top 3 tokens at step 2, continued side by side (Branch API)

Each generated token is recorded with its probability, surprisal and the
entropy of the distribution it came from (both in bits), and the top-k
alternatives at its position. Choosing another token at position i keeps
tokens[:i], puts the chosen one at i and generates the rest again from there.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anywidget
import ipywidgets
import traitlets
from matplotlib.figure import Figure

from workbench.widgets.figures import literal, png_output
from workbench.widgets.worker import Worker

if TYPE_CHECKING:
    from workbench.engine.llm import LLM, TokenEvent

STATIC = Path(__file__).parent / "static"
UPDATE_INTERVAL = 0.05  # seconds between widget updates while streaming (~20/s)
LN2 = math.log(2.0)
COLOR_MODES = ("probability", "surprisal")


def _bits(nats: float | None) -> float | None:
    return None if nats is None else nats / LN2


def _json_float(x: float | None, cap: float = 1e6) -> float | None:
    """A float that JSON (and the browser) can carry: infinities clamp to ±cap."""
    if x is None or math.isnan(x):
        return None
    return max(-cap, min(cap, float(x)))


BUSY_NOTICE = "still generating; choose again when it has finished"


class TokenView(anywidget.AnyWidget):
    """Generated tokens as coloured spans (`wb-token`, `data-index`) after the prompt.

    Hovering or clicking a token opens its top-k alternatives (`wb-alternatives`,
    rows `wb-alt` with `data-id`); clicking an alternative sends the custom
    message `{"type": "choose", "index": i, "token_id": id}` to Python.
    Synced traits: `prompt`, `tokens`, `color_by` ("probability" or "surprisal"),
    `selected` (index of the pinned token, -1 for none), `running`, `error`.
    """

    _esm = STATIC / "tokens.js"
    _css = STATIC / "widgets.css"

    prompt = traitlets.Unicode("").tag(sync=True)
    tokens = traitlets.List(traitlets.Dict()).tag(sync=True)
    color_by = traitlets.Enum(COLOR_MODES, default_value="probability").tag(sync=True)
    selected = traitlets.Int(-1).tag(sync=True)
    running = traitlets.Bool(False).tag(sync=True)
    error = traitlets.Unicode("").tag(sync=True)


class LogitsCell(Worker, ipywidgets.VBox):
    """Generate from `prompt` with `logprobs=top_k` and explore the choices made.

    A `VBox` holding a `TokenView` (`.view`) and an `ipywidgets.Output`
    (`.output`) showing the entropy figure and the distribution at the selected
    step, refreshed after each run. Generation runs on a worker thread; with
    `autorun` (default) it starts at once. Extra `options` go to
    `model.generate` (e.g. `seed`, `top_p`).
    """


    def __init__(self, model: LLM, prompt: str = "The capital of France is",
                 max_tokens: int = 32, top_k: int = 5, color_by: str = "probability",
                 temperature: float = 0, *, autorun: bool = True, **options: Any):
        if color_by not in COLOR_MODES:
            raise ValueError(f"color_by must be one of {COLOR_MODES}, got {color_by!r}")
        if top_k < 1:
            raise ValueError("top_k must be >= 1")
        if not (hasattr(model, "tokenize") and hasattr(model, "forward")):
            raise TypeError(f"the logits cell reads a local model's token ids and logits; "
                            f"{type(model).__name__} has none (load an LLM)")
        self.model = model
        self.prompt = prompt
        self.max_tokens = int(max_tokens)
        self.top_k = int(top_k)
        self.temperature = float(temperature)
        self.options: dict[str, Any] = dict(options)
        self.view = TokenView(prompt=prompt, color_by=color_by)
        self.output = ipywidgets.Output()
        self.comparison = ipywidgets.HTML("")  # `compare`'s table of branches
        super().__init__(children=[self.view, self.comparison, self.output])
        self._tokens: list[dict[str, Any]] = []
        self._prompt_ids: list[int] = []
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.view.on_msg(self._on_frontend_msg)
        self.view.observe(self._on_selected, names="selected")
        if autorun:
            self.run()

    # -- public API --------------------------------------------------------------------------
    @property
    def tokens(self) -> list[dict[str, Any]]:
        """The generated tokens: dicts with `id`, `text`, `prob`, `logprob` (nats),
        `surprisal` and `entropy` (bits), `top` (the top-k alternatives as dicts with
        `id`, `text`, `prob`, most likely first) and `chosen` (picked by `choose`)."""
        with self._lock:
            return [dict(t, top=[dict(a) for a in t["top"]]) for t in self._tokens]

    @property
    def text(self) -> str:
        """The generated text."""
        return self.model.detokenize([t["id"] for t in self.tokens])

    @property
    def color_by(self) -> str:
        """How tokens are coloured: "probability" or "surprisal"."""
        return self.view.color_by

    @color_by.setter
    def color_by(self, value: str) -> None:
        self.view.color_by = value

    @property
    def running(self) -> bool:
        """True while a generation runs."""
        return self._thread is not None and self._thread.is_alive()

    def run(self, prompt: str | None = None) -> threading.Thread:
        """(Re)generate from the prompt (optionally a new one) on a worker thread.

        Waits for a generation still running first; returns the worker thread.
        """
        self.wait()
        if prompt is not None:
            self.prompt = prompt
            self.view.prompt = prompt
        self._prompt_ids = self.model.tokenize(self.prompt)
        return self._start([], list(self._prompt_ids), self.max_tokens)

    def choose(self, index: int, token_id: int) -> threading.Thread:
        """Replace the token at `index` by `token_id` and regenerate what follows.

        Tokens before `index` stay as they are. Waits for a running generation
        first; returns the worker thread.
        """
        self.wait()
        tokens = self.tokens
        if not 0 <= index < len(tokens):
            raise IndexError(f"token index {index} out of range (0..{len(tokens) - 1})")
        token_id = int(token_id)
        n_vocab = self.model.config.n_vocab
        if not 0 <= token_id < n_vocab:
            raise ValueError(f"token id {token_id} outside the vocabulary [0, {n_vocab})")
        old = tokens[index]
        logprob = next((math.log(a["prob"]) for a in old["top"] if a["id"] == token_id
                        and a["prob"] > 0), None)
        if logprob is None:  # not among the recorded alternatives: ask the model
            logprob = self._logprob_at(self._prompt_ids + [t["id"] for t in tokens[:index]],
                                       token_id)
        chosen = self._token_record(index, token_id, self.model.detokenize([token_id]),
                                    logprob, old["entropy"] * LN2 if old["entropy"] is not None
                                    else None, old["top"], chosen=True)
        prefix = tokens[:index] + [chosen]
        ids = self._prompt_ids + [t["id"] for t in prefix]
        remaining = self.max_tokens - len(prefix)
        if token_id in self.model.tokenizer.eot_ids:
            remaining = 0
        thread = self._start(prefix, ids, remaining)
        self.view.selected = index
        return thread

    def compare(self, index: int, k: int = 3, max_tokens: int = 16) -> list[dict[str, Any]]:
        """Continue the `k` most likely tokens at position `index` side by side.

        The text up to `index` is run once; each alternative forks from it (sharing
        its cache) and is continued greedily for up to `max_tokens` tokens, all
        branches in one forward pass per step. Returns one dict per alternative,
        lowest perplexity first: `id`, `token`, `text` (the continuation after the
        token), `perplexity` (of the token and its continuation); the same table
        is shown under the tokens (`.comparison`).
        """
        from workbench.engine.explore.branch import Branch, BranchStore

        self.wait()
        tokens = self.tokens
        if not 0 <= index < len(tokens):
            raise IndexError(f"token index {index} out of range (0..{len(tokens) - 1})")
        history = self._prompt_ids + [t["id"] for t in tokens[:index]]
        alternatives = [a["id"] for a in tokens[index]["top"][: max(1, int(k))]]
        store = BranchStore(self.model, max_active=len(alternatives) + 1,
                            max_len=min(self.model.kv_cache_size,
                                        len(history) + max_tokens + 1))
        root = Branch.create(self.model, {"temperature": 0}, store=store)
        try:
            root.prefill(history)
            branches = [root.fork() for _ in alternatives]
            starts = [b.is_stop(t) for b, t in zip(branches, alternatives)]
            store.commit(list(zip(branches, alternatives)))
            live = [b for b, stopped in zip(branches, starts) if not stopped]
            for _ in range(max_tokens - 1):
                step = [(b, b.produce()) for b in live]
                step = [(b, t) for b, (t, stop, _) in step if not stop]
                if not step:
                    break
                store.commit(step)
                live = [b for b, _ in step]
            rows = [{"id": a, "token": self.model.detokenize([a]),
                     "text": self.model.detokenize(b.generated[1:]), "perplexity": b.perplexity}
                    for a, b in zip(alternatives, branches)]
        finally:
            root.prune_subtree()
        rows.sort(key=lambda r: r["perplexity"])
        self.comparison.value = _comparison_html(index, rows)
        return rows

    def entropy_figure(self) -> Figure:
        """Entropy of the next-token distribution (bits) and the surprisal of the token
        taken, over the generation steps."""
        tokens = self.tokens
        fig = Figure(figsize=(7.0, 2.6), layout="constrained")
        ax = fig.add_subplot()
        steps = list(range(len(tokens)))
        ent = [t["entropy"] if t["entropy"] is not None else math.nan for t in tokens]
        sur = [t["surprisal"] if t["surprisal"] is not None else math.nan for t in tokens]
        ax.plot(steps, ent, marker="o", markersize=3, label="entropy")
        ax.plot(steps, sur, linestyle="none", marker="x", label="surprisal of chosen token")
        ax.set_xlabel("generation step")
        ax.set_ylabel("bits")
        ax.set_title("Next-token entropy (bits)")
        if steps:
            ax.set_xlim(-0.5, len(steps) - 0.5)
            ax.legend(loc="upper right", fontsize="small")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        return fig

    def distribution_figure(self, index: int) -> Figure:
        """Bar chart of the top-k next-token probabilities at step `index` (the token
        taken highlighted)."""
        tokens = self.tokens
        if not 0 <= index < len(tokens):
            raise IndexError(f"token index {index} out of range (0..{len(tokens) - 1})")
        token = tokens[index]
        top = token["top"]
        labels = [literal(repr(a["text"])) for a in top]
        probs = [a["prob"] for a in top]
        colors = ["tab:orange" if a["id"] == token["id"] else "tab:blue" for a in top]
        fig = Figure(figsize=(7.0, 0.4 * len(top) + 1.2), layout="constrained")
        ax = fig.add_subplot()
        y = list(range(len(top)))
        ax.barh(y, probs, color=colors)
        ax.set_yticks(y, labels)
        ax.invert_yaxis()
        ax.set_xlim(0, 1)
        ax.set_xlabel("probability")
        ax.set_title(literal(f"Step {index}: top-{len(top)} next tokens (took "
                             f"{token['text']!r}, p={token['prob']:.3f})"))
        for yi, p in zip(y, probs):
            ax.text(min(p + 0.01, 0.9), yi, f"{p:.3f}", va="center", fontsize="small")
        return fig

    def close(self) -> None:
        """Wait for the worker and close the widgets."""
        self.wait()
        for child in (getattr(self, "view", None), getattr(self, "output", None)):
            if child is not None:
                child.close()
        super().close()

    # -- internals ---------------------------------------------------------------------------
    @staticmethod
    def _token_record(index: int, token_id: int, text: str, logprob: float | None,
                      entropy_nats: float | None, top: list[dict[str, Any]],
                      chosen: bool = False) -> dict[str, Any]:
        prob = math.exp(logprob) if logprob is not None else None
        return {
            "index": index, "id": token_id, "text": text,
            "prob": _json_float(prob), "logprob": _json_float(logprob),
            "surprisal": _json_float(-logprob / LN2) if logprob is not None else None,
            "entropy": _json_float(_bits(entropy_nats)), "top": top, "chosen": chosen,
        }

    def _record(self, index: int, event: TokenEvent) -> dict[str, Any]:
        top = [{"id": a.id, "text": a.text, "prob": _json_float(math.exp(a.logprob))}
               for a in (event.top or ())]
        return self._token_record(index, int(event.id), event.piece, event.logprob,
                                  event.entropy, top)

    def _logprob_at(self, ids: list[int], token_id: int) -> float:
        from workbench.engine.decoding.sampling import log_softmax

        cache = self.model.new_cache(len(ids) + 1)
        logits = self.model.forward(ids, cache)[-1]
        return float(log_softmax(logits)[token_id])

    def _start(self, prefix: list[dict[str, Any]], ids: list[int], remaining: int
               ) -> threading.Thread:
        with self._lock:
            self._tokens = list(prefix)
        self.view.error = ""
        self.view.running = True
        self.view.tokens = list(prefix)
        thread = threading.Thread(target=self._generate, args=(prefix, ids, remaining),
                                  name="workbench-logits", daemon=True)
        self._thread = thread
        thread.start()
        return thread

    def _generate(self, prefix: list[dict[str, Any]], ids: list[int], remaining: int) -> None:
        """Worker: extend `prefix` by up to `remaining` tokens, streaming to the view."""
        tokens = list(prefix)
        try:
            if remaining > 0:
                options = {**self.options, "temperature": self.temperature}
                completion = self.model.generate(ids, max_tokens=remaining,
                                                 logprobs=self.top_k, **options)
                pushed = 0.0
                for event in completion.iter_events():
                    if event.id is None:
                        continue
                    tokens.append(self._record(len(tokens), event))
                    with self._lock:
                        self._tokens = list(tokens)
                    now = time.perf_counter()
                    if now - pushed >= UPDATE_INTERVAL:
                        pushed = now
                        self.view.tokens = list(tokens)
        except Exception as exc:  # shown in the view, never raised in the kernel
            self.view.error = f"{type(exc).__name__}: {exc}"
        finally:
            with self._lock:
                self._tokens = list(tokens)
            self.view.tokens = list(tokens)
            if self.view.selected >= len(tokens):
                self.view.selected = -1
            try:
                self._show_figures()
            except Exception as exc:  # noqa: BLE001 - a plotting problem must not hide tokens
                self.view.error = f"figure: {type(exc).__name__}: {exc}"
            if self.view.error == BUSY_NOTICE:  # a choice refused while this ran: over now
                self.view.error = ""
            self.view.running = False

    def _show_figures(self) -> None:
        """Replace the Output's content by PNGs of the entropy and distribution figures."""
        tokens = self.tokens
        if not tokens:
            self.output.outputs = ()
            return
        index = self.view.selected if 0 <= self.view.selected < len(tokens) else 0
        figures = [self.entropy_figure(), self.distribution_figure(index)]
        self.output.outputs = tuple(png_output(fig) for fig in figures)

    def _on_selected(self, change: dict) -> None:
        if not self.view.running:
            try:
                self._show_figures()
            except Exception as exc:  # noqa: BLE001
                self.view.error = f"figure: {type(exc).__name__}: {exc}"

    def _on_frontend_msg(self, widget: Any, content: Any, buffers: Any) -> None:
        """Actions from the browser: {"type": "choose", "index": i, "token_id": id}."""
        if not isinstance(content, dict) or content.get("type") != "choose":
            return
        if self.running:
            self.view.error = BUSY_NOTICE
            return
        try:
            self.choose(int(content["index"]), int(content["token_id"]))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            self.view.error = f"{type(exc).__name__}: {exc}"


def _comparison_html(index: int, rows: list[dict[str, Any]]) -> str:
    import html

    body = "".join(
        f"<tr><td><code>{html.escape(repr(r['token']))}</code></td>"
        f"<td>{html.escape(r['text'])}</td><td>{r['perplexity']:.2f}</td></tr>" for r in rows)
    return (f"<table class='wb-branches'><caption>alternatives at token {index}, "
            f"continued greedily (lowest perplexity first)</caption><tr><th>token</th>"
            f"<th>continuation</th><th>perplexity</th></tr>{body}</table>")
