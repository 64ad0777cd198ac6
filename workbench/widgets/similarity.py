"""`SimilarityCell`: sentences in, a cosine-similarity heatmap and nearest neighbours out.

    cell = SimilarityCell(enc, ["A man is eating food.", "A man is riding a horse.", ...])
    cell                          # editor, heatmap, search box and results
    cell.wait()
    cell.matrix                   # (n, n) cosine similarities
    cell.search("someone has a meal", k=3)   # [(sentence, score), ...], best first
    cell.neighbours(0, k=2)       # the 2 sentences closest to sentence 0

`model` is anything with `embed_batch` and a `busy` signal: an `Encoder`, or
an `LLM` (last-hidden-state embeddings). Embedding runs on a worker thread; the
heatmap is drawn with matplotlib and shown as a PNG in an `Output` widget.
"""

from __future__ import annotations

import html
import threading
import time
from collections.abc import Sequence

import ipywidgets
import numpy as np
from matplotlib.figure import Figure

from workbench.engine.encoder import Embedder, cosine_similarity
from workbench.widgets.badges import BusyBadge
from workbench.widgets.figures import literal, png_output
from workbench.widgets.worker import Worker

EXAMPLE_SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing the violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
]


class SimilarityCell(Worker, ipywidgets.VBox):
    """Embed a list of sentences; show their cosine similarities and search among them.

    Children: a status line with a busy badge (`.badge`, `.status`), the sentence
    editor (`.editor`, one sentence per line) with an Embed button
    (`.embed_button`), the heatmap (`.output`), a query box (`.query`) with a
    Search button (`.search_button`) and the results table (`.results`).
    """

    def __init__(self, model: Embedder, sentences: Sequence[str] | None = None, *,
                 k: int = 3, autorun: bool = True):
        if not hasattr(model, "embed_batch"):
            raise TypeError(f"{type(model).__name__} cannot embed text (no embed_batch)")
        if k < 1:
            raise ValueError("k must be >= 1")
        self.model = model
        self.k = int(k)
        self._sentences: list[str] = _clean(EXAMPLE_SENTENCES if sentences is None
                                            else sentences)
        self._embeddings = np.zeros((0, 0), np.float32)
        self._lock = threading.Lock()
        self.badge = BusyBadge(model)
        self.status = ipywidgets.HTML("")
        self.editor = ipywidgets.Textarea("\n".join(self._sentences),
                                          placeholder="one sentence per line",
                                          layout=ipywidgets.Layout(width="100%", height="9em"))
        self.embed_button = ipywidgets.Button(description="Embed", icon="th")
        self.output = ipywidgets.Output()
        self.query = ipywidgets.Text(placeholder="search the sentences by meaning",
                                     continuous_update=False,  # a change is Enter or blur
                                     layout=ipywidgets.Layout(width="60%"))
        self.search_button = ipywidgets.Button(description="Search", icon="search")
        self.results = ipywidgets.HTML("")
        self.embed_button.on_click(lambda _: self.run(self.editor.value.split("\n")))
        self.search_button.on_click(lambda _: self._search_clicked())
        self.query.observe(lambda _: self._search_clicked(), names="value")
        super().__init__(children=[
            ipywidgets.HBox([self.badge, self.status]),
            self.editor, self.embed_button, self.output,
            ipywidgets.HBox([self.query, self.search_button]), self.results,
        ])
        self.add_class("wb-similarity")
        if autorun:
            self.run()

    # -- public API --------------------------------------------------------------------------
    @property
    def sentences(self) -> list[str]:
        """The sentences embedded by the last run."""
        with self._lock:
            return list(self._sentences)

    @property
    def embeddings(self) -> np.ndarray:
        """Their vectors, (n, dim) float32 (empty before the first run finishes)."""
        with self._lock:
            return self._embeddings.copy()

    @property
    def matrix(self) -> np.ndarray:
        """Cosine similarity of every pair of sentences, (n, n)."""
        vectors = self.embeddings
        if not len(vectors):
            return np.zeros((0, 0), np.float32)
        return cosine_similarity(vectors, vectors)

    @property
    def running(self) -> bool:
        """True while sentences are being embedded."""
        return self._thread is not None and self._thread.is_alive()

    def run(self, sentences: Sequence[str] | None = None) -> threading.Thread:
        """Embed `sentences` (or the current ones) on a worker thread, then redraw.

        Empty lines are dropped. Waits for a run in progress first.
        """
        self.wait()
        if sentences is not None:
            cleaned = _clean(sentences)
            with self._lock:
                self._sentences = cleaned
            self.editor.value = "\n".join(cleaned)
        self.status.value = "embedding ..."
        self._thread = threading.Thread(target=self._embed, name="workbench-similarity",
                                        daemon=True)
        self._thread.start()
        return self._thread

    def search(self, query: str, k: int | None = None) -> list[tuple[str, float]]:
        """The `k` sentences closest in meaning to `query`: (sentence, cosine), best first.

        The results are shown in the cell's table as well.
        """
        self.wait()
        k = self.k if k is None else int(k)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        vectors = self.embeddings
        if not len(vectors):
            raise RuntimeError("no sentences are embedded yet")
        q = np.asarray(self.model.embed_batch([query]))[0]
        scores = cosine_similarity(q, vectors)[0]
        hits = self._top(scores, k)
        self.results.value = _table(f"nearest to {query!r}", hits)
        return hits

    def neighbours(self, index: int, k: int | None = None) -> list[tuple[str, float]]:
        """The `k` sentences closest to sentence `index` (itself excluded), best first."""
        sims = self.matrix
        if not 0 <= index < len(sims):
            raise IndexError(f"sentence index {index} out of range (0..{len(sims) - 1})")
        scores = sims[index].copy()
        scores[index] = -np.inf
        return self._top(scores, self.k if k is None else int(k))

    def heatmap_figure(self) -> Figure:
        """The similarity matrix as a heatmap, sentences labelled on both axes."""
        sims = self.matrix
        labels = [literal(_short(s)) for s in self.sentences]
        n = len(labels)
        size = 2.5 + 0.45 * n
        fig = Figure(figsize=(size + 2.5, size), layout="constrained")
        ax = fig.add_subplot()
        image = ax.imshow(sims, cmap="viridis", vmin=min(0.0, float(sims.min(initial=0))),
                          vmax=1.0)
        ax.set_xticks(range(n), labels, rotation=60, ha="right", fontsize="small")
        ax.set_yticks(range(n), labels, fontsize="small")
        for i in range(n):
            for j in range(n):
                ax.text(j, i, f"{sims[i, j]:.2f}", ha="center", va="center", fontsize="x-small",
                        color="black" if sims[i, j] > 0.6 else "white")
        ax.set_title("Cosine similarity")
        fig.colorbar(image, ax=ax, shrink=0.8)
        return fig

    def close(self) -> None:
        """Wait for the worker and close the widgets."""
        self.wait()
        badge = getattr(self, "badge", None)  # absent when __init__ refused its arguments
        if badge is not None:
            badge.close()
        super().close()

    # -- internals ---------------------------------------------------------------------------
    def _top(self, scores: np.ndarray, k: int) -> list[tuple[str, float]]:
        sentences = self.sentences
        order = np.argsort(-scores, kind="stable")
        return [(sentences[i], float(scores[i])) for i in order[:k] if np.isfinite(scores[i])]

    def _embed(self) -> None:
        """Worker: embed the sentences, then draw the heatmap and the neighbour table."""
        sentences = self.sentences
        try:
            start = time.perf_counter()
            vectors = (np.asarray(self.model.embed_batch(sentences), dtype=np.float32)
                       if sentences else np.zeros((0, 0), np.float32))
            seconds = time.perf_counter() - start
            with self._lock:
                self._embeddings = vectors
            if sentences:
                self.output.outputs = (png_output(self.heatmap_figure()),)
                rows = [(s, self.neighbours(i, 1)[0]) for i, s in enumerate(sentences)
                        if len(sentences) > 1]
                self.results.value = _neighbour_table(rows) if rows else ""
            else:
                self.output.outputs = ()
                self.results.value = ""
            self.status.value = (f"{len(sentences)} sentences embedded in {seconds:.2f} s"
                                 + (f" ({len(sentences) / seconds:.0f}/s)" if seconds else ""))
        except Exception as exc:  # shown in the cell, never raised in the kernel
            self.status.value = (f'<span class="wb-error">{html.escape(type(exc).__name__)}: '
                                 f"{html.escape(str(exc))}</span>")

    def _search_clicked(self) -> None:
        query = self.query.value.strip()
        if not query:
            return
        try:
            self.search(query)
        except Exception as exc:  # noqa: BLE001 - shown in the cell
            self.results.value = (f'<span class="wb-error">{html.escape(type(exc).__name__)}: '
                                  f"{html.escape(str(exc))}</span>")


