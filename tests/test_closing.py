"""Constrained outputs that end valid: the closer's shortest completions against a search
of every prefix, and generations pushed to run away (a logits processor that always
wants one more letter, or the same words) closed at the budget, in free text and in
loops. The generation tests over the JSONSchemaBench sample are in test_grammar.py."""

from __future__ import annotations

import json
import time
import warnings

import numpy as np
import pytest

from workbench import ClosedEarlyWarning, Closing, Grammar, GrammarBudgetError
from workbench.engine.decoding.closing import min_json_bytes, shortest_completion

RECORD = {"type": "object",
          "properties": {"note": {"type": "string"},
                         "count": {"type": "integer", "minimum": 18}},
          "required": ["note", "count"], "additionalProperties": False}


def shortest_by_every_prefix(grammar: Grammar, tokenizer, alphabet: bytes,
                             limit: int) -> bytes | None:
    """The shortest text over `alphabet` the grammar accepts, found breadth first over
    every prefix the grammar allows (no merging of states: slow, and sure)."""
    vocab = grammar.matcher(tokenizer).vocabulary
    level = [(b"", grammar.matcher(tokenizer))]
    for _ in range(limit + 1):
        following = []
        for text, m in level:
            if m.is_accepting:
                return text
            for byte in alphabet:
                token = int(vocab.byte_tokens[byte])
                if m.llmatcher.validate_tokens([token]) == 1:
                    child = m.clone()
                    child.consume(token)
                    following.append((text + bytes([byte]), child))
        level = following
    return None


@pytest.mark.parametrize("kind, source, alphabet", [
    ("regex", r"(ab|c)+d{2}", b"abcd"),
    ("regex", r"[1-9][0-9]*x", b"0123456789x"),
    ("gbnf", 'root ::= "(" root ")" | "[" item ("," item)* "]"\nitem ::= [0-9] | root',
     b"()[],0123456789"),
    ("json_schema", {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5}},
                     "required": ["a"]}, b'{}":a0123456789'),
    ("json_schema", {"type": "array", "items": {"enum": ["xy", "z"]}, "minItems": 2},
     b'[]",xyz'),
])
def test_shortest_completion_is_as_short_as_a_search_of_every_prefix(smollm2, kind, source,
                                                                      alphabet):
    grammar = {"regex": Grammar.from_regex, "gbnf": Grammar.from_gbnf,
               "json_schema": Grammar.from_json_schema}[kind](source)
    m = grammar.matcher(smollm2.tokenizer)
    plan = shortest_completion(m.llmatcher, m.vocabulary)
    expected = shortest_by_every_prefix(grammar, smollm2.tokenizer, alphabet, 12)
    assert plan is not None and expected is not None
    assert len(plan.data) == len(expected), (plan.data, expected)
    m.accepts(plan.tokens)
    assert m.is_accepting


def test_shortest_completion_from_inside_a_string(smollm2):
    g = Grammar.from_json_schema(RECORD)
    m = g.matcher(smollm2.tokenizer)
    m.accepts(smollm2.tokenize('{"note": "it was a', add_bos=False))
    plan = shortest_completion(m.llmatcher, m.vocabulary)
    assert plan.data == b'","count":18}'


def letter_lover(tokenizer, text: str):
    """A logits processor that makes `text`'s tokens the model's favourites: inside a JSON
    string the model then writes them for ever."""
    favourite = tokenizer.encode(text, add_bos=False)

    def boost(ids: np.ndarray, logits: np.ndarray) -> np.ndarray:
        logits[favourite] += 50.0
        return logits
    return boost


def test_a_runaway_string_is_closed_at_the_budget(smollm2):
    prompt = "A JSON record: "
    runaway = dict(schema=RECORD, max_tokens=24, temperature=0,
                   logits_processors=[letter_lover(smollm2.tokenizer, "a")])
    c = smollm2.generate(prompt, **runaway, closing=Closing(free_text_tokens=0,
                                                            repetition=False))
    value = json.loads(c.text)
    assert set(value) == {"note", "count"} and value["count"] >= 18
    assert c.finish_reason == "length" and c.closed_early == "budget"
    assert len(c.token_ids) <= 24
    forced = [ev for ev in c.events if ev.closed]
    assert forced and all(ev.closed == "budget" for ev in forced)
    # without the closer the same call is cut inside the string
    plain = smollm2.generate(prompt, **runaway, closing=False)
    assert plain.finish_reason == "length" and plain.closed_early is None
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain.text)


