"""`LLM.trace`: the residual stream, the logit lens and the attention weights.

- test_trace_equals_transformers: on the tiny random-weight models of every family the
  tiny-model tests cover (tests/test_tiny_models.py, tests/test_tiny_families.py), fp32,
  against transformers' `output_hidden_states` / `output_attentions` and its final norm
  and head applied to each layer's output (the goldens `trace-*`, tests/goldens/make_trace.py):
  residuals and lens logits to 1e-4 of their largest magnitude (the tiny-model metric),
  attention weights to 1e-5 absolute with exact zeros where the model does not look
  (causal, sliding windows), the lens's top ids, probabilities and entropy from its logits.
- test_trace_on_every_device: the host path runs whatever the `LLM`'s device (MLX, the
  CuPy backend's code on NumPy): the same trace as on the CPU.
- test_smollm2_final_lens_is_its_logits: SmolLM2 (Q4_1): the last layer's lens equals
  `LLM.forward`'s logits bit for bit, and the fp32 transformers arbiter
  (`fp32-arbiter-smollm2`) to 1e-4 of its scale.
- test_refused_for_size / test_512_tokens_with_attention_for_2_layers: the bound.
- test_trace_speed: prints a 64-token trace (all layers, attention) against a plain
  64-token prefill; no timed assertion.
"""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest

from tests.goldens import load
from tests.goldens.make_trace import model_goldens, prompt_of, trace_name
from tests.support.devices import DEVICES, open_llm


def _close(ours: np.ndarray, ref: np.ndarray, what: str, rtol: float = 1e-4) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape}, expected {ref.shape}"
    err = float(np.max(np.abs(ours.astype(np.float64) - ref)))
    scale = float(np.max(np.abs(ref)))
    assert err <= rtol * scale, f"{what}: max |ours - ref| = {err:.3e} > {rtol} * {scale:.3f}"


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _entropy(p: np.ndarray) -> np.ndarray:
    return -(p * np.log(np.maximum(p, 1e-300))).sum(axis=-1)


def _hidden_keys(T: int, window: int) -> np.ndarray:
    """(T, T) True where query t may not see key s."""
    s, t = np.arange(T)[None, :], np.arange(T)[:, None]
    hidden = s > t
    return hidden | (s <= t - window) if window else hidden


def _open(name: str, device: str = "cpu"):
    # LongRoPE: a context no longer than the original one picks the short factors, as a
    # fresh transformers model does on a short prompt
    size = 64 if name.endswith("longrope") else 128
    return open_llm(load(name).file("model.gguf"), device, kv_cache_size=size,
                    prepare_kernels=False)


def _check_against(trace, golden, name: str) -> None:
    a = golden.arrays
    n_layer = a["attentions"].shape[0]
    assert trace.layers == tuple(range(n_layer))
    for i in range(n_layer):
        ref = a["last_residual"] if i == n_layer - 1 else a["hidden_states"][i + 1]
        _close(trace.residual[i], ref, f"{name}: residual after layer {i}")
        _close(trace.lens_logits(i), a["lens_logits"][i], f"{name}: lens logits at layer {i}")
        # the lens's top ids, probabilities and entropy are those of its own logits ...
        mine = _softmax(trace.lens_logits(i))
        k = trace.top_ids.shape[2]
        top = np.take_along_axis(mine, trace.top_ids[i].astype(np.int64), axis=1)
        order = np.argsort(-mine, axis=1, kind="stable")[:, :k]
        assert np.allclose(top, np.take_along_axis(mine, order, axis=1), atol=1e-7), \
            f"{name}: lens top ids at layer {i}"
        np.testing.assert_allclose(trace.top_probs[i], top, atol=2e-6,
                                   err_msg=f"{name}: lens probabilities at layer {i}")
        np.testing.assert_allclose(trace.entropy[i], _entropy(mine), atol=2e-5,
                                   err_msg=f"{name}: lens entropy at layer {i}")
        # ... and near transformers' (its logits within 1e-4 of their scale, above)
        probs = _softmax(a["lens_logits"][i])
        np.testing.assert_allclose(trace.top_probs[i], np.take_along_axis(
            probs, trace.top_ids[i].astype(np.int64), axis=1), atol=2e-5)
        np.testing.assert_allclose(trace.entropy[i], _entropy(probs), atol=1e-4)
        w, ref_w = trace.attention[i], a["attentions"][i]
        assert w.shape == ref_w.shape
        np.testing.assert_allclose(w, ref_w, atol=1e-5,
                                   err_msg=f"{name}: attention weights of layer {i}")
        hidden = _hidden_keys(w.shape[1], trace.windows[i])
        assert not w[:, hidden].any(), f"{name}: layer {i} attends where the model does not"
        assert np.allclose(w.sum(axis=2), 1.0, atol=1e-5)


