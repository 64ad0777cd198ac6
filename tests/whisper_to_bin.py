"""Test helper: write a transformers `WhisperForConditionalGeneration` as a whisper.cpp
`.bin` file (the layout `workbench.engine.formats.whisper_file` documents), with openai-whisper's
tensor names, matrices in F32, F16 or Q8_0, and conv biases as (out, 1) like whisper.cpp's
converter writes them."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

F32, F16, Q8_0 = 0, 1, 8

# transformers (after "model.") -> openai-whisper names; N is the layer
_LAYER = {
    "self_attn.q_proj": "attn.query", "self_attn.k_proj": "attn.key",
    "self_attn.v_proj": "attn.value", "self_attn.out_proj": "attn.out",
    "self_attn_layer_norm": "attn_ln",
    "encoder_attn.q_proj": "cross_attn.query", "encoder_attn.k_proj": "cross_attn.key",
    "encoder_attn.v_proj": "cross_attn.value", "encoder_attn.out_proj": "cross_attn.out",
    "encoder_attn_layer_norm": "cross_attn_ln",
    "fc1": "mlp.0", "fc2": "mlp.2", "final_layer_norm": "mlp_ln",
}
_TOP = {
    "encoder.conv1": "encoder.conv1", "encoder.conv2": "encoder.conv2",
    "encoder.embed_positions.weight": "encoder.positional_embedding",
    "encoder.layer_norm": "encoder.ln_post",
    "decoder.embed_tokens.weight": "decoder.token_embedding.weight",
    "decoder.embed_positions.weight": "decoder.positional_embedding",
    "decoder.layer_norm": "decoder.ln",
}


def openai_name(hf_name: str) -> str | None:
    name = hf_name.removeprefix("model.")
    if name == "proj_out.weight":
        return None  # tied to the token embedding
    for hf, ours in _TOP.items():
        if name == hf or name.startswith(hf + "."):
            return ours + name[len(hf):]
    side, _, rest = name.partition(".layers.")
    layer, _, rest = rest.partition(".")
    module, _, kind = rest.rpartition(".")
    return f"{side}.blocks.{layer}.{_LAYER[module]}.{kind}"


def write_bin(model, path: Path, mel_filters: np.ndarray, tokens: list[bytes],
              matrix_type: int = F32) -> Path:
    cfg = model.config
    hparams = (cfg.vocab_size, cfg.max_source_positions, cfg.d_model,
               cfg.encoder_attention_heads, cfg.encoder_layers, cfg.max_target_positions,
               cfg.d_model, cfg.decoder_attention_heads, cfg.decoder_layers, cfg.num_mel_bins,
               matrix_type)
    with open(path, "wb") as out:
        out.write(struct.pack("<I", 0x67676D6C))
        out.write(struct.pack("<11i", *hparams))
        out.write(struct.pack("<2i", *mel_filters.shape))
        out.write(np.ascontiguousarray(mel_filters, np.float32).tobytes())
        out.write(struct.pack("<i", len(tokens)))
        for tok in tokens:
            out.write(struct.pack("<I", len(tok)) + tok)
        for hf_name, tensor in model.state_dict().items():
            name = openai_name(hf_name)
            if name is None:
                continue
            data = tensor.detach().float().numpy()
            if name in ("encoder.conv1.bias", "encoder.conv2.bias"):
                data = data.reshape(-1, 1)
            matrix = data.ndim >= 2 and "positional" not in name \
                and not name.endswith("conv1.bias") and not name.endswith("conv2.bias")
            kind = matrix_type if matrix else F32
            if kind == Q8_0 and (data.ndim != 2 or data.shape[-1] % 32):
                kind = F16  # conv kernels (rows of 3) cannot be Q8_0, as in whisper.cpp
            if kind == Q8_0:
                from gguf import GGMLQuantizationType
                from gguf.quants import quantize

                raw = quantize(data, GGMLQuantizationType.Q8_0).tobytes()
            else:
                raw = np.ascontiguousarray(data.astype(np.float16 if kind == F16
                                                       else np.float32)).tobytes()
            encoded = name.encode()
            out.write(struct.pack("<3i", data.ndim, len(encoded), kind))
            out.write(struct.pack(f"<{data.ndim}i", *reversed(data.shape)))
            out.write(encoded)
            out.write(raw)
    return path