def _clean(sentences: Sequence[str]) -> list[str]:
    if isinstance(sentences, str):
        raise TypeError("sentences must be a list of strings")
    sentences = list(sentences)
    other = next((s for s in sentences if not isinstance(s, str)), None)
    if other is not None:
        raise TypeError(f"sentences must be strings, not {type(other).__name__}")
    return [s.strip() for s in sentences if s.strip()]


def _short(text: str, width: int = 40) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _table(title: str, hits: list[tuple[str, float]]) -> str:
    rows = "".join(f"<tr><td>{score:.3f}</td><td>{html.escape(s)}</td></tr>" for s, score in hits)
    return (f'<table class="wb-neighbours"><caption>{html.escape(title)}</caption>'
            f"<tr><th>cosine</th><th>sentence</th></tr>{rows}</table>")


def _neighbour_table(rows: list[tuple[str, tuple[str, float]]]) -> str:
    body = "".join(f"<tr><td>{html.escape(s)}</td><td>{html.escape(n)}</td>"
                   f"<td>{score:.3f}</td></tr>" for s, (n, score) in rows)
    return ('<table class="wb-neighbours"><caption>nearest neighbour of each sentence'
            "</caption><tr><th>sentence</th><th>nearest</th><th>cosine</th></tr>"
            f"{body}</table>")