@pytest.mark.parametrize("model", model_goldens())
def test_trace_equals_transformers(model):
    golden = load(trace_name(model))
    assert golden.inputs["prompt"] == prompt_of(model)
    with _open(model) as m:
        trace = m.trace(golden.inputs["prompt"], attention=True)
        _check_against(trace, golden, model)
        if m.config.sliding_window:  # the windows are the model's, on its local layers only
            assert trace.windows == {i: m.model.blocks[i].attn.window
                                     for i in range(m.config.n_layer)}
            assert any(trace.windows.values())


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "cpu"])
@pytest.mark.parametrize("model", ["tiny-llama-qwen3", "tiny-family-gemma3"])
def test_trace_on_every_device(model, device):
    golden = load(trace_name(model))
    with _open(model, device) as m:
        assert m.backend is not None
        trace = m.trace(golden.inputs["prompt"], attention=True)
        _check_against(trace, golden, f"{model} on {device}")
        from workbench.engine.models.trace import host_model

        assert host_model(m) is host_model(m)  # the host copy is built once


def test_choosing_layers_heads_and_messages():
    model = "tiny-family-gemma3"
    golden = load(trace_name(model))
    prompt = golden.inputs["prompt"]
    with _open(model) as m:
        t = m.trace(prompt, layers=[-1, 1], attention=[2], heads=[3, 1], top_k=3)
        assert t.layers == (1, 2, 5) and sorted(t.attention) == [2] and t.heads == (1, 3)
        assert t.residual.shape == (3, len(prompt), 64) and t.top_ids.shape == (3, len(prompt), 3)
        np.testing.assert_allclose(t.attention[2], golden.arrays["attentions"][2][[1, 3]],
                                   atol=1e-5)
        _close(t.residual[t.index(-1)], golden.arrays["last_residual"], "last residual")
        assert t.kv_head(3) == 1 and t.kv_head(1) == 0  # 4 query heads over 2 KV heads
        with pytest.raises(IndexError, match="not traced"):
            t.index(0)
        dist = t.distribution(5, 7)
        assert dist.shape == (m.config.n_vocab,) and abs(dist.sum() - 1) < 1e-9
        assert int(np.argmax(dist)) == int(t.top_ids[2, 7, 0])
        with pytest.raises(ValueError, match="layer 6"):
            m.trace(prompt, layers=[6])
        with pytest.raises(ValueError, match="heads"):
            m.trace(prompt, heads=[4])
        with pytest.raises(ValueError, match="at least one layer"):
            m.trace(prompt, layers=[])
        assert m.trace(prompt, layers=[0], attention=[]).attention == {}
        chat = m.trace([{"role": "user", "content": "hi"}], layers=[0])
        assert chat.ids == m._chat_ids([{"role": "user", "content": "hi"}], None)
        assert "".join(chat.tokens) == m.detokenize(chat.ids)



