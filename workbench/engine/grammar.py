"""Constrained decoding: GBNF, JSON Schema and regular expressions as token masks.

    >>> g = Grammar.from_json_schema({"type": "object", "properties": {"n": {"type": "integer"}}})
    >>> m.generate("A JSON object: ", grammar=g, temperature=0).text
    '{"n": 1}'

A `Grammar` is a checked, reusable description; `Grammar.matcher(tokenizer)`
gives the state of one sequence (`GrammarMatcher`). Before every sampling step
the matcher computes which tokens may come next (`mask`), the sampler draws
only among those, and the chosen token is fed back (`consume`). The matching
itself is llguidance's (an Earley parser over a token trie). This module owns
the front door: GBNF errors with line and column, JSON Schema rewrites into
forms llguidance supports, `UnsupportedSchemaError` for what it does not (never
a silently unconstrained schema), and the model's vocabulary as token bytes.
"""

from __future__ import annotations

import copy
import json
import re
import time
import warnings
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import llguidance
import numpy as np
from llguidance import gbnf_to_lark

from workbench.engine.profiling import span
from workbench.engine.tokenizers import Tokenizer

# Whitespace a JSON grammar allows between tokens: one space, or one or two line breaks
# and an indent of up to 20, as llama.cpp's JSON-Schema grammars allow. Unbounded
# whitespace lets small models pad with newlines until max_tokens. A schema's own
# "x-guidance": {"whitespace_pattern": ...} overrides it.
JSON_WHITESPACE = r"( |\r?\n(\r?\n)?[ \t]{0,20})?"
# The largest integer a JSON reader keeps exactly (2^53 - 1, I-JSON's limit, RFC 7493).
# Integers a schema leaves unbounded are generated within ±this, 16 digits at most, as
# llama.cpp's schema grammars allow 16: unbounded, a small model can write digits until
# max_tokens (Qwen2.5-Coder-0.5B did, greedily, on an integer "repeat" count).
SAFE_INTEGER = 2**53 - 1
# Earley items per parser row; llguidance's default (2000) is too tight for schemas with
# many optional, interdependent properties (JSON Schema Store's tmlanguage.json). Items per
# mask: the default (50,000) failed mid-generation on vocabularies with many whitespace
# tokens (Qwen2's) inside objects with dozens of optional keys (NASA CMR's query schema
# after `{\n`, tmlanguage after `{\n  "patterns": [\n    {\n`, which needs more than 200,000);
# at 1,000,000 every mask over the JSONSchemaBench sample succeeds, the slowest in ~8 ms.
PARSER_LIMITS = llguidance.LLParserLimits(max_items_in_row=5000, step_max_items=1_000_000)

__all__ = [
    "Grammar", "GrammarMatcher", "GrammarError", "SchemaError", "UnsupportedSchemaError",
    "parse_gbnf", "compile_schema",
]


class GrammarError(ValueError):
    """A grammar that cannot be used; `line` and `column` (1-based) locate the problem
    in the grammar text when they are known."""

    def __init__(self, message: str, *, line: int | None = None, column: int | None = None):
        where = f"line {line}, column {column}: " if line is not None else ""
        super().__init__(where + message)
        self.line = line
        self.column = column


class SchemaError(GrammarError):
    """A JSON Schema that is not valid; `keyword` names the offending keyword when known."""

    def __init__(self, message: str, *, keyword: str | None = None, **where):
        super().__init__(message, **where)
        self.keyword = keyword


class UnsupportedSchemaError(SchemaError):
    """A valid JSON Schema using a keyword that constrained decoding cannot enforce."""


