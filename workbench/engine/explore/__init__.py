"""Exploring what a model would say: branches of one conversation, search strategies over
them, and the uncertainty metrics (entropy, surprisal, perplexity)."""
