"""Crafted model and cache files: each fails fast with its loader's own error class
(`GGUFError`, `PrefixCacheError`, `WhisperFileError`, all ValueErrors) and a message that
names the problem, never with an error from deep inside, a blowup or a silent bad load.

The "valid except one field" files start from the tiny real models the fidelity tests
use (stored in the goldens `tiny-llama-speculative` and `whisper-tiny-random-f32`);
headers the `gguf` writer refuses to produce are written byte by byte. Cases that used to
allocate gigabytes, and the seeded fuzz loop, run in a subprocess under RLIMIT_AS and a
timeout, so a blowup or a hang fails the test instead of taking the machine down.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from gguf import GGUFValueType as VT

from tests.support.file_layouts import HPARAM, patched, prefix_parts, write_prefix
from tests.support.gguf_bytes import ARCH, gguf_bytes, gguf_str, kv, rewrite_gguf, tensor
from tests.support.limited_loads import FAST, assert_limited_refusal, refused, run_limited
from tests.support.mutations import (
    EXTRA_COUNT_KEYS,
    HOSTILE_INTS,
    HOSTILE_VALUES,
    LARGE_COUNTS,
    mutated_bytes,
)
from workbench.engine.formats.gguf import GGUFError, open_gguf
from workbench.engine.formats.whisper_file import WhisperFile, WhisperFileError
from workbench.engine.runtime.prefix_cache import PrefixCache, PrefixCacheError

KV_CACHE_SIZE = 64


# -- building the files --------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """A tiny random-weight llama (2 layers, width 64, 4 heads over 2 KV heads, 269 tokens,
    weight seed 7): the speculative tests' target, from the golden `tiny-llama-speculative`."""
    from tests.goldens import load
    from tests.goldens.make_tiny_llama import SPECULATIVE

    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    shutil.copyfile(load(SPECULATIVE).file("target.gguf"), path)
    return path


@pytest.fixture(scope="module")
def tiny_bin(tmp_path_factory) -> Path:
    """A tiny random-weight Whisper `.bin` (vocab 120, 80 mels, width 64, 2 + 2 layers), as
    `tests.whisper_to_bin.write_bin` wrote it: the golden `whisper-tiny-random-f32`."""
    from tests.goldens import load

    path = tmp_path_factory.mktemp("bin") / "tiny-whisper.bin"
    shutil.copyfile(load("whisper-tiny-random-f32").file("tiny.bin"), path)
    return path


@pytest.fixture(scope="module")
def tiny_llm(tiny_gguf):
    from workbench import LLM

    with LLM(open_gguf(tiny_gguf), prepare_kernels=False, kv_cache_size=KV_CACHE_SIZE) as m:
        yield m


def load_llm(path: Path):
    from workbench import LLM

    return LLM(open_gguf(path), prepare_kernels=False, kv_cache_size=KV_CACHE_SIZE)


# -- GGUF: metadata the model uses ----------------------------------------------------------

