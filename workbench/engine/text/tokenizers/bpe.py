"""Byte-level BPE (`tokenizer.ggml.model == "gpt2"`), as llama.cpp's `llm_tokenizer_bpe`.

Encoding a raw-text fragment (special tokens are already cut out):

1. Pre-tokenization: the regexes that llama.cpp associates with
   `tokenizer.ggml.pre` are applied one after the other; each splits every
   current piece into its matches *and* the unmatched text between them.
   llama.cpp runs regexes that use Unicode categories (`\\p{L}` ...) on a
   "collapsed" copy of the text in which every non-ASCII code point becomes one
   stand-in character per category (whitespace becomes `\\v`), and the others
   on a copy where non-ASCII whitespace becomes `\\v`. Both copies are
   reproduced here, so their quirks carry over too (`\\p{Lu}` and `\\p{Ll}` both
   stand for any letter; U+3000 is only ever whitespace). Category data is
   Unicode 15.1's, as in llama.cpp.
2. Each piece is spelled in GPT-2's byte-to-unicode alphabet and merged by
   rank: the adjacent pair with the lowest merge rank first, leftmost first on
   ties. Pieces already in the vocabulary skip merging for pre-tokenizers
   that ignore merges (llama 3, tekken).
3. Merged symbols missing from the vocabulary fall back to single-byte
   tokens, as llama.cpp does.

Results are cached per piece, so repeated words cost a dictionary look-up.
"""

from __future__ import annotations

import heapq
import unicodedata
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import regex

from workbench.engine.text.tokenizers.base import (
    CACHED_WORD_CHARS,
    Tokenizer,
    UnsupportedTokenizerError,
)

# -- pre-tokenizer regexes (llama.cpp's, by pre-tokenizer type) ------------------------------

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_JAIS2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)"
          r"|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}")
_SEED_CODER = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_BAILINGMOE = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+")
# "upper then lower" / "lower" letter runs, written with ASCII-only case tests
_UPPER_RUN = r"((?=[\p{L}])([^a-z]))"
_LOWER_RUN = r"((?=[\p{L}])([^A-Z]))"
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER_RUN}*{_LOWER_RUN}+"
           rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER_RUN}+{_LOWER_RUN}*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER_RUN}*{_LOWER_RUN}+{_CONTRACTIONS}?"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER_RUN}+{_LOWER_RUN}*{_CONTRACTIONS}?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
    "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
_DEEPSEEK_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
_PORO = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"

_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "llama3": (_LLAMA3,),
    "jais2": (_JAIS2,),
    # "$" of std::regex: the end of the piece only (Python's "$" also matches before a final "\n")
    "deepseek-llm": ("[\r\n]", _DEEPSEEK_LETTERS, _DEEPSEEK_PUNCT, r"\s+\Z", _CJK, r"\p{N}+"),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"),
    "deepseek-v3": (
        r"\p{N}{1,3}",
        "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    "starcoder": (r"\p{N}", _GPT2),
    "gpt2": (_GPT2,),
    "qwen2": (_QWEN2,),
    "qwen35": (_QWEN35,),
    "poro": (_PORO,),
    "viking": (_PORO, r"\p{N}"),
    "tekken": (_TEKKEN,),
    "gpt4o": (_GPT4O,),
    "bailingmoe": (_BAILINGMOE,),
    "seed-coder": (_SEED_CODER,),
}


@dataclass(frozen=True)
class _PreType:
    """How llama.cpp treats one `tokenizer.ggml.pre` value."""

    regexes: str  # key of _REGEXES
    clean_spaces: bool = True
    ignore_merges: bool = False
    add_bos: bool = False
    no_bos: bool = False  # the BOS default is disabled (chatglm)


def _group(names: str, pre: _PreType) -> dict[str, _PreType]:
    return {name: pre for name in names.split()}


