"""Converters from other checkpoint formats to the files the engine loads.

- `hf_bert_to_gguf`: a Hugging Face / sentence-transformers BERT folder to a
  `bert` GGUF (F32, F16 or Q8_0).
- `ct2_whisper_to_bin`: a CTranslate2 (faster-whisper) Whisper folder to a
  whisper.cpp `ggml-*.bin` file.
- `requantize_gguf`: a GGUF file again with its matrices in another type.
"""

from workbench.engine.formats.convert.bert import ConversionError, hf_bert_to_gguf
from workbench.engine.formats.convert.checkpoint import CheckpointError
from workbench.engine.formats.convert.requantize import requantize_gguf
from workbench.engine.formats.convert.whisper import ct2_whisper_to_bin, mel_filters

__all__ = ["CheckpointError", "ConversionError", "ct2_whisper_to_bin", "hf_bert_to_gguf",
           "mel_filters", "requantize_gguf"]
