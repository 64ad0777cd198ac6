"""Test helper: write a transformers Llama / Qwen2 / Qwen3 model (and Mistral, Mixtral,
Qwen2-MoE, Phi-3, Gemma 3) as a GGUF file.

The file holds what llama.cpp's `convert_hf_to_gguf.py` produces for such a
checkpoint, so that the engine can be checked against transformers on tiny
random-weight models without downloading anything:

- metadata `{arch}.*` (block count, context/embedding/feed-forward lengths,
  head counts, key/value length when the head size is not hidden/heads, RoPE
  base and dimension count, RMS-norm epsilon; linear RoPE scaling as
  `rope.scaling.type`/`.factor`);
- Llama 3 RoPE scaling as llama.cpp stores it: no scaling keys, but a
  `rope_freqs.weight` tensor of one divisor per rotated pair;
- llama only: the rows of the Q and K projections reordered per head so that
  RoPE rotates interleaved pairs (x[2i], x[2i+1]) instead of the halves that
  transformers rotates; qwen2 and qwen3 use NEOX RoPE in llama.cpp and are
  written unchanged;
- Mistral as llama with `llama.attention.sliding_window`; Mixtral and Qwen2-MoE
  experts as 3-D tensors (`ffn_{gate,up,down}_exps`, the fused gate/up parameter
  of transformers split in two), the router `ffn_gate_inp` and Qwen2-MoE's shared
  expert (`*_shexp`, its sigmoid gate as the vector `ffn_gate_inp_shexp`);
- Phi-3 with its fused `attn_qkv` and `ffn_up` (gate rows first) as they are,
  and LongRoPE as llama.cpp's converter writes it: `rope_factors_long.weight`,
  `rope_factors_short.weight`, `rope.scaling.original_context_length` and
  `rope.scaling.attn_factor` (sqrt(1 + ln(factor) / ln(original context)),
  factor = context length / original context, unless the config gives it);
- Gemma 3 with its four norms per layer, every norm weight stored as 1 + w (the
  converter folds Gemma's `x * (1 + w)` into the weight);
- a tiny GPT-2 style byte-level BPE vocabulary (`tiny_vocab`): 256 byte symbols,
  a few merges and `<|endoftext|>` as a control token. Build the model with
  `vocab_size=len(tiny_vocab().tokens)`.

1-D tensors (norms, biases, RoPE factors) are always F32, as llama.cpp writes
them; matrices are F32, or F16/BF16/Q8_0... with `qtype` (`gguf.quants.quantize`).
`snap_to_qtype` rounds a model's matrices through that format in place, so that
transformers computes with exactly the weights the file holds.

The writer runs where the goldens are made (tests/goldens); torch is imported only by
`snap_to_qtype`, so the test gate may import the vocabulary and the row order from here.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
from gguf import (
    GGMLQuantizationType,
    GGUFWriter,
    LlamaFileType,
    RopeScalingType,
    TokenType,
    quants,
)

F32 = GGMLQuantizationType.F32
F16 = GGMLQuantizationType.F16

ARCHS = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "phi3", "gemma3")

_FILE_TYPES = {
    GGMLQuantizationType.F32: LlamaFileType.ALL_F32,
    GGMLQuantizationType.F16: LlamaFileType.MOSTLY_F16,
    GGMLQuantizationType.BF16: LlamaFileType.MOSTLY_BF16,
    GGMLQuantizationType.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    GGMLQuantizationType.Q4_0: LlamaFileType.MOSTLY_Q4_0,
    GGMLQuantizationType.Q4_1: LlamaFileType.MOSTLY_Q4_1,
    GGMLQuantizationType.Q5_0: LlamaFileType.MOSTLY_Q5_0,
    GGMLQuantizationType.Q5_1: LlamaFileType.MOSTLY_Q5_1,
}

# transformers parameter name (after "model.layers.N.") -> GGUF name (after "blk.N.")
_BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# per architecture, where it differs from the table above
_ARCH_BLOCK_NAMES = {
    "gemma3": {"post_attention_layernorm.weight": "post_attention_norm.weight",
               "pre_feedforward_layernorm.weight": "ffn_norm.weight",
               "post_feedforward_layernorm.weight": "post_ffw_norm.weight"},
    "phi3": {"self_attn.qkv_proj.weight": "attn_qkv.weight",
             "mlp.gate_up_proj.weight": "ffn_up.weight"},
    "llama": {"mlp.gate.weight": "ffn_gate_inp.weight",  # Mixtral
              "mlp.experts.down_proj": "ffn_down_exps.weight"},
    "qwen2moe": {"mlp.gate.weight": "ffn_gate_inp.weight",
                 "mlp.experts.down_proj": "ffn_down_exps.weight",
                 "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
                 "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
                 "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
                 "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight"},
    "qwen3moe": {"mlp.gate.weight": "ffn_gate_inp.weight",
                 "mlp.experts.down_proj": "ffn_down_exps.weight"},
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


# -- vocabulary ----------------------------------------------------------------------------

def byte_symbols() -> list[str]:
    """The 256 byte-level BPE symbols in GPT-2's order: the printable Latin-1 bytes stand
    for themselves (in byte order), then every other byte b gets chr(256 + n), n counting
    those bytes in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    keep = set(printable)
    others = [b for b in range(256) if b not in keep]
    return [chr(b) for b in printable] + [chr(256 + n) for n in range(len(others))]


