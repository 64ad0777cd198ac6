"""Constrained generations that end valid: closing at the budget, in free text and in loops.

A grammar only says which tokens may come next; it never tells a model to finish.
A small model asked for JSON can write a string that never closes, an array that
keeps growing or digits without end, and at `max_tokens` the output is cut where
it stands: not JSON. A `Closer` rides along with one sequence's `GrammarMatcher`
and makes the output end valid:

- **At the budget.** It keeps a plan: a short way, in tokens of this vocabulary,
  from where the grammar stands to where it accepts (what is left of the last
  plan, a greedy probe, or, as the budget nears, a search for a shortest one over
  llguidance matcher copies). While the plan fits the tokens left,
  the model writes freely. When the tokens left come down to the plan's length,
  the sequence follows the plan: it closes the string, the containers, writes the
  smallest value a required property takes, and ends valid at or before
  `max_tokens`. Close to that point every token the model picks is tried on a copy
  first, and kept only if a completion still fits after it. A grammar whose
  shortest completion does not fit `max_tokens` (or the context left after the
  prompt) is refused before the first token (`GrammarBudgetError`).
- **In free text that runs long** (`Closing.free_text_tokens`): a stretch of
  tokens where the grammar allows most of the vocabulary, as inside a JSON string,
  is closed once it is that long, and the model goes on after it. A JSON Schema can
  give a string its own budget with our keyword `"x-max-tokens": N`.
- **In a loop** (`Closing.repetition`): when the last tokens repeat one pattern
  (32 tokens or more, a period of at most 16 tokens, three times at least), the
  sequence follows the plan until the pattern is broken; where the grammar already
  accepts, it ends there.

Each event the closer forced carries the reason (`TokenEvent.closed`), and a
generation closed at the budget finishes with "length". A generation the model
ends on its own, with no loop and no overlong free text, is never touched: the
closer only acts when a plan would no longer fit.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import time
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np

from workbench.engine.decoding.grammar import GrammarError, GrammarMatcher, _Vocabulary

__all__ = ["ClosedEarlyWarning", "Closing", "Closer", "GrammarBudgetError", "Plan",
           "shortest_completion", "min_json_bytes"]

# A state is free text when its grammar allows more than this share of the vocabulary.
FREE_SHARE = 0.5
# Within this many tokens of slack (and the plan's length again), every token the model
# picks is tried before it is kept: one token can open an object whose required
# properties lengthen the shortest completion by dozens of tokens.
WINDOW = 32
# A loop: the last LOOP_SPAN tokens (or three periods, if longer) repeat with a period of
# at most LOOP_PERIOD tokens.
LOOP_SPAN = 32
LOOP_PERIOD = 16
# Work one search may do (masks computed; one takes ~20 us on a 49k vocabulary), and the
# states it keeps per byte of distance.
SEARCH_MASKS = 2000
SEARCH_WIDTH = 64
# Searches one sequence may run, and those remembered per grammar and vocabulary
# (signature -> the bytes found): at most MEMO_SIZE of them and MEMO_BYTES of found bytes
# per grammar (a grammar that forces long literals finds long plans), for MEMO_GRAMMARS
# grammars, so at most 64 MiB of plans per model however many requests bring new ones.
SEARCHES = 4
MEMO_SIZE = 4096
MEMO_BYTES = 1 << 20
MEMO_GRAMMARS = 64
# What a byte costs in the search: whitespace and other bytes cost more than printable
# ASCII, so that a completion pads with none (JSON's optional whitespace would otherwise
# multiply the states at every distance) and writes no control characters where free text
# allows them.
BYTE_COST = np.full(256, 8, dtype=np.int64)
BYTE_COST[0x21:0x7F] = 1
BYTE_COST[[0x20, 0x09, 0x0A, 0x0D]] = 6
# Where the probe finds no completion in GREEDY_BYTES, it is run again for up to the tokens
# left times the longest token's bytes, at most this many bytes.
LONG_PROBE_BYTES = 1 << 16


class GrammarBudgetError(GrammarError):
    """The grammar's shortest completion does not fit the tokens the call allows."""


class ClosedEarlyWarning(UserWarning):
    """A constrained answer was closed before the model ended it; `reason` says why
    ("budget", "free_text" or "repetition"), `text` is the answer."""

    def __init__(self, reason: str, text: str):
        why = {"budget": "at the max_tokens budget (raise max_tokens for a fuller answer)",
               "free_text": "where a free-text value ran past its token limit",
               "repetition": "where the model repeated itself in a loop"}[reason]
        super().__init__(f"the answer was closed {why}: {text[:120]!r}")
        self.reason = reason
        self.text = text


