"""SentencePiece-style tokenizer (`tokenizer.ggml.model == "llama"`), as llama.cpp's
`llm_tokenizer_spm`.

Each raw-text fragment (special tokens are already cut out) gets a leading
space when `add_space_prefix` is set and the fragment starts the text or
follows a special token; spaces become U+2581 ("▁"). Starting from single
characters, the adjacent pair whose concatenation is a vocabulary token with
the highest score is merged first (leftmost on ties), until no pair forms a
token. Symbols that are not tokens fall back to byte tokens (`<0xNN>`).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import Any

import numpy as np

from workbench.engine.text.tokenizers.base import Tokenizer

SPACE_MARK = "\u2581"  # "▁", SentencePiece's visible space


class SPMTokenizer(Tokenizer):
    """A llama-style SentencePiece vocabulary from GGUF metadata."""

    model = "llama"

    def __init__(self, md: Mapping[str, Any]) -> None:
        super().__init__(md, default_bos=1, default_eos=2, default_unk=0, add_bos=True,
                         add_space_prefix=True, clean_spaces=False)
        scores = md.get("tokenizer.ggml.scores")
        if scores is None:
            self._scores: list[float] = [0.0] * self.vocab_size
        else:
            scores = np.asarray(scores, dtype=np.float32)
            if len(scores) < self.vocab_size:
                raise ValueError("tokenizer.ggml.scores is shorter than the vocabulary")
            self._scores = scores[: self.vocab_size].tolist()
        self._byte_ids: list[int | None] | None = None

    def _normal_piece(self, text: str) -> bytes:
        return text.replace(SPACE_MARK, " ").encode()

    def _encode_fragments(self, fragments: list[str | int]) -> list[int]:
        ids: list[int] = []
        after_special = True  # the text start counts as following a special token
        for fragment in fragments:
            if isinstance(fragment, int):
                ids.append(fragment)
                after_special = True
                continue
            if self.add_space_prefix and after_special:
                fragment = " " + fragment
            self._encode_text(fragment.replace(" ", SPACE_MARK), ids)
            after_special = False
        return ids

    def _encode_text(self, text: str, out: list[int]) -> None:
        vocab, scores = self._token_to_id, self._scores
        symbols = list(text)
        n = len(symbols)
        nxt = [*range(1, n), -1]
        prv = list(range(-1, n - 1))
        heap: list[tuple[float, int, int, int]] = []

        def queue(left: int, right: int) -> None:
            merged = symbols[left] + symbols[right]
            token_id = vocab.get(merged)
            if token_id is not None:  # best score first, then leftmost
                heapq.heappush(heap, (-scores[token_id], left, right, len(merged)))

        for i in range(n - 1):
            queue(i, i + 1)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            a, b = symbols[left], symbols[right]
            if not a or not b or len(a) + len(b) != size:
                continue  # outdated: one side has changed since the pair was queued
            symbols[left], symbols[right] = a + b, ""
            after = nxt[right]
            nxt[left] = after
            if after != -1:
                prv[after] = left
            if prv[left] != -1:
                queue(prv[left], left)
            if after != -1:
                queue(left, after)

        i = 0 if n else -1
        while i != -1:
            token_id = vocab.get(symbols[i])
            if token_id is not None:
                out.append(token_id)
            else:
                out.extend(self._byte_fallback(symbols[i]))
            i = nxt[i]

    def _byte_fallback(self, symbol: str) -> list[int]:
        """Byte tokens for the UTF-8 bytes of `symbol` (`<0xNN>`, else the byte's own
        one-character token, else the unknown token)."""
        if self._byte_ids is None:
            vocab = self._token_to_id
            self._byte_ids = [
                vocab.get(f"<0x{b:02X}>", vocab.get(chr(b)) if b < 0x80 else None)
                for b in range(256)
            ]
        ids = []
        for b in symbol.encode():
            token_id = self._byte_ids[b]
            if token_id is None:
                token_id = self.unk_id
            if token_id is not None:
                ids.append(token_id)
        return ids