_MERGES = ("Ġ t", "h e", "i n", "Ġ a", "e r", "Ġt he", "o n", "r e", "Ġ s", "e n", "Ġ o", "a t")


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    eos_id: int  # also BOS


def tiny_vocab() -> Vocab:
    """256 byte symbols, one token per merge result, then `<|endoftext|>` (control)."""
    tokens = byte_symbols()
    for merge in _MERGES:
        a, b = merge.split(" ")
        assert a in tokens and b in tokens, merge
        tokens.append(a + b)
    types = [int(TokenType.NORMAL)] * len(tokens)
    tokens.append("<|endoftext|>")
    types.append(int(TokenType.CONTROL))
    return Vocab(tokens, types, list(_MERGES), len(tokens) - 1)


# -- tensor transforms ---------------------------------------------------------------------

def interleave_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder the rows of a Q or K projection (weight or bias) head by head: transformers
    rotates the pairs (i, i + d/2) of each head, llama.cpp's llama rotates (2i, 2i + 1), so
    output row h*d + 2i + j takes input row h*d + j*d/2 + i (j in {0, 1})."""
    rows = w.shape[0]
    d = rows // n_head
    split = w.reshape(n_head, 2, d // 2, *w.shape[1:])  # [head, half, i]
    return np.ascontiguousarray(np.swapaxes(split, 1, 2).reshape(w.shape))


def _rope_params(config) -> dict:
    """RoPE settings of a transformers config: `rope_parameters` (transformers 5) or the
    older `rope_theta` / `rope_scaling` attributes."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    legacy = getattr(config, "rope_scaling", None) or {}
    for k, v in legacy.items():
        params.setdefault(k, v)
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def llama3_rope_factors(config, head_dim: int) -> np.ndarray:
    """Per-pair frequency divisors for Llama 3 RoPE scaling (llama.cpp's `rope_freqs.weight`).

    Pairs whose wavelength is below original_ctx/high_freq_factor keep their frequency
    (1), those above original_ctx/low_freq_factor are divided by `factor`, and those in
    between blend the two. (llama.cpp's converter reads original_max_position_embeddings
    from the top level of config.json with a default of 8192; real Llama 3.x checkpoints
    keep 8192 inside rope_scaling, so both agree there. Here it is taken from the RoPE
    parameters, which is what transformers computes with.)
    """
    p = _rope_params(config)
    base = float(p["rope_theta"])
    factor = float(p.get("factor", 8.0))
    low = float(p.get("low_freq_factor", 1.0))
    high = float(p.get("high_freq_factor", 4.0))
    old_ctx = float(p.get("original_max_position_embeddings")
                    or getattr(config, "original_max_position_embeddings", None) or 8192)
    inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    out = []
    for f in inv_freq:
        wavelength = 2.0 * math.pi / f
        if wavelength < old_ctx / high:
            out.append(1.0)
        elif wavelength > old_ctx / low:
            out.append(factor)
        else:
            s = (old_ctx / wavelength - low) / (high - low)
            out.append(1.0 / ((1.0 - s) / factor + s))
    return np.asarray(out, dtype=np.float32)