@dataclass(frozen=True)
class Closing:
    """How a constrained generation is kept able to end valid (see the module docs).

    Attributes:
        budget: close the output so it ends valid within `max_tokens` (and the
            context), and refuse up front a grammar whose shortest completion is
            longer.
        free_text_tokens: close a stretch of free text (where the grammar allows
            most tokens, as in a JSON string) after this many tokens; None: half of
            `max_tokens`; 0: never.
        repetition: close a loop of repeated tokens.
    """

    budget: bool = True
    free_text_tokens: int | None = None
    repetition: bool = True

    @classmethod
    def of(cls, value: Closing | bool | None) -> Closing | None:
        """A call's `closing=` option: a `Closing`, True (the defaults) or False (off)."""
        if isinstance(value, Closing):
            return value
        if value is None or value is True:
            return cls()
        if value is False:
            return None
        raise TypeError(f"closing must be a Closing or a bool, got {type(value).__name__}")


@dataclass(frozen=True)
class Plan:
    """A way from a matcher's state to one where its grammar accepts: the bytes, and the
    tokens that write them."""

    data: bytes
    tokens: list[int]

    def __len__(self) -> int:
        return len(self.tokens)


def plan_of(matcher: llguidance.LLMatcher, vocab: _Vocabulary, data: bytes,
            encoded: dict[bytes, list[int]] | None = None) -> Plan | None:
    """`data` as a plan from `matcher`'s state, in as few tokens as the tokenizer's own
    encoding or the bytes take; None if the grammar does not accept there after `data`.
    `encoded`: the tokenizer's encodings found before (bytes -> tokens), used and filled.
    `matcher` is left as it was."""
    tokens = [int(t) for t in vocab.byte_tokens[list(data)]]
    if any(t < 0 for t in tokens):
        return None
    if matcher.validate_tokens(tokens) != len(tokens):  # (asking changes nothing)
        return None
    trial = matcher.deep_copy()
    trial.consume_tokens(tokens)
    if not trial.is_accepting():
        return None
    known = {} if encoded is None else encoded
    if data not in known:
        if len(known) >= MEMO_SIZE:
            known.clear()
        try:
            known[data] = vocab.encode(data)
        except Exception:  # a tokenizer that cannot encode these bytes alone: the bytes
            known[data] = tokens
    shorter = known[data]
    if len(shorter) < len(tokens) and matcher.validate_tokens(shorter) == len(shorter):
        tokens = shorter
    return Plan(data, tokens)


def greedy_completion(matcher: llguidance.LLMatcher, vocab: _Vocabulary,
                      encoded: dict[bytes, list[int]] | None = None) -> Plan | None:
    """A completion written by the greedy probe (`_probe`): cheap, often short, and
    sometimes none (a probe can circle, as `0` after `0` in arithmetic)."""
    return plan_of(matcher, vocab, _probe(matcher, vocab.byte_tokens, GREEDY_BYTES), encoded)


def shortest_completion(matcher: llguidance.LLMatcher, vocab: _Vocabulary, *,
                        max_masks: int = SEARCH_MASKS) -> Plan | None:
    """A shortest way from `matcher`'s state to one where the grammar accepts.

    A uniform-cost search over the bytes the grammar allows (each byte fed as its
    single-byte token to a copy of the matcher; bytes the grammar forces are taken in
    one move; `BYTE_COST` weighs them), first over printable ASCII without whitespace
    or backslash, then over every byte.

    States are told apart by a signature: their token mask, and the bytes a fixed
    greedy probe writes from them (`_probe`; a mask alone does not tell `{` from
    `{"a": 1,`). Copies with one signature are one state, reached first by the
    shortest way, so a letter inside a string leads nowhere new. States with one
    signature can still differ (a string with a `minLength` of 40 looks the same after
    each letter); where the search finds nothing, it runs again merging only states at
    one distance (the three searches get a quarter, a half and a quarter of `max_masks`,
    and what one leaves to the next), and where that finds nothing, the greedy probe is
    the answer if it ends accepted (it writes that string's 40 letters). A class of
    bytes the grammar allows in full (all lowercase letters) is tried through one
    member. `matcher` is left as it was.
    """
    left = [0]  # the masks a search may still compute; what one leaves goes to the next
    for plain, strict, share in ((True, True, 0.25), (False, True, 0.5), (False, False, 0.25)):
        left[0] += int(share * max_masks)
        path = _search(matcher, vocab, left, plain, strict)
        if path is not None:
            return plan_of(matcher, vocab, bytes(path))
    return greedy_completion(matcher, vocab)