@pytest.mark.slow
def test_a_long_string_is_closed_after_its_free_text_budget(smollm2):
    c = smollm2.generate("A JSON record: ", schema=RECORD, max_tokens=200, temperature=0,
                         logits_processors=[letter_lover(smollm2.tokenizer, "a")],
                         closing=Closing(free_text_tokens=10, repetition=False))
    value = json.loads(c.text)
    assert c.closed_early == "free_text"
    assert len(smollm2.tokenize(value["note"], add_bos=False)) <= 12
    assert c.finish_reason == "stop"  # the model wrote the rest and ended it


def test_a_loop_is_closed_and_the_model_goes_on(smollm2):
    c = smollm2.generate("A JSON record: ", schema=RECORD, max_tokens=300, temperature=0,
                         logits_processors=[letter_lover(smollm2.tokenizer, " ha")],
                         closing=Closing(free_text_tokens=0))
    value = json.loads(c.text)
    assert c.closed_early == "repetition"
    assert value["note"].count("ha") < 60  # closed long before the budget
    assert len(c.token_ids) < 100


@pytest.mark.slow
def test_batched_runaways_all_end_valid(smollm2):
    outputs = smollm2.generate_batch(["A JSON record: ", "Another record: "], schema=RECORD,
                                     max_tokens=20, temperature=0,
                                     logits_processors=[letter_lover(smollm2.tokenizer, "a")])
    for c in outputs:
        assert json.loads(c.text)["count"] >= 18 and len(c.token_ids) <= 20


@pytest.mark.slow
def test_chat_json_closed_at_the_budget_warns_and_returns_the_object(smollm2):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value, c = smollm2.chat_json(
            [{"role": "user", "content": "Describe a cat."}], RECORD, max_tokens=16,
            temperature=0, logits_processors=[letter_lover(smollm2.tokenizer, "a")],
            return_completion=True)
    assert value["count"] >= 18 and c.closed_early == "budget"
    assert [w.category for w in caught] == [ClosedEarlyWarning]


# A record of 56 required fields of seven kinds: its shortest completion is hundreds of
# tokens, nearly all forced (the keys), longer than the greedy probe's reach and far past
# what a search can reach.
LONG_RECORD_KINDS = [
    {"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"type": "number"},
    {"type": "string", "enum": ["low", "medium", "high"]},
    {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
     "required": ["x", "y"]},
    {"type": "array", "items": {"type": "string"}},
]
LONG_RECORD = {"type": "object", "additionalProperties": False,
               "properties": {f"reading_{i:02d}": LONG_RECORD_KINDS[i % 7] for i in range(56)},
               "required": [f"reading_{i:02d}" for i in range(56)]}


@pytest.mark.slow
def test_a_long_mostly_forced_schema_finishes_valid_at_max_tokens_1024(smollm2):
    """Many required properties: the model rambles inside them (extra keys where the
    inner objects allow them), and the closer still ends the record valid within 1024
    tokens (it used to run out with no plan: IncompleteOutputError)."""
    jsonschema = pytest.importorskip("jsonschema")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ClosedEarlyWarning)
        value, c = smollm2.chat_json(
            [{"role": "user", "content": "Fill in a sensor record."}], LONG_RECORD,
            max_tokens=1024, temperature=0, return_completion=True)
    jsonschema.validate(value, LONG_RECORD)
    assert len(value) == 56 and c.usage.completion_tokens <= 1024


