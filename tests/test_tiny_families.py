"""Tiny random-weight Gemma 3, Phi-3, Mistral, Mixtral, Qwen2-MoE and Qwen3-MoE models:
transformers -> GGUF (tests/hf_to_gguf.py) -> our engine, logits compared against the
stored goldens `tiny-family-<variant>` (tests/goldens/make_tiny_families.py builds the
models and runs transformers on them; the test gate runs no peer): each holds the GGUF
file, transformers' logits over the whole 600-token prompt, its greedy `generate` ids and,
for LongRoPE, its logits with the short factors.

The Gemma 3, Phi-3, Mistral and Mixtral variants have a sliding window of 8
positions, and the prompt is 600 tokens long: longer than the window and than
the rotating cache of the sliding-window layers (window + `RING_SLACK` = 264
positions), so the ring wraps twice, during one long prefill chunk, across
chunks and while decoding one token at a time. Gemma 3 has six layers (five
local, one global). The Q8_0 variants decode through the fused stack
(`workbench.kernels.decode`), the others kernel by kernel. The logits, greedy and
batched tests of the dense families also run on the GPU backends' code (`DEVICES` of
tests/support/devices.py); the rotating-cache tests are the NumPy engine's. The metric is the
one of tests/support/tiny_llama.py:

    max |ours - ref| <= 1e-4 * max |ref|    (over all T x V entries)
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import goldens
from tests.goldens.make_tiny_families import PROMPT, VARIANTS, WINDOW, golden_name
from tests.support.devices import DEVICES, open_llm
from tests.support.tiny_llama import assert_close as _assert_close
from workbench.engine.runtime.kv_cache import RING_SLACK


class Built:
    """The golden of one of `VARIANTS`: its GGUF `path`, transformers' logits `ref`
    (600, V) over `PROMPT`, and the rest of what transformers answered (`golden`)."""

    def __init__(self, name: str):
        self.name = name
        self.golden = goldens.load(golden_name(name))
        assert self.golden.inputs["prompt"] == PROMPT, \
            f"the golden {golden_name(name)} was made from another prompt: regenerate it"
        self.path = self.golden.file("model.gguf")
        self.ref = self.golden.arrays["logits"]


@pytest.fixture(scope="module", params=list(VARIANTS))
def built(request):
    return Built(request.param)


@pytest.fixture
def engine(built):
    """The NumPy engine."""
    from workbench import LLM

    m = LLM.load(built.path, kv_cache_size=1024)
    yield m
    m.close()


@pytest.fixture(params=DEVICES)
def any_engine(built, request):
    """The model on each of `DEVICES`."""
    m = open_llm(built.path, request.param, kv_cache_size=1024)
    yield m
    m.close()


def _windowed(engine) -> bool:
    return bool(engine.config.sliding_window)


def test_the_files_say_what_the_models_are(built, engine):
    cfg = engine.config
    kwargs = built.golden.inputs["config"]  # what transformers' model was built with
    assert cfg.sliding_window == kwargs.get("sliding_window", 0)
    assert cfg.n_expert == kwargs.get("num_experts", kwargs.get("num_local_experts", 0))
    if built.name.startswith("gemma3"):
        assert [cfg.is_local(i) for i in range(6)] == [True] * 5 + [False]
    pool = engine.model.new_pool(1)
    assert pool.ring == (WINDOW + RING_SLACK if _windowed(engine) else 0)
    assert engine.model.fused_decode == built.name.endswith("q8_0")


def test_logits_whole_prompt(built, any_engine):
    engine = any_engine
    ours = engine.forward(PROMPT, engine.new_cache())
    _assert_close(np.asarray(ours), built.ref, f"{built.name}: forward(600 tokens at once)")


@pytest.mark.slow
def test_logits_chunks_then_decode(built, any_engine):
    engine = any_engine
    cache = engine.new_cache()
    parts = [engine.forward(PROMPT[:300], cache), engine.forward(PROMPT[300:560], cache)]
    for t in PROMPT[560:]:
        parts.append(engine.forward([t], cache))
    ours = np.concatenate([np.asarray(p) for p in parts], axis=0)
    _assert_close(ours, built.ref, f"{built.name}: chunks of 300 and 260, then 40 single tokens")
    if engine.backend is None and _windowed(engine) and engine.model.new_pool(1).ring:
        # the sliding-window layers never wrote past their ring: that memory stays untouched
        pool, local = cache.pool, np.nonzero(cache.pool.local)[0]
        assert not pool.keys[local, cache.slot, :, pool.ring :].any()


@pytest.mark.parametrize("device", [d for d in DEVICES if d.startswith("cuda")])
def test_recorded_decode_steps(built, device):
    """The decode step as CUDA graphs record it (`DeviceLlamaModel.step_logits`: tokens,
    slots and positions read from device buffers) against transformers: one sequence for
    40 steps past 560 positions, then three sequences of one pool decoded together (on
    the 4-row recording, the last row a repeat of the first) at positions 599, 30 and
    480, sliding windows included."""
    with open_llm(built.path, device, kv_cache_size=1024) as m:
        model, be = m.model, m.backend
        assert be.records
        one = model.new_cache()
        parts = [model.forward(PROMPT[:560], one)[-1:]]
        for t in PROMPT[560:]:
            [logits] = model.step_logits([t], [one], [be.asarray(np.array([t], np.int32))])
            parts.append(be.to_host(logits)[None])
        assert one.offset == 600 and one.tokens == PROMPT
        _assert_close(np.concatenate(parts), built.ref[559:],
                      f"{built.name}: 560 tokens, then 40 recorded decode steps")

        pool = model.new_pool(3)
        ends = [600, 31, 481]  # prompts of these lengths, the last token decoded together
        caches = pool.caches()[::-1]  # slots 2, 1, 0
        for c, end in zip(caches, ends):
            model.forward(PROMPT[: end - 1], c)
        last = [PROMPT[end - 1] for end in ends]
        rows = model.step_logits(last, caches, [be.asarray(np.array([t], np.int32))
                                                for t in last])
        assert [c.offset for c in caches] == [600, 31, 481]
        recorded = pool.recordings
        if any(layer.moe is not None for layer in model.layers):
            assert recorded is None  # experts route through the host: never recorded
        else:
            # the decode step's recordings (the prompts' own where the step is fused)
            assert sorted(k for k in recorded.steps if k[1]) == [(4, True)]
        for row, end in zip(rows, ends):
            _assert_close(be.to_host(row)[None], built.ref[end - 1 : end],
                          f"{built.name}: the row at position {end - 1} of 3 decoded together")


def test_longrope_short_factors():
    """A cache no longer than the original context (64) selects the short factors, as
    transformers does for sequences that short (the golden's `short_factor_logits`: a
    fresh model over these 40 tokens)."""
    from workbench import LLM

    built = Built("phi3-longrope")
    ref = built.golden.arrays["short_factor_logits"]
    with LLM.load(built.path, kv_cache_size=64) as m:
        _assert_close(np.asarray(m.forward(PROMPT[:40], m.new_cache())), ref,
                      "phi3-longrope: 40 tokens, short factors")


@pytest.mark.slow
def test_greedy_generation(built, any_engine):
    """Against transformers' greedy `generate` (the golden's `generated` ids)."""
    engine = any_engine
    prompt, n = PROMPT[:100], 8  # (longer than LongRoPE's original context: long factors)
    stored = built.golden.inputs["generate"]
    assert (stored["prompt_tokens"], stored["max_new_tokens"]) == (len(prompt), n)
    ref = built.golden.outputs["generated"]
    if ref and ref[-1] == built.golden.inputs["eos_id"]:
        ref = ref[:-1]
    assert engine.generate(prompt, max_tokens=n, temperature=0).token_ids == ref


@pytest.mark.slow
def test_batched_decode_equals_one_by_one(built, any_engine):
    engine = any_engine
    prompts = [PROMPT[:290], PROMPT[100:130], PROMPT[200:480]]
    batch = engine.generate_batch(prompts, max_tokens=12, temperature=0)
    for prompt, got in zip(prompts, batch):
        assert got.token_ids == engine.generate(prompt, max_tokens=12,
                                                temperature=0).token_ids


def test_stepping_back_and_forking_a_rotating_cache(built, engine):
    if not _windowed(engine):
        pytest.skip(f"{built.name} has no sliding window")
    model = engine.model
    tail = PROMPT[:5]

    def fresh(ids):
        return model.forward(np.asarray(ids), model.new_cache())[-len(tail):]

    cache = model.new_cache()
    model.forward(np.asarray(PROMPT), cache)
    cache.trim(590)  # within the ring's slack: kept
    assert cache.offset == 590
    _assert_close(model.forward(np.asarray(tail), cache), fresh(PROMPT[:590] + tail),
                  f"{built.name}: 10 positions back")
    cache.trim(300)  # the ring no longer holds the window before 300: starts over
    assert cache.offset == 0

    pool = model.new_pool(2)
    parent, _ = pool.caches()
    model.forward(np.asarray(PROMPT[:500]), parent)
    child = parent.fork(1)
    model.forward(np.asarray(PROMPT[500:]), parent)  # the parent's ring moves on
    ours = [model.forward(np.asarray(tail[:3]), child)]  # prefill, then the decode path
    ours += [model.forward(np.asarray([t]), child) for t in tail[3:]]
    _assert_close(np.concatenate(ours), fresh(PROMPT[:500] + tail),
                  f"{built.name}: a fork of a rotating cache")


def test_removing_positions_from_a_rotating_cache(built, engine):
    """`kv_remove` (llama.cpp's context shift) on a rotating cache moves what the ring
    holds the way it moves a cache that keeps every position."""
    if not _windowed(engine):
        pytest.skip(f"{built.name} has no sliding window")
    model = engine.model
    rotating, plain = model.new_cache(), model.new_cache()
    plain.pool.ring = 0  # the same pool, every position at its own index
    tail = np.asarray(PROMPT[:5])
    for cache in (rotating, plain):
        model.forward(np.asarray(PROMPT), cache)
        model.kv_remove(cache, 4, 104)  # a sink of 4, then 100 positions dropped
        assert cache.offset == 500 and cache.tokens == PROMPT[:4] + PROMPT[104:]
    assert rotating.ring_floor == 600 - WINDOW - RING_SLACK - 100
    _assert_close(model.forward(tail, rotating), model.forward(tail, plain),
                  f"{built.name}: kv_remove on a rotating cache")
    with pytest.raises(ValueError, match="sliding-window"):  # the window's keys are gone
        model.kv_remove(rotating, 4, 500)
    engine.generate(PROMPT, max_tokens=1, temperature=0).token_ids  # noqa: B018 (fills the cache)
    assert engine._cache.offset == 600
    engine.kv_remove(4, 580)  # recomputed: the remaining 24 tokens run again from 0
    assert engine._cache.offset == 24
    ref = engine.model.forward(np.asarray(PROMPT[:4] + PROMPT[580:] + PROMPT[:5]),
                               engine.new_cache())[-5:]
    got = engine.forward(PROMPT[:5], engine._cache)
    _assert_close(np.asarray(got), ref, f"{built.name}: LLM.kv_remove, recomputed")


def test_prefix_cache_of_a_rotating_cache(built, engine, tmp_path):
    if not _windowed(engine):
        pytest.skip(f"{built.name} has no sliding window")
    prefix = engine.prefix(PROMPT[:500])
    assert prefix.local_from == 500 - WINDOW - RING_SLACK
    prefix = engine.load_prefix(prefix.save(tmp_path / "p.wbp"))
    assert prefix.local_from == 500 - WINDOW - RING_SLACK
    cache = engine.new_cache()
    cache.restore(prefix, 495)
    assert cache.offset == 495
    tail = PROMPT[520:525]
    ours = engine.forward(tail, cache)
    ref = engine.forward(PROMPT[:495] + tail, engine.new_cache())[-len(tail):]
    _assert_close(np.asarray(ours), np.asarray(ref), f"{built.name}: restored prefix")
    cache.restore(prefix, 100)  # the window before 100 was not kept: nothing restored
    assert cache.offset == 0
    opts = dict(max_tokens=6, temperature=0)
    assert engine.generate(PROMPT[:510], prefix=prefix, **opts).token_ids == \
        engine.generate(PROMPT[:510], **opts).token_ids



def test_each_family_declares_its_quirks(built, engine):
    """The shared llama code reads a family's quirks from its blocks and config: Gemma 3's
    post-norms and GeGLU (`Gemma3Block`), sliding windows on the local layers only."""
    cfg, blocks = engine.config, engine.model.blocks
    gemma = built.name.startswith("gemma3")
    for b in blocks:
        assert (b.post_attn_norm is not None) == (b.post_ffn_norm is not None) == gemma
        assert getattr(b.ffn, "gelu", False) == gemma  # experts: SwiGLU
    assert [b.attn.window for b in blocks] == \
        [cfg.sliding_window if cfg.is_local(i) else 0 for i in range(cfg.n_layer)]


@pytest.mark.parametrize("neox", [False, True])
def test_rope_rotates_the_leading_pairs_of_each_head(neox):
    """`rope.rotate`, shared by prefill, cache edits and the device twin, against complex
    multiplication: pairs (x[i], x[i + d/2]) (NEOX) or (x[2i], x[2i+1]), the dims past
    `dim` untouched."""
    from workbench.engine.models.rope import rotate

    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 2, 12)).astype(np.float32)  # (T, heads, head_dim)
    angles = rng.standard_normal((3, 1, 4)).astype(np.float32)  # (T, 1, dim / 2)
    out = rotate(np, x, np.cos(angles), np.sin(angles), 8, neox)
    a, b = (np.arange(4), np.arange(4, 8)) if neox else (np.arange(0, 8, 2), np.arange(1, 8, 2))
    z = (x[..., a] + 1j * x[..., b]) * np.exp(1j * angles.astype(np.float64))
    np.testing.assert_allclose(out[..., a], z.real, atol=1e-5)
    np.testing.assert_allclose(out[..., b], z.imag, atol=1e-5)
    np.testing.assert_array_equal(out[..., 8:], x[..., 8:])
