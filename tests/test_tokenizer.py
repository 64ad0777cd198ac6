"""Tokenizers from GGUF metadata: synthetic vocabularies, and the real models against
llama.cpp's reference tokenizations in ../shared/reference."""

from __future__ import annotations

import functools
import random
import time

import numpy as np
import pytest

from tests.support.byte_level import gpt2_alphabet
from tests.support.shared import reference
from workbench.engine.text.tokenizers import (
    BPETokenizer,
    SPMTokenizer,
    TokenAttr,
    UnsupportedTokenizerError,
    clean_up_tokenization_spaces,
    load_tokenizer,
)
from workbench.engine.text.tokenizers.bpe import PRE_TOKENIZERS, PreTokenizer, byte_encode
from workbench.engine.text.tokenizers.stream import StreamDecoder

NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6


def tiny_bpe(merges: list[str], *, pre: str | None = "gpt2", user_defined: tuple[str, ...] = (),
             **keys) -> BPETokenizer:
    """256 byte tokens, one token per merge result, <|endoftext|> and user-defined tokens."""
    tokens = gpt2_alphabet()
    for merge in merges:
        if merge.replace(" ", "") not in tokens:
            tokens.append(merge.replace(" ", ""))
    types = [NORMAL] * len(tokens)
    tokens.append("<|endoftext|>")
    types.append(CONTROL)
    for text in user_defined:
        tokens.append(text)
        types.append(USER_DEFINED)
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
          "tokenizer.ggml.merges": merges,
          "tokenizer.ggml.eos_token_id": tokens.index("<|endoftext|>"),
          "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"), **keys}
    if pre is not None:
        md["tokenizer.ggml.pre"] = pre
    tok = load_tokenizer(md)
    assert isinstance(tok, BPETokenizer)
    return tok


def ids_of(tok, *texts: str) -> list[int]:
    return [tok.token_to_id(t) for t in texts]


# -- byte-level BPE on a synthetic vocabulary ------------------------------------------------

def test_byte_alphabet_matches_gpt2():
    alphabet = gpt2_alphabet()
    assert byte_encode("Hello world\n") == "HelloĠworldĊ"
    assert byte_encode("é") == alphabet[0xC3] + alphabet[0xA9]
    tok = tiny_bpe([])
    assert [tok.token_bytes(i) for i in range(256)] == [bytes([b]) for b in range(256)]


def test_merges_follow_rank_then_position():
    tok = tiny_bpe(["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d"])
    assert tok.encode("hello world") == ids_of(tok, "hello", "Ġwor", "ld")
    assert tiny_bpe(["b c", "a b"]).encode("abc") == ids_of(tiny_bpe(["b c", "a b"]), "a", "bc")
    tok = tiny_bpe(["a b", "b c"])
    assert tok.encode("abc") == ids_of(tok, "ab", "c")
    tok = tiny_bpe(["a a"])
    assert tok.encode("aaa") == ids_of(tok, "aa", "a")  # leftmost pair first on a tie


def test_merge_result_missing_from_vocab_falls_back_to_ascii_bytes():
    tok = load_tokenizer({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2",
                          "tokenizer.ggml.tokens": gpt2_alphabet(),
                          "tokenizer.ggml.merges": ["x y"]})  # "xy" is not a token
    assert tok.encode("xy") == ids_of(tok, "x", "y")


def test_special_tokens_are_cut_out_before_pretokenization():
    tok = tiny_bpe(["h i"], user_defined=("<tool>",))
    eot, tool = ids_of(tok, "<|endoftext|>", "<tool>")
    hi = tok.token_to_id("hi")
    assert tok.encode("hi<|endoftext|>hi") == [hi, eot, hi]
    plain = tok.encode("hi<|endoftext|>hi", special=False)
    assert eot not in plain and tok.decode(plain) == "hi<|endoftext|>hi"
    # user-defined tokens are matched even with special=False, as in llama.cpp
    assert tok.encode("<tool>hi", special=False) == [tool, hi]