BAD_METADATA = {
    "alignment-0": ({"general.alignment": (0, VT.UINT32)}, "alignment is 0.*power of two"),
    "alignment-3": ({"general.alignment": (3, VT.UINT32)}, "alignment is 3.*power of two"),
    "block-count-0": ({"llama.block_count": (0, VT.UINT32)}, "'llama.block_count' is 0"),
    "block-count-3": ({"llama.block_count": (3, VT.UINT32)},
                      "'llama.block_count' is 3, but the file holds tensors for 2 layers "
                      "\\(blk.0 to blk.1\\)"),
    "block-count-1": ({"llama.block_count": (1, VT.UINT32)},
                      "'llama.block_count' is 1, but the file holds tensors for 2 layers"),
    "expert-count-huge": ({"llama.expert_count": (2**31 - 1, VT.UINT32),
                           "llama.expert_used_count": (2, VT.UINT32)},
                          "no tensor 'blk.0.ffn_gate_inp.weight'"),
    "head-count-0": ({"llama.attention.head_count": (0, VT.UINT32)}, "head_count' is 0"),
    "head-count-kv-0": ({"llama.attention.head_count_kv": (0, VT.UINT32)},
                        "head_count_kv' is 0"),
    "freq-base-nan": ({"llama.rope.freq_base": (math.nan, VT.FLOAT32)},
                      "freq_base' is nan; it must be finite"),
    "freq-base-inf": ({"llama.rope.freq_base": (math.inf, VT.FLOAT64)}, "freq_base' is inf"),
    "rms-eps-negative": ({"llama.attention.layer_norm_rms_epsilon": (-1.0, VT.FLOAT32)},
                         "epsilon' is -1.0; it must be finite and > 0"),
    "rms-eps-huge": ({"llama.attention.layer_norm_rms_epsilon": (1e30, VT.FLOAT32)},
                     "and <= 1.0"),
    "context-length-0": ({"llama.context_length": (0, VT.UINT32)}, "context_length' is 0"),
    "block-count-string": ({"llama.block_count": ("two", VT.STRING)},
                           "block_count' holds a str.*not an integer"),
    "embedding-huge": ({"llama.embedding_length": (2**40, VT.UINT64)},
                       "embedding_length' is 1099511627776, outside"),
    "head-count-negative": ({"llama.attention.head_count": (-4, VT.INT32)},
                            "head_count' is -4, outside"),
    "heads-not-dividing-width": ({"llama.attention.head_count": (6, VT.UINT32)},
                                 "64 does not split into 6 heads"),
    "kv-heads-not-dividing-heads": ({"llama.attention.head_count_kv": (3, VT.UINT32)},
                                    "4 query heads do not share 3 KV heads"),
    "vocab-size-mismatch": ({"llama.vocab_size": (1000, VT.UINT32)},
                            "vocabulary does not add up: 269 tokens.*1000"),
    "rope-dims-odd": ({"llama.rope.dimension_count": (15, VT.UINT32)},
                      "dimension_count 15 must be even"),
    "rope-factor-nan": ({"llama.rope.scaling.type": ("linear", VT.STRING),
                         "llama.rope.scaling.factor": (math.nan, VT.FLOAT32)},
                        "scaling.factor' is nan"),
    "tokens-not-a-list": ({"tokenizer.ggml.tokens": (7, VT.UINT32)}, "tokenizer.ggml.tokens"),
    "swa-pattern-wrong-length": ({"llama.attention.sliding_window": (8, VT.UINT32),
                                  "llama.attention.sliding_window_pattern":
                                      ([True] * 5, VT.ARRAY, VT.BOOL)},
                                 "flags 5 layers of 2"),
    "feed-forward-mismatch": ({"llama.feed_forward_length": (100, VT.UINT32)},
                              "'blk.0.ffn_gate.weight' has shape \\(128, 64\\).*\\(100, 64\\)"),
    "key-length-mismatch": ({"llama.attention.key_length": (32, VT.UINT32),
                             "llama.attention.value_length": (32, VT.UINT32),
                             "llama.rope.dimension_count": (32, VT.UINT32)},
                            "'blk.0.attn_q.weight' has shape"),
}


@pytest.mark.parametrize("case", list(BAD_METADATA))
def test_bad_metadata_is_refused_at_load(tiny_gguf, tmp_path, case):
    changes, match = BAD_METADATA[case]
    path = rewrite_gguf(tiny_gguf, tmp_path / f"{case}.gguf", changes)
    refused(GGUFError, match, load_llm, path)


def test_the_unchanged_file_loads_and_answers(tiny_gguf, tmp_path):
    """The control: the same rewrite without a change gives a working model."""
    m = load_llm(rewrite_gguf(tiny_gguf, tmp_path / "same.gguf"))
    logits = m.forward([1, 2, 3], m.new_cache())
    assert logits.shape == (3, 269) and np.isfinite(logits).all()


def test_tensor_shapes_must_fit_the_metadata(tiny_gguf, tmp_path):
    path = rewrite_gguf(tiny_gguf, tmp_path / "embd.gguf",
                        tensors={"token_embd.weight": lambda a: a[:200]})
    refused(GGUFError, "269 tokens.*200 rows in token_embd", load_llm, path)
    path = rewrite_gguf(tiny_gguf, tmp_path / "out.gguf",
                        tensors={"blk.1.attn_output.weight": lambda a: a[:, :32].copy()})
    refused(GGUFError, "'blk.1.attn_output.weight' has shape \\(64, 32\\).*\\(64, 64\\)",
            load_llm, path)
    path = rewrite_gguf(tiny_gguf, tmp_path / "norm.gguf",
                        tensors={"blk.0.attn_norm.weight": lambda a: a[:10].copy()})
    refused(GGUFError, "'blk.0.attn_norm.weight' has shape \\(10,\\)", load_llm, path)


