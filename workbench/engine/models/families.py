"""The model families this engine runs, by the `general.architecture` of their files:
the decoder classes `LLM` builds (`DECODERS`) and every name `architectures()` lists."""

from __future__ import annotations

from workbench.engine.models import bert, gemma3, llama, llama_config

DECODERS = {**dict.fromkeys(llama.ARCHITECTURES, llama.LlamaModel),
            **dict.fromkeys(gemma3.ARCHITECTURES, gemma3.Gemma3Model)}


def architectures() -> list[str]:
    """The `general.architecture` values of the GGUF files this engine runs, sorted: the
    decoder families `LLM` loads and the encoders `Encoder` loads (Whisper's ggml files
    carry no architecture name; `WhisperModel` loads them)."""
    return sorted({*llama_config.ARCHITECTURES, *gemma3.ARCHITECTURES, *bert.ARCHITECTURES})
