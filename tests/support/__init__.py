"""Builders and helpers for the tests, shared between modules or moved out of long ones;
fixtures stay in tests/conftest.py.

- shared: the files under ../shared (reference JSON, audio, seeds).
- devices: the devices the fidelity tests run on and how to open a model on each.
- quant_blocks: random GGUF blocks and a bit-for-bit float comparison.
- tiny_llama: tiny random-weight llama-family models written to GGUF, and their tolerance.
- tiny_encoders: tiny random-weight BERT and Whisper models (transformers).
- speech: the JFK sentence and a word error rate.
- long_texts: long random texts and the check that an encoder cuts them fast and exactly.
- chat_templates: family-style chat templates written for the tests.
- byte_level: GPT-2's printable stand-ins for bytes.
- polling: waiting for a condition with a deadline.
- gguf_bytes, file_layouts, limited_loads, mutations: hostile model and cache files,
  loading them under limits, fuzzing.
- schema_order: a JSON value with its keys in the order its schema declares them.
"""
