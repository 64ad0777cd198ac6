"""Producers of the fp32 arbiter's goldens (tests/test_llamacpp_reference.py compares
against them): transformers running a real model's weights, dequantized from its GGUF file
to fp32 (tests/gguf_to_hf.py), along each of llama.cpp's reference paths
(../shared/reference/llamacpp_*.json: a prompt and the ids llama.cpp generated greedily).

- `fp32-arbiter-smollm2`, `fp32-arbiter-qwen`, `fp32-arbiter-gemma3`: one per model of
  `CASES`, with the model file's name and sha256 and what it read of the reference
  (`reference_inputs`: each path's ids and the first steps' top-10 ids) as inputs.

The full logits, positions x vocabulary, are too large to keep (Qwen: 294 x 151,936
floats), so a golden keeps what the tests compare. Its arrays run over the positions of
every path, one path after the other (N positions in all, G paths):

- `scale.npy` (G,): the largest |logit| of each path's whole logits array, the scale of the
  1e-4 relative tolerance;
- `argmax.npy` (N,): the argmax at every position;
- `top_ids.npy`, `top_logits.npy` (N, TOP): the TOP largest logits of each position (their
  ids in ascending order);
- `bottom_ids.npy`, `bottom_logits.npy` (N, BOTTOM): the BOTTOM smallest, so that the
  entry of largest magnitude, which sets the scale, is kept whatever its sign;
- `sample_ids.npy` (S,), `sample_logits.npy` (N, S): the logits at a fixed sample of ids
  across the vocabulary, the same at every position (`vocabulary_sample`);
- `top10_first_logits.npy` (G, 10): the logits at the first generated step's position for
  the ten ids llama.cpp ranked highest there (`top10_first` of the reference).

This module holds the inputs (the tests import them); the peers (torch, transformers) are
imported inside the producers only.
"""

from __future__ import annotations

import numpy as np

from tests.goldens import Golden, peer_versions
from tests.support.shared import reference

# the real models, by test case: their registry alias and llama.cpp's reference outputs
ALIASES = {"smollm2": "smollm2-135m", "qwen": "qwen2.5-coder-0.5b", "gemma3": "gemma3-270m"}
CASES = {"smollm2": "llamacpp_smollm2.json", "qwen": "llamacpp_qwen2.5-coder-0.5b.json",
         "gemma3": "llamacpp_gemma3-270m.json"}

TOP = 64  # the largest logits kept per position: the argmax and what could overtake it
BOTTOM = 16  # the smallest logits kept per position: the most negative, at times the largest |x|
SAMPLE_STRATA = 512  # one sampled id per 1/512 of the vocabulary
SAMPLE_SEED = 45


def golden_name(case: str) -> str:
    """The golden of the fp32 arbiter for `case` (a key of `CASES`)."""
    return f"fp32-arbiter-{case}"


def reference_inputs(ref: dict) -> dict:
    """What a golden reads of llama.cpp's reference `ref`: its paths (each generation's
    prompt ids and generated ids) and the ids it ranked top-10 at each first step."""
    return {"paths": [gen["prompt_ids"] + gen["ids"] for gen in ref["generations"]],
            "top10_first_ids": [[int(i) for i, _ in gen["top10_first"]]
                                for gen in ref["generations"]]}


def vocabulary_sample(vocab_size: int) -> np.ndarray:
    """The ids whose logits a golden keeps at every position, ascending: the first and last
    id, and one seeded id in each of `SAMPLE_STRATA` equal slices of the vocabulary (so that
    no stretch of rows a kernel might get wrong goes unsampled)."""
    rng = np.random.default_rng(SAMPLE_SEED)
    edges = np.linspace(0, vocab_size, SAMPLE_STRATA + 1).astype(np.int64)
    picks = rng.integers(edges[:-1], edges[1:])
    return np.unique(np.concatenate([[0, vocab_size - 1], picks])).astype(np.int32)


def _fp32_arbiter(case: str) -> Golden:
    """transformers in fp32 on `case`'s dequantized weights along llama.cpp's paths."""
    from tests.gguf_to_hf import hf_logits, hf_model_from_gguf
    from workbench.engine.formats import sources
    from workbench.engine.formats.gguf import open_gguf
    from workbench.registry import file_sha256

    path = sources.resolve(ALIASES[case])
    ref = reference(CASES[case])
    read = reference_inputs(ref)
    model = hf_model_from_gguf(open_gguf(path))
    exact = [hf_logits(model, ids) for ids in read["paths"]]  # (T, vocab) each
    sample = vocabulary_sample(exact[0].shape[1])

    rows = np.concatenate(exact)  # (N, vocab)
    order = np.argsort(-rows, axis=1, kind="stable")
    top, bottom = np.sort(order[:, :TOP], axis=1), np.sort(order[:, -BOTTOM:], axis=1)
    first = [logits[len(gen["prompt_ids"]) - 1, ids] for gen, logits, ids
             in zip(ref["generations"], exact, read["top10_first_ids"])]
    return Golden(
        peer=peer_versions("torch", "transformers", "gguf"),
        inputs={"model": ALIASES[case], "model_file": path.name,
                "model_sha256": file_sha256(path), "reference": CASES[case], **read,
                "top": TOP, "bottom": BOTTOM, "sample_strata": SAMPLE_STRATA,
                "sample_seed": SAMPLE_SEED},
        arrays={"scale": np.array([np.abs(x).max() for x in exact], dtype=np.float32),
                "argmax": rows.argmax(axis=1).astype(np.int32),
                "top_ids": top.astype(np.int32),
                "top_logits": np.take_along_axis(rows, top, axis=1).astype(np.float32),
                "bottom_ids": bottom.astype(np.int32),
                "bottom_logits": np.take_along_axis(rows, bottom, axis=1).astype(np.float32),
                "sample_ids": sample,
                "sample_logits": rows[:, sample].astype(np.float32),
                "top10_first_logits": np.array(first, dtype=np.float32)})


def fp32_arbiter_smollm2() -> Golden:
    """The fp32 arbiter on SmolLM2-135M (Q4_1) along llama.cpp's paths."""
    return _fp32_arbiter("smollm2")


def fp32_arbiter_qwen() -> Golden:
    """The fp32 arbiter on Qwen2.5-Coder-0.5B (Q4_K/Q5_0/Q6_K/Q8_0) along llama.cpp's paths."""
    return _fp32_arbiter("qwen")


def fp32_arbiter_gemma3() -> Golden:
    """The fp32 arbiter on Gemma 3 270M (Q4_K_M) along llama.cpp's paths."""
    return _fp32_arbiter("gemma3")


GOLDENS = {golden_name("smollm2"): fp32_arbiter_smollm2, golden_name("qwen"): fp32_arbiter_qwen,
           golden_name("gemma3"): fp32_arbiter_gemma3}