@pytest.mark.parametrize("n_layer", [2_000_000, 2**31 - 1])
@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_huge_block_count_in_limited_memory(tiny_gguf, tiny_bert_gguf, tmp_path, arch, n_layer):
    """A block count far past the file's layers is refused by comparing it with the blk.N
    tensors, before any per-layer loop (these used to build ~18 dict entries per claimed
    layer: a MemoryError after 10 s or more)."""
    src, load = (tiny_gguf, "load_llm") if arch == "llama" else (tiny_bert_gguf, "load_encoder")
    path = rewrite_gguf(src, tmp_path / "layers.gguf",
                        {f"{arch}.block_count": (n_layer, VT.UINT32)})
    assert_limited_refusal(f"""
from pathlib import Path
from tests.test_hostile_files import {load}
load = lambda: {load}(Path({str(path)!r}))
""", "GGUFError", f"'{arch}.block_count' is {n_layer}, but the file holds tensors for 2 "
        "layers")


def test_huge_heads_without_a_query_projection_in_limited_memory(tiny_gguf, tmp_path):
    """Head sizes are checked against the query projection, which must be there before the
    RoPE tables are sized by them (without it, 2^30 rotated dimensions: 4 GiB at once)."""
    huge = (2**30, VT.UINT32)
    path = rewrite_gguf(tiny_gguf, tmp_path / "heads.gguf",
                        {"llama.attention.key_length": huge,
                         "llama.attention.value_length": huge,
                         "llama.rope.dimension_count": huge},
                        drop_tensors=("blk.0.attn_q.weight",))
    assert_limited_refusal(f"""
from pathlib import Path
from tests.test_hostile_files import load_llm
load = lambda: load_llm(Path({str(path)!r}))
""", "GGUFError", "no tensor 'blk.0.attn_q.weight'")


def test_empty_token_texts_are_told_apart(tiny_gguf, tmp_path):
    """Empty token texts are renamed `[EMPTY_i]` (as the tokenizer and llama.cpp do) before
    the duplicate check: several of them load; a real duplicate is still refused."""
    tokens = list(GGUFReader(tiny_gguf).fields["tokenizer.ggml.tokens"].contents())

    def with_tokens(name: str, **at: str) -> Path:
        new = list(tokens)
        for i, text in at.items():
            new[int(i[1:])] = text
        return rewrite_gguf(tiny_gguf, tmp_path / name,
                            {"tokenizer.ggml.tokens": (new, VT.ARRAY, VT.STRING)})

    m = load_llm(with_tokens("empty.gguf", t250="", t251="", t252=""))
    assert m.tokenizer.tokens[250:253] == ["[EMPTY_250]", "[EMPTY_251]", "[EMPTY_252]"]
    ids = m.tokenizer.encode("the cat sat on the mat", add_bos=False)
    assert ids and all(i < 250 or i > 252 for i in ids)
    assert m.tokenizer.decode(ids) == "the cat sat on the mat"
    assert np.isfinite(m.forward(ids[:3], m.new_cache())).all()
    m.close()
    refused(GGUFError, "tokenizer.ggml.tokens holds the same token text twice", load_llm,
            with_tokens("dup.gguf", t251=tokens[250]))
    refused(GGUFError, "tokenizer.ggml.tokens holds the same token text twice", load_llm,
            with_tokens("dup-empty.gguf", t250="", t251="[EMPTY_250]"))


@pytest.fixture(scope="module")
def tiny_bert_gguf(tmp_path_factory) -> Path:
    """A tiny random-weight BERT (width 64, 4 heads, 2 layers), converted as users do."""
    from tests.support.tiny_encoders import tiny_bert
    from workbench.engine.formats.convert import hf_bert_to_gguf

    folder = tmp_path_factory.mktemp("bert")
    tiny_bert(folder / "tiny")
    return hf_bert_to_gguf(folder / "tiny", folder / "tiny-bert.gguf")