# -- grammars ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Grammar:
    """A checked grammar, independent of any model: build once, use for many generations.

    Attributes:
        kind: "gbnf", "json_schema" or "regex".
        source: the GBNF text, the schema as JSON text, or the pattern.
        spec: the grammar in llguidance's format (what the matcher runs).
        schema: the JSON Schema (for `kind == "json_schema"`).
        model: the pydantic model class the schema came from, if any.
        warnings: what was relaxed when compiling (unknown `format`s, which JSON
            Schema treats as annotations).
        string_budgets: for a JSON Schema, the strings with a token budget (our
            extension keyword `"x-max-tokens": N` on a string schema): (path, N) pairs,
            a path of property names, "[]" for any array item and "{}" for any other
            property (see `workbench.engine.closing`).
    """

    kind: str
    source: str
    spec: str
    schema: Any = None
    model: type | None = None
    warnings: tuple[str, ...] = ()
    string_budgets: tuple[tuple[tuple[str, ...], int], ...] = ()

    @classmethod
    def from_gbnf(cls, text: str) -> Grammar:
        """A llama.cpp GBNF grammar (start rule `root`). Raises `GrammarError` with the
        line and column of unbalanced brackets, unterminated strings, undefined rules or
        an empty grammar."""
        if not isinstance(text, str):
            raise TypeError(f"GBNF grammar must be text, got {type(text).__name__}")
        if not _strip_gbnf_comments(text).strip():
            raise GrammarError("the grammar is empty (it needs at least a `root ::= ...` rule)")
        _check_parentheses(text)
        try:
            lark = _gbnf_to_lark(text)
        except gbnf_to_lark.GbnfToLarkError as e:
            raise _error_at(text, e.pos.pos, str(e).split(" at line ")[0]) from None
        except Exception as e:  # the converter reports missing rules as plain exceptions
            raise _gbnf_error(text, str(e)) from None
        spec = llguidance.LLMatcher.grammar_from_lark(lark)
        _check(spec, GrammarError)
        return cls("gbnf", text, spec)

    @classmethod
    def from_json_schema(cls, schema: Mapping[str, Any] | str | bool | type) -> Grammar:
        """JSON text that validates against `schema`: a dict, its JSON text, or a pydantic
        model class. Raises `SchemaError` for an invalid schema and `UnsupportedSchemaError`
        (naming the keyword) for one that cannot be enforced.

        Two bounds keep a small model from running on where the schema sets none: the
        whitespace between tokens (`JSON_WHITESPACE`), and integers with no `minimum` or
        `maximum`, which stay within ±(2^53 - 1) (`SAFE_INTEGER`, the integers a JSON
        reader keeps exactly)."""
        model = None
        if isinstance(schema, type):
            if not hasattr(schema, "model_json_schema"):
                raise TypeError(f"{schema.__name__} is not a pydantic model class")
            model, schema = schema, _closed(schema.model_json_schema(),
                                            schema.model_config.get("extra") == "allow")
        elif isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise SchemaError(f"the schema is not JSON: {e.msg}", line=e.lineno,
                                  column=e.colno) from None
        if not isinstance(schema, (Mapping, bool)):
            raise SchemaError(f"a JSON Schema is an object or a boolean, got "
                              f"{type(schema).__name__}")
        if schema is False:
            raise SchemaError("the schema false accepts no JSON value")
        if schema is True:  # any JSON value: the empty schema
            schema = {}
        relaxed: list[str] = []
        prepared = _safe_integers(_rewrite(copy.deepcopy(schema)))
        while True:
            try:
                spec = llguidance.LLMatcher.grammar_from_json_schema(
                    prepared, defaults={"whitespace_pattern": JSON_WHITESPACE})
            except ValueError as e:
                raise SchemaError(str(e)) from None
            message = _validation_error(spec)
            if message is None:
                break
            unknown = re.match(r"Unknown format: (.*)", message)
            if unknown and unknown[1] not in relaxed:  # an annotation only, by the spec
                relaxed.append(unknown[1])
                prepared = _drop_format(prepared, unknown[1])
                continue
            raise _schema_error(message)
        notes = tuple(f"format {f!r} is not known; it is not enforced" for f in relaxed)
        for note in notes:
            warnings.warn(note, stacklevel=2)
        return cls("json_schema", json.dumps(schema, ensure_ascii=False), spec,
                   schema=schema, model=model, warnings=notes,
                   string_budgets=tuple(_string_budgets(schema)))

    @classmethod
    def from_regex(cls, pattern: str) -> Grammar:
        """Text that matches `pattern` in full (Rust `regex` syntax, close to Python's
        without look-around or back-references)."""
        if not isinstance(pattern, str):
            raise TypeError(f"pattern must be text, got {type(pattern).__name__}")
        spec = llguidance.LLMatcher.grammar_from_regex(pattern)
        _check(spec, GrammarError)
        return cls("regex", pattern, spec)

    def matcher(self, tokenizer: Tokenizer, n_vocab: int | None = None) -> GrammarMatcher:
        """A fresh matcher of this grammar over `tokenizer`'s vocabulary; `n_vocab`: the
        model's logits width when it is larger than the vocabulary (padding rows)."""
        return GrammarMatcher(self, _vocabulary(tokenizer, n_vocab or tokenizer.vocab_size))

    def __repr__(self) -> str:
        return f"Grammar.{self.kind}({self.source[:60]!r})"


