"""Goldens `tiny-llama-*`: the tiny random-weight llama-family models of
tests/support/tiny_llama.py built with transformers, written to GGUF by tests/hf_to_gguf.py,
and what transformers answers on them.

- `tiny-llama-<variant>`, one per `tiny_llama.VARIANTS` (tests/test_tiny_models.py; the
  llama one also tests/test_branch.py, the qwen2-q8_0 one tests/test_kernel_cache.py):
  - `model.gguf`: the model as tests/hf_to_gguf.py writes it;
  - `logits.npy` (20, 269) float32: transformers' logits over `tiny_llama.PROMPT`;
  - `greedy_ids` (outputs): the ids transformers' greedy `generate` appends to `PROMPT` in
    `GREEDY_STEPS` steps (a trailing EOS kept, as generate returns it), and
    `greedy_scores.npy` (steps, 269) float32: its scores (the logits) at each step;
  - `config` (outputs): the transformers config values the layout test checks the file's
    metadata against (`head_dim` resolved as transformers computes with it);
  - `layer0_q_proj.npy`, `layer0_k_proj.npy` and `embed_tokens.npy`: transformers'
    weights of those matrices (as rounded through the storage type), which the layout test
    finds in the file (Q/K rows reordered per head for llama).
- `tiny-llama-speculative` (tests/test_speculative.py, and tests/test_hostile_files.py,
  whose tiny llama is the same file as this target): `target.gguf`, the llama variant's
  config with weight seed 7; `draft.gguf`, that model after `DRAFT_NOISE` * std of each
  matrix times seeded normal noise was added to every matrix; `other_vocab.gguf`, the
  target with tokens 100 and 101 swapped in its vocabulary.
- `tiny-llama-device-qwen3` (tests/test_device.py): `model.gguf`, the qwen3 variant's
  config with weight seed 99.
- `tiny-llama-branch-gemma3` (tests/test_branch.py): `model.gguf`, a Gemma 3 of 6 layers
  (5 with a sliding window of 8), weight seed 77.

Only the producers import the peers (torch, transformers); the tests import the constants.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tests.goldens import Golden, peer_versions
from tests.support.tiny_llama import COMMON, F32, PROMPT, VARIANTS, VOCAB, golden_name

GREEDY_STEPS = 8
PEERS = ("torch", "transformers", "gguf")  # gguf: the writer of the files' bytes

SPECULATIVE = "tiny-llama-speculative"
SPECULATIVE_SEED, DRAFT_SEED, DRAFT_NOISE = 7, 1, 0.25
SWAPPED_TOKENS = (100, 101)  # other_vocab.gguf: these two tokens' texts trade places

DEVICE_QWEN3 = "tiny-llama-device-qwen3"
DEVICE_SEED = 99

BRANCH_GEMMA3 = "tiny-llama-branch-gemma3"
GEMMA3_SEED = 77
GEMMA3_CONFIG = {**COMMON, "max_position_embeddings": 1024, "num_hidden_layers": 6,
                 "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
                 "rms_norm_eps": 1e-6}


def _special_ids() -> dict:
    return dict(bos_token_id=VOCAB.eos_id, eos_token_id=VOCAB.eos_id, pad_token_id=VOCAB.eos_id)


def make_variant(name: str) -> Golden:
    """Build the variant `name` and run transformers on it: the golden `tiny-llama-<name>`."""
    import torch

    from tests.support.tiny_llama import build_variant, variant_seed

    arch, cfg_name, kwargs, qtype = VARIANTS[name]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.gguf"
        model, logits = build_variant(name, path)
        gguf_bytes = path.read_bytes()
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=GREEDY_STEPS,
                             do_sample=False, eos_token_id=VOCAB.eos_id,
                             pad_token_id=VOCAB.eos_id, output_scores=True,
                             return_dict_in_generate=True)
    cfg = model.config
    sd = model.state_dict()
    config = {
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        "rope_parameters": dict(cfg.rope_parameters), "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": bool(cfg.tie_word_embeddings), "vocab_size": cfg.vocab_size,
    }
    return Golden(
        peer=peer_versions(*PEERS),
        inputs={"arch": arch, "config_class": cfg_name, "config": {**COMMON, **kwargs},
                "storage_type": qtype.name, "seed": variant_seed(name), "eos_id": VOCAB.eos_id,
                "prompt": PROMPT, "greedy_steps": GREEDY_STEPS},
        outputs={"config": config,
                 "greedy_ids": [int(t) for t in out.sequences[0, len(PROMPT):]]},
        arrays={
            "logits": np.asarray(logits, np.float32),
            "greedy_scores": torch.stack([s[0] for s in out.scores]).float().numpy(),
            "layer0_q_proj": sd["model.layers.0.self_attn.q_proj.weight"].float().numpy(),
            "layer0_k_proj": sd["model.layers.0.self_attn.k_proj.weight"].float().numpy(),
            "embed_tokens": sd["model.embed_tokens.weight"].float().numpy(),
        },
        files={"model.gguf": gguf_bytes},
    )


def make_speculative() -> Golden:
    """The target, its noisy draft and the target with another vocabulary (as GGUF)."""
    import torch
    import transformers

    from tests.hf_to_gguf import Vocab, write_gguf
    from tests.support.tiny_llama import build_tiny

    arch, cfg_name, kwargs, qtype = VARIANTS["llama"]
    config = transformers.LlamaConfig(**COMMON, **kwargs, **_special_ids())
    a, b = SWAPPED_TOKENS
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model, _ = build_tiny(transformers.LlamaForCausalLM, config, SPECULATIVE_SEED, arch,
                              qtype, folder / "target.gguf", PROMPT)
        tokens = list(VOCAB.tokens)
        tokens[a], tokens[b] = tokens[b], tokens[a]
        write_gguf(model, folder / "other_vocab.gguf", arch, qtype=qtype,
                   vocab=Vocab(tokens, VOCAB.token_types, VOCAB.merges, VOCAB.eos_id))
        g = torch.Generator().manual_seed(DRAFT_SEED)
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 2:
                    p.add_(DRAFT_NOISE * p.std() * torch.randn(p.shape, generator=g))
        write_gguf(model, folder / "draft.gguf", arch, qtype=qtype)
        files = {f"{n}.gguf": (folder / f"{n}.gguf").read_bytes()
                 for n in ("target", "draft", "other_vocab")}
    return Golden(
        peer=peer_versions(*PEERS),
        inputs={"arch": arch, "config_class": cfg_name, "config": {**COMMON, **kwargs},
                "storage_type": qtype.name, "seed": SPECULATIVE_SEED,
                "draft": {"seed": DRAFT_SEED, "noise": DRAFT_NOISE},
                "swapped_tokens": list(SWAPPED_TOKENS)},
        files=files,
    )


def _single_file(config_name: str, model_name: str, config: dict, seed: int, arch: str,
                 prompt: list[int]) -> Golden:
    """A golden holding one model's GGUF (`model.gguf`), F32, as `build_tiny` writes it."""
    import transformers

    from tests.support.tiny_llama import build_tiny

    cfg = getattr(transformers, config_name)(**config, **_special_ids())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.gguf"
        build_tiny(getattr(transformers, model_name), cfg, seed, arch, F32, path, prompt)
        gguf_bytes = path.read_bytes()
    return Golden(
        peer=peer_versions(*PEERS),
        inputs={"arch": arch, "config_class": config_name, "config": config,
                "storage_type": F32.name, "seed": seed},
        files={"model.gguf": gguf_bytes},
    )


def make_device_qwen3() -> Golden:
    """The qwen3 variant's config with weight seed 99 (tests/test_device.py)."""
    arch, cfg_name, kwargs, _ = VARIANTS["qwen3"]
    return _single_file(cfg_name, "Qwen3ForCausalLM", {**COMMON, **kwargs}, DEVICE_SEED, arch,
                        PROMPT[:12])


def make_branch_gemma3() -> Golden:
    """A 6-layer Gemma 3 with sliding windows of 8 (tests/test_branch.py)."""
    return _single_file("Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA3_CONFIG, GEMMA3_SEED,
                        "gemma3", PROMPT)


def _variant_producer(name: str) -> Callable[[], Golden]:
    def produce() -> Golden:
        return make_variant(name)

    produce.__name__ = produce.__qualname__ = f"make_{name.replace('-', '_')}"
    return produce


GOLDENS = {
    **{golden_name(v): _variant_producer(v) for v in VARIANTS},
    SPECULATIVE: make_speculative,
    DEVICE_QWEN3: make_device_qwen3,
    BRANCH_GEMMA3: make_branch_gemma3,
}
