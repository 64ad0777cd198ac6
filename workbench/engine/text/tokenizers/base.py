"""What the tokenizers share (see the package docstring): `Tokenizer`, the base class that
`BPETokenizer`, `SPMTokenizer` and `WordPieceTokenizer` derive from, with token
attributes, special-token partitioning, the end-of-generation set and detokenization,
following llama.cpp's `llama_vocab`."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from enum import IntFlag
from typing import Any

import numpy as np

# Words (pre-tokenized pieces) up to this long are memoised by the tokenizers that cache
# their encodings; longer ones are encoded each time. Memoising every word let a client's
# long random words grow a cache of 65,536 entries by ~1 MB a word (BPE).
CACHED_WORD_CHARS = 64


def token_texts(tokens: Iterable[str]) -> list[str]:
    """The token texts as the vocabulary keys them: an empty text becomes `[EMPTY_i]`
    (its id i), as llama.cpp renames it on load, so several empty tokens stay distinct.
    The GGUF reader's duplicate-token check applies the same rule."""
    return [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]


class UnsupportedTokenizerError(ValueError):
    """The GGUF names a tokenizer model or pre-tokenizer this package does not implement."""


class TokenAttr(IntFlag):
    """Per-token attributes (llama.cpp's `llama_token_attr` bits)."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    LSTRIP = 1 << 8  # strip whitespace to the left of this special token when partitioning
    RSTRIP = 1 << 9  # ... and to its right


# GGUF `tokenizer.ggml.token_type` values (gguf.TokenType) -> attribute bits
_TYPE_TO_ATTR = np.array([
    TokenAttr.UNDEFINED,     # 0: undefined
    TokenAttr.NORMAL,        # 1
    TokenAttr.UNKNOWN,       # 2
    TokenAttr.CONTROL,       # 3
    TokenAttr.USER_DEFINED,  # 4
    TokenAttr.UNUSED,        # 5
    TokenAttr.BYTE,          # 6
], dtype=np.int64)

_UNKNOWN, _CONTROL, _USER, _NORMAL, _BYTE = (
    int(TokenAttr.UNKNOWN), int(TokenAttr.CONTROL), int(TokenAttr.USER_DEFINED),
    int(TokenAttr.NORMAL), int(TokenAttr.BYTE))
_LSTRIP, _RSTRIP = int(TokenAttr.LSTRIP), int(TokenAttr.RSTRIP)
_SPECIAL = _CONTROL | _USER | _UNKNOWN  # what the partitioning cuts out of the text

# Token texts llama.cpp recognizes when the metadata does not name the token.
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
              "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# Texts of tokens that end a generation (llama.cpp's EOG list).
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
              "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
              "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
              "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[")
# Always rendered as plain text (gpt-oss channel markup).
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")

# Metadata keys for special token ids, in the order llama.cpp applies them (the
# deprecated prefix/suffix/middle keys come last and win).
_SPECIAL_ID_KEYS = (
    ("bos", "tokenizer.ggml.bos_token_id"), ("eos", "tokenizer.ggml.eos_token_id"),
    ("eot", "tokenizer.ggml.eot_token_id"), ("eom", "tokenizer.ggml.eom_token_id"),
    ("unk", "tokenizer.ggml.unknown_token_id"), ("sep", "tokenizer.ggml.seperator_token_id"),
    ("pad", "tokenizer.ggml.padding_token_id"), ("mask", "tokenizer.ggml.mask_token_id"),
    ("fim_pre", "tokenizer.ggml.fim_pre_token_id"), ("fim_suf", "tokenizer.ggml.fim_suf_token_id"),
    ("fim_mid", "tokenizer.ggml.fim_mid_token_id"), ("fim_pad", "tokenizer.ggml.fim_pad_token_id"),
    ("fim_rep", "tokenizer.ggml.fim_rep_token_id"), ("fim_sep", "tokenizer.ggml.fim_sep_token_id"),
    ("fim_pre", "tokenizer.ggml.prefix_token_id"), ("fim_suf", "tokenizer.ggml.suffix_token_id"),
    ("fim_mid", "tokenizer.ggml.middle_token_id"),
)

_C_SPACE = " \t\n\v\f\r"  # C isspace() in the "C" locale


def clean_up_tokenization_spaces(data: bytes) -> bytes:
    """llama.cpp's `clean_spaces` post-processing of detokenized text.

    Three passes, each over the previous one's output: drop a space before
    `? ! . ,`; turn `" ' "` into `"'"`; drop the space before the contractions
    `'s 'm 're 've`.
    """
    data = re.sub(rb" (?=[?!.,])", b"", data)
    data = data.replace(b" ' ", b"'")
    return re.sub(rb" '(?=[sm]|re|ve)", b"'", data)


class Tokenizer:
    """A llama.cpp-compatible tokenizer built from GGUF metadata.

    Attributes:
        model: `tokenizer.ggml.model` ("gpt2" or "llama").
        tokens: token texts as stored in the GGUF, indexed by id.
        vocab_size: number of tokens.
        bos_id, eos_id, unk_id: special token ids, or None.
        eot_ids: ids that end a turn or a generation (llama.cpp's EOG set: EOS,
            EOT, EOM, the fill-in-the-middle pad/repo/separator tokens and the
            tokens whose text is a known end marker such as `<|im_end|>`).
        add_bos, add_eos: whether `encode` adds BOS / EOS by default.
        add_space_prefix: SentencePiece's dummy prefix space; when set, `decode`
            also drops one leading space of the first token.
        clean_spaces: `decode` applies `clean_up_tokenization_spaces`.
    """

    model: str = ""

    def __init__(self, md: Mapping[str, Any], *, default_bos: int | None,
                 default_eos: int | None, default_unk: int | None, add_bos: bool,
                 add_space_prefix: bool, clean_spaces: bool) -> None:
        tokens = md.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, Sequence) or isinstance(tokens, str) or not tokens:
            raise ValueError("the GGUF has no tokenizer.ggml.tokens array")
        self.tokens: list[str] = token_texts(tokens)
        self.vocab_size: int = len(self.tokens)
        self._token_to_id: dict[str, int] = dict(zip(self.tokens, range(self.vocab_size)))
        if len(self._token_to_id) != self.vocab_size:
            raise ValueError("the GGUF vocabulary holds duplicate token texts")

        types = md.get("tokenizer.ggml.token_type")
        if types is None:
            attrs = np.full(self.vocab_size, _NORMAL, dtype=np.int64)
        else:
            types = np.asarray(types, dtype=np.int64)[: self.vocab_size]
            if len(types) < self.vocab_size:
                raise ValueError("tokenizer.ggml.token_type is shorter than the vocabulary")
            attrs = np.where((types >= 0) & (types < len(_TYPE_TO_ATTR)),
                             _TYPE_TO_ATTR[np.clip(types, 0, len(_TYPE_TO_ATTR) - 1)], 0)
        self._attrs: list[int] = attrs.tolist()

        self.add_space_prefix: bool = bool(md.get("tokenizer.ggml.add_space_prefix",
                                                  add_space_prefix))
        self.clean_spaces: bool = clean_spaces
        self._resolve_special_ids(md, default_bos, default_eos, default_unk)
        self.add_bos: bool = bool(md.get("tokenizer.ggml.add_bos_token", add_bos))
        self.add_eos: bool = bool(md.get("tokenizer.ggml.add_eos_token", False))
        if self.add_bos and self.bos_id is None:
            raise ValueError("tokenizer.ggml.add_bos_token is true, but there is no BOS token")
        if self.add_eos and self.eos_id is None:
            raise ValueError("tokenizer.ggml.add_eos_token is true, but there is no EOS token")
        self._detect_special_tokens()
        self._build_special_lists(md)
        self._pieces: dict[int, bytes] = {}

    # -- construction ------------------------------------------------------------------------
    def _resolve_special_ids(self, md: Mapping[str, Any], bos: int | None, eos: int | None,
                             unk: int | None) -> None:
        ids: dict[str, int | None] = {name: None for name, _ in _SPECIAL_ID_KEYS}
        ids.update(bos=bos, eos=eos, unk=unk)
        for name, key in _SPECIAL_ID_KEYS:
            if ids[name] is not None and not 0 <= ids[name] < self.vocab_size:
                ids[name] = None  # a default outside the vocabulary is disabled
            value = md.get(key)
            if value is not None and 0 <= int(value) < self.vocab_size:
                ids[name] = int(value)
        self._special_ids = ids
        self.bos_id: int | None = ids["bos"]
        self.eos_id: int | None = ids["eos"]
        self.unk_id: int | None = ids["unk"]

    def _id_of_any(self, texts: Iterable[str]) -> int | None:
        found = [self._token_to_id[t] for t in texts if t in self._token_to_id]
        return min(found) if found else None

    def _mark_control(self, token_id: int) -> None:
        self._attrs[token_id] |= _CONTROL

    def _detect_special_tokens(self) -> None:
        """EOT/EOM/FIM by text where the metadata leaves them unset, and the EOG set."""
        ids = self._special_ids
        for name, texts in (("eot", _EOT_TEXTS), ("eom", _EOM_TEXTS), *_FIM_TEXTS.items()):
            if ids[name] is None:
                found = self._id_of_any(texts)
                if found is not None:
                    ids[name] = found
                    self._mark_control(found)

        eog = {ids[name] for name in ("fim_pad", "fim_rep", "fim_sep") if ids[name] is not None}
        for text in _EOG_TEXTS:
            token_id = self._token_to_id.get(text)
            if token_id is not None:
                eog.add(token_id)
                self._mark_control(token_id)
        for text in _ALWAYS_RENDERED:
            if text in self._token_to_id:
                self._attrs[self._token_to_id[text]] = _USER
        eog.update(ids[name] for name in ("eos", "eot", "eom") if ids[name] is not None)

        # gpt-oss / solar-open: "<|end|>" ends a message there, not the generation
        texts = {self.tokens[i] for i in eog}
        has_call = "<|call|>" in texts or "<|calls|>" in texts
        if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
            end_id = self._token_to_id["<|end|>"]
            eog.discard(end_id)
            self._attrs[end_id] = _USER
        # gemma 4 and plamo: "</s>" is an ordinary token there
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            s_id = self._token_to_id["</s>"]
            eog.discard(s_id)
            self._attrs[s_id] = _NORMAL
        self.eot_ids: frozenset[int] = frozenset(eog)

    def _build_special_lists(self, md: Mapping[str, Any]) -> None:
        """Ids cut out of the text before tokenization, longest text first."""
        attrs = np.asarray(self._attrs, dtype=np.int64)
        special = np.flatnonzero(attrs & _SPECIAL).tolist()
        special.sort(key=lambda i: (-len(self.tokens[i].encode()), i))
        self._special_all: list[int] = special
        self._special_user: list[int] = [i for i in special if self._attrs[i] & _USER and
                                         not self._attrs[i] & (_CONTROL | _UNKNOWN)]
        name = str(md.get("general.name", "")).lower()
        if "phi-3" in name or "phi3" in name:  # llama.cpp's per-model attribute fix-up
            for i in special:
                self._attrs[i] |= _RSTRIP
            for text, on in (("</s>", True), ("<unk>", False), ("<s>", False),
                             ("<|endoftext|>", False)):
                if text in self._token_to_id:
                    i = self._token_to_id[text]
                    self._attrs[i] = self._attrs[i] | _RSTRIP if on else self._attrs[i] & ~_RSTRIP

    # -- encoding ----------------------------------------------------------------------------
    def encode(self, text: str, *, add_bos: bool | None = None, add_eos: bool | None = None,
               special: bool = True) -> list[int]:
        """Token ids of `text`, as llama.cpp's `llama_tokenize`.

        `add_bos`/`add_eos` default to the model's `add_bos`/`add_eos`.
        `special=True` turns the text of control and user-defined tokens (e.g.
        `<|im_start|>`) into those tokens; `special=False` treats control-token
        text as plain text (user-defined tokens are still matched, as llama.cpp
        does).
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be str, not {type(text).__name__}")
        ids: list[int] = []
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise ValueError("this vocabulary has no BOS token")
            ids.append(self.bos_id)
        ids.extend(self._encode_fragments(self._partition(text, special)))
        if self.add_eos if add_eos is None else add_eos:
            if self.eos_id is None:
                raise ValueError("this vocabulary has no EOS token")
            ids.append(self.eos_id)
        return ids

    def _encode_fragments(self, fragments: list[str | int]) -> list[int]:
        """Ids of partitioned text: `str` fragments to tokenize, `int` special token ids."""
        raise NotImplementedError

    def _partition(self, text: str, special: bool) -> list[str | int]:
        """Cut `text` at special tokens, longest first (llama.cpp's
        `tokenizer_st_partition`): raw text fragments (str) and token ids (int)."""
        if not text:
            return []
        fragments: list[str | int] = [text]
        for token_id in self._special_all if special else self._special_user:
            token = self.tokens[token_id]
            if token not in text:
                continue
            attr = self._attrs[token_id]
            cut: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or token not in fragment:
                    cut.append(fragment)
                    continue
                rest = fragment
                while True:
                    at = rest.find(token)
                    if at < 0:
                        if rest:
                            cut.append(rest)
                        break
                    left = rest[:at].rstrip(_C_SPACE) if attr & _LSTRIP else rest[:at]
                    if left:
                        cut.append(left)
                    cut.append(token_id)
                    rest = rest[at + len(token):]
                    if attr & _RSTRIP:
                        rest = rest.lstrip(_C_SPACE)
            fragments = cut
        return fragments

    # -- decoding ----------------------------------------------------------------------------
    def _check_id(self, token_id: int) -> int:
        token_id = int(token_id)
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        return token_id

    def _normal_piece(self, text: str) -> bytes:
        """Bytes of a normal token's text (byte-level or SentencePiece spelling)."""
        raise NotImplementedError

    def token_bytes(self, id: int, *, skip_special: bool = False) -> bytes:
        """The raw bytes token `id` stands for (llama.cpp's `token_to_piece`).

        Control, unknown and user-defined tokens give their text; byte tokens
        (`<0xNN>`) their byte; unused or undefined tokens nothing. With
        `skip_special`, control and unknown tokens give nothing.
        """
        token_id = self._check_id(id)
        attr = self._attrs[token_id]
        if skip_special and attr & (_CONTROL | _UNKNOWN):
            return b""
        piece = self._pieces.get(token_id)
        if piece is None:
            text = self.tokens[token_id]
            if attr & (_CONTROL | _UNKNOWN | _USER):
                piece = text.encode()
            elif attr & _NORMAL:
                piece = self._normal_piece(text)
            elif attr & _BYTE:
                piece = bytes([int(text[3:5], 16)])
            else:
                piece = b""
            self._pieces[token_id] = piece
        return piece

    def decode_bytes(self, ids: Sequence[int], *, skip_special: bool = False) -> bytes:
        """The bytes of `ids` (llama.cpp's `llama_detokenize` before UTF-8 decoding)."""
        parts = [self.token_bytes(i, skip_special=skip_special) for i in ids]
        if parts and self.add_space_prefix and parts[0][:1] == b" ":
            parts[0] = parts[0][1:]
        data = b"".join(parts)
        return clean_up_tokenization_spaces(data) if self.clean_spaces else data

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """The text of `ids`, like llama.cpp's detokenizer.

        Control tokens are rendered as their text unless `skip_special`; bytes
        that are not valid UTF-8 become U+FFFD.
        """
        return self.decode_bytes(ids, skip_special=skip_special).decode("utf-8", "replace")

    # -- token properties --------------------------------------------------------------------
    def token_to_id(self, text: str) -> int | None:
        """The id of the token whose stored text is exactly `text`, or None."""
        return self._token_to_id.get(text)

    def attr(self, id: int) -> TokenAttr:
        """The attributes of token `id`."""
        return TokenAttr(self._attrs[self._check_id(id)])

    def is_control(self, id: int) -> bool:
        """Whether `id` is a control token (BOS, EOS, `<|im_start|>` ...)."""
        return bool(self._attrs[self._check_id(id)] & _CONTROL)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(model={self.model!r}, vocab_size={self.vocab_size}, "
                f"bos_id={self.bos_id}, eos_id={self.eos_id})")