def _search(matcher: llguidance.LLMatcher, vocab: _Vocabulary, left: list[int],
            plain: bool, strict: bool) -> list[int] | None:
    """The search of `shortest_completion`: the bytes of a completion, or None; `left[0]`
    is the masks it may compute (and is counted down). `plain`:
    try printable ASCII bytes only, no whitespace and no backslash (JSON's optional
    whitespace and escapes multiply the ways to every state); `strict`: one state per
    signature, else one per signature and distance (then a byte that leaves the
    signature as it was is not followed)."""
    byte_tokens = vocab.byte_tokens
    words = np.zeros((vocab.n_vocab + 31) // 32, dtype=np.int32)
    has_token = np.nonzero(byte_tokens >= 0)[0]  # the bytes that have a token
    if plain:
        has_token = has_token[(has_token > 0x20) & (has_token < 0x7F) & (has_token != 0x5C)]
    ids = byte_tokens[has_token]

    def look(m: llguidance.LLMatcher) -> tuple[tuple, list[int]]:
        """The state's signature and the bytes to try from it."""
        left[0] -= 1
        signature = _signature(m, vocab, words)
        # bit i of 32-bit word w is token 32 * w + i (`words` holds the mask now)
        return signature, _representatives(has_token[(words[ids >> 5] >> (ids & 31)) & 1 == 1])

    root = matcher.deep_copy()
    signature, allowed = look(root)
    order = itertools.count()
    queue = [(0, next(order), root, [], signature, allowed)]
    best = {signature if strict else (0, signature): 0}  # the lowest cost of each state
    per_cost: dict[int, int] = {}
    while queue:
        cost, _, node, path, signature, allowed = heapq.heappop(queue)
        if strict and best[signature] < cost:  # reached by a shorter way since
            continue
        if signature[1]:
            return path
        for byte in allowed:
            child = node.deep_copy()
            if not child.consume_token(int(byte_tokens[byte])):
                continue
            step = [byte]
            for forced in child.compute_ff_bytes():  # bytes with no choice: one move
                if byte_tokens[forced] < 0 or not child.consume_token(int(byte_tokens[forced])):
                    break
                step.append(forced)
            if left[0] <= 0:
                return None
            child_signature, child_allowed = look(child)
            at = cost + int(BYTE_COST[step].sum())
            key = child_signature if strict else (at, child_signature)
            if best.get(key, at + 1) <= at or (not strict and child_signature == signature):
                continue
            if per_cost.get(at, 0) >= SEARCH_WIDTH:
                continue
            per_cost[at] = per_cost.get(at, 0) + 1
            best[key] = at
            heapq.heappush(queue, (at, next(order), child, path + step, child_signature,
                                   child_allowed))
    return None


def _signature(m: llguidance.LLMatcher, vocab: _Vocabulary, words: np.ndarray | None = None
               ) -> tuple:
    """What tells `m`'s state from others (see `shortest_completion`): its token mask
    (computed into `words`, (n_vocab + 31) // 32 int32, when given), whether it accepts,
    and what the probe writes from it."""
    if words is None:
        words = np.zeros((vocab.n_vocab + 31) // 32, dtype=np.int32)
    m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
    return hash(words.tobytes()), m.is_accepting(), _probe(m, vocab.byte_tokens)


# The order in which `_probe` tries bytes: what closes first.
PROBE_ORDER = [b for b in b'"\')]}>,;:0.' + bytes(range(0x21, 0x7F))]
_PROBED = frozenset(PROBE_ORDER)
PROBE_BYTES = 24
GREEDY_BYTES = 512
# The probe takes one byte at most this many times in a row where another is allowed
# (digits of a number would otherwise go on for ever).
PROBE_RUN = 8


def _probe(m: llguidance.LLMatcher, byte_tokens: np.ndarray, length: int = PROBE_BYTES
           ) -> bytes:
    """What `m` writes if it takes, at each of up to `length` steps, the first byte of
    PROBE_ORDER its grammar allows, one byte PROBE_RUN times in a row at most while
    another is allowed (`m` is left as it was). States alike in their masks but not in
    what follows (after `{` and after `{"a": 1,` come different keys; after `[` of a
    list with minItems 2 and after its first item, different closings) probe
    differently."""
    taken: list[int] = []
    for _ in range(length):
        if m.is_accepting():
            break
        forced = m.compute_ff_bytes()
        if forced:  # the one byte that can come next (a key's or a keyword's letters):
            # what the scan below would find, without asking for the bytes before it
            byte = forced[0] if forced[0] in _PROBED and _allows(m, byte_tokens, forced[0]) \
                else None
        else:
            tired = (taken[-1] if len(taken) >= PROBE_RUN
                     and taken[-PROBE_RUN:] == taken[-1:] * PROBE_RUN else None)
            byte = next((b for b in PROBE_ORDER if b != tired and _allows(m, byte_tokens, b)),
                        tired if tired is not None and _allows(m, byte_tokens, tired)
                        else None)
        if byte is None:
            break
        m.consume_token(int(byte_tokens[byte]))
        taken.append(byte)
    if taken:
        m.rollback(len(taken))
    return bytes(taken)


def _allows(m: llguidance.LLMatcher, byte_tokens: np.ndarray, byte: int) -> bool:
    """Whether `m` takes `byte` next (asked without consuming: a refused token would put
    `m` in error)."""
    token = int(byte_tokens[byte])
    return token >= 0 and m.validate_tokens([token]) == 1


# Byte classes tried through one member when the grammar allows all of them.
# Digits are tried one by one: a number's bounds tell them apart.
_CLASSES = (range(ord("a"), ord("z") + 1), range(ord("A"), ord("Z") + 1))


def _representatives(allowed: np.ndarray) -> list[int]:
    """The bytes to try from a state that allows `allowed`: every one, except one member
    for a class allowed in full, and one lead byte of a multi-byte UTF-8 character (its
    characters are never shorter than ASCII ones)."""
    rest = set(int(b) for b in allowed)
    picked = []
    for cls in _CLASSES:
        if all(b in rest for b in cls):
            rest.difference_update(cls)
            picked.append(cls[0])
    high = sorted(b for b in rest if b >= 0x80)
    rest.difference_update(high)
    return sorted(rest) + picked + high[:1]


class _Plans(dict):
    """One grammar's remembered searches (state signature -> the completion's bytes, or
    None where none was found), within MEMO_SIZE entries and MEMO_BYTES bytes."""

    nbytes = 0  # the bytes of the completions held

    def remember(self, signature: Any, data: bytes | None) -> None:
        size = 0 if data is None else len(data)
        old = self.pop(signature, None)
        self.nbytes -= 0 if old is None else len(old)
        if size > MEMO_BYTES:
            return  # longer than the memo holds: searched again where needed
        if len(self) >= MEMO_SIZE or self.nbytes + size > MEMO_BYTES:
            self.clear()
            self.nbytes = 0
        self[signature] = data
        self.nbytes += size


class Closer:
    """Keeps one sequence's constrained output able to end valid (see the module docs).

    Per step: `steer(allowed, remaining)` before sampling (it may narrow the mask to the
    plan's next token, or to the end tokens), `admits(token, remaining)` after it (False:
    the token would leave no completion that fits; sample again from `forced()`), and
    `advance(token)` once the matcher consumed it. `reason` is why the output was closed
    early, once it was ("budget", "free_text" or "repetition"); `times` the seconds spent
    per step (the first step's includes the start plan).

    Plans are found cheaply first: what is left of the last plan (still right while the
    model writes inside a string), a plan remembered for an alike state, or the greedy
    probe. A search for a shortest one runs only where none of those fits the tokens
    left, so a runaway costs a few searches at most.
    """

    def __init__(self, matcher: GrammarMatcher, options: Closing, max_tokens: int,
                 end_ids: np.ndarray, room: int | None = None):
        """`room`: the tokens the context can still take after the prompt (None: only
        `max_tokens` limits the output); the budget is the smaller of the two."""
        self.matcher = matcher
        self.options = options
        self.end_ids = end_ids
        plans = matcher.vocabulary.plans
        if matcher.grammar.spec not in plans and len(plans) >= MEMO_GRAMMARS:
            plans.clear()  # a long session of many grammars: start over
        self._memo: _Plans = plans.setdefault(matcher.grammar.spec, _Plans())
        self._encoded: dict[bytes, list[int]] = {}  # the tokenizer's encodings of plans
        self._searches = 0
        self.free_limit = (max(16, max_tokens // 2) if options.free_text_tokens is None
                           else options.free_text_tokens)
        self.reason: str | None = None
        self.times: list[float] = []
        self.plan: Plan | None = None
        self._fresh = False  # the plan starts from the matcher's current state
        self._planned = 0  # the plan's length when it was found
        self._since = 0  # tokens consumed since the plan went stale
        self._next: Plan | None = None  # the plan after the token `admits` tried
        self._wrap: str | None = None  # closing now because of free text or a loop
        self._free_run = 0
        self._tokens: list[int] = []
        # JSON strings with their own budget (the schema's "x-max-tokens"): where the
        # output stands, and the tokens written into the string open now
        budgets = matcher.grammar.string_budgets
        self._json = _JSONPosition(budgets) if budgets else None
        self._string_tokens = 0
        start = time.perf_counter()
        budget = max_tokens if room is None else min(max_tokens, room)
        limit = (f"max_tokens={max_tokens}" if budget == max_tokens else
                 f"the {budget} tokens the context (kv_cache_size) has left after the prompt")
        if options.budget and matcher.grammar.kind == "json_schema":
            # by the numbers first: a search cannot reach a minLength of 10^9
            size, why = _min_bytes_of(matcher.grammar)
            floor = -(-size // matcher.vocabulary.longest())
            if floor > budget:
                raise GrammarBudgetError(
                    f"the shortest output this schema allows takes at least {floor} tokens "
                    f"({size:,} bytes{f', by {why}' if why else ''}), more than {limit}")
        self._replan(budget)  # (which probes as far as the budget goes where it must)
        if options.budget and self.plan is not None and len(self.plan) > budget:
            raise GrammarBudgetError(
                f"the shortest output found for this grammar takes {len(self.plan)} tokens "
                f"({self.plan.data.decode('utf-8', 'replace')[:80]!r}), more than {limit}")
        self._carry = time.perf_counter() - start  # counted in the first step's time

    def steer(self, allowed: np.ndarray, remaining: int) -> np.ndarray:
        """The tokens the sampler may pick, given the grammar's `allowed` (bool (n_vocab,),
        end tokens set where the output is complete) and the `remaining` tokens this
        sequence may still write."""
        start = time.perf_counter()
        try:
            free = np.count_nonzero(allowed) > FREE_SHARE * allowed.size
            self._free_run = self._free_run + 1 if free else 0
            self._wrap = self._wrapping(free)
            if not self._fresh and (self._wrap or (self.options.budget
                                                   and self._due(remaining))):
                self._replan(remaining)
            if self.plan is None:
                return allowed
            if self._wrap or (self.options.budget and (
                    len(self.plan) >= remaining or (not self.plan and self.reason == "budget"))):
                self.reason = self.reason or self._wrap or "budget"
                return self.forced()
            return allowed
        finally:
            self.times.append(time.perf_counter() - start + self._carry)
            self._carry = 0.0

    def admits(self, token: int, remaining: int) -> bool:
        """Whether a completion still fits after `token`, tried on a copy of the matcher
        when the slack is small (the plan found is kept for `advance`)."""
        self._next = None
        plan = self.plan
        if (not self.options.budget or plan is None or not self._fresh
                or (plan and token == plan.tokens[0]) or not self._near(remaining)):
            return True
        start = time.perf_counter()
        trial = self.matcher.llmatcher.deep_copy()
        trial.consume_token(int(token))
        after = self._find(trial, remaining - 1, self._shifted(token))
        self.times[-1] += time.perf_counter() - start
        if after is not None and len(after) <= remaining - 1:
            self._next = after
            return True
        self.reason = self.reason or "budget"
        return False

    def forced(self) -> np.ndarray:
        """A mask that allows only the plan's next token (the end tokens, where the output
        is complete)."""
        only = np.zeros(self.matcher.n_vocab, dtype=bool)
        only[self.plan.tokens[0] if self.plan else self.end_ids] = True
        return only

    def advance(self, token: int) -> None:
        """Follow the matcher past `token` (which it has consumed)."""
        self._tokens.append(int(token))
        if self._json is not None:
            was_open = self._json.budget is not None
            self._json.feed(self._bytes(token))
            self._string_tokens = (self._string_tokens + 1 if was_open else 1
                                   ) if self._json.budget is not None else 0
        if self._next is not None:
            self.plan, self._next, self._fresh = self._next, None, True
            self._planned, self._since = len(self.plan), 0
        elif self._fresh and self.plan and token == self.plan.tokens[0]:
            self.plan = Plan(self.plan.data[len(self._bytes(token)):], self.plan.tokens[1:])
        else:
            self._fresh = False
            self._since += 1

    # -- internals ----------------------------------------------------------------------------
    def _bytes(self, token: int) -> bytes:
        return self.matcher.vocabulary.lltokenizer.decode_bytes([int(token)])

    def _shifted(self, token: int) -> list[bytes]:
        """What the last plan's bytes may still do after `token`: all of them (the token
        was more of a string), or what follows the token's bytes if the plan began so."""
        if self.plan is None:
            return []
        data, written = self.plan.data, self._bytes(token)
        return [data[len(written):]] if data.startswith(written) else [data]

    def _find(self, matcher: llguidance.LLMatcher, remaining: int,
              reuse: list[bytes]) -> Plan | None:
        """A plan from `matcher`'s state: what is left of the last plan, if it fits the
        `remaining` tokens; else the shortest of that, a search's from a state with this
        signature before, and the greedy probe; and, where none of them fits, a new
        search's (remembered for this grammar and vocabulary, so the sequences of a batch,
        and a model circling through the same states, search once; at most SEARCHES per
        sequence, since one can take a second on a large schema)."""
        vocab, encoded = self.matcher.vocabulary, self._encoded
        found = [p for p in (plan_of(matcher, vocab, d, encoded) for d in reuse)
                 if p is not None]
        best = min(found, key=len, default=None)
        if best is not None and len(best) <= remaining:
            return best  # what is left of the last plan still fits: nothing more to find
        signature = _signature(matcher, vocab)
        known = self._memo.get(signature, False)  # False: never searched; None: found none
        found += [p for p in (plan_of(matcher, vocab, known, encoded) if known else None,
                              greedy_completion(matcher, vocab, encoded)) if p is not None]
        best = min(found, key=len, default=None)
        if best is None:  # the completion may be longer than the probe went (many
            # required properties still to write), and than a search reaches: the probe
            # again, as far as the tokens left go (far cheaper than a search)
            best = self._long_probe(matcher, remaining)
        if ((best is None or len(best) > remaining) and known is False
                and self._searches < SEARCHES):
            self._searches += 1
            searched = shortest_completion(matcher, vocab)
            self._memo.remember(signature, None if searched is None else searched.data)
            if searched is not None and (best is None or len(searched) < len(best)):
                best = searched
        return best

    def _long_probe(self, matcher: llguidance.LLMatcher, remaining: int) -> Plan | None:
        """The greedy probe's completion from `matcher`'s state, up to the bytes the
        `remaining` tokens could write (at most LONG_PROBE_BYTES)."""
        vocab = self.matcher.vocabulary
        length = min(LONG_PROBE_BYTES, remaining * vocab.longest() + 1)
        return plan_of(matcher, vocab, _probe(matcher.deep_copy(), vocab.byte_tokens, length),
                       self._encoded)

    def _replan(self, remaining: int) -> None:
        """Find a plan from the current state."""
        reuse = [self.plan.data] if self.plan is not None else []
        self.plan = self._find(self.matcher.llmatcher, remaining, reuse)
        self._fresh = self.plan is not None
        self._planned, self._since = len(self.plan or ()), 0

    def _near(self, remaining: int) -> bool:
        """Whether the slack the plan leaves is within the window where each token is
        tried first."""
        return remaining - self._planned <= WINDOW + self._planned

    def _due(self, remaining: int) -> bool:
        """Whether a stale plan should be found again: at once near the budget, else each
        time a third of the slack it left has been written (so a runaway costs a few
        plans, not one per token)."""
        slack = remaining - self._planned - WINDOW - self._planned
        return self._since >= max(1, slack // 3)

    def _wrapping(self, free: bool) -> str | None:
        """Why the output should be closed now, if it should: a stretch of free text
        past its limit (or a JSON string past its own), or a loop."""
        if free and self.free_limit and self._free_run > self.free_limit:
            return "free_text"
        if (self._json is not None and self._json.budget is not None
                and self._string_tokens >= self._json.budget):
            return "free_text"
        if self.options.repetition and _looping(self._tokens):
            return "repetition"
        return None


# -- the shortest JSON a schema allows, by the numbers -------------------------------------------
# Subschemas one bound may weigh (each `anyOf` branch is weighed with what its parent
# requires besides); past it the bound is 0: nothing is refused by it.
MIN_BYTES_WORK = 20_000
_JSON_TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")
_MIN_BYTES: dict[str, tuple[int, str]] = {}  # schema text -> bound, for the last grammars


def _min_bytes_of(grammar: Any) -> tuple[int, str]:
    key = grammar.source
    if key not in _MIN_BYTES:
        if len(_MIN_BYTES) >= MEMO_GRAMMARS:
            _MIN_BYTES.clear()
        _MIN_BYTES[key] = min_json_bytes(grammar.schema)
    return _MIN_BYTES[key]


def min_json_bytes(schema: Any) -> tuple[int, str]:
    """A lower bound on the bytes of any JSON text valid against `schema`, and what
    makes it large ("minItems 1000000 at /a", "" when nothing does), computed from the
    schema's numbers: `minLength`, `minItems`, `minProperties`, `required`, `const` and
    `enum`, through `properties`, `items`, `prefixItems`, `allOf` (all must hold: the
    largest), `anyOf` / `oneOf` (one must: the smallest), local `$ref`s and `type`s.
    What it cannot weigh counts nothing (`pattern`, `format`, `not`, a recursive `$ref`),
    so the bound never exceeds the true shortest; with no whitespace and one byte per
    character it is often that shortest. An output of N bytes takes at least N / (the
    longest token's bytes) tokens."""
    weigher = _MinBytes(schema)
    try:
        return weigher.weigh([schema], (), "")
    except _OutOfWork:
        return 0, ""


class _OutOfWork(Exception):
    pass


class _MinBytes:
    """`min_json_bytes`'s work: a schema as the list of its facets (the subschemas that
    must all hold: itself, its `allOf`s and `$ref`s), weighed per type."""

    def __init__(self, root: Any):
        self.root = root
        self.work = 0
        self.memo: dict[int, tuple[int, str]] = {}

    def weigh(self, schemas: list[Any], refs: tuple[int, ...], at: str) -> tuple[int, str]:
        self.work += 1
        if self.work > MIN_BYTES_WORK:
            raise _OutOfWork
        key = id(schemas[0]) if len(schemas) == 1 else None
        if key is not None and key in self.memo:
            return self.memo[key]
        facets, refs = self._facets(schemas, refs)
        result = self._weigh_facets(facets, refs, at)
        if key is not None:
            self.memo[key] = result
        return result

    def _facets(self, schemas: list[Any], refs: tuple[int, ...]
                ) -> tuple[list[Any], tuple[int, ...]]:
        """The subschemas that must all hold: `schemas`, their `allOf`s and the targets of
        their local `$ref`s, flattened (a `$ref` already being weighed is left out)."""
        facets, todo = [], list(schemas)
        while todo:
            s = todo.pop()
            facets.append(s)
            if not isinstance(s, dict):
                continue
            if isinstance(s.get("allOf"), list):
                todo += s["allOf"]
            target = self._target(s.get("$ref"))
            if target is not None and id(target) not in refs:
                refs = (*refs, id(target))
                todo.append(target)
        return facets, refs

    def _target(self, ref: Any) -> Any:
        if not (isinstance(ref, str) and ref.startswith("#")):
            return None
        target = self.root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                return None
        return target

    def _weigh_facets(self, facets: list[Any], refs: tuple[int, ...], at: str
                      ) -> tuple[int, str]:
        if any(f is False for f in facets):
            return 0, ""  # nothing is valid: no bound is wrong, 0 is the safe one
        dicts = [f for f in facets if isinstance(f, dict)]
        types = set(_JSON_TYPES)
        for f in dicts:
            t = f.get("type")
            if isinstance(t, str):
                types &= {t, "integer"} if t == "number" else {t}
            elif isinstance(t, list):
                allowed = {x for x in t if isinstance(x, str)}
                types &= allowed | ({"integer"} if "number" in allowed else set())
        if not types:
            return 0, ""
        best = min((self._weigh_type(t, dicts, refs, at) for t in types), key=lambda r: r[0])
        for f in dicts:  # a value from a list: the shortest of them
            values = ([f["const"]] if "const" in f else f["enum"]
                      if isinstance(f.get("enum"), list) and f["enum"] else None)
            if values is not None:
                best = max(best, (min(_value_bytes(v) for v in values), ""),
                           key=lambda r: r[0])
        for i, f in enumerate(dicts):  # one branch must hold, with everything else here
            for key in ("anyOf", "oneOf"):
                branches = f.get(key)
                if isinstance(branches, list) and branches:
                    rest = [*dicts[:i], {k: v for k, v in f.items() if k != key}, *dicts[i + 1:]]
                    shortest = min((self.weigh([*rest, b], refs, at) for b in branches),
                                   key=lambda r: r[0])
                    best = max(best, shortest, key=lambda r: r[0])
        return best

    def _weigh_type(self, kind: str, dicts: list[dict], refs: tuple[int, ...], at: str
                    ) -> tuple[int, str]:
        if kind in ("number", "integer"):
            return 1, ""
        if kind in ("boolean", "null"):
            return 4, ""
        if kind == "string":
            n = max((_count(f.get("minLength")) for f in dicts), default=0)
            return 2 + n, (f"minLength {n} at {at or '/'}" if n else "")
        if kind == "array":
            return self._weigh_array(dicts, refs, at)
        return self._weigh_object(dicts, refs, at)

    def _weigh_array(self, dicts: list[dict], refs: tuple[int, ...], at: str
                     ) -> tuple[int, str]:
        n = max((_count(f.get("minItems")) for f in dicts), default=0)
        if n == 0:
            return 2, ""

        def item_schemas(i: int) -> list[Any]:
            found = []
            for f in dicts:
                prefix = f.get("prefixItems", f.get("items"))
                if isinstance(prefix, list):
                    if i < len(prefix):
                        found.append(prefix[i])
                    elif "prefixItems" in f and isinstance(f.get("items"), (dict, bool)):
                        found.append(f["items"])
                    elif isinstance(f.get("additionalItems"), (dict, bool)):
                        found.append(f["additionalItems"])
                elif isinstance(f.get("items"), (dict, bool)):
                    found.append(f["items"])
            return found

        prefix = max((len(p) for f in dicts for p in (f.get("prefixItems"), f.get("items"))
                      if isinstance(p, list)), default=0)
        total, why = 2 + (n - 1), f"minItems {n} at {at or '/'}"
        heaviest = 0
        for i in range(min(n, prefix + 1)):  # past the prefixes every item is alike
            schemas = item_schemas(i)
            size, inner = self.weigh(schemas, refs, f"{at}/{i}") if schemas else (1, "")
            size = max(size, 1)
            count = 1 if i < prefix else n - prefix
            total += size * count
            if size * count > heaviest and inner:
                heaviest = size * count
                why = f"minItems {n} at {at or '/'}, of {inner}" if count > 1 else inner
        return total, why

    def _weigh_object(self, dicts: list[dict], refs: tuple[int, ...], at: str
                      ) -> tuple[int, str]:
        required = list(dict.fromkeys(r for f in dicts for r in f.get("required") or ()
                                      if isinstance(r, str)))
        n = max([len(required), *(_count(f.get("minProperties")) for f in dicts)])
        if n == 0:
            return 2, ""
        total, why = 2 + (n - 1), (f"minProperties {n} at {at or '/'}"
                                   if n > len(required) else "")
        heaviest = 0
        for name in required:
            schemas = [f["properties"][name] for f in dicts
                       if isinstance(f.get("properties"), dict) and name in f["properties"]]
            size, inner = (self.weigh(schemas, refs, f"{at}/{name}") if schemas else (1, ""))
            size = len(json.dumps(name, ensure_ascii=False).encode()) + 1 + max(size, 1)
            total += size
            if size > heaviest and inner:
                heaviest, why = size, inner
        return total + 4 * (n - len(required)), why  # others: `"":0` at least


def _count(value: Any) -> int:
    """A schema's count keyword as a whole number (0 where it is not one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0
    if isinstance(value, float) and not math.isfinite(value):
        return 0
    return max(0, int(value))


def _value_bytes(value: Any) -> int:
    """The bytes of the shortest JSON text of `value` (a number: 1, as `1.0` may be `1`)."""
    if isinstance(value, str):
        return len(json.dumps(value, ensure_ascii=False).encode())
    if isinstance(value, bool):
        return 4 if value else 5
    if value is None:
        return 4
    if isinstance(value, (int, float)):
        return 1
    if isinstance(value, list):
        return 2 + max(len(value) - 1, 0) + sum(_value_bytes(v) for v in value)
    if isinstance(value, dict):
        return 2 + max(len(value) - 1, 0) + sum(
            _value_bytes(str(k)) + 1 + _value_bytes(v) for k, v in value.items())
    return 1



class _JSONPosition:
    """Where JSON text stands as its bytes come in: the path of the value being written
    and, inside a string value whose path has a budget, that budget (`budget`).

    `budgets`: `Grammar.string_budgets`, paths of property names, "[]" for an array
    item and "{}" for any property."""

    def __init__(self, budgets: tuple[tuple[tuple[str, ...], int], ...]):
        self.budgets = budgets
        self.stack: list[list] = []  # ["{", key, expecting a key] or ["[", None]
        self.budget: int | None = None
        self._string = False  # inside a string (a key or a value)
        self._key: bytearray | None = None  # the key being read, inside a key string
        self._escaped = False

    def feed(self, data: bytes) -> None:
        for byte in data:
            if self._string:
                self._read_string(byte)
            elif byte == 0x22:  # "
                self._string = True
                top = self.stack[-1] if self.stack else None
                if top is not None and top[0] == "{" and top[2]:
                    self._key = bytearray()
                else:
                    self.budget = self._budget_at(self.path())
            elif byte in b"{[":
                self.stack.append(["{", None, True] if byte == 0x7B else ["[", None])
            elif byte in b"}]" and self.stack:
                self.stack.pop()
            elif byte == 0x3A and self.stack and self.stack[-1][0] == "{":  # :
                self.stack[-1][2] = False
            elif byte == 0x2C and self.stack and self.stack[-1][0] == "{":  # ,
                self.stack[-1][1:] = [None, True]

    def _read_string(self, byte: int) -> None:
        if self._escaped:
            self._escaped = False
        elif byte == 0x5C:  # backslash
            self._escaped = True
        elif byte == 0x22:  # the closing quote
            self._string, self.budget = False, None
            if self._key is not None:
                self.stack[-1][1] = json.loads(b'"' + bytes(self._key) + b'"')
                self._key = None
            return
        if self._key is not None:
            self._key.append(byte)

    def path(self) -> tuple[str, ...]:
        return tuple("[]" if frame[0] == "[" else frame[1] for frame in self.stack)

    def _budget_at(self, path: tuple[str, ...]) -> int | None:
        for pattern, budget in self.budgets:
            if len(pattern) == len(path) and all(
                    p == s or (p == "{}" and s != "[]") for p, s in zip(pattern, path)):
                return budget
        return None


def _looping(tokens: list[int]) -> bool:
    """Whether the last tokens repeat one pattern (see LOOP_SPAN and LOOP_PERIOD)."""
    for period in range(1, LOOP_PERIOD + 1):
        span = max(LOOP_SPAN, 3 * period)
        if len(tokens) >= span + period and tokens[-span:] == tokens[-span - period:-period]:
            return True
    return False