def load_encoder(path: Path):
    from workbench import Encoder

    return Encoder(open_gguf(path), prepare_kernels=False)


BAD_BERT = {
    "heads-not-dividing-width": ({"bert.attention.head_count": (5, VT.UINT32)},
                                 "64 does not split into 5 heads"),
    "eps-nan": ({"bert.attention.layer_norm_epsilon": (math.nan, VT.FLOAT32)},
                "epsilon' is nan"),
    "block-count-0": ({"bert.block_count": (0, VT.UINT32)}, "'bert.block_count' is 0"),
    "block-count-3": ({"bert.block_count": (3, VT.UINT32)},
                      "'bert.block_count' is 3, but the file holds tensors for 2 layers"),
    "context-length-string": ({"bert.context_length": ("512", VT.STRING)},
                              "context_length' holds a str"),
    "feed-forward-mismatch": ({"bert.feed_forward_length": (96, VT.UINT32)},
                              "'blk.0.ffn_up.weight' has shape \\(128, 64\\)"),
    "causal-an-array": ({"bert.attention.causal": ([0, 1], VT.ARRAY, VT.UINT8)},
                        "a causal BERT"),
}


@pytest.mark.parametrize("case", list(BAD_BERT))
def test_bad_bert_metadata_is_refused_at_load(tiny_bert_gguf, tmp_path, case):
    changes, match = BAD_BERT[case]
    refused(GGUFError, match, load_encoder,
            rewrite_gguf(tiny_bert_gguf, tmp_path / f"{case}.gguf", changes))


def test_the_unchanged_bert_loads(tiny_bert_gguf, tmp_path):
    enc = load_encoder(rewrite_gguf(tiny_bert_gguf, tmp_path / "same.gguf"))
    assert np.isfinite(enc.embed("hello world")).all()


# -- GGUF: malformed headers ----------------------------------------------------------------

def _nested_arrays(depth: int) -> bytes:
    one_level = struct.pack("<IQ", VT.ARRAY, 1)  # an array holding one array
    return kv("deep", VT.ARRAY, one_level * depth + struct.pack("<IQ", VT.UINT8, 0))


BAD_HEADERS = {
    "nested-100000-deep": (gguf_bytes([ARCH, _nested_arrays(100_000)]), "nests arrays deeper"),
    "string-length-2^62": (gguf_bytes([ARCH, kv("s", VT.STRING, struct.pack("<Q", 2**62))]),
                           "string of 4611686018427387904 bytes runs past the end"),
    "string-array-count-2^60": (gguf_bytes([ARCH, kv("a", VT.ARRAY, struct.pack(
        "<IQ", VT.STRING, 2**60))]), "array 'a' claims 1152921504606846976 items"),
    "uint64-array-count-2^61": (gguf_bytes([ARCH, kv("a", VT.ARRAY, struct.pack(
        "<IQ", VT.UINT64, 2**61))]), "array 'a' claims 2305843009213693952 items"),
    "n-kv-2^63": (gguf_bytes([ARCH], n_kv=2**63), "metadata claims 9223372036854775808 items"),
    "n-tensors-2^63": (gguf_bytes([ARCH], n_tensors=2**63), "claims 9223372036854775808 tens"),
    "unknown-value-type": (gguf_bytes([ARCH, kv("x", 99, b"")]), "'x' has unknown value type 99"),
    "unknown-array-type": (gguf_bytes([ARCH, kv("x", VT.ARRAY, struct.pack("<IQ", 77, 1))]),
                           "'x' is an array of unknown type 77"),
    "duplicate-key": (gguf_bytes([ARCH, ARCH]), "'general.architecture' appears twice"),
    "n-dims-1000": (gguf_bytes([ARCH], [tensor("t", (4,), n_dims=1000)]), "1000 dimensions"),
    "dims-overflowing": (gguf_bytes([ARCH], [tensor("t", (2**63, 2**63, 2**63, 2**63))],
                                    tail=bytes(64)), "truncated: tensor 't' ends at byte"),
    "dim-zero": (gguf_bytes([ARCH], [tensor("t", (4, 0))], tail=bytes(64)), "has shape"),
    "offset-past-the-end": (gguf_bytes([ARCH], [tensor("t", (4,), offset=2**40)],
                                       tail=bytes(64)), "truncated: tensor 't' ends at byte"),
    "offset-unaligned": (gguf_bytes([ARCH], [tensor("t", (4,), offset=3)], tail=bytes(64)),
                         "offset 3, not a multiple of the alignment 32"),
    "duplicate-tensor": (gguf_bytes([ARCH], [tensor("t", (4,)), tensor("t", (4,))],
                                    tail=bytes(64)), "'t' is listed twice"),
    "alignment-a-string": (gguf_bytes([ARCH, kv("general.alignment", VT.STRING, gguf_str("32"))]),
                           "alignment is '32'"),
    "version-99": (b"GGUF" + struct.pack("<IQQ", 99, 0, 0), "version 99 is not supported"),
}


