"""Goldens `trace-<golden>`: what transformers shows inside the tiny random-weight models of
`tiny-llama-*` and `tiny-family-*` (tests/test_trace.py holds `LLM.trace` to them).

For each of those goldens the model is built again with transformers (the same recipe
and seed; the GGUF it writes must be byte for byte the stored `model.gguf`, so the
reference belongs to the file the test loads) and run once over the first `TOKENS` ids
of its prompt with `output_hidden_states` and `output_attentions` (eager attention):

- `hidden_states.npy` (n_layer + 1, T, 64) float32: transformers' `hidden_states` (the
  embeddings, then the output of each layer; the last one after the final norm);
- `last_residual.npy` (T, 64) float32: the last layer's output before the final norm
  (read with a forward hook on that layer);
- `attentions.npy` (n_layer, n_head, T, T) float32: transformers' `attentions`;
- `lens_logits.npy` (n_layer, T, 269) float32: the model's final norm and head applied
  to each layer's output (`lm_head(norm(h))`, Gemma's soft-capping where set), the
  logit lens;
- `model_sha256` (inputs): the digest of the GGUF file it was checked against.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tests.goldens import Golden, load, peer_versions
from tests.goldens import make_tiny_families as families
from tests.support import tiny_llama

TOKENS = {"tiny-llama": 20, "tiny-family": 24}  # prompt ids traced (24: 3 sliding windows)


def trace_name(model_golden: str) -> str:
    return f"trace-{model_golden}"


def model_goldens() -> list[str]:
    """The goldens whose models are traced."""
    return ([tiny_llama.golden_name(v) for v in tiny_llama.VARIANTS]
            + [families.golden_name(v) for v in families.VARIANTS])


def prompt_of(model_golden: str) -> list[int]:
    """The ids traced for that model."""
    if model_golden.startswith("tiny-llama"):
        return list(tiny_llama.PROMPT[: TOKENS["tiny-llama"]])
    return list(families.PROMPT[: TOKENS["tiny-family"]])


def _build(model_golden: str, path: Path):
    if model_golden.startswith("tiny-llama-"):
        model, _ = tiny_llama.build_variant(model_golden[len("tiny-llama-"):], path)
    else:
        model, _ = families._build(model_golden[len("tiny-family-"):], path)
    return model


def make(model_golden: str) -> Golden:
    import torch

    stored = load(model_golden).file("model.gguf").read_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.gguf"
        model = _build(model_golden, path)
        if path.read_bytes() != stored:
            raise RuntimeError(f"{model_golden}: the rebuilt model's GGUF differs from the "
                               "stored one; regenerate that golden first")
    prompt = prompt_of(model_golden)
    captured = {}
    decoder = model.model
    hook = decoder.layers[-1].register_forward_hook(
        lambda module, args, out: captured.__setitem__("h", out[0] if isinstance(out, tuple)
                                                       else out))
    with torch.no_grad():
        out = model(torch.tensor([prompt]), output_hidden_states=True, output_attentions=True)
        hook.remove()
        hidden = [h[0].float() for h in out.hidden_states]
        layer_outputs = [*hidden[1:-1], captured["h"][0].float()]
        cap = getattr(model.config, "final_logit_softcapping", None)
        lens = []
        for h in layer_outputs:
            z = model.lm_head(decoder.norm(h))
            if cap:
                z = torch.tanh(z / cap) * cap
            lens.append(z.float())
        last_logits = out.logits[0].float()
    assert torch.allclose(lens[-1], last_logits, rtol=1e-5, atol=1e-5), "lens != logits"
    return Golden(
        peer=peer_versions("torch", "transformers", "gguf"),
        inputs={"model": model_golden, "prompt": prompt,
                "model_sha256": hashlib.sha256(stored).hexdigest()},
        arrays={
            "hidden_states": torch.stack(hidden).numpy().astype(np.float32),
            "last_residual": layer_outputs[-1].numpy().astype(np.float32),
            "attentions": torch.stack([a[0].float() for a in out.attentions]).numpy()
            .astype(np.float32),
            "lens_logits": torch.stack(lens).numpy().astype(np.float32),
        },
    )


def _producer(model_golden: str) -> Callable[[], Golden]:
    def produce() -> Golden:
        return make(model_golden)

    produce.__name__ = produce.__qualname__ = f"make_{model_golden.replace('-', '_')}"
    return produce


GOLDENS = {trace_name(g): _producer(g) for g in model_goldens()}
