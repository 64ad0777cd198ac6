"""Tokenizers built from GGUF metadata, token-exact with llama.cpp.

`load_tokenizer(metadata)` reads the `tokenizer.ggml.*` keys of a GGUF file and
returns a `Tokenizer`:

- `BPETokenizer` for `tokenizer.ggml.model == "gpt2"`: byte-level BPE with the
  pre-tokenizer regexes llama.cpp picks from `tokenizer.ggml.pre`;
- `SPMTokenizer` for `tokenizer.ggml.model == "llama"`: SentencePiece-style
  score-ordered merges with byte fallback;
- `WordPieceTokenizer` for `tokenizer.ggml.model == "bert"`: BERT's normalizer,
  punctuation split and greedy longest-match WordPiece.

What they share lives in `base.py`, and follows llama.cpp's `llama_vocab`:

- token attributes from `tokenizer.ggml.token_type`, corrected by token text the
  way llama.cpp does (end-of-turn and fill-in-the-middle tokens become control
  tokens);
- special-token partitioning: before any pre-tokenization, the text is cut at
  every occurrence of a control, user-defined or unknown token (longest texts
  first); with `special=False` only user-defined tokens are cut out;
- the end-of-generation set (`eot_ids`) and the BOS/EOS defaults;
- detokenization: per-token pieces, control tokens rendered or dropped, the
  leading-space strip of `add_space_prefix` vocabularies and the
  `clean_up_tokenization_spaces` passes of those BPE vocabularies that use them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from workbench.engine.text.tokenizers.base import (
    TokenAttr,
    Tokenizer,
    UnsupportedTokenizerError,
    clean_up_tokenization_spaces,
    token_texts,
)
from workbench.engine.text.tokenizers.bpe import BPETokenizer
from workbench.engine.text.tokenizers.spm import SPMTokenizer
from workbench.engine.text.tokenizers.wordpiece import WordPieceTokenizer


def load_tokenizer(md: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer that GGUF metadata `md` describes.

    Dispatches on `tokenizer.ggml.model`: "gpt2" -> `BPETokenizer`,
    "llama" -> `SPMTokenizer`, "bert" -> `WordPieceTokenizer`; anything else
    raises `UnsupportedTokenizerError`.
    """
    model = md.get("tokenizer.ggml.model")
    if model == "gpt2":
        return BPETokenizer(md)
    if model == "llama":
        return SPMTokenizer(md)
    if model == "bert":
        return WordPieceTokenizer(md)
    raise UnsupportedTokenizerError(
        f"tokenizer model {model!r} is not supported; supported: 'gpt2' (byte-level BPE), "
        f"'llama' (SentencePiece) and 'bert' (WordPiece)")


__all__ = ["BPETokenizer", "SPMTokenizer", "TokenAttr", "Tokenizer", "UnsupportedTokenizerError",
           "WordPieceTokenizer", "clean_up_tokenization_spaces", "load_tokenizer", "token_texts"]