@pytest.mark.parametrize("closing", [True, False], ids=["closer", "no-closer"])
def test_an_open_ended_answer_complete_at_the_budget_is_returned(smollm2, closing):
    """`root ::= [0-9]+` is complete after any digit: an answer the budget cut is valid,
    returned with a warning (and marked closed at the budget), never IncompleteOutputError."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value, c = smollm2.chat_json([{"role": "user", "content": "Write a long number."}],
                                     grammar="root ::= [0-9]+", max_tokens=8, temperature=0,
                                     logits_processors=[letter_lover(smollm2.tokenizer, "1")],
                                     closing=closing, return_completion=True)
    assert c.usage.completion_tokens == 8 and c.finish_reason == "length"
    assert c.closed_early == "budget" and c.text.isdigit() and value == int(c.text)
    assert [w.category for w in caught] == [ClosedEarlyWarning]


@pytest.mark.slow
def test_chat_json_takes_a_gbnf_grammar(smollm2):
    json_like = 'root ::= "{\\"name\\": \\"" [a-z]+ "\\"}"'
    value = smollm2.chat_json([{"role": "user", "content": "Name a cat."}],
                              grammar=json_like, temperature=0, max_tokens=32)
    assert isinstance(value, dict) and list(value) == ["name"]
    text = smollm2.chat_json([{"role": "user", "content": "Say yes or no."}],
                             grammar='root ::= "yes" | "no"', temperature=0)
    assert text in ("yes", "no")
    with pytest.raises(ValueError, match="one of them"):
        smollm2.chat_json([{"role": "user", "content": "hi"}])


@pytest.mark.slow
def test_closing_off_and_on_agree_where_the_model_ends_on_its_own(smollm2):
    """The closer acts only where a plan would no longer fit: an answer the model ends
    itself, greedy or sampled, is the same token for token."""
    runs = [("Give a note and a count above 18 as JSON.", dict(temperature=0)),
            ("Write a short note about cats and how many cats you saw (more than 18), as "
             "JSON.", dict(temperature=0.9, seed=3))]
    for content, options in runs:
        messages = [{"role": "user", "content": content}]
        on = smollm2.chat(messages, schema=RECORD, max_tokens=200, **options)
        off = smollm2.chat(messages, schema=RECORD, max_tokens=200, closing=False, **options)
        assert on.closed_early is None and on.finish_reason == "stop"
        assert on.token_ids == off.token_ids


@pytest.mark.slow
def test_x_max_tokens_gives_one_string_its_own_budget(smollm2):
    schema = {"type": "object", "required": ["title", "body"], "additionalProperties": False,
              "properties": {"title": {"type": "string", "x-max-tokens": 4},
                             "body": {"type": "string"}}}
    g = Grammar.from_json_schema(schema)
    assert g.string_budgets == ((("title",), 4),)
    c = smollm2.generate("A JSON note: ", schema=g, max_tokens=60, temperature=0,
                         logits_processors=[letter_lover(smollm2.tokenizer, "a")],
                         closing=Closing(free_text_tokens=0, repetition=False))
    value = json.loads(c.text)
    assert len(smollm2.tokenize(value["title"], add_bos=False)) <= 5
    assert len(value["body"]) > 20  # the body has no budget of its own: it runs on
    assert c.closed_early == "free_text"


@pytest.mark.parametrize("budget", [0, -3, 2.5, "10", True])
def test_x_max_tokens_must_be_a_positive_integer(budget):
    from workbench.engine.decoding.grammar import SchemaError

    with pytest.raises(SchemaError, match="x-max-tokens"):
        Grammar.from_json_schema({"type": "string", "x-max-tokens": budget})


def test_x_max_tokens_follows_items_refs_and_combinators():
    g = Grammar.from_json_schema({
        "$defs": {"tag": {"type": "string", "x-max-tokens": 3}},
        "type": "object", "properties": {
            "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}},
            "notes": {"type": "object", "additionalProperties": {
                "anyOf": [{"type": "string", "x-max-tokens": 7}, {"type": "null"}]}}}})
    assert set(g.string_budgets) == {(("tags", "[]"), 3), (("notes", "{}"), 7)}


# -- minimums no search reaches -----------------------------------------------------------------
NESTED_MINIMUMS = {  # 1,000 rows of a string of 500 or a list of 300: ~300 KB at least
    "type": "object", "required": ["rows"], "properties": {"rows": {"$ref": "#/$defs/rows"}},
    "$defs": {"rows": {"type": "array", "minItems": 1000, "items": {"anyOf": [
        {"type": "string", "minLength": 500},
        {"allOf": [{"type": "array"}, {"minItems": 300}]}]}}}}


@pytest.mark.parametrize("schema, words", [
    ({"type": "string", "minLength": 1_000_000_000}, "minLength 1000000000"),
    ({"type": "array", "minItems": 1_000_000}, "minItems 1000000"),
    ({"type": "object", "minProperties": 1_000_000}, "minProperties 1000000"),
    (NESTED_MINIMUMS, "503,010 bytes, by minItems 1000 at /rows, of minLength 500 at /rows/0"),
])
def test_a_huge_minimum_is_refused_before_the_first_token(smollm2, schema, words):
    """These ran 26-52 s and returned cut JSON: the search for a shortest completion
    cannot reach them, so nothing was refused. The schema's numbers bound the output
    from below (bytes, over the longest token's bytes: tokens)."""
    start = time.perf_counter()
    with pytest.raises(GrammarBudgetError, match=f"at least \\d+ tokens .*{words}.*"
                                                 f"max_tokens=64"):
        smollm2.chat([{"role": "user", "content": "hi"}], schema=schema, max_tokens=64)
    assert time.perf_counter() - start < 2


def test_a_minimum_past_the_search_is_found_by_a_longer_probe(smollm2):
    """minItems 200 fits the bound (401 bytes, ~5 tokens of SmolLM2's longest) but not
    the budget; the search gives up on it, and the probe, run on for the budget's bytes,
    finds an array of 200 items that takes more than 64 tokens."""
    with pytest.raises(GrammarBudgetError, match=r"takes \d+ tokens.*max_tokens=64"):
        smollm2.chat([{"role": "user", "content": "hi"}],
                     schema={"type": "array", "minItems": 200}, max_tokens=64)


@pytest.mark.parametrize("schema, size", [
    (RECORD, len('{"note":"","count":0}')),
    ({"type": "array", "minItems": 3, "items": {"enum": ["abc", "de"]}}, len('["de","de","de"]')),
    ({"type": "array", "prefixItems": [{"const": "abc"}, {"type": "string", "minLength": 4}],
      "minItems": 2}, len('["abc","1234"]')),
    ({"allOf": [{"type": "string"}, {"minLength": 7}]}, 9),
    ({"type": "string", "anyOf": [{"minLength": 5}, {"minLength": 3}]}, 5),
    ({"anyOf": [{"type": "string", "minLength": 50}, {"type": "null"}]}, 4),
    ({"minLength": 50}, 1),  # any type: a number is 1 byte
    ({"$defs": {"n": {"type": "object", "required": ["k"], "properties": {
        "k": {"type": "array", "minItems": 2, "items": {"$ref": "#/$defs/n"}}}}},
      "$ref": "#/$defs/n"}, len('{"k":[0,0]}')),  # recursion counts nothing more
    ({"type": "object", "minProperties": 2, "required": ["a"]}, len('{"a":0,"":0}')),
])
def test_min_json_bytes_bounds_the_shortest_json(schema, size):
    assert min_json_bytes(schema)[0] == size


def test_min_json_bytes_never_exceeds_a_completion_the_search_finds(smollm2):
    """The bound is a bound: at most the length of a completion found by search."""
    for schema in [RECORD, {"allOf": [{"type": "array"}, {"minItems": 5}]},
                   {"type": "array", "minItems": 4, "items": {"type": "object", "required": [
                       "id"], "properties": {"id": {"type": "string", "minLength": 2}}}},
                   {"anyOf": [{"const": "abcdef"}, {"type": "array", "minItems": 2}]}]:
        m = Grammar.from_json_schema(schema).matcher(smollm2.tokenizer)
        plan = shortest_completion(m.llmatcher, m.vocabulary)
        assert plan is not None and min_json_bytes(schema)[0] <= len(plan.data), schema


def test_remembered_plans_stay_within_their_bounds():
    """A grammar's remembered searches hold at most MEMO_SIZE entries and MEMO_BYTES of
    completions (a grammar forcing long literals finds long ones): past either bound the
    memo starts over, and a completion longer than MEMO_BYTES is not kept at all."""
    from workbench.engine.decoding.closing import MEMO_BYTES, MEMO_SIZE, _Plans

    def held(plans: _Plans) -> int:
        return sum(len(v or b"") for v in plans.values())

    plans = _Plans()
    for i in range(MEMO_SIZE + 10):
        plans.remember(i, b"}" if i % 2 else None)
        assert len(plans) <= MEMO_SIZE
    assert len(plans) == 10 and plans.nbytes == 5
    big = MEMO_BYTES // 3
    for i in range(7):
        plans.remember(("long", i), bytes(big))
        assert plans.nbytes <= MEMO_BYTES and plans.nbytes == held(plans)
    plans.remember("too long", bytes(MEMO_BYTES + 1))
    assert "too long" not in plans
    plans.remember(("long", 6), b"x")  # found again: replaced, counted once
    assert plans[("long", 6)] == b"x" and plans.nbytes == held(plans)