def _encode(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    data = np.ascontiguousarray(data, dtype=np.float32)
    if qtype == F32:
        return data
    if qtype == F16:
        return data.astype(np.float16)
    return quants.quantize(data, qtype)


def _is_matrix(gguf_name: str, ndim: int) -> bool:
    """Stored in `qtype` (the rest, norms, biases and routers, stays F32)."""
    return (ndim in (2, 3) and gguf_name.endswith(".weight")
            and not gguf_name.endswith(("_norm.weight", "ffn_gate_inp.weight")))


def snap_to_qtype(model, qtype: GGMLQuantizationType) -> None:
    """Round every matrix of `model` (in place) through `qtype` and back to float32, so a
    transformers reference computes with exactly the values `write_gguf(..., qtype)` stores."""
    import torch

    if qtype == F32:
        return
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 3 or (p.ndim == 2 and not name.endswith("mlp.gate.weight")):
                raw = _encode(p.detach().float().numpy(), qtype)
                if qtype == F16:
                    back = raw.astype(np.float32)
                else:
                    back = quants.dequantize(raw, qtype).reshape(p.shape)
                p.copy_(torch.from_numpy(np.asarray(back, dtype=np.float32)))


# -- writer ----------------------------------------------------------------------------------

def _gguf_name(hf_name: str, arch: str) -> str:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    names = {**_BLOCK_NAMES, **_ARCH_BLOCK_NAMES.get(arch, {})}
    parts = hf_name.split(".", 3)  # model, layers, N, rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in names:
        return f"blk.{int(parts[2])}.{names[parts[3]]}"
    raise ValueError(f"no GGUF name for the transformers tensor {hf_name!r}")


def _tensors(model, arch: str):
    """(GGUF name, float32 array) of each tensor to write, transformed as llama.cpp's
    converter transforms them (not yet the Q/K row order)."""
    for hf_name, tensor in model.state_dict().items():
        if not tensor.is_floating_point() or hf_name.endswith("rotary_emb.inv_freq"):
            continue
        data = tensor.detach().float().numpy()
        if hf_name.endswith("mlp.experts.gate_up_proj"):  # (n_expert, 2 F, D): gate, then up
            blk = f"blk.{int(hf_name.split('.')[2])}."
            half = data.shape[1] // 2
            yield blk + "ffn_gate_exps.weight", data[:, :half]
            yield blk + "ffn_up_exps.weight", data[:, half:]
            continue
        name = _gguf_name(hf_name, arch)
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + 1.0
        if name.endswith("ffn_gate_inp_shexp.weight"):
            data = data.reshape(-1)  # (1, D) -> (D,)
        yield name, data


def write_gguf(model, path: str | os.PathLike, arch: str, qtype: GGMLQuantizationType = F32,
               vocab: Vocab | None = None) -> None:
    """Write `model` (a transformers LlamaForCausalLM / Qwen2ForCausalLM /
    Qwen3ForCausalLM) to `path` as llama.cpp's converter would for `arch`.

    `qtype` is the storage type of the matrices (token embedding and output included);
    `vocab` defaults to `tiny_vocab()` and must have exactly `config.vocab_size` tokens.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    n_expert = getattr(model.config, "num_local_experts", None) or \
        getattr(model.config, "num_experts", None) or 0
    qtype = GGMLQuantizationType(qtype)
    cfg = model.config
    vocab = vocab or tiny_vocab()
    if len(vocab.tokens) != cfg.vocab_size:
        raise ValueError(f"the vocabulary has {len(vocab.tokens)} tokens, the model "
                         f"{cfg.vocab_size}: build the config with vocab_size={len(vocab.tokens)}")

    n_embd, n_head = cfg.hidden_size, cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_head
    head_dim = getattr(cfg, "head_dim", None) or n_embd // n_head
    rope = _rope_params(cfg)
    if arch == "gemma3":  # the global layers' parameters (the local ones are fixed)
        rope = _rope_params(cfg).get("full_attention") or rope
        rope.setdefault("rope_type", "default")
        if float(cfg.query_pre_attn_scalar) != head_dim:
            raise ValueError("llama.cpp scales Gemma 3 queries by 1/sqrt(head_dim): build the "
                             "config with query_pre_attn_scalar=head_dim")
    rope_type = rope["rope_type"]
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    longrope = arch == "phi3" and rope_type == "longrope"
    if not longrope and (rope_type not in ("default", "linear", "llama3") or (
            arch != "llama" and rope_type != "default")):
        raise ValueError(f"RoPE type {rope_type!r} is not handled for {arch}")

    w = GGUFWriter(os.fspath(path), arch)
    w.add_name(f"tiny-random-{arch}")
    w.add_file_type(_FILE_TYPES.get(qtype, LlamaFileType.GUESSED))
    w.add_quantization_version(2)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    if head_dim != n_embd // n_head:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_rope_dimension_count(head_dim)
    window = getattr(cfg, "sliding_window", None)
    if window and (arch in ("llama", "phi3", "gemma3")):
        w.add_sliding_window(int(window))
    if n_expert:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(int(cfg.num_experts_per_tok))
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_feed_forward_length(int(cfg.moe_intermediate_size))
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(int(cfg.shared_expert_intermediate_size))
    if arch == "llama":
        w.add_vocab_size(cfg.vocab_size)
        if rope_type == "linear":
            w.add_rope_scaling_type(RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(rope["factor"]))

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.eos_id)
    w.add_eos_token_id(vocab.eos_id)
    w.add_add_bos_token(False)

    if arch == "llama" and rope_type == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg, head_dim))
    if longrope:
        original = int(rope["original_max_position_embeddings"])
        factor = rope.get("factor") or cfg.max_position_embeddings / original
        attn_factor = rope.get("attention_factor") or (
            math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0)
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(float(attn_factor))
        for which in ("long", "short"):
            w.add_tensor(f"rope_factors_{which}.weight",
                         np.asarray(rope[f"{which}_factor"], dtype=np.float32))

    seen = set()
    for name, data in _tensors(model, arch):
        if name == "output.weight" and tied:
            continue
        if arch not in ("qwen2", "qwen2moe") and name.endswith(
                ("attn_q.bias", "attn_k.bias", "attn_v.bias")):
            raise ValueError(f"llama.cpp's {arch} has no Q/K/V biases; the model has {name}")
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            data = interleave_rope_rows(data, n_head)
        elif arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            data = interleave_rope_rows(data, n_kv)
        if _is_matrix(name, data.ndim):
            w.add_tensor(name, _encode(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        seen.add(name)
    expected = {"token_embd.weight", "output_norm.weight"}
    if not tied:
        expected.add("output.weight")
    if missing := expected - seen:
        raise ValueError(f"the model has no tensor for {sorted(missing)}")

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
