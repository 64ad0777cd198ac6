"""Speculative decoding: SmolLM2 Q4_1 drafts for SmolLM2 re-quantized to Q8_0; the greedy
output must be the Q8_0 model's own, token for token."""

from __future__ import annotations

import pytest

from workbench.engine.convert import requantize_gguf
from workbench.engine.speculative import speculative_generate

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def target(smollm2, tmp_path_factory):
    from workbench import LLM

    path = requantize_gguf(smollm2.path, tmp_path_factory.mktemp("q8") / "smollm2-q8_0.gguf",
                           "q8_0")
    with LLM.load(path) as m:
        yield m


@pytest.mark.parametrize("question,draft_tokens", [
    ("Write three sentences about the sea.", 4),
    ("List the planets of the solar system.", 6),
    ("What is 12 times 7?", 1),
])
def test_greedy_output_is_the_targets_own(target, smollm2, question, draft_tokens):
    prompt = target.tokenize(target.apply_chat_template(
        [{"role": "user", "content": question}]), add_bos=False)
    alone = target.generate(prompt, temperature=0, max_tokens=48)
    r = speculative_generate(target, smollm2, prompt, max_tokens=48,
                             draft_tokens=draft_tokens)
    assert r.token_ids == alone.token_ids
    assert r.text == alone.text and r.finish_reason == alone.finish_reason
    assert r.drafted > 0 and 0.0 <= r.acceptance_rate <= 1.0
    # the same model at lower precision agrees most of the time: fewer target passes
    assert r.acceptance_rate > 0.5, r
    assert r.target_passes < len(r.token_ids)


def test_max_tokens_and_arguments(target, smollm2):
    r = speculative_generate(target, smollm2, "The capital of France is", max_tokens=5)
    assert r.token_ids == target.generate("The capital of France is", temperature=0,
                                          max_tokens=5).token_ids
    assert len(r.token_ids) == 5 and r.finish_reason == "length"
    assert speculative_generate(target, smollm2, "Hi", max_tokens=0).token_ids == []
    with pytest.raises(ValueError, match="draft_tokens"):
        speculative_generate(target, smollm2, "Hi", draft_tokens=0)


def test_a_draft_with_another_vocabulary_is_refused(target, qwen):
    with pytest.raises(ValueError, match="another vocabulary"):
        speculative_generate(target, qwen, "Hi")


def test_requantized_file_keeps_metadata_and_values(target, smollm2, tmp_path):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from workbench.engine.convert import requantize_gguf

    src, dst = GGUFReader(smollm2.path), GGUFReader(target.path)
    assert {f.name: f.contents() for f in src.fields.values() if not f.name.startswith("GGUF.")} \
        == {f.name: f.contents() for f in dst.fields.values() if not f.name.startswith("GGUF.")}
    for a, b in zip(src.tensors, dst.tensors):
        assert a.name == b.name
        x, y = dequantize(a.data, a.tensor_type), dequantize(b.data, b.tensor_type)
        assert x.shape == y.shape
        # Q8_0 keeps each Q4_1 value to within half a step of its block's scale
        assert abs(x - y).max() <= abs(x).max() / 127 + 1e-6, a.name
    with pytest.raises(ValueError, match="qtype"):
        requantize_gguf(smollm2.path, tmp_path / "x.gguf", "q3_weird")