@pytest.mark.parametrize("case", list(BAD_HEADERS))
def test_malformed_headers_are_refused(tmp_path, case):
    data, match = BAD_HEADERS[case]
    path = tmp_path / f"{case}.gguf"
    path.write_bytes(data)
    refused(GGUFError, match, open_gguf, path)


# -- PrefixCache files -----------------------------------------------------------------------

N_PREFIX = 10


@pytest.fixture(scope="module")
def prefix_file(tiny_llm, tmp_path_factory) -> Path:
    cfg = tiny_llm.config
    rng = np.random.default_rng(0)
    shape = (cfg.n_layer, cfg.n_head_kv, N_PREFIX, cfg.head_dim)
    pc = PrefixCache(rng.integers(0, cfg.n_vocab, N_PREFIX).tolist(),
                     rng.standard_normal(shape, np.float32),
                     rng.standard_normal(shape, np.float32), tiny_llm.file_sha256)
    return pc.save(tmp_path_factory.mktemp("prefix") / "tiny.wbprefix")


def test_prefix_round_trip(tiny_llm, prefix_file):
    pc = tiny_llm.load_prefix(prefix_file)
    header, payload = prefix_parts(prefix_file)
    assert header["version"] == PrefixCache.VERSION == 2
    assert pc.tokens == header["tokens"] and len(pc) == N_PREFIX
    assert pc.keys.tobytes() + pc.values.tobytes() == payload
    assert issubclass(PrefixCacheError, ValueError)


def test_prefix_length_field_2_63(tiny_llm, prefix_file, tmp_path):
    data = bytearray(prefix_file.read_bytes())
    data[8:16] = struct.pack("<Q", 2**63)
    (tmp_path / "p").write_bytes(bytes(data))
    refused(PrefixCacheError, "header is damaged \\(it claims 9223372036854775808 bytes",
            tiny_llm.load_prefix, tmp_path / "p")


def test_prefix_deep_json_header(tiny_llm, prefix_file, tmp_path):
    _, payload = prefix_parts(prefix_file)
    path = write_prefix(tmp_path / "p", b"[" * 2000 + b"]" * 2000, payload)
    refused(PrefixCacheError, "header is damaged \\(nested 2000 deep\\)",
            tiny_llm.load_prefix, path)
    path = write_prefix(tmp_path / "q", b'{"a": "\\\\u005b"}', payload)
    refused(PrefixCacheError, "not the plain JSON", tiny_llm.load_prefix, path)


def test_prefix_payload_checked_by_checksum(tiny_llm, prefix_file, tmp_path):
    data = bytearray(prefix_file.read_bytes())
    data[-100] ^= 0x40  # one bit of the values
    (tmp_path / "p").write_bytes(bytes(data))
    refused(PrefixCacheError, "checksum does not match", tiny_llm.load_prefix, tmp_path / "p")
    # a NaN payload with a valid checksum (crafted, not damaged): refused all the same
    header, payload = prefix_parts(prefix_file)
    nan = np.frombuffer(payload, np.float32).copy()
    nan[5] = np.nan
    path = write_prefix(tmp_path / "nan", header, nan.tobytes())
    refused(PrefixCacheError, "NaN or infinite", tiny_llm.load_prefix, path)


@pytest.mark.parametrize("version", [1, 3, "2", None])
def test_prefix_other_format_versions(tiny_llm, prefix_file, tmp_path, version):
    header, payload = prefix_parts(prefix_file)
    header["version"] = version
    path = write_prefix(tmp_path / "p", header, payload, digest=version != 1)
    refused(PrefixCacheError, f"format version {version!r} is not supported.*make the prefix "
            "again", tiny_llm.load_prefix, path)


