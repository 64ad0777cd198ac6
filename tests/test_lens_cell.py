"""`LensCell` driven from Python (no browser): the traits static/lens.js draws, the
selection and detail, the figures, and the message a model without a forward pass gets."""

from __future__ import annotations

from io import BytesIO

import numpy as np
import pytest
import traitlets

from tests.goldens import load
from tests.goldens.make_trace import trace_name
from tests.support.devices import DEVICES, open_llm
from workbench.widgets import LensCell
from workbench.widgets.lens import STATIC

MODEL = "tiny-family-gemma3"  # 6 layers, 4 heads over 2 KV heads, sliding windows of 8


@pytest.fixture(scope="module")
def tiny():
    from workbench import LLM

    with LLM.load(load(MODEL).file("model.gguf"), kv_cache_size=64,
                  prepare_kernels=False) as m:
        yield m


@pytest.fixture(scope="module")
def prompt():
    return load(trace_name(MODEL)).inputs["prompt"]


def test_static_assets_are_local_and_define_the_classes():
    js, css = (STATIC / "lens.js").read_text(), (STATIC / "lens.css").read_text()
    assert "http://" not in js and "https://" not in js  # works offline
    for cls in ("wb-lens-cell", "wb-lens-popup", "wb-lens-detail", "wb-lens-tab",
                "wb-attn-heatmap", "wb-attn-line", "wb-attn-layer", "wb-attn-head"):
        assert cls in js and f".{cls}" in css, cls


def test_the_cell_shows_the_trace(tiny, prompt):
    cell = LensCell(tiny, prompt, top_k=6)
    assert cell.wait(timeout=60) and cell.error == "", cell.error
    trace = cell.trace
    T = len(prompt)
    assert cell.tokens == trace.tokens and len(cell.tokens) == T
    assert cell.layers == list(range(6)) and len(cell.grid) == 6
    assert all(len(row) == T for row in cell.grid)
    c = cell.grid[3][7]
    assert c["t"] == trace.top_tokens(3)[7][0][0] and len(c["top"]) == 6
    assert c["p"] == pytest.approx(float(trace.top_probs[3, 7, 0]), abs=1e-5)
    assert c["h"] == pytest.approx(float(trace.entropy[3, 7]) / np.log(2), abs=1e-3)
    # attention: uint8 weights x 255, (layers, heads, T, T)
    assert cell.attention_layers == list(range(6)) and cell.heads == [0, 1, 2, 3]
    data = np.frombuffer(cell.attention_data, np.uint8).reshape(6, 4, T, T)
    assert np.abs(data / 255.0 - np.stack([trace.attention[i] for i in range(6)])).max() \
        <= 0.5 / 255 + 1e-6
    assert cell.attn_layer == 5 and cell.attn_head == 0 and cell.attn_token == T - 1
    assert cell.kv_group == 2 and cell.windows == [8, 8, 8, 8, 8, 0]  # 5 local layers, 1 global
    assert "24 tokens, 6 layers, 6 with attention" in cell.status
    assert not cell.running


def test_selecting_a_cell_opens_its_distribution_beside_the_final_one(tiny, prompt):
    cell = LensCell(tiny, prompt, layers=[1, 2])
    cell.wait(timeout=60)
    assert cell.layers == [1, 2, 5]  # the last layer always: the detail compares with it
    assert cell.detail() is None
    cell.select(2, 4)
    assert cell.selected == [2, 4]
    d = cell.detail()
    assert d["layer"] == 2 and d["position"] == 4
    assert d["at_layer"] == cell.trace.top_tokens(2)[4]
    assert d["final"] == cell.trace.top_tokens(-1)[4]
    cell.selected = [5, 0]  # as a click in the browser sets it
    assert cell.detail()["final"] == cell.detail()["at_layer"]
    with pytest.raises(IndexError):
        cell.select(0, 1)  # layer 0 not traced
    with pytest.raises(IndexError):
        cell.select(1, len(prompt))
    cell.color_by = "entropy"
    cell.tab = "attention"
    with pytest.raises(traitlets.TraitError):
        cell.tab = "nothing"


def test_figures(tiny, prompt):
    cell = LensCell(tiny, prompt, attention=[5], heads=[1, 2])
    cell.wait(timeout=60)
    assert cell.attention_layers == [5] and cell.heads == [1, 2]
    fig = cell.lens_figure()
    assert len(fig.axes[0].texts) == 6 * len(prompt)
    fig.savefig(BytesIO(), format="png")
    fig = cell.attention_figure(5, 2)
    assert "Layer 5, head 2 (KV head 1)" in fig.axes[0].get_title()
    fig.savefig(BytesIO(), format="png")
    with pytest.raises(IndexError, match="no attention"):
        cell.attention_figure(4, 1)
    with pytest.raises(IndexError, match="not kept"):
        cell.attention_figure(5, 0)


def test_a_refused_trace_is_shown_in_the_cell(tiny, prompt):
    cell = LensCell(tiny, prompt, max_bytes=1000)
    cell.wait(timeout=60)
    assert cell.error.startswith("TraceTooLargeError: this trace would need")
    assert cell.trace is None and cell.grid == [] and not cell.running
    with pytest.raises(RuntimeError, match="would need"):
        cell.lens_figure()


def test_a_remote_model_gets_told_it_needs_a_local_one():
    from workbench.server.remote import RemoteEngine

    remote = RemoteEngine("http://127.0.0.1:9/v1", "some-model")
    cell = LensCell(remote, "hello")
    assert "need a local model" in cell.error and "RemoteEngine" in cell.error
    assert cell.run() is None and cell.trace is None
    with pytest.raises(ValueError):
        LensCell(remote, color_by="rainbow")


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "cpu"])
def test_the_cell_on_another_backend(device, prompt):
    """The cell traces the host path whatever the model's device: the same grid."""
    from workbench import LLM

    path = load(MODEL).file("model.gguf")
    with LLM.load(path, kv_cache_size=64, prepare_kernels=False) as cpu_model:
        ref = LensCell(cpu_model, prompt, layers=[2], attention=[2])
        ref.wait(timeout=60)
    with open_llm(path, device, kv_cache_size=64) as m:
        cell = LensCell(m, prompt, layers=[2], attention=[2])
        assert cell.wait(timeout=60) and cell.error == "", cell.error
        assert [[c["t"] for c in row] for row in cell.grid] == \
            [[c["t"] for c in row] for row in ref.grid]
        a = np.frombuffer(cell.attention_data, np.uint8).astype(int)
        assert np.abs(a - np.frombuffer(ref.attention_data, np.uint8)).max() <= 1
