"""Goldens `tiny-family-<variant>`: tiny random-weight Gemma 3, Phi-3, Mistral, Mixtral,
Qwen2-MoE and Qwen3-MoE models built with transformers, written to GGUF by
tests/hf_to_gguf.py, and what transformers answers on them (tests/test_tiny_families.py).

This module is the recipe of those models (`VARIANTS`, `COMMON`, `PROMPT`, `WINDOW`):
the tests read it to know what each file is, and only the producers import the peers
(torch, transformers). Each golden holds:

- `model.gguf`: the model as tests/hf_to_gguf.py writes it;
- `logits.npy` (600, 269) float32: transformers' logits over the whole `PROMPT`;
- `generated` (outputs): the ids transformers' greedy `generate` appends to `PROMPT[:100]`
  in 8 steps (a trailing EOS kept, as generate returns it);
- phi3-longrope only: `short_factor_logits.npy` (40, 269) float32, the logits of a freshly
  built copy over `PROMPT[:40]` (no longer than the original context: the short factors).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from tests.goldens import Golden, peer_versions

F32 = GGMLQuantizationType.F32
Q8_0 = GGMLQuantizationType.Q8_0

WINDOW = 8  # the sliding window of Gemma 3's local layers, Phi-3, Mistral and Mixtral
VOCAB_SIZE = 269  # len(tests.hf_to_gguf.tiny_vocab().tokens)
EOS_ID = 268  # tiny_vocab().eos_id, also BOS and padding
PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, VOCAB_SIZE - 1, 600)]  # no EOS
GENERATE_PROMPT, GENERATE_STEPS = 100, 8  # greedy generate: PROMPT[:100], 8 new tokens
SHORT_PROMPT = 40  # LongRoPE's short factors: PROMPT[:40]
COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
              attn_implementation="eager")

# name -> (GGUF arch, config class, model class, config kwargs, storage type)
VARIANTS = {
    "gemma3": ("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        rms_norm_eps=1e-6), F32),
    "gemma3-q8_0": ("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32, sliding_window=WINDOW,
        rms_norm_eps=1e-6), Q8_0),
    "phi3": ("phi3", "Phi3Config", "Phi3ForCausalLM", dict(sliding_window=WINDOW), F32),
    "mistral": ("llama", "MistralConfig", "MistralForCausalLM", dict(
        sliding_window=WINDOW, head_dim=16), F32),
    # LongRoPE (Phi-3.5 / Phi-4-mini style): original context 64, so the 600-token prompt
    # and a 1024-position cache use the long factors; `short_factor_logits` the short
    "phi3-longrope": ("phi3", "Phi3Config", "Phi3ForCausalLM", dict(
        original_max_position_embeddings=64, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
        "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
        "short_factor": [1.0, 1.0, 1.1, 1.2, 1.4, 1.6, 1.8, 2.0]}), F32),
    # Q8_0 matrices: decode runs through the fused stack (`kernels.decode`) with the windows
    "mistral-q8_0": ("llama", "MistralConfig", "MistralForCausalLM", dict(
        sliding_window=WINDOW, head_dim=32), Q8_0),
    "phi3-q8_0": ("phi3", "Phi3Config", "Phi3ForCausalLM", dict(sliding_window=WINDOW), Q8_0),
    "mixtral": ("llama", "MixtralConfig", "MixtralForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW), F32),
    "qwen2moe": ("qwen2moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=False), F32),
    "qwen3moe": ("qwen3moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        head_dim=16), F32),
}


def golden_name(variant: str) -> str:
    return f"tiny-family-{variant}"


def _seed(variant: str) -> int:
    return 4321 + sum(map(ord, variant))


def _build(variant: str, path: Path):
    """The transformers model of `variant` (seeded random weights rounded through its
    storage type) written to `path`, and its logits (600, V) over `PROMPT`."""
    import transformers

    from tests.support.tiny_llama import build_tiny

    arch, cfg_name, model_name, kwargs, qtype = VARIANTS[variant]
    config = getattr(transformers, cfg_name)(**{**COMMON, **kwargs}, bos_token_id=EOS_ID,
                                             eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    return build_tiny(getattr(transformers, model_name), config, _seed(variant), arch, qtype,
                      path, PROMPT)


def make(variant: str) -> Golden:
    """Build `variant` and run transformers on it: the golden `tiny-family-<variant>`."""
    import torch

    from tests.hf_to_gguf import tiny_vocab

    vocab = tiny_vocab()
    assert (len(vocab.tokens), vocab.eos_id) == (VOCAB_SIZE, EOS_ID), "tiny_vocab changed"
    arch, cfg_name, model_name, kwargs, qtype = VARIANTS[variant]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.gguf"
        model, logits = _build(variant, path)
        gguf_bytes = path.read_bytes()
        prompt = PROMPT[:GENERATE_PROMPT]
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=GENERATE_STEPS,
                                 do_sample=False, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
        arrays = {"logits": np.asarray(logits, np.float32)}
        if variant == "phi3-longrope":
            # a fresh copy, as a cache of 64 positions meets it: no longer context seen yet
            fresh, _ = _build(variant, Path(tmp) / "fresh.gguf")
            with torch.no_grad():
                short = fresh(torch.tensor([PROMPT[:SHORT_PROMPT]])).logits[0].float().numpy()
            arrays["short_factor_logits"] = np.asarray(short, np.float32)
    return Golden(
        peer=peer_versions("torch", "transformers", "gguf"),
        inputs={"arch": arch, "config_class": cfg_name, "model_class": model_name,
                "config": {**COMMON, **kwargs}, "storage_type": GGMLQuantizationType(qtype).name,
                "seed": _seed(variant), "eos_id": EOS_ID, "prompt": PROMPT,
                "generate": {"prompt_tokens": GENERATE_PROMPT, "max_new_tokens": GENERATE_STEPS,
                             "do_sample": False}},
        outputs={"generated": [int(t) for t in out[0, len(prompt):]]},
        arrays=arrays,
        files={"model.gguf": gguf_bytes},
    )


def _producer(variant: str) -> Callable[[], Golden]:
    def produce() -> Golden:
        return make(variant)

    produce.__name__ = produce.__qualname__ = f"make_{variant.replace('-', '_')}"
    return produce


GOLDENS = {golden_name(v): _producer(v) for v in VARIANTS}