BAD_PREFIX_HEADERS = {
    "layers": (lambda h: h.update(shape=[3] + h["shape"][1:]), "do not fit this model"),
    "head-dim": (lambda h: h.update(shape=h["shape"][:3] + [8]), "do not fit this model"),
    "tokens-vs-shape": (lambda h: h.update(tokens=h["tokens"][:4]), "do not fit this model"),
    "token-out-of-vocab": (lambda h: h["tokens"].__setitem__(0, 269), "outside this model's"),
    "token-a-string": (lambda h: h["tokens"].__setitem__(0, "x"), "header is damaged"),
    "local-from": (lambda h: h.update(local_from=11), "local_from 11 lies outside"),
    "dtype": (lambda h: h.update(dtype="float16"), "header is damaged"),
    "sha": (lambda h: h.update(model_sha256="0" * 64), "another model file"),
    "not-a-dict": (lambda h: None, "header is damaged"),
}


@pytest.mark.parametrize("case", list(BAD_PREFIX_HEADERS))
def test_prefix_header_checked_against_the_model(tiny_llm, prefix_file, tmp_path, case):
    header, payload = prefix_parts(prefix_file)
    change, match = BAD_PREFIX_HEADERS[case]
    change(header)
    path = write_prefix(tmp_path / "p", [header] if case == "not-a-dict" else header, payload)
    refused(PrefixCacheError, match, tiny_llm.load_prefix, path)


def _huge_prefix(prefix_file: Path, path: Path, n: int) -> Path:
    """A sparse prefix file whose header claims `n` tokens of this model's shape."""
    header, _ = prefix_parts(prefix_file)
    L, H, _, d = header["shape"]
    header.update(tokens=[1] * n, shape=[L, H, n, d])
    write_prefix(path, header, b"", digest=False)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size + 2 * 4 * L * H * n * d + 32)
    return path


def test_prefix_past_kv_cache_size_is_not_read(tiny_llm, prefix_file, tmp_path):
    path = _huge_prefix(prefix_file, tmp_path / "long.wbprefix", 300)
    refused(PrefixCacheError, "300 tokens, more than the model's kv_cache_size 64; load the "
            "model with a larger kv_cache_size", tiny_llm.load_prefix, path)


def test_a_1_4_gb_prefix_in_limited_memory(tiny_gguf, prefix_file, tmp_path):
    """A 1.4 GB prefix for a 64-position model: refused from its header, in a subprocess
    under a 2 GiB address-space limit (the file is sparse)."""
    path = _huge_prefix(prefix_file, tmp_path / "big.wbprefix", 2_800_000)
    assert path.stat().st_size > 1.4e9
    assert_limited_refusal(f"""
from workbench import LLM
from workbench.engine.formats.gguf import open_gguf
m = LLM(open_gguf({str(tiny_gguf)!r}), prepare_kernels=False, kv_cache_size={KV_CACHE_SIZE})
load = lambda: m.load_prefix({str(path)!r})
""", "PrefixCacheError", "header is damaged \\(it claims 84001\\d\\d bytes.*at most 4864")


# -- whisper.cpp .bin ------------------------------------------------------------------------

def load_whisper(path: Path):
    from workbench.engine.models.whisper import Whisper

    return Whisper(WhisperFile(path))


BAD_WHISPER = {
    "n_text_ctx-1": ({"n_text_ctx": 1}, "'decoder.positional_embedding' has shape \\(64, 64\\)"
                     ".*\\(1, 64\\)"),
    "n_audio_ctx-1499": ({"n_audio_ctx": 1499}, "'encoder.positional_embedding'"),
    "n_vocab-0": ({"n_vocab": 0}, "n_vocab = 0"),
    "n_vocab-121": ({"n_vocab": 121}, "'decoder.token_embedding.weight' has shape \\(120, 64\\)"),
    "n_audio_state-negative": ({"n_audio_state": -64}, "n_audio_state = -64"),
    "n_audio_head-7": ({"n_audio_head": 7}, "n_audio_state 64 does not split into"),
    "n_text_head-0": ({"n_text_head": 0}, "n_text_head = 0"),
    "n_audio_layer-huge": ({"n_audio_layer": 2**31 - 1}, "n_audio_layer = 2147483647"),
    "n_text_state-32": ({"n_text_state": 32}, "has shape"),
    "n_mels-1000": ({"n_mels": 1000}, "n_mels = 1000"),
    "n_mels-40": ({"n_mels": 40}, "mel filter bank of 80 x 201 for n_mels 40"),
    "n_mel-mismatch": ({"n_mel": 81}, "mel filter bank of 81 x 201"),
    "n_fft-negative": ({"n_fft": -1}, "mel filter bank of 80 x -1"),
    "ftype-negative": ({"ftype": -1}, "implausible ftype -1"),
}


