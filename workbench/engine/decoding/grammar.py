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
import threading
import time
import warnings
import weakref
from collections.abc import Iterable, Mapping
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import llguidance
import numpy as np
from llguidance import gbnf_to_lark

from workbench.engine.runtime.profiling import span
from workbench.engine.text.tokenizers.base import Tokenizer

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

# What may reach llguidance. Its compiler follows rule references by recursion, about 3 KB
# of stack per rule on the way and 1.8 KB more per group of alternatives around a
# reference (llguidance 1.9.1): a chain of 2,650 GBNF rules (`r1 ::= "a" r2 | "b"` ...)
# overflows an 8 MiB stack, so does a chain of 250 rules each inside 20 such groups
# (65 KB of text), or of 1,100 JSON Schema `$ref`s, and the process dies (SIGSEGV), taking
# a server with it. So every compile runs on a thread with COMPILE_STACK_BYTES of stack
# (reserved, not committed: only what the recursion touches is used), where the deepest
# grammar these bounds admit (~16 MiB) fits many times over, and a grammar past them is
# refused with a `GrammarTooLargeError`. The text bound also bounds the time: 10,000
# alternatives (100,000 characters) compile in ~0.7 s, and compile time grows faster
# than the size.
MAX_GRAMMAR_CHARS = 100_000
MAX_GBNF_RULES = 2_000
MAX_GBNF_NESTING = 28  # parentheses in parentheses; llguidance's Lark parser refuses 29
# Subschemas within subschemas, `$ref`s followed (JSON text nested deeper than 128 levels
# is refused by llguidance's reader anyway).
MAX_SCHEMA_DEPTH = 256
COMPILE_STACK_BYTES = 256 << 20
# Threads computing prefetched masks, shared by every matcher: a mask whose parser work
# blows up runs up to PARSER_LIMITS' million items (a few hundred ms), and a few of those
# at once must leave threads for the other sequences' masks.
MASK_THREADS = 8
# The bytes of a forced text that llguidance's tokenizer callback reads (`_TokenSource`):
# ~10 ms of our tokenizer at worst (one 4 KB word), where a million took 2.4 s.
FORCED_BYTES_READ = 4096
_MASK_POOL: ThreadPoolExecutor | None = None
_MASK_POOL_LOCK = threading.Lock()

__all__ = [
    "Grammar", "GrammarMatcher", "GrammarError", "GrammarTooLargeError", "SchemaError",
    "SchemaTooLargeError", "UnsupportedSchemaError", "parse_gbnf", "compile_schema",
]


class GrammarError(ValueError):
    """A grammar that cannot be used; `line` and `column` (1-based) locate the problem
    in the grammar text when they are known."""

    def __init__(self, message: str, *, line: int | None = None, column: int | None = None):
        where = f"line {line}, column {column}: " if line is not None else ""
        super().__init__(where + message)
        self.line = line
        self.column = column


class GrammarTooLargeError(GrammarError):
    """A grammar or schema past what the compiler takes safely: too long, too many rules,
    or nested too deep (see MAX_GRAMMAR_CHARS and the bounds after it)."""


class SchemaError(GrammarError):
    """A JSON Schema that is not valid; `keyword` names the offending keyword when known."""

    def __init__(self, message: str, *, keyword: str | None = None, **where):
        super().__init__(message, **where)
        self.keyword = keyword


class UnsupportedSchemaError(SchemaError):
    """A valid JSON Schema using a keyword that constrained decoding cannot enforce."""


