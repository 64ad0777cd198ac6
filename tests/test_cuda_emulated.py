"""The CUDA decode path with the real kernels, run on the CPU (tests/support/cuda_emulator.py:
gguf.cu and `cuda.STEP_SOURCE` compiled by g++, NumPy arrays for CuPy's).

- The fused decode step (`DeviceLlamaModel._fused_step`: six launches a layer) gives
  transformers' greedy tokens on the tiny llama, qwen2 (biases; Q8_0), qwen3 (per-head Q/K
  norms; head size 32; tied output) and F16 models, with every recording kept (each new
  one is checked against the layers' kernels run one by one, and would be dropped with a
  warning if it disagreed); a batch gives each sequence the tokens it gets alone.
- Gemma 3 (post-norms: the unfused recorded step) gives the CPU engine's greedy tokens.
- What a CUDA graph of the step would hold: at most 6 nodes a layer plus 4, and every
  kernel of a decode step runs inside its recording (nothing per layer from Python).
- The products of matrices stored in several formats (a Q4_K_M file's Q, K, V; gate and
  up of different formats) give what the unfused norm, products and GLU give.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from tests import goldens
from tests.goldens.make_tiny_llama import BRANCH_GEMMA3, GREEDY_STEPS
from tests.support import cuda_emulator
from tests.support.devices import cuda_emulated, open_llm
from tests.support.tiny_llama import PROMPT, VOCAB, Built

FUSED = ["llama", "qwen2-q8_0", "qwen3", "llama-f16"]


@pytest.fixture(scope="module", params=FUSED)
def built(request, tmp_path_factory):
    return Built(request.param, tmp_path_factory.mktemp("tiny"))


def _greedy(m, prompt, n):
    return m.generate(prompt, max_tokens=n, temperature=0,
                      logit_bias={VOCAB.eos_id: -100.0}).token_ids


def test_fused_step_gives_transformers_greedy_tokens(built):
    want = list(built.golden.outputs["greedy_ids"])  # transformers' greedy generate
    if want and want[-1] == VOCAB.eos_id:  # ours stops at EOS without reporting it
        want = want[:-1]
    with open_llm(built.path, "cuda-emulated") as m, warnings.catch_warnings():
        warnings.simplefilter("error")  # a recording dropped for a disagreement warns
        assert m.model._fused
        assert m.generate(PROMPT, max_tokens=GREEDY_STEPS, temperature=0).token_ids == want
        # one recording of the decode step (one row), one of the prompt's tokens
        assert m.model._fused and (1, True) in m._cache.pool.recordings.steps
        assert m.model.recorded_prefill_rows and \
            [logits for _, logits in m._cache.pool.recordings.steps] == [False, True]


@pytest.mark.parametrize("name", ["qwen2-q8_0", "qwen3"])
def test_fused_step_batches_sequences_as_alone(name, tmp_path):
    """Biases and per-head norms, three sequences in a recording of four rows."""
    built = Built(name, tmp_path)
    prompts = [PROMPT, PROMPT[:7], PROMPT[5:]]
    with open_llm(built.path, "cuda-emulated") as m, warnings.catch_warnings():
        warnings.simplefilter("error")
        alone = [_greedy(m, p, 5) for p in prompts]
        outs = m.generate_batch(prompts, max_tokens=5, temperature=0,
                                logit_bias={VOCAB.eos_id: -100.0})
        assert [o.token_ids for o in outs] == alone
        assert m.model._fused


def test_unfused_recorded_step_on_gemma3():
    """Gemma 3's post-norms keep it on the recorded step of one kernel per operation."""
    path = goldens.load(BRANCH_GEMMA3).file("model.gguf")
    with open_llm(path, "cuda-emulated") as m, open_llm(path, "cpu") as ref:
        assert m.model._recording and not m.model._fused
        assert _greedy(m, PROMPT, 6) == _greedy(ref, PROMPT, 6)
        assert m._cache.pool.recordings


def _prompted(m):
    """A cache (of a pool of two, as the scheduler's of many: a pool of one reads its
    prompts without recordings) with a 5-token prompt in it, and its step recording of
    one row made."""
    cache = m.model.new_pool(2).caches()[0]
    m.model.hidden(np.asarray(PROMPT[:5]), cache)
    m.model.step_logits([7], [cache], [None])
    assert (1, True) in cache.pool.recordings.steps  # (and the prompt's, of 8 rows)
    return cache


def test_a_decode_step_is_six_launches_a_layer_plus_four(tmp_path):
    """Every launch the fused step makes, kernels and CuPy operations alike (each one
    node of its CUDA graph), counted for one and for 64 sequences."""
    built = Built("qwen2-q8_0", tmp_path)  # biases: the most a llama layer does
    with open_llm(built.path, "cuda-emulated") as m:
        recordings = _prompted(m).pool.recordings
        layers = m.model.config.n_layer
        for rows in (1, 64):
            tokens, slots, pos = (b[:rows] for b in (recordings.tokens, recordings.slots,
                                                     recordings.pos))
            cuda_emulator.LAUNCHES.clear()
            logits = m.model._recorded_step(tokens, slots, pos, recordings.keys,
                                            recordings.values)
            launches = list(cuda_emulator.LAUNCHES)
            assert logits.shape == (rows, m.model.config.n_vocab)
            assert len(launches) <= 6 * layers + 4, launches
            assert sum(n.startswith("step_") for n in launches) == 4 * layers + 1, launches