def test_decode_renders_or_skips_control_tokens():
    tok = tiny_bpe(["h i"])
    ids = tok.encode("hi<|endoftext|>")
    assert tok.decode(ids) == "hi<|endoftext|>"
    assert tok.decode(ids, skip_special=True) == "hi"
    assert tok.is_control(ids[-1]) and not tok.is_control(ids[0])
    assert tok.token_bytes(ids[-1]) == b"<|endoftext|>"
    assert tok.attr(ids[-1]) & TokenAttr.CONTROL


def test_invalid_utf8_decodes_to_replacement_char():
    tok = tiny_bpe([])
    first_byte_of_robot = "🤖".encode()[0]
    assert tok.decode([first_byte_of_robot]) == "\ufffd"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


def test_bos_eos_and_end_of_generation_ids():
    tok = tiny_bpe([])
    eot = tok.token_to_id("<|endoftext|>")
    assert tok.bos_id == tok.eos_id == eot and eot in tok.eot_ids
    assert not tok.add_bos and tok.encode("a") == ids_of(tok, "a")
    assert tok.encode("a", add_bos=True) == [eot, *ids_of(tok, "a")]
    assert tiny_bpe([], pre="llama-bpe").add_bos  # llama 3 adds BOS unless told otherwise
    assert not tiny_bpe([], pre="llama-bpe", **{"tokenizer.ggml.add_bos_token": False}).add_bos


def test_clean_up_tokenization_spaces():
    raw = b"a , b ' c 's x 're y 'll z ."
    assert clean_up_tokenization_spaces(raw) == b"a, b'c's x're y 'll z."
    tok = tiny_bpe([], pre="gpt2")  # gpt2-style vocabularies clean up, smollm/qwen2 do not
    assert tok.clean_spaces and not tiny_bpe([], pre="qwen2").clean_spaces
    assert tok.decode(tok.encode("Hi , there !")) == "Hi, there!"


@pytest.mark.parametrize("pre, text, pieces", [
    ("qwen2", "12345 abc  def\n\nx", ["1", "2", "3", "4", "5", " abc", " ", " def", "\n\n", "x"]),
    ("llama-bpe", "12345 IT'S", ["123", "45", " IT", "'S"]),
    ("smollm", "12345 it's  x", ["1", "2", "3", "4", "5", " it", "'s", " ", " x"]),
    ("gpt2", "  hello\tworld!!", [" ", " hello", "\t", "world", "!!"]),
    ("qwen2", "日本語のテキスト。", ["日本語のテキスト", "。"]),
    ("qwen2", "café\u00a0non", ["café", "\u00a0non"]),
    ("default", "a+b=12345", ["a", "+", "b", "=", "123", "45"]),
    # a Unicode 15.1 letter (CJK extension I) is a letter, as in llama.cpp's tables
    ("qwen2", "x\U0002ebf0y 1", ["x\U0002ebf0y", " ", "1"]),
])
def test_pretokenizer_splits(pre, text, pieces):
    assert PreTokenizer(pre).split(text) == pieces


def test_every_listed_pretokenizer_compiles_and_covers_the_text():
    text = "It's 2024: naïve café — 日本語, \u00a0émoji 🤖!\n\n  x=1~2 "
    for pre in PRE_TOKENIZERS:
        assert "".join(PreTokenizer(pre).split(text)) == text, pre


