"""Converters from other checkpoint formats to the files the engine loads.

- `hf_bert_to_gguf`: a Hugging Face / sentence-transformers BERT folder to a
  `bert` GGUF (F32, F16 or Q8_0).
"""

from workbench.engine.convert.bert import ConversionError, hf_bert_to_gguf
from workbench.engine.convert.checkpoint import CheckpointError

__all__ = ["CheckpointError", "ConversionError", "hf_bert_to_gguf"]
