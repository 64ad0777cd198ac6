"""A transformers model holding a GGUF file's weights, dequantized to fp32.

It is the exact-arithmetic reference for the real models: llama.cpp quantizes
activations to 8 bits inside quantized matmuls and keeps the KV cache in fp16,
so its logits carry noise of a few tenths; transformers on the same dequantized
weights (`gguf.quants.dequantize`) in fp32 does not. Only the producers of the
goldens import it (tests/goldens/make_llamacpp.py, a peer: torch); the tests
compare against what they stored.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import quants

from workbench.engine.formats.gguf import GGUFFile


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's converter permutation of Q/K rows (interleaved RoPE pairs ->
    rotate-half layout that transformers uses)."""
    rows, cols = w.shape
    # (n_head, 2, rows_per_head/2, cols) -> (n_head, rows_per_head/2, 2, cols)
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def hf_model_from_gguf(g: GGUFFile):
    """A `LlamaForCausalLM` / `Qwen2ForCausalLM` / `Gemma3ForCausalLM` with the file's
    weights in fp32 (Gemma's norm weights with llama.cpp's +1 taken off again)."""
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    arch = g.architecture
    md = g.metadata

    def key(name):
        return md[f"{arch}.{name}"]

    n_head, n_kv = key("attention.head_count"), key("attention.head_count_kv")
    tied = "output.weight" not in g.tensors
    common = dict(
        vocab_size=len(md["tokenizer.ggml.tokens"]), hidden_size=key("embedding_length"),
        intermediate_size=key("feed_forward_length"), num_hidden_layers=key("block_count"),
        num_attention_heads=n_head, num_key_value_heads=n_kv,
        rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
        rope_theta=key("rope.freq_base"), max_position_embeddings=key("context_length"),
        tie_word_embeddings=tied,
    )
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "gemma3":
        head_dim = key("attention.key_length")
        n_layer = key("block_count")
        del common["rope_theta"]
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            **common, head_dim=head_dim, query_pre_attn_scalar=head_dim,
            sliding_window=key("attention.sliding_window"),
            layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                         for i in range(n_layer)],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": key("rope.freq_base")},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
            attn_implementation="eager"))
    else:
        raise ValueError(f"no transformers reference wired for {arch}")

    def weight(name):
        t = g.tensor(name)
        w = quants.dequantize(np.asarray(t.data), t.qtype).reshape(t.shape)
        return torch.from_numpy(np.array(w, dtype=np.float32))  # a writable copy

    sd = {"model.embed_tokens.weight": weight("token_embd.weight"),
          "model.norm.weight": weight("output_norm.weight") - float(arch == "gemma3"),
          "lm_head.weight": weight("token_embd.weight" if tied else "output.weight")}
    for i in range(key("block_count")):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        wq, wk = weight(p + "attn_q.weight"), weight(p + "attn_k.weight")
        if arch == "llama":
            wq = torch.from_numpy(_unpermute(wq.numpy(), n_head))
            wk = torch.from_numpy(_unpermute(wk.numpy(), n_kv))
        sd[q + "self_attn.q_proj.weight"], sd[q + "self_attn.k_proj.weight"] = wq, wk
        sd[q + "self_attn.v_proj.weight"] = weight(p + "attn_v.weight")
        sd[q + "self_attn.o_proj.weight"] = weight(p + "attn_output.weight")
        if arch == "qwen2":
            for n in "qkv":
                sd[q + f"self_attn.{n}_proj.bias"] = weight(p + f"attn_{n}.bias")
        sd[q + "mlp.gate_proj.weight"] = weight(p + "ffn_gate.weight")
        sd[q + "mlp.up_proj.weight"] = weight(p + "ffn_up.weight")
        sd[q + "mlp.down_proj.weight"] = weight(p + "ffn_down.weight")
        if arch == "gemma3":
            for ours, theirs in (("attn_norm", "input_layernorm"),
                                 ("post_attention_norm", "post_attention_layernorm"),
                                 ("ffn_norm", "pre_feedforward_layernorm"),
                                 ("post_ffw_norm", "post_feedforward_layernorm"),
                                 ("attn_q_norm", "self_attn.q_norm"),
                                 ("attn_k_norm", "self_attn.k_norm")):
                sd[q + theirs + ".weight"] = weight(p + ours + ".weight") - 1.0
            continue
        sd[q + "input_layernorm.weight"] = weight(p + "attn_norm.weight")
        sd[q + "post_attention_layernorm.weight"] = weight(p + "ffn_norm.weight")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected or [k for k in missing if "rotary" not in k]:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    return model.eval()


def hf_logits(model, ids: list[int]) -> np.ndarray:
    """Logits (T, vocab) of the transformers model at every position."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()
