"""WordPiece tokenizer for BERT-style encoders (`tokenizer.ggml.model == "bert"`).

The ids equal those of Hugging Face's `BertTokenizerFast` on the same
vocabulary. Text goes through four steps:

1. cleaning: NUL, U+FFFD and control characters (category C*, except tab,
   newline and carriage return) are dropped; every whitespace character
   becomes a space;
2. CJK ideographs get a space on either side, so each is its own word;
3. when the model is uncased: canonical decomposition (NFD), combining marks
   (category Mn) dropped, lower-casing (`strip_accents` follows `lowercase`
   unless the metadata says otherwise);
4. words are split at whitespace and around each punctuation character
   (ASCII punctuation and Unicode categories P*), then each word is cut
   greedily into the longest vocabulary pieces from its start; a word with a
   character no piece covers, or longer than 100 characters, becomes `[UNK]`.

The GGUF stores the vocabulary the way llama.cpp's converter writes it: a
word-initial piece carries a leading U+2581 ("▁hello"), a continuation piece
is bare ("llo" for Hugging Face's "##llo"), and bracketed special tokens
("[CLS]") are unchanged. `encode` adds `[CLS]` in front and `[SEP]` behind
(the GGUF's BOS and EOS).

Two metadata keys that llama.cpp does not define say how the model normalizes:
`tokenizer.ggml.lowercase` and `tokenizer.ggml.strip_accents` (booleans).
When they are absent the text is lower-cased and accents are stripped, as
llama.cpp does for every BERT vocabulary.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from typing import Any

from workbench.engine.text.tokenizers.base import CACHED_WORD_CHARS, Tokenizer

SPACE_MARK = "\u2581"  # "▁": marks a word-initial piece in the GGUF vocabulary
MAX_WORD_CHARS = 100  # longer words become [UNK], as in BERT's WordPiece

# CJK Unified Ideographs blocks (BERT's "Chinese character" test; Hangul and kana are not in it)
_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
               (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def _is_cjk(cp: int) -> bool:
    return any(lo <= cp <= hi for lo, hi in _CJK_RANGES)


def _is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True  # all ASCII non-alphanumeric symbols, such as "$" and "^", count
    return unicodedata.category(ch).startswith("P")


class WordPieceTokenizer(Tokenizer):
    """A BERT WordPiece vocabulary from GGUF metadata.

    Attributes (besides `Tokenizer`'s):
        lowercase: the text is lower-cased before splitting.
        strip_accents: combining marks are removed (after NFD) before splitting.
        cls_id, sep_id, pad_id, mask_id: the special tokens (CLS is BOS, SEP is EOS).
    """

    model = "bert"

    def __init__(self, md: Mapping[str, Any]) -> None:
        super().__init__(md, default_bos=101, default_eos=102, default_unk=100, add_bos=True,
                         add_space_prefix=True, clean_spaces=False)
        self.add_eos = bool(md.get("tokenizer.ggml.add_eos_token", True))
        if self.add_eos and self.eos_id is None:
            raise ValueError("this BERT vocabulary has no [SEP] token")
        if self.unk_id is None:
            raise ValueError("this BERT vocabulary has no [UNK] token")
        self.lowercase: bool = bool(md.get("tokenizer.ggml.lowercase", True))
        self.strip_accents: bool = bool(md.get("tokenizer.ggml.strip_accents", self.lowercase))
        self.cls_id: int | None = self.bos_id
        self.sep_id: int | None = self._special_ids["sep"] if self._special_ids["sep"] \
            is not None else self.eos_id
        self.pad_id: int = self._special_ids["pad"] if self._special_ids["pad"] is not None else 0
        self.mask_id: int | None = self._special_ids["mask"]
        # piece text -> id, for word starts ("▁hello" in the file) and continuations ("llo")
        self._starts: dict[str, int] = {}
        self._rests: dict[str, int] = {}
        for i, tok in enumerate(self.tokens):
            if tok.startswith(SPACE_MARK):
                self._starts.setdefault(tok[1:], i)
            elif not self.is_control(i):
                self._rests.setdefault(tok, i)
        self._longest = max(map(len, self.tokens))
        self._words: dict[str, tuple[int, ...]] = {}  # memo of word -> ids

    # -- encoding ----------------------------------------------------------------------------
    def normalize(self, text: str) -> str:
        """Steps 1-3 of the module docstring: the text the words are split from."""
        out = []
        for ch in text:
            cp = ord(ch)
            if cp == 0 or cp == 0xFFFD:
                continue
            cat = unicodedata.category(ch)
            if ch in "\t\n\r" or ch.isspace():
                out.append(" ")
            elif cat.startswith("C"):
                continue
            elif _is_cjk(cp):
                out.append(f" {ch} ")
            else:
                out.append(ch)
        text = "".join(out)
        if self.strip_accents:
            text = "".join(c for c in unicodedata.normalize("NFD", text)
                           if unicodedata.category(c) != "Mn")
        if self.lowercase:
            text = text.lower()
        return text

    def words(self, text: str) -> list[str]:
        """The pre-tokenized words of `text` (normalized, split at spaces and punctuation)."""
        words = []
        for chunk in self.normalize(text).split():
            start = 0
            for i, ch in enumerate(chunk):
                if _is_punctuation(ch):
                    if i > start:
                        words.append(chunk[start:i])
                    words.append(ch)
                    start = i + 1
            if start < len(chunk):
                words.append(chunk[start:])
        return words

    def _encode_fragments(self, fragments: list[str | int]) -> list[int]:
        ids: list[int] = []
        for fragment in fragments:
            if isinstance(fragment, int):
                ids.append(fragment)
                continue
            for word in self.words(fragment):
                ids.extend(self._word_ids(word))
        return ids

    def _word_ids(self, word: str) -> tuple[int, ...]:
        """Greedy longest-match-first pieces of one word; `(unk,)` when it cannot be covered."""
        cached = self._words.get(word)
        if cached is not None:
            return cached
        ids: list[int] = []
        if len(word) <= MAX_WORD_CHARS:
            start, n = 0, len(word)
            while start < n:
                table = self._starts if start == 0 else self._rests
                for end in range(min(n, start + self._longest), start, -1):
                    piece_id = table.get(word[start:end])
                    if piece_id is not None:
                        ids.append(piece_id)
                        start = end
                        break
                else:
                    ids = []
                    break
        result = tuple(ids) if ids else (self.unk_id,)
        if len(word) <= CACHED_WORD_CHARS and len(self._words) < 1 << 16:
            self._words[word] = result
        return result

    # -- decoding ----------------------------------------------------------------------------
    def _normal_piece(self, text: str) -> bytes:
        return text.replace(SPACE_MARK, " ").encode()