def test_unsupported_tokenizers_raise():
    with pytest.raises(UnsupportedTokenizerError, match="'t5'.*'gpt2'.*'bert'"):
        load_tokenizer({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(UnsupportedTokenizerError, match="'kimi-k2'.*qwen2"):
        tiny_bpe([], pre="kimi-k2")
    assert issubclass(UnsupportedTokenizerError, ValueError)
    with pytest.warns(UserWarning, match="tokenizer.ggml.pre"):
        assert tiny_bpe([], pre=None).pre_tokenizer.pre == "default"


# -- SentencePiece on a synthetic vocabulary -------------------------------------------------

def tiny_spm(pieces: dict[str, float], **keys) -> SPMTokenizer:
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, CONTROL, CONTROL, *[BYTE] * 256, *[NORMAL] * len(pieces)]
    scores = [0.0, 0.0, 0.0, *[0.0] * 256, *pieces.values()]
    tok = load_tokenizer({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                          "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
                          "tokenizer.ggml.scores": np.array(scores, dtype=np.float32), **keys})
    assert isinstance(tok, SPMTokenizer)
    return tok


def test_spm_merges_by_score_with_space_prefix():
    vocab = {"▁": -1.0, "a": -2.0, "b": -2.0}
    tok = tiny_spm({**vocab, "▁a": -0.5, "ab": -3.0})
    assert tok.add_bos and tok.add_space_prefix and tok.bos_id == 1
    assert tok.encode("ab") == [1, *ids_of(tok, "▁a", "b")]
    tok = tiny_spm({**vocab, "▁a": -3.0, "ab": -0.5})
    assert tok.encode("ab", add_bos=False) == ids_of(tok, "▁", "ab")
    assert tok.decode(tok.encode("ab", add_bos=False)) == "ab"  # the prefix space is dropped
    # ... from the first token only, as llama.cpp does: here that is BOS
    assert tok.decode(tok.encode("ab")) == "<s> ab"
    assert tok.decode(tok.encode("ab"), skip_special=True) == " ab"


def test_spm_byte_fallback_and_no_space_prefix():
    tok = tiny_spm({"▁": -1.0, "a": -2.0}, **{"tokenizer.ggml.add_space_prefix": False})
    ids = tok.encode("aé a", add_bos=False)
    assert ids == [*ids_of(tok, "a", "<0xC3>", "<0xA9>", "▁", "a")]
    assert tok.decode(ids) == "aé a"
    assert tok.token_bytes(tok.token_to_id("<0xC3>")) == b"\xc3"
    assert tok.eot_ids == {2}  # "</s>" is the EOS and an end-of-generation text


# -- streaming -------------------------------------------------------------------------------

def stream(tok, ids, skip_special=False) -> list[str]:
    decoder = StreamDecoder(tok, skip_special=skip_special)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


def assert_streams_whole_characters(tok, ids, skip_special=False):
    parts = stream(tok, ids, skip_special)
    full = tok.decode(ids, skip_special=skip_special)
    assert "".join(parts) == full
    if "\ufffd" not in full:
        assert all("\ufffd" not in p for p in parts)
    return parts


def test_stream_holds_back_partial_characters():
    tok = tiny_bpe([])
    ids = list("🤖 ok 日本".encode())  # one byte per token
    parts = assert_streams_whole_characters(tok, ids)
    assert parts[:4] == ["", "", "", "🤖"]


def test_stream_matches_decode_with_space_cleanup():
    tok = tiny_bpe([], pre="gpt2")
    alphabet = list(" ',.!?smrevltxé".encode()) + [tok.token_to_id("<|endoftext|>")]
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.choice(alphabet) for _ in range(rng.randrange(1, 12))]
        assert_streams_whole_characters(tok, ids)
        assert_streams_whole_characters(tok, ids, skip_special=True)


# -- the real models against llama.cpp -------------------------------------------------------

MODELS = {
    "smollm2-135m": "llamacpp_smollm2.json",
    "qwen2.5-coder-0.5b": "llamacpp_qwen2.5-coder-0.5b.json",
    "gemma3-270m": "llamacpp_gemma3-270m.json",
}



@functools.cache
def metadata(alias: str) -> dict:
    from workbench.engine.formats.gguf import open_gguf
    from workbench.engine.formats.sources import pull

    return open_gguf(pull(alias)).metadata


@functools.cache
def model_tokenizer(alias: str):
    return load_tokenizer(metadata(alias))