# `tokenizer.ggml.pre` values -> behaviour, from llama.cpp's llama_vocab::load.
# "gpt2" is not a llama.cpp name; GGUF writers use it for GPT-2's own pre-tokenizer.
PRE_TOKENIZERS: dict[str, _PreType] = {
    **_group("default", _PreType("default")),
    **_group("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2",
             _PreType("llama3", ignore_merges=True, add_bos=True)),
    **_group("dbrx smaug-bpe", _PreType("llama3")),
    **_group("chatglm-bpe", _PreType("llama3", no_bos=True)),
    **_group("glm4 glm5", _PreType("llama3", ignore_merges=True, no_bos=True)),
    **_group("jais-2", _PreType("jais2")),
    **_group("deepseek-llm", _PreType("deepseek-llm", clean_spaces=False)),
    **_group("deepseek-coder", _PreType("deepseek-coder", clean_spaces=False)),
    **_group("deepseek-v3 hunyuan-dense", _PreType("deepseek-v3", clean_spaces=False)),
    **_group("falcon", _PreType("falcon")),
    **_group("starcoder refact codeshell exaone minerva-7b mellum2", _PreType("starcoder")),
    **_group("smollm command-r", _PreType("starcoder", clean_spaces=False)),
    **_group("gpt2 gpt-2 phi-2 gigachat a.x-4.0 mellum mpt olmo jais exaone4",
             _PreType("gpt2")),
    **_group("trillion granite-docling", _PreType("gpt2", clean_spaces=False)),
    **_group("qwen2 deepseek-r1-qwen kormo f2llmv2 hunyuan grok-2 solar-open",
             _PreType("qwen2", clean_spaces=False)),
    **_group("stablelm2 megrez", _PreType("qwen2")),
    **_group("qwen35", _PreType("qwen35", clean_spaces=False)),
    **_group("poro-chat", _PreType("poro", clean_spaces=False)),
    **_group("bloom gpt3-finnish", _PreType("poro")),
    **_group("viking", _PreType("viking", clean_spaces=False)),
    **_group("tekken", _PreType("tekken", clean_spaces=False, ignore_merges=True, add_bos=True)),
    **_group("gpt-4o llama4 kanana2", _PreType("gpt4o", clean_spaces=False)),
    **_group("bailingmoe bailingmoe2 llada-moe", _PreType("bailingmoe", clean_spaces=False)),
    **_group("seed-coder", _PreType("seed-coder", clean_spaces=False)),
}

# -- the two text copies llama.cpp matches its regexes against -------------------------------

_WHITESPACE = frozenset([*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
                         0x2028, 0x2029, 0x202F, 0x205F, 0x3000])
# stand-ins of the collapsed copy, per Unicode category (llama.cpp uses these byte values)
_STAND_IN = {"N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5"}
_OTHER = "\xd0"
# what a category class becomes in a collapsed regex: its stand-in plus its ASCII members
_CLASS_MEMBERS = {
    "N": "\xd10-9",
    "L": "\xd2A-Za-z",
    "P": "\xd3!-#%-*,-/:-;?-@\\[-\\]_\\{\\}",
    "M": "\xd4",
    "S": "\xd5\\$\\+<->\\^`\\|~",
}
_CATEGORY_OF_CLASS = {"N": "N", "L": "L", "P": "P", "M": "M", "S": "S",
                      "Lu": "L", "Ll": "L", "Lt": "L", "Lm": "L", "Lo": "L"}
_CLASS = regex.compile(r"\\p\{(" + "|".join(_CATEGORY_OF_CLASS) + r")\}")


# llama.cpp's category table is Unicode 15.1's. Code points assigned in 15.0 and 15.1, with
# their major category, for Pythons whose `unicodedata` is older (3.11 has Unicode 14.0).
_UNICODE_15_ADDITIONS = (
    (0x00CF3, 0x00CF3, "M"), (0x00ECE, 0x00ECE, "M"), (0x02FFC, 0x02FFF, "S"),
    (0x031EF, 0x031EF, "S"), (0x10EFD, 0x10EFF, "M"), (0x1123F, 0x11240, "L"),
    (0x11241, 0x11241, "M"), (0x11B00, 0x11B09, "P"), (0x11F00, 0x11F01, "M"),
    (0x11F02, 0x11F02, "L"), (0x11F03, 0x11F03, "M"), (0x11F04, 0x11F10, "L"),
    (0x11F12, 0x11F33, "L"), (0x11F34, 0x11F3A, "M"), (0x11F3E, 0x11F42, "M"),
    (0x11F43, 0x11F4F, "P"), (0x11F50, 0x11F59, "N"), (0x1342F, 0x1342F, "L"),
    (0x13440, 0x13440, "M"), (0x13441, 0x13446, "L"), (0x13447, 0x13455, "M"),
    (0x1B132, 0x1B132, "L"), (0x1B155, 0x1B155, "L"), (0x1D2C0, 0x1D2D3, "N"),
    (0x1DF25, 0x1DF2A, "L"), (0x1E030, 0x1E06D, "L"), (0x1E08F, 0x1E08F, "M"),
    (0x1E4D0, 0x1E4EB, "L"), (0x1E4EC, 0x1E4EF, "M"), (0x1E4F0, 0x1E4F9, "N"),
    (0x1F6DC, 0x1F6DC, "S"), (0x1F774, 0x1F776, "S"), (0x1F77B, 0x1F77F, "S"),
    (0x1F7D9, 0x1F7D9, "S"), (0x1FA75, 0x1FA77, "S"), (0x1FA87, 0x1FA88, "S"),
    (0x1FAAD, 0x1FAAF, "S"), (0x1FABB, 0x1FABD, "S"), (0x1FABF, 0x1FABF, "S"),
    (0x1FACE, 0x1FACF, "S"), (0x1FADA, 0x1FADB, "S"), (0x1FAE8, 0x1FAE8, "S"),
    (0x1FAF7, 0x1FAF8, "S"), (0x2B739, 0x2B739, "L"), (0x2EBF0, 0x2EE5D, "L"),
    (0x31350, 0x323AF, "L"),
)