@pytest.mark.parametrize("case", list(BAD_WHISPER))
def test_bad_whisper_hparams(tiny_bin, tmp_path, case):
    fields, match = BAD_WHISPER[case]
    refused(WhisperFileError, match, load_whisper, patched(tiny_bin, tmp_path / "w.bin", **fields))


def test_whisper_vocabulary_and_tensor_headers(tiny_bin, tmp_path):
    data = tiny_bin.read_bytes()
    at = HPARAM["n_fft"] + 4 + 4 * 80 * 201  # n_tokens
    for n_tokens, match in ((2**31 - 1, "stored tokens for n_vocab 120"),
                            (-1, "-1 stored tokens")):
        path = tmp_path / "v.bin"
        path.write_bytes(data[:at] + struct.pack("<i", n_tokens) + data[at + 4:])
        refused(WhisperFileError, match, WhisperFile, path)
    path = tmp_path / "len.bin"  # the first token claims 4 GB
    path.write_bytes(data[: at + 4] + struct.pack("<I", 2**32 - 1) + data[at + 8:])
    refused(WhisperFileError, "truncated inside the vocabulary", WhisperFile, path)
    first = at + 4 + sum(4 + 1 for _ in range(100))  # the first tensor's header
    path = tmp_path / "dims.bin"
    path.write_bytes(data[:first + 12] + struct.pack("<i", -5) + data[first + 16:])
    refused(WhisperFileError, "has dimensions \\(-5", WhisperFile, path)


def test_whisper_n_text_ctx_2_30_in_limited_memory(tiny_bin, tmp_path):
    path = patched(tiny_bin, tmp_path / "ctx.bin", n_text_ctx=2**30)
    assert_limited_refusal(f"""
from workbench.engine.models.whisper import Whisper
from workbench.engine.formats.whisper_file import WhisperFile
load = lambda: Whisper(WhisperFile({str(path)!r}))
""", "WhisperFileError", "n_text_ctx = 1073741824")
    path = patched(tiny_bin, tmp_path / "ctx2.bin", n_text_ctx=448)
    refused(WhisperFileError, "'decoder.positional_embedding' has shape \\(64, 64\\), but the "
            "hyperparameters make it \\(448, 64\\)", load_whisper, path)


# -- seeded fuzzing -----------------------------------------------------------------------------