def parse_gbnf(text: str) -> Grammar:
    """Parse and check a llama.cpp GBNF grammar (see `Grammar.from_gbnf`)."""
    return Grammar.from_gbnf(text)


def compile_schema(schema: Mapping[str, Any] | str | bool | type) -> Grammar:
    """Compile a JSON Schema or pydantic model class (see `Grammar.from_json_schema`)."""
    return Grammar.from_json_schema(schema)


def resolve_grammar(grammar: Grammar | str | None = None, schema: Any = None) -> Grammar | None:
    """The grammar of a call's `grammar=` (a Grammar or GBNF text) or `schema=` option."""
    if grammar is not None and schema is not None:
        raise ValueError("pass either grammar= or schema=, not both")
    if schema is not None and not isinstance(schema, Grammar):
        with span("grammar", what="compile"):
            return Grammar.from_json_schema(schema)
    if schema is not None:
        return schema
    if isinstance(grammar, str):
        with span("grammar", what="compile"):
            return Grammar.from_gbnf(grammar)
    if grammar is not None and not isinstance(grammar, Grammar):
        raise TypeError(f"grammar must be a Grammar or GBNF text, got {type(grammar).__name__}")
    return grammar


# -- matching ---------------------------------------------------------------------------------
class GrammarMatcher:
    """Where one sequence stands in a grammar: the tokens allowed next, fed token by token.

    `mask()` before sampling, `consume(token)` after. `mask_times` holds the
    seconds each `mask()` took.
    """

    def __init__(self, grammar: Grammar, vocab: _Vocabulary):
        self.grammar = grammar
        self.n_vocab = vocab.n_vocab
        self._vocab = vocab
        self._matcher = llguidance.LLMatcher(vocab.lltokenizer, grammar.spec, log_level=0,
                                             limits=PARSER_LIMITS)
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        self._bits = np.zeros((1, (self.n_vocab + 31) // 32), dtype=np.int32)
        self.mask_times: list[float] = []

    def mask(self) -> np.ndarray:
        """Which tokens may come next: bool (n_vocab,). The end-of-generation tokens are
        allowed exactly when the text so far is a complete match."""
        start = time.perf_counter()
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        # bit i of 32-bit word w is token 32 * w + i
        allowed = np.unpackbits(self._bits.view(np.uint8), count=self.n_vocab,
                                bitorder="little").view(bool)
        self.mask_times.append(time.perf_counter() - start)
        if self._matcher.is_error():
            raise GrammarError(f"the grammar matcher failed: {self._matcher.get_error()}")
        return allowed

    def allows(self, token: int) -> bool:
        """Whether the grammar allows `token` next (nothing is consumed)."""
        return self._matcher.validate_tokens([int(token)]) == 1

    def consume(self, token: int) -> None:
        """Advance past `token`; raises `GrammarError` if the grammar does not allow it,
        and the matcher then stays where it was."""
        if self._matcher.try_consume_tokens([int(token)]) != 1:  # refused: nothing consumed
            if self._matcher.is_error():
                raise GrammarError(f"the grammar matcher failed: {self._matcher.get_error()}")
            raise GrammarError(f"token {token} is not allowed here by the grammar")

    def accepts(self, tokens: Iterable[int]) -> int:
        """Feed `tokens` while the grammar allows them; returns how many it took (the
        matcher stays usable: a refused token is not consumed)."""
        tokens = [int(t) for t in tokens]
        n = self._matcher.validate_tokens(tokens)
        if n and not self._matcher.consume_tokens(tokens[:n]):
            raise GrammarError(self._matcher.get_error())
        return n

    @property
    def llmatcher(self) -> llguidance.LLMatcher:
        """llguidance's matcher underneath, for dry runs on its copies (`deep_copy()`);
        feed this matcher through `consume` only."""
        return self._matcher

    @property
    def vocabulary(self) -> _Vocabulary:
        """The vocabulary as llguidance sees it (token bytes, the single-byte tokens)."""
        return self._vocab

    @property
    def is_accepting(self) -> bool:
        """Whether the text so far is a complete match (the sequence may end here)."""
        return self._matcher.is_accepting()

    @property
    def is_finished(self) -> bool:
        """Whether no further token can be added (only an end token may follow)."""
        return self._matcher.is_stopped()

    def clone(self) -> GrammarMatcher:
        """An independent copy at the same position (for branching a generation)."""
        twin = copy.copy(self)
        twin._matcher = self._matcher.deep_copy()
        twin._bits = self._bits.copy()
        twin.mask_times = list(self.mask_times)
        return twin


@dataclass(frozen=True)
class _Vocabulary:
    lltokenizer: llguidance.LLTokenizer
    n_vocab: int
    byte_tokens: np.ndarray  # (256,) int32: the token that is exactly byte b, or -1
    # what the closer found per grammar (spec -> state signature -> completion bytes)
    plans: dict = field(default_factory=dict, compare=False)


_VOCABULARIES: weakref.WeakKeyDictionary[Tokenizer, dict[int, _Vocabulary]] = (
    weakref.WeakKeyDictionary())


def _vocabulary(tokenizer: Tokenizer, n_vocab: int) -> _Vocabulary:
    """llguidance's view of a vocabulary: every token's bytes, control tokens marked with a
    leading 0xFF (so grammars never produce them as text), the end-of-generation tokens
    as EOS. Built once per tokenizer (~0.3 s for 49k tokens)."""
    built = _VOCABULARIES.setdefault(tokenizer, {})
    if n_vocab not in built:
        tokens, special = [], []
        byte_tokens = np.full(256, -1, dtype=np.int32)
        for i in range(tokenizer.vocab_size):
            piece = tokenizer.token_bytes(i)
            if tokenizer.is_control(i):
                piece = b"\xff" + piece
                special.append(i)
            elif len(piece) == 1 and byte_tokens[piece[0]] < 0:
                byte_tokens[piece[0]] = i
            tokens.append(piece)
        tokens += [b""] * (n_vocab - len(tokens))  # logits rows past the vocabulary
        eos = sorted(tokenizer.eot_ids) or [tokenizer.eos_id or 0]
        wrapper = llguidance.TokenizerWrapper(_TokenSource(tokenizer, tokens, special, eos[0]))
        built[n_vocab] = _Vocabulary(llguidance.LLTokenizer(wrapper, n_vocab=n_vocab,
                                                            eos_token=eos), n_vocab, byte_tokens)
    return built[n_vocab]


class _TokenSource:
    """The object `llguidance.TokenizerWrapper` reads a vocabulary from. It refers to the
    tokenizer weakly: the vocabulary is cached under the tokenizer as a weak key, and a
    strong reference from the value would keep both alive for good."""

    def __init__(self, tokenizer: Tokenizer, tokens: list[bytes], special: list[int], eos: int):
        self.tokens = tokens
        self.special_token_ids = special
        self.eos_token_id = eos
        self.bos_token_id = tokenizer.bos_id
        self._tokenizer = weakref.ref(tokenizer)

    def __call__(self, data: bytes) -> list[int]:
        tokenizer = self._tokenizer()
        if tokenizer is None:
            raise RuntimeError("the tokenizer of this grammar vocabulary is gone")
        return tokenizer.encode(data.decode("utf-8", "replace"), add_bos=False, special=False)


# -- checks and error messages ----------------------------------------------------------------
def _validation_error(spec: str) -> str | None:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        spec, limits=PARSER_LIMITS)
    return messages[0] if is_error else None


def _check(spec: str, error: type[GrammarError]) -> None:
    message = _validation_error(spec)
    if message is not None:
        raise error(message.strip())


def _gbnf_to_lark(text: str) -> str:
    """GBNF as llguidance's Lark, with llama.cpp's meaning.

    llguidance's converter turns rules made only of characters into lexemes,
    and its lexer takes the longest match. That changes what a grammar means:
    in llama.cpp's arithmetic.gbnf, `num ::= [0-9]+ ws` with `ws ::= [ \t\n]*`
    followed by "\n" could never end, since `ws` swallows every newline. Here
    every rule stays a parser rule, so only literals and character classes are
    lexemes and the Earley parser keeps every reading, as llama.cpp does.
    """
    rules = gbnf_to_lark.GrammarParser().parse(text)
    gbnf_to_lark.resolve(rules)  # checks references and root; names rules the Lark way
    taken = {r.name for r in rules.values()}
    for r in rules.values():
        if r.rule_is_terminal:
            r.rule_is_terminal = False
            name = r.name.lower()
            while name in taken:
                name += "_"
            taken.add(name)
            r.name = name
    ordered = sorted(rules.values(), key=lambda r: r.order)
    return "\n\n".join(["%llguidance {}", *map(str, ordered)]) + "\n"


def _strip_gbnf_comments(text: str) -> str:
    return re.sub(r"#[^\n]*", "", text)


def _check_parentheses(text: str) -> None:
    """Raise at the first parenthesis without a partner (strings, character classes and
    comments skipped); the converter would only notice at the end of the grammar."""
    open_at: list[int] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c in "\"[":  # a string or a character class: skip to its unescaped end
            end = "\"" if c == "\"" else "]"
            i += 1
            while i < len(text) and text[i] != end:
                i += 2 if text[i] == "\\" else 1
        elif c == "#":
            while i < len(text) and text[i] != "\n":
                i += 1
        elif c == "(":
            open_at.append(i)
        elif c == ")":
            if not open_at:
                raise _error_at(text, i, "')' without a matching '('")
            open_at.pop()
        i += 1
    if open_at:
        raise _error_at(text, open_at[-1], "'(' is never closed")


def _error_at(text: str, pos: int, message: str) -> GrammarError:
    line = text.count("\n", 0, pos) + 1
    column = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return GrammarError(message, line=line, column=column)


def _gbnf_error(text: str, message: str) -> GrammarError:
    """A converter error located in the GBNF text: the first use of a missing rule."""
    missing = re.match(r"Rule '(.+)' not found", message)
    if missing:
        for m in re.finditer(rf"(?<![\w-]){re.escape(missing[1])}(?![\w-])", text):
            if not re.match(r"\s*::=", text[m.end():]):  # a use, not a definition
                return _error_at(text, m.start(), f"rule {missing[1]!r} is used but never defined")
    if message.startswith("No 'root' rule"):
        return GrammarError("the grammar has no `root` rule (generation starts at root)")
    return GrammarError(message)


def _schema_error(message: str) -> SchemaError:
    message = message.strip()
    keys = re.match(r'Unimplemented keys: \[(.*)\]', message)
    if keys:
        names = [k.strip().strip('"') for k in keys[1].split(",")]
        return UnsupportedSchemaError(
            f"the schema uses {', '.join(names)}, which constrained decoding cannot "
            f"enforce (rather than ignore it, the schema is refused)", keyword=names[0])
    if "patternProperty regexes" in message:
        return UnsupportedSchemaError(f"patternProperties: {message}",
                                      keyword="patternProperties")
    keyword = re.search(r"'(\$?\w+)'", message)
    invalid_type = message.startswith("Invalid type")
    return SchemaError(message, keyword="type" if invalid_type else
                       keyword[1] if keyword else None)


# -- JSON Schema rewrites ---------------------------------------------------------------------
# Keywords whose value is a schema, a list of schemas, or a map of names to schemas; other
# keywords (enum, const, default, examples ...) hold data and are never rewritten.
_ONE = ("additionalProperties", "additionalItems", "items", "not", "contains",
        "propertyNames", "if", "then", "else", "unevaluatedItems", "unevaluatedProperties")
_MANY = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas")


def _subschemas(schema: dict) -> Iterable[tuple[Any, Any]]:
    """(container, key) of every direct subschema of `schema`."""
    for k in _ONE:
        if isinstance(schema.get(k), (dict, bool)):
            yield schema, k
    for k in _MANY:
        if isinstance(schema.get(k), list):
            yield from ((schema[k], i) for i in range(len(schema[k])))
    for k in _MAP:
        if isinstance(schema.get(k), dict):
            yield from ((schema[k], name) for name in schema[k])


def _rewrite(schema: Any) -> Any:
    """Rewrite keywords llguidance lacks into equivalent ones it has (in place):
    `dependencies`, `dependentRequired` and `dependentSchemas` become `anyOf`s of "absent"
    or "present and ...", `not: {not: S}` becomes S, `not: {required: [names]}` becomes
    "one of the names is absent"."""
    if not isinstance(schema, dict):
        return schema
    conditions = []
    while isinstance(schema.get("not"), dict) and set(schema["not"]) == {"not"}:
        conditions.append(schema.pop("not")["not"])  # not(not(S)) is S
    for container, key in list(_subschemas(schema)):
        container[key] = _rewrite(container[key])
    conditions = [_rewrite(c) for c in conditions]
    deps = {}
    for k in ("dependencies", "dependentRequired", "dependentSchemas"):
        if isinstance(schema.get(k), dict):
            deps.update(schema.pop(k))
    for name, then in deps.items():
        absent = {"properties": {name: False}}
        present = ({"required": [name, *then]} if isinstance(then, list)
                   else {"allOf": [{"required": [name]}, _rewrite(then)]})
        conditions.append({"anyOf": [absent, present]})
    negated = schema.get("not")
    if (isinstance(negated, dict) and set(negated) == {"required"}
          and isinstance(negated["required"], list) and negated["required"]):
        names = schema.pop("not")["required"]
        conditions.append({"anyOf": [{"properties": {n: False}} for n in names]})
    if conditions:
        schema["allOf"] = [*schema.get("allOf", []), *conditions]
    return schema


def _safe_integers(schema: Any) -> Any:
    """`schema` with every integer that has no lower or upper bound bounded by
    ±SAFE_INTEGER (in place). Left as they are: enums and constants, types that also
    admit any number (the bound would apply to it too), and subschemas under `not` and
    `if`, where a bound would change what the schema admits."""
    if not isinstance(schema, dict):
        return schema
    kind = schema.get("type")
    kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
    if "integer" in kinds and "number" not in kinds and not (
            "enum" in schema or "const" in schema):
        if "minimum" not in schema and "exclusiveMinimum" not in schema:
            schema["minimum"] = -SAFE_INTEGER
        if "maximum" not in schema and "exclusiveMaximum" not in schema:
            schema["maximum"] = SAFE_INTEGER
    for container, key in _subschemas(schema):
        if container is not schema or key not in ("not", "if"):
            _safe_integers(container[key])
    return schema


# Our keyword: a token budget for the strings a schema describes.
MAX_TOKENS_KEYWORD = "x-max-tokens"


def _string_budgets(schema: Any, root: Any = None, path: tuple[str, ...] = (),
                    seen: frozenset[int] = frozenset()) -> Iterable[tuple[tuple[str, ...], int]]:
    """(path, budget) of each subschema carrying MAX_TOKENS_KEYWORD, through properties,
    items, additional properties, the combinators and local `$ref`s."""
    root = schema if root is None else root
    if not isinstance(schema, dict) or id(schema) in seen:
        return
    seen = seen | {id(schema)}
    budget = schema.get(MAX_TOKENS_KEYWORD)
    if budget is not None:
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise SchemaError(f"{MAX_TOKENS_KEYWORD} must be a positive integer, got "
                              f"{budget!r}", keyword=MAX_TOKENS_KEYWORD)
        yield path, budget
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        target = root
        for part in ref[1:].split("/")[1:]:
            target = target.get(part.replace("~1", "/").replace("~0", "~"), {}) \
                if isinstance(target, dict) else {}
        yield from _string_budgets(target, root, path, seen)
    for name, sub in (schema.get("properties") or {}).items():
        yield from _string_budgets(sub, root, (*path, name), seen)
    for key, step in (("items", "[]"), ("additionalItems", "[]"),
                      ("additionalProperties", "{}")):
        yield from _string_budgets(schema.get(key), root, (*path, step), seen)
    for key in ("prefixItems", "items"):
        if isinstance(schema.get(key), list):
            for sub in schema[key]:
                yield from _string_budgets(sub, root, (*path, "[]"), seen)
    for key in ("allOf", "anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            yield from _string_budgets(sub, root, path, seen)


def _closed(schema: dict, extra_allowed: bool) -> dict:
    """A pydantic model's schema with `additionalProperties: false` on its objects (the
    model would drop extra keys anyway), unless the model allows extras."""
    if not extra_allowed:
        for s in [schema, *schema.get("$defs", {}).values()]:
            if "properties" in s and "additionalProperties" not in s:
                s["additionalProperties"] = False
    return schema


def _drop_format(schema: Any, name: str) -> Any:
    """`schema` without `format: name` anywhere (in place)."""
    if isinstance(schema, dict):
        if schema.get("format") == name:
            del schema["format"]
        for container, key in list(_subschemas(schema)):
            _drop_format(container[key], name)
    return schema
