"""Streaming detokenization: text from token ids as they are generated.

A token may end in the middle of a UTF-8 character (byte-fallback tokens, or
byte-level BPE pieces of emoji and CJK text), so `StreamDecoder` holds back an
incomplete multi-byte tail until the bytes that complete it arrive. Where the
tokenizer cleans up spaces (`Tokenizer.clean_spaces`), a space can still be
removed by the characters that follow it, so text within three bytes after a
space is held back too. Everything `push` returned plus `flush` equals
`tokenizer.decode(ids)` for the ids pushed.
"""

from __future__ import annotations

import codecs

from workbench.engine.text.tokenizers.base import Tokenizer, clean_up_tokenization_spaces

# clean_up_tokenization_spaces decides about a space from at most this many bytes after it
_CLEANUP_LOOKAHEAD = 3


class StreamDecoder:
    """Turns token ids into text incrementally, never splitting a character.

    `push(id)` returns the text that has become final (possibly ""), `flush()`
    the rest (an incomplete UTF-8 tail becomes U+FFFD, as in `decode`).
    `skip_special` drops control tokens, as in `Tokenizer.decode`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._reset()

    def _reset(self) -> None:
        self._raw = bytearray()  # all bytes so far, before space clean-up
        self._sent = 0  # bytes of the cleaned text already given to the UTF-8 decoder
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._first = True

    def push(self, id: int) -> str:
        """Add token `id`; return the newly completed text."""
        piece = self.tokenizer.token_bytes(id, skip_special=self.skip_special)
        if self._first:
            self._first = False
            if self.tokenizer.add_space_prefix and piece[:1] == b" ":
                piece = piece[1:]  # decode() drops the first token's prefix space
        if not self.tokenizer.clean_spaces:
            return self._utf8.decode(piece)
        self._raw += piece
        return self._release(self._stable_length())

    def flush(self) -> str:
        """Return whatever is held back and reset for a new stream."""
        if self.tokenizer.clean_spaces:
            text = self._release(len(self._raw), final=True)
        else:
            text = self._utf8.decode(b"", final=True)
        self._reset()
        return text

    def _stable_length(self) -> int:
        """The longest prefix of the raw bytes whose cleaned form later bytes cannot change:
        one whose last bytes hold no space."""
        end = len(self._raw)
        while end > 0:
            space = self._raw.rfind(b" ", max(0, end - _CLEANUP_LOOKAHEAD), end)
            if space < 0:
                break
            end = space
        return end

    def _release(self, end: int, final: bool = False) -> str:
        cleaned = clean_up_tokenization_spaces(bytes(self._raw[:end]))
        fresh = cleaned[self._sent:]
        self._sent = len(cleaned)
        return self._utf8.decode(fresh, final=final)
