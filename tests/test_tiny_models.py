"""Tiny random-weight Llama / Qwen2 / Qwen3 models: transformers -> GGUF -> our engine.

Each variant is a transformers model (hidden 64, 2 layers, 4 query heads over
2 KV heads, a 269-token byte-level vocabulary) with seeded random weights
large enough that attention is far from uniform (so RoPE, GQA and the QK norm
all move the logits), written with `tests.hf_to_gguf.write_gguf` as llama.cpp's
converter would; logits are compared at every position of a fixed 20-token prompt.
The file and what transformers answered on it (logits, greedy generation, config,
weights) are the golden `tiny-llama-<variant>` (tests/goldens/make_tiny_llama.py):
no peer runs here.

Metric for every logits comparison:
    max |ours - ref| <= 1e-4 * max |ref|    (over all T x V entries)

- test_gguf_layout: the converter's file, read back with `gguf.GGUFReader`
  (names, shapes, types, metadata against transformers' config; layer 0's Q/K rows and
  the embedding against transformers' weights); no engine needed.
- test_numpy_reference_on_gguf: a small NumPy forward pass written here from the
  llama.cpp conventions (interleaved RoPE for llama, NEOX for qwen, rope_freqs
  divisors, QK norm) on the GGUF tensors matches transformers' logits: this checks
  the converter itself, independently of the engine.
- test_logits_whole_prompt / test_logits_prefill_then_decode: the engine's
  `LLM.forward` on the whole prompt in one call, and 12-token prefill then one
  token at a time with the same cache.
- test_greedy_generation: `LLM.generate(ids, temperature=0)` gives transformers'
  `generate(do_sample=False)` tokens (its scores at each step are stored to judge a
  near tie).
- The engine tests run on each of `DEVICES` (tests/support/devices.py): the NumPy engine,
  the MLX backend, and the CuPy backend's code with NumPy standing in for CuPy.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from tests.goldens.make_tiny_llama import GREEDY_STEPS
from tests.hf_to_gguf import interleave_rope_rows
from tests.support.devices import DEVICES, open_llm
from tests.support.tiny_llama import PROMPT, RTOL, VARIANTS, VOCAB, Built, V
from tests.support.tiny_llama import assert_close as _assert_close

PREFILL = 12


@pytest.fixture(scope="module", params=list(VARIANTS))
def built(request, tmp_path_factory):
    return Built(request.param, tmp_path_factory.mktemp("tiny"))


# -- the converter, checked without the engine --------------------------------------------

def test_gguf_layout(built):
    r = gguf.GGUFReader(built.path)
    cfg = built.golden.outputs["config"]  # transformers' config
    arch = built.arch

    def field(key):
        f = r.fields[key]
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            if f.types[-1] == gguf.GGUFValueType.STRING:
                return [bytes(f.parts[i]).decode() for i in f.data]
            return [f.parts[i][0].item() for i in f.data]
        if f.types[0] == gguf.GGUFValueType.STRING:
            return bytes(f.parts[f.data[0]]).decode()
        return f.parts[f.data[0]][0].item()

    head_dim = cfg["head_dim"]
    assert field("general.architecture") == arch
    assert field(f"{arch}.block_count") == 2
    assert field(f"{arch}.context_length") == 128
    assert field(f"{arch}.embedding_length") == 64
    assert field(f"{arch}.feed_forward_length") == 128
    assert field(f"{arch}.attention.head_count") == 4
    assert field(f"{arch}.attention.head_count_kv") == 2
    assert field(f"{arch}.rope.dimension_count") == head_dim
    assert field(f"{arch}.rope.freq_base") == pytest.approx(cfg["rope_parameters"]["rope_theta"])
    assert field(f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(cfg["rms_norm_eps"])
    if head_dim != 16:
        assert field(f"{arch}.attention.key_length") == head_dim
        assert field(f"{arch}.attention.value_length") == head_dim
    else:
        assert f"{arch}.attention.key_length" not in r.fields
    scaling = cfg["rope_parameters"].get("rope_type")
    if scaling == "linear":
        assert field(f"{arch}.rope.scaling.type") == "linear"
        assert field(f"{arch}.rope.scaling.factor") == pytest.approx(4.0)
    else:
        assert f"{arch}.rope.scaling.type" not in r.fields

    assert field("tokenizer.ggml.model") == "gpt2"
    tokens = field("tokenizer.ggml.tokens")
    assert len(tokens) == V == cfg["vocab_size"]
    assert tokens[0] == "!" and tokens[188] == "Ā" and tokens[-1] == "<|endoftext|>"
    assert len(set(tokens)) == V
    types = field("tokenizer.ggml.token_type")
    assert types[-1] == 3 and set(types[:-1]) == {1}
    merges = field("tokenizer.ggml.merges")
    assert merges and all(a + b in tokens for a, b in (m.split(" ") for m in merges))
    assert field("tokenizer.ggml.bos_token_id") == field("tokenizer.ggml.eos_token_id") == V - 1

    tensors = {t.name: t for t in r.tensors}
    hd, kvd = 4 * head_dim, 2 * head_dim
    expect = {"token_embd.weight": (V, 64), "output_norm.weight": (64,)}
    if not cfg["tie_word_embeddings"]:
        expect["output.weight"] = (V, 64)
    if scaling == "llama3":
        expect["rope_freqs.weight"] = (head_dim // 2,)
    for i in range(2):
        p = f"blk.{i}."
        expect.update({p + "attn_norm.weight": (64,), p + "ffn_norm.weight": (64,),
                       p + "attn_q.weight": (hd, 64), p + "attn_k.weight": (kvd, 64),
                       p + "attn_v.weight": (kvd, 64), p + "attn_output.weight": (64, hd),
                       p + "ffn_gate.weight": (128, 64), p + "ffn_up.weight": (128, 64),
                       p + "ffn_down.weight": (64, 128)})
        if arch == "qwen2":
            expect.update({p + "attn_q.bias": (hd,), p + "attn_k.bias": (kvd,),
                           p + "attn_v.bias": (kvd,)})
        if arch == "qwen3":
            expect.update({p + "attn_q_norm.weight": (head_dim,),
                           p + "attn_k_norm.weight": (head_dim,)})
    assert set(tensors) == set(expect)
    for name, shape in expect.items():
        t = tensors[name]
        # GGUF lists dims fastest-first
        assert tuple(reversed([int(d) for d in t.shape])) == shape, name
        want = built.qtype if len(shape) == 2 else gguf.GGMLQuantizationType.F32
        assert t.tensor_type == want, name

    q = _read(r, "blk.0.attn_q.weight")
    k = _read(r, "blk.0.attn_k.weight")
    q_hf, k_hf = built.golden.arrays["layer0_q_proj"], built.golden.arrays["layer0_k_proj"]
    if arch == "llama":  # rows permuted per head: row h*d + 2i + j <- h*d + j*d/2 + i
        d = head_dim
        assert np.array_equal(q[1], q_hf[d // 2]) and np.array_equal(q[2], q_hf[1])
        assert np.array_equal(q, interleave_rope_rows(q_hf, 4))
        assert np.array_equal(k, interleave_rope_rows(k_hf, 2))
    else:
        assert np.array_equal(q, q_hf) and np.array_equal(k, k_hf)
    assert np.array_equal(_read(r, "token_embd.weight"), built.golden.arrays["embed_tokens"])
    if scaling == "llama3":
        f = _read(r, "rope_freqs.weight")
        assert f[0] == 1.0 and 1.0 < f[1] < 8.0 and np.all(f[2:] == 8.0)


def _read(r, name: str) -> np.ndarray:
    t = next(t for t in r.tensors if t.name == name)
    shape = tuple(reversed([int(d) for d in t.shape]))
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)


def _numpy_forward(path, ids: list[int]) -> np.ndarray:
    """Logits (T, V) of a llama-family GGUF, computed the way llama.cpp defines the
    architectures (a reference for the converter, not the engine's code)."""
    r = gguf.GGUFReader(path)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

    def num(key, default=None):
        f = r.fields.get(f"{arch}.{key}")
        return default if f is None else f.parts[-1][0].item()

    W = {t.name: _read(r, t.name) for t in r.tensors}
    n_head, n_kv, eps = num("attention.head_count"), num("attention.head_count_kv"), \
        num("attention.layer_norm_rms_epsilon")
    d = num("attention.key_length", num("embedding_length") // n_head)
    scale = num("rope.scaling.factor", 1.0)  # written for linear scaling only
    inv = num("rope.freq_base") ** (-np.arange(0, d, 2) / d)
    if "rope_freqs.weight" in W:
        inv = inv / W["rope_freqs.weight"]
    ang = np.arange(len(ids))[:, None] / scale * inv[None, :]  # (T, d/2)
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]

    def rope(x):  # (T, H, d)
        if arch == "llama":
            a, b = x[..., 0::2], x[..., 1::2]
            out = np.empty_like(x)
            out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
            return out
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    T = len(ids)
    x = W["token_embd.weight"][ids].astype(np.float64)
    for i in range(num("block_count")):
        p = f"blk.{i}."
        h = norm(x, W[p + "attn_norm.weight"])
        q, k, v = (h @ W[p + f"attn_{n}.weight"].T + W.get(p + f"attn_{n}.bias", 0.0)
                   for n in "qkv")
        q, k, v = q.reshape(T, n_head, d), k.reshape(T, n_kv, d), v.reshape(T, n_kv, d)
        if p + "attn_q_norm.weight" in W:
            q, k = norm(q, W[p + "attn_q_norm.weight"]), norm(k, W[p + "attn_k_norm.weight"])
        q, k = rope(q), rope(k)
        rep = n_head // n_kv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(d)
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", pr, v).reshape(T, n_head * d)
        x = x + o @ W[p + "attn_output.weight"].T
        h = norm(x, W[p + "ffn_norm.weight"])
        g = h @ W[p + "ffn_gate.weight"].T
        x = x + (g / (1 + np.exp(-g)) * (h @ W[p + "ffn_up.weight"].T)) @ W[p + "ffn_down.weight"].T
    x = norm(x, W["output_norm.weight"])
    return (x @ W.get("output.weight", W["token_embd.weight"]).T).astype(np.float32)


def test_numpy_reference_on_gguf(built):
    _assert_close(_numpy_forward(built.path, PROMPT), built.ref,
                  f"{built.name}: NumPy reference on the GGUF vs transformers")


# -- the engine --------------------------------------------------------------------------

@pytest.fixture(params=DEVICES)
def engine(built, request):
    m = open_llm(built.path, request.param)
    yield m
    m.close()


def test_logits_whole_prompt(built, engine):
    ours = engine.forward(PROMPT, engine.new_cache())
    _assert_close(np.asarray(ours), built.ref, f"{built.name}: forward(whole prompt)")


def test_logits_prefill_then_decode(built, engine):
    cache = engine.new_cache()
    parts = [engine.forward(PROMPT[:PREFILL], cache)]
    for t in PROMPT[PREFILL:]:
        parts.append(engine.forward([t], cache))
    ours = np.concatenate([np.asarray(p) for p in parts], axis=0)
    _assert_close(ours, built.ref, f"{built.name}: prefill {PREFILL} + one token at a time")


def test_greedy_generation(built, engine):
    ref = list(built.golden.outputs["greedy_ids"])  # transformers' greedy generate
    scores = built.golden.arrays["greedy_scores"]  # its logits at each step (steps, V)
    if ref and ref[-1] == VOCAB.eos_id:  # ours stops at EOS without reporting it
        ref = ref[:-1]
    ours = engine.generate(PROMPT, max_tokens=GREEDY_STEPS, temperature=0).token_ids
    if ours == ref:
        return
    step = next(i for i, (a, b) in enumerate(zip([*ours, None], [*ref, None])) if a != b)
    at = scores[step] if step < len(scores) else None
    if at is not None and step < len(ours):
        # logits that agree to RTOL may still pick a different argmax where the top two
        # are closer than that: the sequences may then part ways without a fault
        top2 = np.sort(at)[::-1][:2]
        if float(top2[0] - top2[1]) <= 2 * RTOL * float(np.abs(at).max()):
            ours_score = float(at[ours[step]])
            assert float(top2[0]) - ours_score <= 2 * RTOL * float(np.abs(at).max())
            return
    pytest.fail(f"{built.name}: greedy ids differ at step {step}: ours {ours}, "
                f"transformers {ref} (transformers' top-2 logits there: "
                f"{None if at is None else np.sort(at)[::-1][:2].tolist()})")
