"""From logits to tokens: a sequence's decoding state (`sequence`), sampling, grammars, the
closer that finishes structured answers, structured answers, and the two loops that run
generations: the `Scheduler` (continuous batching) and speculative decoding, both
through the `GenerationModel` protocol."""