@pytest.mark.parametrize("rows", [16, 200])  # under and over the Numba kernels' row counts
def test_lens_runs_with_openblas_quiet(monkeypatch, rows):
    """Where NumPy came first (a notebook), OpenBLAS's workers spin after each call, and a
    Numba product right after one waits for them: the trace keeps OpenBLAS at one thread
    while it runs (a 64-token SmolLM2 trace took 2.8 s instead of 0.8 s), at any length,
    since its lens products are Numba's whatever the prompt's length."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from workbench.engine.models import trace as trace_module
    from workbench.engine.runtime import cores

    seen: list[list[int]] = []
    lens_rows = trace_module.lens_rows

    def recording(*args):
        seen.append([p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"])
        return lens_rows(*args)

    monkeypatch.setattr(cores, "_blas_spins", True)
    monkeypatch.setattr(trace_module, "lens_rows", recording)
    ids = [int(i) for i in np.random.default_rng(0).integers(3, 200, rows)]
    path = load("tiny-family-gemma3").file("model.gguf")
    with (threadpool_limits(limits=2, user_api="blas"),
          open_llm(path, "cpu", kv_cache_size=256, prepare_kernels=False) as m):
        m.trace(ids, layers=[0, -1])
        assert seen and all(threads and set(threads) == {1} for threads in seen), seen
        assert {p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"} == {2}
def test_lens_kernel_equals_float64_numpy():
    from workbench.kernels.lens import lens_rows

    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((7, 3001)) * rng.uniform(0.5, 12, (7, 1))).astype(np.float32)
    logits[3, 100:110] = logits[3].max() + 1.0  # ties: the lower id first
    k = 6
    ids, probs = np.empty((7, k), np.int32), np.empty((7, k), np.float32)
    entropy = np.empty(7, np.float32)
    lens_rows(logits, ids, probs, entropy)
    p = _softmax(logits)
    assert (ids == np.argsort(-logits, axis=1, kind="stable")[:, :k]).all()
    np.testing.assert_allclose(probs, np.take_along_axis(p, ids.astype(np.int64), 1), rtol=2e-6)
    np.testing.assert_allclose(entropy, -(p * np.log(p)).sum(axis=1), rtol=2e-6, atol=1e-6)


# -- SmolLM2 ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    from workbench import LLM

    arbiter = load("fp32-arbiter-smollm2")
    with LLM.load(arbiter.inputs["model"], kv_cache_size=1024) as m:
        assert m.file_sha256 == arbiter.inputs["model_sha256"]
        m.warmup.wait()
        yield m, arbiter


def test_smollm2_final_lens_is_its_logits(smollm2):
    m, arbiter = smollm2
    ids = arbiter.inputs["paths"][0]
    t = m.trace(ids, attention=True)
    final = t.lens_logits(-1)
    logits = m.forward(ids, m.new_cache())
    assert np.array_equal(final, logits)  # bit for bit
    assert (t.top_ids[-1][:, 0] == logits.argmax(axis=1)).all()
    np.testing.assert_allclose(t.top_probs[-1][:, 0], _softmax(logits).max(axis=1), rtol=1e-5)
    a, T = arbiter.arrays, len(ids)
    ref_ids = np.concatenate([a["top_ids"][:T], a["bottom_ids"][:T],
                              np.broadcast_to(a["sample_ids"], (T, a["sample_ids"].size))], 1)
    ref = np.concatenate([a["top_logits"][:T], a["bottom_logits"][:T], a["sample_logits"][:T]], 1)
    err = np.abs(np.take_along_axis(final, ref_ids, axis=1) - ref).max()
    assert err <= 1e-4 * float(a["scale"][0]), f"final lens vs the fp32 arbiter: {err:.3e}"
    # past 128 tokens the lens runs in chunks, each through the kernel all rows would take
    long_ids = [t for path in arbiter.inputs["paths"] for t in path][:200]
    last = m.trace(long_ids, layers=[-1])
    assert np.array_equal(last.lens_logits(-1), m.forward(long_ids, m.new_cache()))
    assert (last.top_ids[0][:, 0] == m.forward(long_ids, m.new_cache()).argmax(axis=1)).all()


def test_refused_for_size(smollm2):
    from workbench.engine.models.trace import TraceTooLargeError

    m, _ = smollm2
    ids = list(range(1000, 1900))
    with pytest.raises(TraceTooLargeError, match=r"would need \d+\.\d MB") as info:
        m.trace(ids, attention=True)
    err = info.value
    # 30 layers x 9 heads x 900^2 floats of attention alone
    assert err.needed > 30 * 9 * 900**2 * 4 and err.limit == 512 * 2**20
    print(f"\nrefused: {err}")
    with pytest.raises(TraceTooLargeError):
        m.trace(ids[:64], layers=[0], max_bytes=2**20)


def _status_bytes(field: str) -> int | None:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None


@pytest.mark.slow  # about a minute on 2 shared cores: 30 lens products over 512 rows
def test_512_tokens_with_attention_for_2_layers(smollm2):
    """All 30 layers' residuals and lens, attention for layers 0 and 29, on 512 tokens: the
    NumPy memory it allocates at its peak (tracemalloc) and, where Linux lets the peak RSS
    be reset, the process's peak RSS above what it held before (BLAS buffers included;
    the weights' pages were read by the tests before), both under 200 MB."""
    m, _ = smollm2
    ids = [int(i) for i in np.random.default_rng(0).integers(100, 40000, 512)]
    m.trace(ids[:8], layers=[0])  # kernels loaded, weights' pages read
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (the peak RSS) to the current RSS
        before = _status_bytes("VmRSS")
    except OSError:
        before = None
    tracemalloc.start()
    try:
        t = m.trace(ids, attention=[0, 29])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    rss = None if before is None else _status_bytes("VmHWM") - before
    print(f"\n512 tokens, 30 layers, attention for layers 0 and 29: holds "
          f"{t.nbytes / 2**20:.1f} MB, NumPy peak {peak / 2**20:.1f} MB"
          + ("" if rss is None else f", peak RSS +{rss / 2**20:.1f} MB"))
    assert t.attention[0].shape == (9, 512, 512) and t.layers == tuple(range(30))
    assert peak < 200 * 2**20
    assert rss is None or rss < 200 * 2**20


def test_trace_speed(smollm2):
    """64 tokens, all 30 layers with attention, against a plain prefill of the same 64
    tokens (the hidden states, and the logits of the last position, as a prompt is read),
    and a trace of the last layer only (its lens: one product with the output matrix);
    the best of 3 each, interleaved. Prints them; asserts nothing about time."""
    m, _ = smollm2
    ids = [int(i) for i in np.random.default_rng(1).integers(100, 40000, 64)]
    m.trace(ids[:8], attention=True)  # compiled kernels loaded
    runs = {"prefill": [], "trace": [], "last layer only": []}

    def prefill():
        with m._forward_lock:
            h = m.model.hidden(np.asarray(ids), m.new_cache(64))
            m.model.logits(h[-1:])

    for _ in range(3):
        for name, run in (("prefill", prefill),
                          ("trace", lambda: m.trace(ids, attention=True)),
                          ("last layer only", lambda: m.trace(ids, layers=[-1]))):
            t0 = time.perf_counter()
            run()
            runs[name].append(time.perf_counter() - t0)
    best = {name: min(times) for name, times in runs.items()}
    print(f"\n64 tokens: prefill {best['prefill']:.3f} s, trace of 30 layers with attention "
          f"{best['trace']:.3f} s ({best['trace'] / best['prefill']:.2f}x), trace of the last "
          f"layer only {best['last layer only']:.3f} s")