@pytest.mark.parametrize("alias", MODELS)
def test_cases_match_llamacpp(alias):
    tok, ref = model_tokenizer(alias), reference(MODELS[alias])
    cases = ref["tokenizer"]["cases"]
    assert len(cases) >= 20
    for case in cases:
        text = case["text"]
        assert tok.encode(text, add_bos=False) == case["ids_special"], text
        assert tok.encode(text, add_bos=False, special=False) == case["ids_plain"], text
        assert tok.decode(case["ids_special"]) == text
        assert tok.decode(case["ids_plain"]) == text


@pytest.mark.parametrize("alias", MODELS)
def test_prompts_and_generations_match_llamacpp(alias):
    tok, ref = model_tokenizer(alias), reference(MODELS[alias])
    if "chat_template" in ref and ref["chat_template"]:
        chat = ref["chat_template"]
        assert tok.encode(chat["rendered"], add_bos=False) == chat["rendered_ids"]
    for gen in ref["generations"]:
        if gen["kind"] == "plain":
            assert tok.encode(gen["prompt"]) == gen["prompt_ids"], gen["prompt"]
        # llama.cpp's detokenization of the generated ids leaves control tokens out
        assert tok.decode(gen["ids"], skip_special=True) == gen["text"]
        assert gen["ids"][-1] not in tok.eot_ids or tok.is_control(gen["ids"][-1])


@pytest.mark.parametrize("alias", MODELS)
def test_stream_decoder_on_model_tokens(alias):
    tok, ref = model_tokenizer(alias), reference(MODELS[alias])
    for case in ref["tokenizer"]["cases"]:
        assert_streams_whole_characters(tok, case["ids_special"])
    for gen in ref["generations"]:
        assert_streams_whole_characters(tok, gen["ids"], skip_special=True)
    emoji = next(c for c in ref["tokenizer"]["cases"] if "🤖" in c["text"])
    parts = stream(tok, emoji["ids_special"])
    if len(emoji["ids_special"]) > len(tok.encode("emoji: ", add_bos=False)) + 2:
        assert "" in parts[:-1]  # a byte piece of an emoji was held back


@pytest.mark.parametrize("alias, eog", [
    ("smollm2-135m", {"<|endoftext|>", "<|im_end|>"}),
    ("qwen2.5-coder-0.5b", {"<|endoftext|>", "<|im_end|>"}),
    ("gemma3-270m", {"<eos>", "<end_of_turn>"}),
])
def test_end_of_generation_ids(alias, eog):
    tok = model_tokenizer(alias)
    assert tok.eos_id in tok.eot_ids
    assert set(ids_of(tok, *eog)) <= tok.eot_ids
    assert all(tok.is_control(i) for i in tok.eot_ids)


def test_qwen_tokenizer_loads_fast():
    md = metadata("qwen2.5-coder-0.5b")
    start = time.perf_counter()
    tok = load_tokenizer(md)
    tok.encode("warm up the caches: def f(x): return x ** 2")
    elapsed = time.perf_counter() - start
    assert tok.vocab_size == 151936
    assert elapsed < 2.0, f"loading the Qwen tokenizer took {elapsed:.2f} s"


def _resident_mib() -> float:
    """Resident memory after handing the allocator's free pages back."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.parametrize("alias, n_words", [("smollm2-135m", 30), ("minilm-l6", 300)])
def test_long_random_words_do_not_pile_up_in_the_word_memo(alias, n_words):
    """The tokenizers memoise the encodings of words, 65,536 of them. A client's long
    random words (a prompt or a text to embed holds a few hundred kB) must not be kept:
    memoised, each 100,000-character word held ~1 MB (BPE) or its 100 kB text
    (WordPiece's [UNK]). Resident memory stays flat over them, and a long word encodes
    the same each time."""
    tok = model_tokenizer(alias)
    rng = random.Random(7)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
                                 k=100_000)) for _ in range(n_words + 3)]
    for w in words[:3]:  # the allocator's and the pre-tokenizer's first growth
        tok.encode(w)
    before = _resident_mib()
    for w in words[3:]:
        tok.encode(w)
    grown = _resident_mib() - before
    assert grown < 10, f"{grown:.0f} MiB kept after {n_words} long words"
    assert tok.encode(words[0]) == tok.encode(words[0])
