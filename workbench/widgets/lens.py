"""`LensCell`: the logit lens and the attention weights of one prompt, in the notebook.

    cell = LensCell(m, "The capital of France is")
    cell                      # a grid of layers x tokens; an Attention tab beside it
    cell.wait()
    cell.trace.top_tokens(-1)  # the `workbench.engine.models.trace.Trace` behind it
    cell.select(20, 5)        # open layer 20's distribution at position 5 beside the final one
    cell.lens_figure()        # the grid as a matplotlib figure
    cell.attention_figure(3, 0)

The grid shows, for each traced layer (the last at the top) and each position, the
lens's most likely next token, coloured by its probability or by the entropy of the
distribution; hovering shows the top 5 and clicking opens that position's distribution at
that layer beside the final layer's. The Attention tab shows one layer and head as a
heatmap (query rows, key columns) and, for a chosen token, lines to the tokens it attends
to, as thick as the weight. The trace runs on a worker thread (`LLM.trace`, the host
forward pass); a model without one (a `RemoteEngine`) gets a message instead.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anywidget
import numpy as np
import traitlets
from matplotlib.figure import Figure

from workbench.widgets.figures import literal
from workbench.widgets.worker import Worker

if TYPE_CHECKING:
    from workbench.engine.models.trace import Trace

STATIC = Path(__file__).parent / "static"
LN2 = math.log(2.0)
COLOR_MODES = ("probability", "entropy")
TABS = ("lens", "attention")
HOVER_K = 5  # alternatives the grid's popup shows
NEEDS_LOCAL = ("The logit lens and the attention views run the model's own forward pass: "
               "they need a local model (workbench.LLM); {name} only sends text to a server.")


class LensCell(Worker, anywidget.AnyWidget):
    """Logit lens grid and attention views of `prompt` (text, token ids or chat messages)
    through `model` (an `LLM`).

    `layers`, `attention`, `heads` and `top_k` go to `LLM.trace` (the last layer is always
    traced: the detail view compares with it); `max_bytes` bounds the trace's memory.
    Synced traits (what `static/lens.js` draws): `tokens`, `layers`, `grid` (per traced
    layer, per position: the top token `t`, its probability `p`, the entropy `h` in bits and
    the `top` list of [text, probability]), `color_by`, `tab`, `selected` ([layer, position]
    or []), `attention_layers`, `heads`, `attention_data` (bytes: uint8 weights x 255,
    (layers, heads, T, T) in that order), `attn_layer`, `attn_head`, `attn_token`,
    `kv_group` (query heads per KV head), `windows` (each attention layer's sliding
    window, 0 for none), `running`, `error`, `status`.
    """

    _esm = STATIC / "lens.js"
    _css = STATIC / "lens.css"

    tokens = traitlets.List(traitlets.Unicode()).tag(sync=True)
    layers = traitlets.List(traitlets.Int()).tag(sync=True)
    grid = traitlets.List().tag(sync=True)
    color_by = traitlets.Enum(COLOR_MODES, default_value="probability").tag(sync=True)
    tab = traitlets.Enum(TABS, default_value="lens").tag(sync=True)
    selected = traitlets.List(traitlets.Int()).tag(sync=True)
    attention_layers = traitlets.List(traitlets.Int()).tag(sync=True)
    heads = traitlets.List(traitlets.Int()).tag(sync=True)
    attention_data = traitlets.Bytes(b"").tag(sync=True)
    attn_layer = traitlets.Int(-1).tag(sync=True)
    attn_head = traitlets.Int(0).tag(sync=True)
    attn_token = traitlets.Int(-1).tag(sync=True)
    kv_group = traitlets.Int(1).tag(sync=True)  # query heads per KV head (grouped-query)
    windows = traitlets.List(traitlets.Int()).tag(sync=True)  # per attention layer, 0: none
    running = traitlets.Bool(False).tag(sync=True)
    error = traitlets.Unicode("").tag(sync=True)
    status = traitlets.Unicode("").tag(sync=True)

    def __init__(self, model: Any, prompt: Any = "The capital of France is", *,
                 layers: Any = None, attention: Any = True, heads: Any = None,
                 top_k: int = 10, color_by: str = "probability", max_bytes: int | None = None,
                 autorun: bool = True):
        if color_by not in COLOR_MODES:
            raise ValueError(f"color_by must be one of {COLOR_MODES}, got {color_by!r}")
        if int(top_k) < 1:
            raise ValueError("top_k must be >= 1")
        super().__init__(color_by=color_by)
        self.model = model
        self.prompt = prompt
        self.options = dict(layers=layers, attention=attention, heads=heads,
                            top_k=max(int(top_k), HOVER_K), max_bytes=max_bytes)
        self.trace: Trace | None = None
        self._thread: threading.Thread | None = None
        if not callable(getattr(model, "trace", None)):
            self.error = NEEDS_LOCAL.format(name=type(model).__name__)
            return
        if autorun:
            self.run()

    # -- public API --------------------------------------------------------------------------
    def run(self, prompt: Any = None) -> threading.Thread | None:
        """Trace the prompt (optionally a new one) on a worker thread; returns it."""
        if not callable(getattr(self.model, "trace", None)):
            return None
        self.wait()
        if prompt is not None:
            self.prompt = prompt
        self.error = ""
        self.running = True
        self.status = "tracing\u2026"
        thread = threading.Thread(target=self._run, name="workbench-lens", daemon=True)
        self._thread = thread
        thread.start()
        return thread

    def select(self, layer: int, position: int) -> None:
        """Open the distribution at `layer` (a layer number; negative from the end) and
        `position` beside the final layer's, as a click on the grid does."""
        trace = self._require_trace()
        layer = trace.layers[trace.index(layer)]
        if not 0 <= position < trace.n_tokens:
            raise IndexError(f"position {position} outside the prompt's {trace.n_tokens} tokens")
        self.selected = [layer, int(position)]

    def detail(self) -> dict[str, Any] | None:
        """What the open detail shows: {"layer", "position", "at_layer": [(text, prob)...],
        "final": [(text, prob)...]}, or None when nothing is selected."""
        if len(self.selected) != 2 or self.trace is None:
            return None
        layer, position = self.selected
        rows = self.trace.top_tokens(layer)
        final = self.trace.top_tokens(-1)
        return {"layer": layer, "position": position, "at_layer": rows[position],
                "final": final[position]}

    def lens_figure(self, max_tokens: int = 24) -> Figure:
        """The grid as a figure: the lens's top token at each layer (rows, the last at the
        top) and position, coloured by its probability (the last `max_tokens` positions)."""
        trace = self._require_trace()
        T = trace.n_tokens
        cols = list(range(max(0, T - max_tokens), T))
        probs = trace.top_probs[:, cols, 0]  # (L, cols)
        fig = Figure(figsize=(1.0 + 0.62 * len(cols), 0.9 + 0.24 * len(trace.layers)),
                     layout="constrained")
        ax = fig.add_subplot()
        ax.imshow(probs, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto", origin="lower")
        for i in range(len(trace.layers)):
            for j, pos in enumerate(cols):
                text = trace._text(int(trace.top_ids[i, pos, 0]))
                ax.text(j, i, literal(_short(text)), ha="center", va="center", fontsize=6)
        ax.set_yticks(range(len(trace.layers)), [str(n) for n in trace.layers], fontsize=6)
        ax.set_xticks(range(len(cols)), [literal(_short(trace.tokens[p])) for p in cols],
                      rotation=60, fontsize=7)
        ax.set_ylabel("layer")
        ax.set_title("Logit lens: the top next token after each layer (colour: probability)")
        return fig

    def attention_figure(self, layer: int, head: int) -> Figure:
        """The attention weights of `layer` and `head` as a heatmap (query rows, key
        columns), the tokens on both axes."""
        trace = self._require_trace()
        n = trace.layer_number(layer)
        if n not in trace.attention:
            raise IndexError(f"layer {n} has no attention recorded "
                             f"(recorded: {sorted(trace.attention)})")
        if head not in trace.heads:
            raise IndexError(f"head {head} was not kept (kept: {list(trace.heads)})")
        w = trace.attention[n][trace.heads.index(head)]
        labels = [literal(_short(t)) for t in trace.tokens]
        size = 1.5 + 0.28 * len(labels)
        fig = Figure(figsize=(size + 1.0, size), layout="constrained")
        ax = fig.add_subplot()
        im = ax.imshow(w, cmap="Blues", vmin=0, vmax=1)
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_xlabel("attends to (key)")
        ax.set_ylabel("token (query)")
        window = trace.windows.get(n, 0)
        ax.set_title(f"Layer {n}, head {head} (KV head {trace.kv_head(head)})"
                     + (f", window {window}" if window else ""))
        fig.colorbar(im, ax=ax, shrink=0.8, label="weight")
        return fig

    # -- internals ---------------------------------------------------------------------------
    def _require_trace(self) -> Trace:
        self.wait()
        if self.trace is None:
            raise RuntimeError(self.error or "nothing traced yet: call run()")
        return self.trace

    def _run(self) -> None:
        try:
            opts = dict(self.options)
            n_layer = self.model.config.n_layer
            layers = opts.pop("layers")
            if layers is not None:  # the last layer always: the detail compares with it
                layers = sorted({*(int(x) % n_layer for x in np.atleast_1d(layers)),
                                 n_layer - 1})
            trace = self.model.trace(self.prompt, layers=layers, **opts)
            self._publish(trace)
        except Exception as exc:  # shown in the cell, never raised in the kernel
            self.error = f"{type(exc).__name__}: {exc}"
            self.status = ""
        finally:
            self.running = False

    def _publish(self, trace: Trace) -> None:
        grid = []
        for i in range(len(trace.layers)):
            row = []
            for pos in range(trace.n_tokens):
                ids, probs = trace.top_ids[i, pos], trace.top_probs[i, pos]
                top = [[trace._text(int(t)), round(float(p), 5)] for t, p in zip(ids, probs)]
                row.append({"t": top[0][0], "p": top[0][1],
                            "h": round(float(trace.entropy[i, pos]) / LN2, 4), "top": top})
            grid.append(row)
        attn_layers = sorted(trace.attention)
        if attn_layers:
            stack = np.stack([trace.attention[n] for n in attn_layers])  # (A, H, T, T)
            data = np.rint(np.clip(stack, 0, 1) * 255).astype(np.uint8).tobytes()
        else:
            data = b""
        self.trace = trace
        with self.hold_sync():
            self.tokens = list(trace.tokens)
            self.layers = list(trace.layers)
            self.grid = grid
            self.attention_layers = attn_layers
            self.heads = list(trace.heads)
            self.attention_data = data
            self.attn_layer = attn_layers[-1] if attn_layers else -1
            self.attn_head = trace.heads[0] if trace.heads else 0
            self.attn_token = trace.n_tokens - 1
            self.kv_group = trace.n_head // trace.n_head_kv
            self.windows = [int(trace.windows.get(n, 0)) for n in attn_layers]
            self.selected = []
            self.status = (f"{trace.n_tokens} tokens, {len(trace.layers)} layers, "
                           f"{len(attn_layers)} with attention ({trace.nbytes / 2**20:.1f} MB)")


def _short(text: str, n: int = 8) -> str:
    text = text.replace("\n", "\u21b5").replace("\t", "\u21e5") or "\u2205"
    text = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)  # no glyph
    return text if len(text) <= n else text[: n - 1] + "\u2026"