def _major_category(cp: int) -> str:
    """The first letter of `cp`'s Unicode general category ("C" when unassigned)."""
    category = unicodedata.category(chr(cp))
    if category == "Cn":
        for first, last, major in _UNICODE_15_ADDITIONS:
            if first <= cp <= last:
                return major
    return category[0]


class _CollapseTable(dict):
    """`str.translate` table for the collapsed copy, filled in on first sight of a char."""

    def __missing__(self, cp: int) -> int:
        if cp < 0x80:
            out = cp
        elif cp in _WHITESPACE:
            out = 0x0B
        else:
            out = ord(_STAND_IN.get(_major_category(cp), _OTHER))
        self[cp] = out
        return out


_COLLAPSE = _CollapseTable()
_WIDE = {cp: 0x0B for cp in _WHITESPACE if cp >= 0x80}


def _collapse_regex(expr: str) -> str:
    """`expr` with each category class replaced by its collapsed members."""
    out: list[str] = []
    inside = False  # within [...]; llama.cpp's rule: a bracket preceded by "\" is literal
    i = 0
    while i < len(expr):
        ch = expr[i]
        escaped = i > 0 and expr[i - 1] == "\\"
        if ch == "[" and not escaped:
            inside = True
        elif ch == "]" and inside and not escaped:
            inside = False
        elif ch == "\\" and (m := _CLASS.match(expr, i)):
            members = _CLASS_MEMBERS[_CATEGORY_OF_CLASS[m.group(1)]]
            out.append(members if inside else f"[{members}]")
            i = m.end()
            continue
        out.append(ch)
        i += 1
    return "".join(out)


