"""SimilarityCell driven from Python (no browser), with the real MiniLM encoder and SmolLM2."""

from __future__ import annotations

import base64
from io import BytesIO

import numpy as np
import pytest

from workbench.widgets import SimilarityCell
from workbench.widgets.similarity import EXAMPLE_SENTENCES

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.",
             "A man is riding a horse.", "A monkey is playing drums.",
             "Someone in a gorilla costume is playing a set of drums."]


@pytest.mark.slow
def test_matrix_equals_the_encoders_similarities(minilm):
    cell = SimilarityCell(minilm, SENTENCES)
    assert cell.wait(timeout=120)
    assert cell.sentences == SENTENCES
    expected = minilm.similarity(SENTENCES, SENTENCES)
    np.testing.assert_allclose(cell.matrix, expected, atol=1e-5)
    np.testing.assert_allclose(np.diag(cell.matrix), 1.0, atol=1e-5)
    assert "5 sentences embedded" in cell.status.value
    # the heatmap is a real PNG in the Output widget
    (out,) = cell.output.outputs
    png = base64.b64decode(out["data"]["image/png"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    width, height = Image.open(BytesIO(png)).size
    assert width > 300 and height > 300
    # the neighbour table pairs each sentence with its nearest other sentence
    assert "nearest neighbour of each sentence" in cell.results.value
    cell.close()


@pytest.mark.slow
def test_search_and_neighbours_rank_by_meaning(minilm):
    cell = SimilarityCell(minilm, SENTENCES, k=2)
    cell.wait(timeout=120)
    hits = cell.search("Someone is having a meal.")
    assert [s for s, _ in hits] == SENTENCES[:2]
    assert hits[0][1] >= hits[1][1]
    assert "Someone is having a meal." in cell.results.value
    assert cell.neighbours(3, k=1)[0][0] == SENTENCES[4]  # the two drummers
    assert all(s != SENTENCES[3] for s, _ in cell.neighbours(3, k=4))  # never itself
    with pytest.raises(IndexError):
        cell.neighbours(10)
    cell.close()


@pytest.mark.slow
def test_editor_and_buttons_rerun(minilm):
    cell = SimilarityCell(minilm, autorun=False)
    assert cell.sentences == EXAMPLE_SENTENCES and len(cell.embeddings) == 0
    cell.editor.value = "first line\n\n  second line  \nthird"
    cell.embed_button.click()
    cell.wait(timeout=120)
    assert cell.sentences == ["first line", "second line", "third"]
    assert cell.matrix.shape == (3, 3)
    cell.query.value = "line"
    cell.search_button.click()
    assert "cosine" in cell.results.value
    cell.close()


@pytest.mark.slow
def test_busy_badge_follows_the_encoder(minilm):
    seen = []
    unsubscribe = minilm.busy.subscribe(seen.append)
    cell = SimilarityCell(minilm, SENTENCES)
    cell.wait(timeout=120)
    unsubscribe()
    assert True in seen and minilm.busy.get() is False
    assert cell.badge.busy is False
    cell.close()


@pytest.mark.slow
def test_works_with_an_llm_too(smollm2):
    cell = SimilarityCell(smollm2, SENTENCES[:3])
    cell.wait(timeout=120)
    assert cell.matrix.shape == (3, 3)
    np.testing.assert_allclose(cell.embeddings[1], smollm2.embed(SENTENCES[1]), atol=1e-5)
    cell.close()


def test_errors_show_in_the_cell():
    from workbench.signals import Signal

    class Broken:
        busy = Signal(False)
        device = Signal("cpu")

        def embed_batch(self, texts):
            raise RuntimeError("<b>no</b> weights")

    cell = SimilarityCell(Broken(), ["a", "b"])
    cell.wait(timeout=10)
    assert "RuntimeError" in cell.status.value and "&lt;b&gt;no&lt;/b&gt;" in cell.status.value
    with pytest.raises(RuntimeError, match="no sentences are embedded"):
        cell.search("x")
    with pytest.raises(TypeError, match="cannot embed"):
        SimilarityCell(object())
    with pytest.raises(TypeError, match="list of strings"):
        SimilarityCell(Broken(), "one string", autorun=False)
    cell.close()


def test_dollar_signs_are_drawn_as_written():
    """Sentences (and tokens) are labels matplotlib would read as math between two `$`:
    "$$5" raised a ParseException that replaced the heatmap and the neighbour table with
    an error, "$5 or $6" came out in math italics. They are drawn as written now; one
    sentence shows no neighbour table, and what is not a string is refused up front."""
    from workbench.signals import Signal

    class Fake:
        busy = Signal(False)
        device = Signal("cpu")

        def embed_batch(self, texts):
            return np.random.default_rng(0).standard_normal((len(texts), 8))

    sentences = ["It costs $$5", "$5 or $6", "cheap"]
    cell = SimilarityCell(Fake(), sentences)
    cell.wait(timeout=30)
    assert "3 sentences embedded" in cell.status.value
    assert "nearest neighbour" in cell.results.value and len(cell.output.outputs) == 1
    fig = cell.heatmap_figure()
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == [s.replace("$", r"\$") for s in sentences]  # mathtext's literal "$"
    fig.savefig(BytesIO(), format="png")
    with pytest.raises(ValueError, match="k must be >= 1"):
        cell.search("x", k=0)
    cell.close()
    one = SimilarityCell(Fake(), ["alone"])
    one.wait(timeout=30)
    assert one.results.value == ""
    one.close()
    with pytest.raises(TypeError, match="strings, not int"):
        SimilarityCell(Fake(), ["a", 3], autorun=False)