def test_every_kernel_of_a_step_runs_inside_its_recording(tmp_path):
    """With a recording made, a decode step, or a short prompt's pass, launches no kernel
    of its own outside the replay: the work from Python is writing the buffers and the
    replay."""
    built = Built("llama", tmp_path)
    backend = cuda_emulated()
    replaying = []

    def capture(step):
        def replay():
            replaying.append(True)
            try:
                return step()
            finally:
                replaying.pop()
        return replay

    backend.capture = capture
    outside = []
    from workbench import LLM
    from workbench.engine.formats.gguf import open_gguf

    with LLM(open_gguf(built.path), backend=backend) as m:
        cache = _prompted(m)
        real = cuda_emulator.EmulatedKernel.__call__

        def launch(self, *args, **kwargs):
            if not replaying:
                outside.append(self.name)
            return real(self, *args, **kwargs)

        cuda_emulator.EmulatedKernel.__call__ = launch
        try:
            for token in (9, 11, 13):
                m.model.step_logits([token], [cache], [None])
            m.model.hidden(np.asarray(PROMPT[8:14]), cache)  # on the prompt's 8-row recording
        finally:
            cuda_emulator.EmulatedKernel.__call__ = real
    assert outside == []


def test_a_prompt_read_on_the_recordings_gives_the_layers_hidden_states(tmp_path):
    """Prompt tokens read by the fused step's recordings (each token a row at its own
    position, 8 rows a replay here: 19 tokens in three) give the hidden states and the
    keys the layers' kernels give, to float32 summation order."""
    built = Built("qwen2-q8_0", tmp_path)
    with open_llm(built.path, "cuda-emulated") as m:
        model = m.model
        model.backend.fused_rows = 8  # rows a recording takes: three replays, not one
        recorded, layers = model.new_pool(2).caches()
        assert model._prefills_recorded(19, n_slots=2)
        h = model.hidden(np.asarray(PROMPT[:19]), recorded)
        assert sorted(recorded.pool.recordings.steps) == [(4, False), (8, False)]
        model.recorded_prefill_rows = 0
        want = model.hidden(np.asarray(PROMPT[:19]), layers)
        scale = np.abs(want).max()
        np.testing.assert_allclose(h, want, rtol=0, atol=1e-4 * scale)
        keys, want_keys = (c.pool.keys[1][c.slot, :, :19] for c in (recorded, layers))
        np.testing.assert_allclose(keys, want_keys, rtol=0, atol=1e-4 * np.abs(want_keys).max())


def test_a_stacked_matrix_steps_each_part_into_its_columns():
    """Q, K and V of different formats (a Q4_K_M file's): `StackedWeight.step_matmul`
    runs each part's kernel into its block of columns, with the norm before and its
    slice of the bias, as the unfused products and norm do; "add" adds; a gated
    epilogue, which needs gate and up in one matrix, is refused."""
    from gguf import GGMLQuantizationType as Q

    from tests.test_cuda_kernels import random_weight
    from workbench.engine.models.weights import Stacked
    from workbench.kernels.linear import QuantizedWeight

    backend = cuda_emulated()
    cp = backend.xp
    rng = np.random.default_rng(3)
    k, parts = 256, [(Q.Q5_0, 64), (Q.Q5_0, 32), (Q.Q8_0, 32)]
    stacked = backend.weight(Stacked([QuantizedWeight(random_weight(q, n, k, rng), q, (n, k))
                                      for q, n in parts]))
    x = rng.standard_normal((3, k)).astype(np.float32)
    norm = rng.standard_normal(k).astype(np.float32)
    bias = rng.standard_normal(128).astype(np.float32)
    normed = backend.rms_norm(cp.asarray(x), cp.asarray(norm), 1e-6)
    want = np.asarray(stacked.matmul(normed)) + bias
    out = cp.empty((3, 128), dtype=np.float32)
    stacked.step_matmul(cp.asarray(x), out, cp.asarray(norm), 1e-6, cp.asarray(bias))
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-4)
    stacked.step_matmul(cp.asarray(x), out, cp.asarray(norm), 1e-6, cp.asarray(bias), "add")
    np.testing.assert_allclose(np.asarray(out), 2 * want, rtol=1e-4, atol=2e-4)
    with pytest.raises(ValueError, match="store and add"):
        stacked.step_matmul(cp.asarray(x), out[:, :64], epilogue="silu")


@pytest.mark.parametrize("mixed", [False, True], ids=["one-matrix", "two-formats"])
def test_gated_step_pairs_gate_and_up(mixed):
    """The fused step's gate/up product: one launch where gate and up are one matrix,
    both products then the activation kernel where they have different formats; both as
    the unfused norm, product and GLU."""
    import types

    from gguf import GGMLQuantizationType as Q

    from tests.test_cuda_kernels import random_weight
    from workbench.engine.models.llama_device import _DeviceLayer
    from workbench.engine.models.weights import Stacked
    from workbench.kernels.linear import QuantizedWeight

    backend = cuda_emulated()
    cp = backend.xp
    rng = np.random.default_rng(4)
    k, n_ff = 256, 96
    gate, up = (random_weight(q, n_ff, k, rng) for q in (Q.Q4_K, Q.Q6_K if mixed else Q.Q4_K))
    if mixed:
        w = Stacked([QuantizedWeight(gate, Q.Q4_K, (n_ff, k)),
                     QuantizedWeight(up, Q.Q6_K, (n_ff, k))])
    else:
        w = QuantizedWeight(np.concatenate([gate, up]), Q.Q4_K, (2 * n_ff, k))
    layer = types.SimpleNamespace(gate_up=backend.weight(w),
                                  ffn_norm=cp.asarray(rng.standard_normal(k).astype(np.float32)))
    x = cp.asarray(rng.standard_normal((2, k)).astype(np.float32))
    got = _DeviceLayer.gated_step(layer, backend, x, 1e-6, gelu=False)
    want = backend.glu(layer.gate_up.matmul(backend.rms_norm(x, layer.ffn_norm, 1e-6)), False)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