class _Splitter:
    """One pre-tokenizer regex and the text copy it runs on."""

    def __init__(self, expr: str) -> None:
        self.collapsed = bool(_CLASS.search(expr))
        self.regex = regex.compile(_collapse_regex(expr) if self.collapsed else expr)

    def split(self, view: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Each span cut into the regex's matches and the text between them."""
        out: list[tuple[int, int]] = []
        for start, end in spans:
            pos = 0
            for m in self.regex.finditer(view[start:end]):
                a, b = m.span()
                if a == b:
                    continue
                if a > pos:
                    out.append((start + pos, start + a))
                out.append((start + a, start + b))
                pos = b
            if start + pos < end:
                out.append((start + pos, end))
        return out


class PreTokenizer:
    """llama.cpp's regex pre-tokenization for one `tokenizer.ggml.pre` value."""

    def __init__(self, pre: str) -> None:
        if pre not in PRE_TOKENIZERS:
            raise UnsupportedTokenizerError(
                f"BPE pre-tokenizer {pre!r} is not supported; supported: "
                f"{', '.join(sorted(PRE_TOKENIZERS))}")
        self.pre = pre
        self.kind = PRE_TOKENIZERS[pre]
        self._splitters = [_Splitter(e) for e in _REGEXES[self.kind.regexes]]

    def split(self, text: str) -> list[str]:
        """The pieces of `text` (which concatenate back to `text`)."""
        collapsed = wide = None
        spans = [(0, len(text))] if text else []
        for splitter in self._splitters:
            if splitter.collapsed:
                if collapsed is None:
                    collapsed = text.translate(_COLLAPSE)
                spans = splitter.split(collapsed, spans)
            else:
                if wide is None:
                    wide = text.translate(_WIDE)
                spans = splitter.split(wide, spans)
        return [text[a:b] for a, b in spans]


# -- GPT-2 byte alphabet ---------------------------------------------------------------------

def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte value."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    alphabet, extra = [], 0
    for b in range(256):
        if b in printable:
            alphabet.append(chr(b))
        else:
            alphabet.append(chr(0x100 + extra))
            extra += 1
    return alphabet


_BYTE_TO_CHAR = _byte_alphabet()
_ENCODE_BYTES = {b: ch for b, ch in enumerate(_BYTE_TO_CHAR)}  # for latin-1 text.translate
_CHAR_TO_BYTE = {ch: b for b, ch in enumerate(_BYTE_TO_CHAR)}


def byte_encode(text: str) -> str:
    """`text`'s UTF-8 bytes spelled in GPT-2's byte alphabet."""
    return text.encode("utf-8").decode("latin-1").translate(_ENCODE_BYTES)


def byte_decode(spelled: str) -> bytes:
    """Bytes of a byte-alphabet spelling; characters outside the alphabet are kept
    in llama.cpp's `[UNK_BYTE_0x..]` form."""
    try:
        return bytes(_CHAR_TO_BYTE[ch] for ch in spelled)
    except KeyError:
        out = bytearray()
        for ch in spelled:
            if ch in _CHAR_TO_BYTE:
                out.append(_CHAR_TO_BYTE[ch])
            else:
                out += f"[UNK_BYTE_0x{ch.encode().hex()}{spelled}]".encode()
        return bytes(out)


# -- the tokenizer ---------------------------------------------------------------------------

class BPETokenizer(Tokenizer):
    """GPT-2-style byte-level BPE from GGUF metadata (`tokenizer.ggml.model == "gpt2"`)."""

    model = "gpt2"
    _CACHE_LIMIT = 1 << 16

    def __init__(self, md: Mapping[str, Any]) -> None:
        pre = md.get("tokenizer.ggml.pre")
        if not pre:
            warnings.warn("the GGUF has no tokenizer.ggml.pre; using the 'default' "
                          "pre-tokenizer, as llama.cpp does", stacklevel=2)
            pre = "default"
        self.pre_tokenizer = PreTokenizer(str(pre))
        kind = self.pre_tokenizer.kind
        super().__init__(md, default_bos=None if kind.no_bos else 11, default_eos=11,
                         default_unk=None, add_bos=kind.add_bos, add_space_prefix=False,
                         clean_spaces=kind.clean_spaces)
        merges = md.get("tokenizer.ggml.merges")
        if merges is None:
            raise ValueError("the GGUF has no tokenizer.ggml.merges")
        # "left right" -> rank; the first of duplicate merges wins
        self._ranks: dict[str, int] = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1)))
        self._ignore_merges = kind.ignore_merges
        self._word_cache: dict[str, list[int]] = {}

    def _normal_piece(self, text: str) -> bytes:
        return byte_decode(text)

    def _encode_fragments(self, fragments: list[str | int]) -> list[int]:
        ids: list[int] = []
        cache = self._word_cache
        for fragment in fragments:
            if isinstance(fragment, int):
                ids.append(fragment)
                continue
            for word in self.pre_tokenizer.split(fragment):
                word_ids = cache.get(word)
                if word_ids is None:
                    word_ids = self._encode_word(word)
                    if len(word) <= CACHED_WORD_CHARS:
                        if len(cache) >= self._CACHE_LIMIT:
                            cache.clear()
                        cache[word] = word_ids
                ids.extend(word_ids)
        return ids

    def _encode_word(self, word: str) -> list[int]:
        vocab = self._token_to_id
        spelled = byte_encode(word)
        if self._ignore_merges and spelled in vocab:
            return [vocab[spelled]]
        ids: list[int] = []
        for symbol in self._merge(list(spelled)):
            token_id = vocab.get(symbol)
            if token_id is not None:
                ids.append(token_id)
            else:  # llama.cpp looks up each byte alone: only ASCII spellings can match
                ids.extend(vocab[ch] for ch in symbol if ch < "\x80" and ch in vocab)
        return ids

    def _merge(self, symbols: list[str]) -> list[str]:
        """Apply merges by rank (lowest first, leftmost on ties) to adjacent symbols."""
        n = len(symbols)
        if n < 2:
            return symbols
        ranks = self._ranks
        nxt = [*range(1, n), -1]
        prv = list(range(-1, n - 1))
        heap = []
        for i in range(n - 1):
            rank = ranks.get(symbols[i] + " " + symbols[i + 1])
            if rank is not None:
                heap.append((rank, i, i + 1, symbols[i] + symbols[i + 1]))
        heapq.heapify(heap)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            a, b = symbols[left], symbols[right]
            if not a or not b or a + b != merged:
                continue  # outdated: one side has changed since the pair was queued
            symbols[left], symbols[right] = merged, ""
            after = nxt[right]
            nxt[left] = after
            if after != -1:
                prv[after] = left
            before = prv[left]
            if before != -1:
                rank = ranks.get(symbols[before] + " " + merged)
                if rank is not None:
                    heapq.heappush(heap, (rank, before, left, symbols[before] + merged))
            if after != -1:
                rank = ranks.get(merged + " " + symbols[after])
                if rank is not None:
                    heapq.heappush(heap, (rank, left, after, merged + symbols[after]))
        return [s for s in symbols if s]