FUZZ_CASES = 120  # per format
def fuzz_main(gguf_path: str, prefix_path: str, bin_path: str, workdir: str, seed: int) -> None:
    """The fuzz loop (run in a limited subprocess): print one line per case that raised
    something other than the loader's own error class or took longer than `FAST`."""
    from workbench import LLM

    work = Path(workdir)
    rng = random.Random(seed)
    model = LLM(open_gguf(gguf_path), prepare_kernels=False, kv_cache_size=KV_CACHE_SIZE)
    reader = GGUFReader(gguf_path)
    keys = [k for k in reader.fields if not k.startswith("GGUF.") and k != "general.architecture"]
    count_keys = [k for k in keys if type(reader.fields[k].contents()) is int]
    count_keys += [k for k in EXTRA_COUNT_KEYS if k not in count_keys]
    gguf_data, prefix_data, bin_data = (Path(p).read_bytes() for p in
                                        (gguf_path, prefix_path, bin_path))
    header_end = reader.data_offset
    n_prefix_header = struct.unpack_from("<Q", prefix_data, 8)[0]
    outcome = {"ok": 0, "refused": 0}

    def attempt(what: str, allowed: type, load, path: Path) -> None:
        start = time.perf_counter()
        try:
            load(path)
            outcome["ok"] += 1
        except allowed:
            outcome["refused"] += 1
        except Exception as exc:  # noqa: BLE001 - reported as the failure it is
            print(f"FAIL {what}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        if time.perf_counter() - start > FAST:
            print(f"SLOW {what}: {time.perf_counter() - start:.1f} s", flush=True)

    def open_llm(path: Path):
        LLM(open_gguf(path), prepare_kernels=False, kv_cache_size=KV_CACHE_SIZE).close()

    for i in range(FUZZ_CASES):
        path = work / f"g{i}.gguf"
        if i % 4 == 1:  # large counts: every other such case the block count itself
            changes = {"llama.block_count" if i % 8 == 1 else rng.choice(count_keys):
                       (rng.choice(LARGE_COUNTS), VT.UINT32)}
            if rng.random() < 0.5:
                changes[rng.choice(count_keys)] = (rng.choice(LARGE_COUNTS), VT.UINT32)
            rewrite_gguf(Path(gguf_path), path, changes)
            what = f"gguf {changes}"
        elif i % 2:
            changes = {}
            for _ in range(rng.randint(1, 2)):
                changes[rng.choice(keys)] = rng.choice(HOSTILE_VALUES)
            rewrite_gguf(Path(gguf_path), path, changes)
            what = f"gguf {changes}"
        else:
            path.write_bytes(mutated_bytes(rng, gguf_data, header_end))
            what = f"gguf bytes case {i}"
        attempt(what, GGUFError, open_llm, path)
        path.unlink()

    for i in range(FUZZ_CASES):
        path = work / f"p{i}.wbprefix"
        if i % 2:
            header = json.loads(prefix_data[16 : 16 + n_prefix_header])
            key = rng.choice(list(header) + ["extra"])
            header[key] = rng.choice([v[0] for v in HOSTILE_VALUES] + [[2**70], [[[]]], {}])
            write_prefix(path, header, prefix_data[16 + n_prefix_header : -32])
            what = f"prefix {key}={header[key]!r}"
        else:
            path.write_bytes(mutated_bytes(rng, prefix_data, 16 + n_prefix_header
                                            if rng.random() < 0.8 else len(prefix_data)))
            what = f"prefix bytes case {i}"
        attempt(what, PrefixCacheError, model.load_prefix, path)

    for i in range(FUZZ_CASES):
        path = work / f"w{i}.bin"
        if i % 2:
            field = rng.choice(list(HPARAM))
            data = bytearray(bin_data)
            value = rng.choice([v for v in HOSTILE_INTS if -2**31 <= v < 2**31]
                               + [1500, 448, 51865, 2**20, 1024, 2_000_000])
            struct.pack_into("<i", data, HPARAM[field], value)
            path.write_bytes(bytes(data))
            what = f"whisper {field}={value}"
        else:
            path.write_bytes(mutated_bytes(rng, bin_data, 52 + 4 * 80 * 201 + 600))
            what = f"whisper bytes case {i}"
        attempt(what, WhisperFileError, load_whisper, path)
    print(f"DONE {outcome['ok']} loaded, {outcome['refused']} refused", flush=True)


def test_seeded_fuzz_of_all_three_formats(tiny_gguf, prefix_file, tiny_bin, tmp_path):
    """A few hundred mutated files, loaded in a subprocess with 2 GiB of address space and
    a time limit: only the loaders' own errors (or a successful load), never a hang."""
    done = run_limited(
        "from tests.test_hostile_files import fuzz_main; "
        f"fuzz_main({str(tiny_gguf)!r}, {str(prefix_file)!r}, {str(tiny_bin)!r}, "
        f"{str(tmp_path)!r}, seed=28)", timeout=120)
    report = done.stdout.splitlines()
    problems = [line for line in report if line.startswith(("FAIL", "SLOW"))]
    assert done.returncode == 0 and report and report[-1].startswith("DONE"), \
        (done.returncode, done.stdout[-3000:], done.stderr[-3000:])
    assert not problems, "\n".join(problems[:30])
    refused_count = int(report[-1].split()[3])
    assert refused_count > FUZZ_CASES  # the mutations do reach the checks