class SchemaTooLargeError(SchemaError, GrammarTooLargeError):
    """A JSON Schema past what the compiler takes safely (see MAX_SCHEMA_DEPTH)."""


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
            property (see `workbench.engine.decoding.closing`).
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
        _check_length(text, "GBNF grammar")
        _check_parentheses(text)
        try:
            lark = _gbnf_to_lark(text)
        except gbnf_to_lark.GbnfToLarkError as e:
            raise _error_at(text, e.pos.pos, str(e).split(" at line ")[0]) from None
        except GrammarError:
            raise
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
            except RecursionError:
                raise _too_deep() from None
        if not isinstance(schema, (Mapping, bool)):
            raise SchemaError(f"a JSON Schema is an object or a boolean, got "
                              f"{type(schema).__name__}")
        if schema is False:
            raise SchemaError("the schema false accepts no JSON value")
        if schema is True:  # any JSON value: the empty schema
            schema = {}
        _check_schema_depth(schema)
        relaxed: list[str] = []
        prepared = _safe_integers(_rewrite(copy.deepcopy(schema)))
        while True:
            try:
                spec = _on_compile_stack(
                    llguidance.LLMatcher.grammar_from_json_schema, prepared,
                    defaults={"whitespace_pattern": JSON_WHITESPACE})
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
        source = json.dumps(schema, ensure_ascii=False)
        budgets = _string_budgets(schema) if MAX_TOKENS_KEYWORD in source else []
        return cls("json_schema", source, spec, schema=schema, model=model, warnings=notes,
                   string_budgets=tuple(budgets))

    @classmethod
    def from_regex(cls, pattern: str) -> Grammar:
        """Text that matches `pattern` in full (Rust `regex` syntax, close to Python's
        without look-around or back-references)."""
        if not isinstance(pattern, str):
            raise TypeError(f"pattern must be text, got {type(pattern).__name__}")
        _check_length(pattern, "regular expression")
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
    seconds each mask took to compute.

    `prefetch()` starts the next mask on a worker thread (llguidance releases the GIL
    while it computes), so that it runs beside the forward pass instead of after it, and
    a grammar whose parser work blows up does not stall the thread that asked: the
    scheduler lets a sequence whose mask is late sit a step out (`ready`, `wait`). Every
    other use of the matcher first waits for a mask being computed (llguidance's matcher
    takes one caller at a time).
    """

    def __init__(self, grammar: Grammar, vocab: _Vocabulary):
        self.grammar = grammar
        self.n_vocab = vocab.n_vocab
        self._vocab = vocab
        self._matcher = _on_compile_stack(llguidance.LLMatcher, vocab.lltokenizer, grammar.spec,
                                          log_level=0, limits=PARSER_LIMITS)
        if self._matcher.is_error():
            raise self._failed()
        self._bits = np.zeros((1, (self.n_vocab + 31) // 32), dtype=np.int32)
        self.mask_times: list[float] = []
        self._next: Future | None = None  # the next mask, being computed by `prefetch`

    def mask(self) -> np.ndarray:
        """Which tokens may come next: bool (n_vocab,). The end-of-generation tokens are
        allowed exactly when the text so far is a complete match."""
        if self._next is not None:
            future, self._next = self._next, None
            return future.result()
        return self._compute()

    def prefetch(self) -> None:
        """Start computing the next `mask()` on a worker thread (nothing if it is already
        under way)."""
        if self._next is None:
            self._next = _mask_workers().submit(self._compute)

    @property
    def ready(self) -> bool:
        """Whether `mask()` would return at once: no mask is being computed, or it is done
        (a mask not prefetched is computed by `mask()` itself)."""
        return self._next is None or self._next.done()

    def wait(self, timeout: float | None) -> bool:
        """Wait up to `timeout` seconds for a prefetched mask; whether it is `ready`."""
        if self._next is not None:
            futures.wait([self._next], timeout)
        return self.ready

    def _settle(self) -> None:
        """Wait for a mask being computed (its result is kept for `mask()`)."""
        if self._next is not None:
            futures.wait([self._next])

    def _compute(self) -> np.ndarray:
        start = time.perf_counter()
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        # bit i of 32-bit word w is token 32 * w + i
        allowed = np.unpackbits(self._bits.view(np.uint8), count=self.n_vocab,
                                bitorder="little").view(bool)
        self.mask_times.append(time.perf_counter() - start)
        if self._matcher.is_error():
            raise self._failed()
        return allowed

    def allows(self, token: int) -> bool:
        """Whether the grammar allows `token` next (nothing is consumed)."""
        self._settle()
        return self._matcher.validate_tokens([int(token)]) == 1

    def consume(self, token: int) -> None:
        """Advance past `token`; raises `GrammarError` if the grammar does not allow it,
        and the matcher then stays where it was. A prefetched mask is dropped."""
        self._settle()
        self._next = None
        if self._matcher.try_consume_tokens([int(token)]) != 1:  # refused: nothing consumed
            if self._matcher.is_error():
                raise self._failed()
            raise GrammarError(f"token {token} is not allowed here by the grammar")

    def accepts(self, tokens: Iterable[int]) -> int:
        """Feed `tokens` while the grammar allows them; returns how many it took (the
        matcher stays usable: a refused token is not consumed)."""
        tokens = [int(t) for t in tokens]
        self._settle()
        self._next = None
        n = self._matcher.validate_tokens(tokens)
        if n and not self._matcher.consume_tokens(tokens[:n]):
            raise self._failed()
        return n

    def _failed(self) -> GrammarError:
        """The matcher's error: llguidance's message without the parser state it dumps
        after it (a page of internal counters, sent on to HTTP clients otherwise)."""
        message = self._matcher.get_error().split("\n<state>", 1)[0].strip()
        if "Too many items" in message or "ParserTooComplex" in message:
            message += (" (the grammar needs more parser work per token than allowed: a "
                        "long fixed repetition of short pieces, such as \"x\"{1000000}?)")
        return GrammarError(f"the grammar matcher failed: {message}")

    @property
    def llmatcher(self) -> llguidance.LLMatcher:
        """llguidance's matcher underneath, for dry runs on its copies (`deep_copy()`);
        feed this matcher through `consume` only."""
        self._settle()
        return self._matcher

    @property
    def vocabulary(self) -> _Vocabulary:
        """The vocabulary as llguidance sees it (token bytes, the single-byte tokens)."""
        return self._vocab

    @property
    def is_accepting(self) -> bool:
        """Whether the text so far is a complete match (the sequence may end here)."""
        self._settle()
        return self._matcher.is_accepting()

    @property
    def is_finished(self) -> bool:
        """Whether no further token can be added (only an end token may follow)."""
        self._settle()
        return self._matcher.is_stopped()

    def clone(self) -> GrammarMatcher:
        """An independent copy at the same position (for branching a generation)."""
        self._settle()
        twin = copy.copy(self)
        twin._next = None  # its own masks: the caller writes into the arrays
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
    # the most bytes one token writes (text tokens; 0: not known, see `longest_token`)
    longest_token: int = 0
    source: _TokenSource | None = field(default=None, compare=False)  # the tokenizer

    def encode(self, data: bytes) -> list[int]:
        """The tokenizer's own encoding of `data` (llguidance's `tokenize_bytes` reads
        only a beginning of long texts: `_TokenSource.__call__`)."""
        if self.source is None:
            return self.lltokenizer.tokenize_bytes(data)
        return self.source.encode(data)

    def longest(self) -> int:
        """The most bytes one text token writes (an output of N bytes takes at least
        N / this tokens)."""
        if self.longest_token:
            return self.longest_token
        return max(len(self.lltokenizer.decode_bytes([i])) for i in range(self.n_vocab))


_VOCABULARIES: weakref.WeakKeyDictionary[Tokenizer, dict[int, _Vocabulary]] = (
    weakref.WeakKeyDictionary())


def _vocabulary(tokenizer: Tokenizer, n_vocab: int) -> _Vocabulary:
    """llguidance's view of a vocabulary: every token's bytes, control tokens marked with a
    leading 0xFF (so grammars never produce them as text), the end-of-generation tokens
    as EOS. Built once per tokenizer (~0.3 s for 49k tokens)."""
    built = _VOCABULARIES.setdefault(tokenizer, {})
    if n_vocab not in built:
        tokens, special, longest = [], [], 1
        byte_tokens = np.full(256, -1, dtype=np.int32)
        for i in range(tokenizer.vocab_size):
            piece = tokenizer.token_bytes(i)
            if tokenizer.is_control(i):
                piece = b"\xff" + piece
                special.append(i)
            else:
                longest = max(longest, len(piece))
                if len(piece) == 1 and byte_tokens[piece[0]] < 0:
                    byte_tokens[piece[0]] = i
            tokens.append(piece)
        tokens += [b""] * (n_vocab - len(tokens))  # logits rows past the vocabulary
        eos = sorted(tokenizer.eot_ids) or [tokenizer.eos_id or 0]
        source = _TokenSource(tokenizer, tokens, special, eos[0])
        built[n_vocab] = _Vocabulary(
            llguidance.LLTokenizer(llguidance.TokenizerWrapper(source), n_vocab=n_vocab,
                                   eos_token=eos),
            n_vocab, byte_tokens, longest_token=longest, source=source)
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
        """llguidance's tokenization: only the first FORCED_BYTES_READ bytes (cut at a
        character's start) of what it asks. It asks for the bytes a grammar forces next,
        at every step while they last, and uses the first token (the rest may be cut
        where a token could merge with what follows): our tokenizer would hold the GIL,
        and so every other thread, for seconds over a literal of a million bytes."""
        if len(data) > FORCED_BYTES_READ:
            cut = FORCED_BYTES_READ
            while cut > 0 and data[cut] & 0xC0 == 0x80:  # a UTF-8 continuation byte
                cut -= 1
            data = data[:cut]
        return self.encode(data)

    def encode(self, data: bytes) -> list[int]:
        """The tokenizer's encoding of `data`, whole."""
        tokenizer = self._tokenizer()
        if tokenizer is None:
            raise RuntimeError("the tokenizer of this grammar vocabulary is gone")
        return tokenizer.encode(data.decode("utf-8", "replace"), add_bos=False, special=False)


