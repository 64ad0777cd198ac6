"""Tiny random-weight llama-family models: a transformers model written to GGUF as
llama.cpp's converter would, with its logits as the reference, and the tolerance the
engine's logits must meet against them.

Each variant has hidden size 64, 2 layers, 4 query heads over 2 KV heads and a 269-token
byte-level vocabulary, and seeded random weights large enough that attention is far from
uniform (so RoPE, GQA and the QK norm all move the logits).

The tests read each variant from its golden (`tiny-llama-<variant>`, tests/goldens): the
GGUF file and what transformers computed on it. `build_variant` and `build_tiny` build
them live with torch and transformers, which they import when called: only the producer
(tests/goldens/make_tiny_llama.py) calls them, and importing this module needs neither.
"""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest

from tests import goldens
from tests.hf_to_gguf import F16, F32, snap_to_qtype, tiny_vocab, write_gguf

Q8_0 = gguf.GGMLQuantizationType.Q8_0

RTOL = 1e-4
PROMPT = [266, 55, 3, 201, 87, 260, 12, 140, 99, 7, 265, 33, 180, 64, 2, 77, 119, 250, 45, 261]
VOCAB = tiny_vocab()
V = len(VOCAB.tokens)

COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              attn_implementation="eager")

_CONFIGS = {"llama": ("LlamaConfig", 1e-5), "qwen2": ("Qwen2Config", 1e-6),
            "qwen3": ("Qwen3Config", 1e-6)}


def _variant(arch: str, theta: float, *, tied: bool = False, qtype=F32, rope: str = "default",
             scaling: dict | None = None, **config) -> tuple:
    """(arch, config class name, config kwargs, storage type) of one variant: the family's
    RMSNorm epsilon, RoPE of base `theta` (`rope` type with its `scaling` parameters)."""
    cfg_name, eps = _CONFIGS[arch]
    rope_parameters = {"rope_type": rope, "rope_theta": theta, **(scaling or {})}
    return arch, cfg_name, dict(config, rms_norm_eps=eps, tie_word_embeddings=tied,
                                rope_parameters=rope_parameters), qtype


# name -> (arch, config class name, config kwargs, storage type)
VARIANTS = {
    "llama": _variant("llama", 10000.0),
    # Llama 3.1-style scaling; original context 64 so that, with head size 16 and
    # theta 5e5, pair 0 keeps its frequency, pair 1 is blended and pairs 2-7 are
    # divided by 8 (llama.cpp's rope_freqs.weight)
    "llama3-rope": _variant("llama", 500000.0, rope="llama3", scaling=dict(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)),
    "llama-linear-rope": _variant("llama", 10000.0, tied=True, rope="linear",
                                  scaling=dict(factor=4.0)),
    "llama-f16": _variant("llama", 10000.0, qtype=F16),
    "qwen2": _variant("qwen2", 1000000.0),
    "qwen2-tied": _variant("qwen2", 1000000.0, tied=True),
    # Q8_0 matrices (the reference holds the dequantized values)
    "qwen2-q8_0": _variant("qwen2", 1000000.0, qtype=Q8_0),
    # explicit head size 32 != 64 / 4 (key_length / value_length in the file)
    "qwen3": _variant("qwen3", 1000000.0, tied=True, head_dim=32),
}


def _randomize(model, seed: int) -> None:
    """Seeded weights with some spread: matrices N(0, 0.1^2) (embedding N(0, 0.5^2)),
    norm weights 1 + N(0, 0.2^2), biases N(0, 0.2^2). transformers' own init (std 0.02,
    unit norms, zero biases) leaves attention almost uniform and biases untested."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if p.ndim == 2:
                p.copy_(noise * (0.5 if "embed_tokens" in name else 0.1))
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(0.2 * noise)


def build_tiny(model_cls, config, seed: int, arch: str, qtype, path, prompt: list[int]):
    """A transformers model of `config` with `_randomize`d weights rounded through `qtype`
    (so the reference computes with the stored values), written to GGUF at `path`;
    returns the model and its logits (T, V) over `prompt`. Needs torch and transformers."""
    import torch

    torch.manual_seed(0)
    model = model_cls(config).float().eval()
    _randomize(model, seed=seed)
    snap_to_qtype(model, qtype)
    write_gguf(model, path, arch, qtype=qtype)
    with torch.no_grad():
        return model, model(torch.tensor([prompt])).logits[0].float().numpy()


def variant_seed(name: str) -> int:
    """The weight seed of the variant `name`."""
    return 1234 + sum(map(ord, name))


def build_variant(name: str, path):
    """The variant `name` of `VARIANTS` built live (`build_tiny` with its config and seed),
    written to GGUF at `path`; returns the transformers model and its logits (T, V) over
    `PROMPT`."""
    import transformers

    arch, cfg_name, kwargs, qtype = VARIANTS[name]
    cfg_cls = getattr(transformers, cfg_name)
    model_cls = getattr(transformers, cfg_name.replace("Config", "ForCausalLM"))
    config = cfg_cls(**COMMON, **kwargs, bos_token_id=VOCAB.eos_id,
                     eos_token_id=VOCAB.eos_id, pad_token_id=VOCAB.eos_id)
    return build_tiny(model_cls, config, variant_seed(name), arch, qtype, path, PROMPT)


def golden_name(name: str) -> str:
    """The golden of the variant `name` (tests/goldens/make_tiny_llama.py makes it)."""
    return f"tiny-llama-{name}"


class Built:
    """One of `VARIANTS` from its golden, its GGUF copied into `tmp_dir`: the file `path`,
    reference logits `ref` (T, V) over `PROMPT`, and the `golden` with the rest of what
    transformers answered (its config, its greedy generation, its Q/K/embedding weights)."""

    def __init__(self, name: str, tmp_dir):
        arch, _, _, qtype = VARIANTS[name]
        self.name, self.arch, self.qtype = name, arch, qtype
        self.golden = goldens.load(golden_name(name))
        assert self.golden.inputs["prompt"] == PROMPT, \
            f"the golden {golden_name(name)} was made on another prompt: regenerate it"
        self.path = tmp_dir / f"{name}.gguf"
        shutil.copyfile(self.golden.file("model.gguf"), self.path)
        self.ref = self.golden.arrays["logits"]


def assert_close(ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    """float32 logits of `ref`'s shape with max |ours - ref| <= RTOL * max |ref|; a failure
    names the positions that are off."""
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape}, expected {ref.shape}"
    assert ours.dtype == np.float32, f"{what}: dtype {ours.dtype}"
    err = np.abs(ours - ref)
    scale = float(np.max(np.abs(ref)))
    if float(np.max(err)) > RTOL * scale:
        per_pos = err.max(axis=1) / scale
        bad = [int(t) for t in np.nonzero(per_pos > RTOL)[0]]
        pytest.fail(f"{what}: max|ours-ref| = {float(np.max(err)):.3e} > {RTOL} * max|ref| "
                    f"({scale:.3f}); relative error per position "
                    f"{np.array2string(per_pos, precision=1)}; first bad positions {bad[:8]}")
