"""Files: GGUF reading, whisper.cpp model files, where model files come from (aliases,
pulls) and the converters from other checkpoint formats."""