# -- checks and error messages ----------------------------------------------------------------
def _validation_error(spec: str) -> str | None:
    is_error, messages = _on_compile_stack(
        llguidance.LLMatcher.validate_grammar_with_warnings, spec, limits=PARSER_LIMITS)
    return messages[0] if is_error else None


_STACK_SIZE_LOCK = threading.Lock()


def _mask_workers() -> ThreadPoolExecutor:
    """The threads that compute prefetched masks (`GrammarMatcher.prefetch`), made on
    first use."""
    global _MASK_POOL
    with _MASK_POOL_LOCK:
        if _MASK_POOL is None:
            _MASK_POOL = ThreadPoolExecutor(MASK_THREADS, thread_name_prefix="workbench-mask")
        return _MASK_POOL


def _on_compile_stack(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` (an llguidance call that compiles a grammar) on a new thread
    with COMPILE_STACK_BYTES of stack; its exception, if any, is raised here. A fresh
    thread costs ~0.1 ms, little beside a compile. Where the platform cannot size a
    thread's stack, `fn` runs here (the bounds keep the common stacks safe)."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, fn(*args, **kwargs)))
        except BaseException as e:  # handed to the caller's thread
            outcome.append((False, e))

    with _STACK_SIZE_LOCK:  # the size applies to threads started while it is set
        try:
            before = threading.stack_size(COMPILE_STACK_BYTES)
        except (ValueError, RuntimeError):
            return fn(*args, **kwargs)
        try:
            thread = threading.Thread(target=run, name="workbench-grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(before)
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _check_length(text: str, what: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarTooLargeError(f"the {what} is {len(text):,} characters long; at most "
                                   f"{MAX_GRAMMAR_CHARS:,} are compiled")


def _too_deep() -> SchemaTooLargeError:
    return SchemaTooLargeError(f"the schema nests subschemas more than {MAX_SCHEMA_DEPTH} "
                               f"deep (counting through $ref); flatten it")


def _check_schema_depth(schema: Any) -> None:
    """Raise `SchemaTooLargeError` where a chain of subschemas in subschemas, following
    local `$ref`s, is longer than MAX_SCHEMA_DEPTH, or the JSON nests deeper than that.
    Iterative (a deep schema must not overflow Python's stack either); a definition is
    measured once, a `$ref` back into one being measured (recursion) counts nothing more,
    as llguidance compiles each definition once."""
    if not isinstance(schema, (dict, list)):
        return
    depth: dict[int, int] = {}  # id -> the deepest chain below it, once measured
    open_ids: set[int] = set()
    # frames: [node, its children, index of the next child, deepest child so far]
    stack = [[schema, _schema_children(schema, schema), 0, 0]]
    open_ids.add(id(schema))
    while stack:
        frame = stack[-1]
        node, children, i = frame[0], frame[1], frame[2]
        if i < len(children):
            frame[2] += 1
            child = children[i]
            if id(child) in depth:
                frame[3] = max(frame[3], depth[id(child)])
            elif id(child) not in open_ids:
                if len(stack) >= MAX_SCHEMA_DEPTH:
                    raise _too_deep()
                open_ids.add(id(child))
                stack.append([child, _schema_children(child, schema), 0, 0])
            continue
        stack.pop()
        open_ids.discard(id(node))
        depth[id(node)] = frame[3] + 1
        if stack:
            stack[-1][3] = max(stack[-1][3], depth[id(node)])
        if depth[id(node)] + len(stack) > MAX_SCHEMA_DEPTH:
            raise _too_deep()


def _schema_children(node: Any, root: Any) -> list[Any]:
    """The JSON values directly inside `node`, and the target of its local `$ref`."""
    if isinstance(node, list):
        return [v for v in node if isinstance(v, (dict, list))]
    if not isinstance(node, dict):
        return []
    children = [v for v in node.values() if isinstance(v, (dict, list))]
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        target = root
        for part in ref[1:].split("/")[1:]:
            key = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict):
                target = target.get(key)
            elif isinstance(target, list) and key.isdigit() and int(key) < len(target):
                target = target[int(key)]
            else:
                target = None
        if isinstance(target, (dict, list)):
            children.append(target)
    return children


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
    lexemes and the Earley parser keeps every reading, as llama.cpp does. (Its
    converter's own resolving step finds those lexeme rules by a fixed point that
    takes time quadratic in a chain of rules, 18 s for 3,000; it is done here
    in one pass.)
    """
    rules = gbnf_to_lark.GrammarParser().parse(text)
    if len(rules) > MAX_GBNF_RULES:
        raise GrammarTooLargeError(f"the grammar has {len(rules):,} rules; at most "
                                   f"{MAX_GBNF_RULES:,} are compiled")
    for order, rule in enumerate(rules.values()):
        rule.order = order
        rule.alternatives = rule.alternatives.simplify()
    for rule in rules.values():  # link every reference to its rule
        nodes = [rule.alternatives]
        while nodes:
            node = nodes.pop()
            if isinstance(node, gbnf_to_lark.RuleRefNode):
                if node.name not in rules:
                    raise ValueError(f"Rule '{node.name}' not found")
                node.target = rules[node.name]
            elif (isinstance(node, gbnf_to_lark.RepetitionNode)
                  and isinstance(node.node, gbnf_to_lark.RepetitionNode)):
                # `("a"*)+` would be written `"a"*+`, which Lark refuses: keep the group
                node.node = gbnf_to_lark.SequenceNode([node.node])
            nodes.extend(node.children())
    if "root" not in rules:
        raise ValueError("No 'root' rule found")
    # Lark's names: `root` is `start`; the rest in lower snake case, made unique
    taken = {"start"}
    for rule in rules.values():
        if rule is rules["root"]:
            rule.name = "start"
            continue
        name = re.sub(r"([a-z])([A-Z])", r"\1_\2", rule.name.replace("-", "_")).lower()
        while name in taken:
            name += "_"
        taken.add(name)
        rule.name = name
    ordered = sorted(rules.values(), key=lambda r: r.order)
    return "\n\n".join(["%llguidance {}", *map(str, ordered)]) + "\n"


def _strip_gbnf_comments(text: str) -> str:
    return re.sub(r"#[^\n]*", "", text)


def _check_parentheses(text: str) -> None:
    """Raise at the first parenthesis without a partner (strings, character classes and
    comments skipped; the converter would only notice at the end of the grammar), or
    nested past MAX_GBNF_NESTING (the converter's parser recurses per level)."""
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
            if len(open_at) > MAX_GBNF_NESTING:
                where = _error_at(text, i, "")
                raise GrammarTooLargeError(
                    f"parentheses are nested more than {MAX_GBNF_NESTING} deep (name an "
                    f"inner part as a rule)", line=where.line, column=where.column)
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
    if message.startswith("recursion limit exceeded"):  # its JSON reader's, 128 levels
        return SchemaTooLargeError(f"the schema's JSON is nested too deep ({message}); "
                                   f"flatten it")
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
MAX_BUDGET_VISITS = 100_000


def _string_budgets(schema: Any) -> list[tuple[tuple[str, ...], int]]:
    """(path, budget) of each subschema carrying MAX_TOKENS_KEYWORD, through properties,
    items, additional properties, the combinators and local `$ref`s. Each subschema is
    visited once per path (a `$ref` that leads back is not followed again), and at most
    MAX_BUDGET_VISITS visits are made: shared definitions under many names could make the
    paths exponentially many."""
    found: list[tuple[tuple[str, ...], int]] = []
    done: set[tuple[int, tuple[str, ...]]] = set()
    # (subschema, path, the ids on the way to it)
    todo: list[tuple[Any, tuple[str, ...], frozenset[int]]] = [(schema, (), frozenset())]
    while todo:
        node, path, seen = todo.pop()
        if not isinstance(node, dict) or id(node) in seen or (id(node), path) in done:
            continue
        done.add((id(node), path))
        if len(done) > MAX_BUDGET_VISITS:
            raise SchemaTooLargeError(f"the schema's {MAX_TOKENS_KEYWORD} keywords are "
                                      f"reached by too many paths", keyword=MAX_TOKENS_KEYWORD)
        seen = seen | {id(node)}
        budget = node.get(MAX_TOKENS_KEYWORD)
        if budget is not None:
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
                raise SchemaError(f"{MAX_TOKENS_KEYWORD} must be a positive integer, got "
                                  f"{budget!r}", keyword=MAX_TOKENS_KEYWORD)
            found.append((path, budget))
        subs: list[tuple[Any, tuple[str, ...]]] = []
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            target = schema
            for part in ref[1:].split("/")[1:]:
                target = target.get(part.replace("~1", "/").replace("~0", "~"), {}) \
                    if isinstance(target, dict) else {}
            subs.append((target, path))
        properties = node.get("properties")
        if isinstance(properties, dict):
            subs += [(sub, (*path, name)) for name, sub in properties.items()]
        for key, step in (("items", "[]"), ("additionalItems", "[]"),
                          ("additionalProperties", "{}")):
            subs.append((node.get(key), (*path, step)))
        for key in ("prefixItems", "items"):
            if isinstance(node.get(key), list):
                subs += [(sub, (*path, "[]")) for sub in node[key]]
        for key in ("allOf", "anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                subs += [(sub, path) for sub in node[key]]
        todo += [(sub, at, seen) for sub, at in reversed(subs)]
    return found


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
