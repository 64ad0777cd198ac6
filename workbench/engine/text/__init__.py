"""Text: tokenizers built from GGUF metadata, chat templates rendered in a sandbox and
their limits, and the `Prompting` mixin that turns messages into token ids."""
