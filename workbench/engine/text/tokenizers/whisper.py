"""Whisper's vocabulary: the stored byte-level BPE tokens plus the special tokens.

A whisper.cpp file stores only the ordinary tokens (raw bytes, 50257 of them);
the special tokens follow at fixed offsets that depend on whether the model is
multilingual (n_vocab 51865, or 51866 with Cantonese) or English-only (51864):

    eot, sot, the language tokens (multilingual only), translate, transcribe,
    solm, prev, nospeech, notimestamps, then 1501 timestamps <|0.00|> .. <|30.00|>
"""

from __future__ import annotations

from collections.abc import Sequence

# Language codes in token order (Whisper's list; the 100th, Cantonese, only in large-v3)
LANGUAGES = (
    "en", "zh", "de", "es", "ru", "ko", "fr", "ja", "pt", "tr", "pl", "ca", "nl", "ar", "sv",
    "it", "id", "hi", "fi", "vi", "he", "uk", "el", "ms", "cs", "ro", "da", "hu", "ta", "no",
    "th", "ur", "hr", "bg", "lt", "la", "mi", "ml", "cy", "sk", "te", "fa", "lv", "bn", "sr",
    "az", "sl", "kn", "et", "mk", "br", "eu", "is", "hy", "ne", "mn", "bs", "kk", "sq", "sw",
    "gl", "mr", "pa", "si", "km", "sn", "yo", "so", "af", "oc", "ka", "be", "tg", "sd", "gu",
    "am", "yi", "lo", "uz", "fo", "ht", "ps", "tk", "nn", "mt", "sa", "lb", "my", "bo", "tl",
    "mg", "as", "tt", "haw", "ln", "ha", "ba", "jw", "su", "yue",
)
N_TIMESTAMPS = 1501  # 0.00 .. 30.00 s in steps of 0.02 s
TIME_PRECISION = 0.02  # seconds per timestamp step


class WhisperTokenizer:
    """Token ids <-> text for a Whisper model, with the special and timestamp tokens.

    Attributes: `n_vocab`, `multilingual`, `languages` (codes this model has tokens
    for), and the ids `eot`, `sot`, `translate`, `transcribe`, `solm`, `prev`,
    `nospeech`, `no_timestamps`, `timestamp_begin`.
    """

    def __init__(self, tokens: Sequence[bytes], n_vocab: int):
        self.n_vocab = int(n_vocab)
        self.multilingual = self.n_vocab >= 51865
        n_languages = self.n_vocab - 51765 - (1 if self.multilingual else 0)
        if self.multilingual and not 0 < n_languages <= len(LANGUAGES):
            raise ValueError(f"n_vocab {n_vocab} matches no Whisper vocabulary")
        self.languages: tuple[str, ...] = LANGUAGES[:n_languages] if self.multilingual else ()
        base = len(tokens)
        self.eot = 50256 + (1 if self.multilingual else 0)
        self.sot = self.eot + 1
        shift = n_languages - 98 if self.multilingual else 0
        self.translate = 50357 + shift
        self.transcribe = 50358 + shift
        self.solm = 50359 + shift
        self.prev = 50360 + shift
        self.nospeech = 50361 + shift
        self.no_timestamps = 50362 + shift
        self.timestamp_begin = 50363 + shift
        if self.timestamp_begin + N_TIMESTAMPS != self.n_vocab:
            raise ValueError(f"n_vocab {n_vocab}: the special tokens do not add up")
        if base > self.eot + 1:  # English-only files also store <|endoftext|>'s text
            raise ValueError(f"{base} stored tokens overlap the special tokens at {self.eot}")
        self._bytes: list[bytes] = list(tokens[: self.eot])  # the ordinary tokens
        self._space = self._bytes.index(b" ") if b" " in self._bytes else None

    # -- ids -----------------------------------------------------------------------------
    def language_token(self, language: str) -> int:
        """The id of `<|language|>`; ValueError for a code this model lacks."""
        if language not in self.languages:
            have = ", ".join(self.languages) if self.languages else "none (English-only model)"
            raise ValueError(f"unknown language {language!r}; this model has: {have}")
        return self.sot + 1 + self.languages.index(language)

    @property
    def language_ids(self) -> list[int]:
        """Ids of all language tokens, in `languages` order."""
        return [self.sot + 1 + i for i in range(len(self.languages))]

    @property
    def space(self) -> int | None:
        """The id of the single-space token (suppressed as the first token)."""
        return self._space

    def sot_sequence(self, language: str | None, task: str = "transcribe",
                     timestamps: bool = False) -> list[int]:
        """The prompt a chunk is decoded from: sot, language and task (multilingual
        models only), and notimestamps unless timestamps are wanted."""
        ids = [self.sot]
        if self.multilingual:
            ids.append(self.language_token(language or "en"))
            if task not in ("transcribe", "translate"):
                raise ValueError(f"task must be 'transcribe' or 'translate', not {task!r}")
            ids.append(self.transcribe if task == "transcribe" else self.translate)
        if not timestamps:
            ids.append(self.no_timestamps)
        return ids

    def is_timestamp(self, token_id: int) -> bool:
        return token_id >= self.timestamp_begin

    def timestamp_seconds(self, token_id: int) -> float:
        """Seconds from the chunk start that a timestamp token stands for."""
        return (token_id - self.timestamp_begin) * TIME_PRECISION

    # -- text ----------------------------------------------------------------------------
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of an ordinary token; b"" for special and timestamp tokens."""
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""

    def token_text(self, token_id: int) -> str:
        """Printable text of any token (specials as `<|name|>`), for displays."""
        if token_id < len(self._bytes):
            return self._bytes[token_id].decode("utf-8", "replace")
        if self.is_timestamp(token_id):
            return f"<|{self.timestamp_seconds(token_id):.2f}|>"
        names = {self.eot: "endoftext", self.sot: "startoftranscript",
                 self.translate: "translate", self.transcribe: "transcribe",
                 self.solm: "startoflm", self.prev: "startofprev", self.nospeech: "nospeech",
                 self.no_timestamps: "notimestamps"}
        if token_id in names:
            return f"<|{names[token_id]}|>"
        lang = token_id - self.sot - 1
        if 0 <= lang < len(self.languages):
            return f"<|{self.languages[lang]}|>"
        return f"<|extra_{token_id}|>"

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`; special and timestamp tokens contribute nothing."""
        return b"".join(self.token_bytes(int(i)) for i in ids).decode("utf-8", "replace")
