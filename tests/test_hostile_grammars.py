"""Hostile grammars: no GBNF grammar or JSON Schema, however many its rules or deep its
nesting, crashes the process. Past the bounds of `workbench.engine.decoding.grammar`
(`MAX_GRAMMAR_CHARS`, `MAX_GBNF_RULES`, `MAX_GBNF_NESTING`, `MAX_SCHEMA_DEPTH`) it is
refused with a `GrammarTooLargeError`, a ValueError the server answers with a 400.

llguidance compiles a grammar by recursion over its rules: a chain of ~2,650 rules
overflowed the stack and killed the process (SIGSEGV) inside its validation. A crash
cannot be caught in-process, so every case here is compiled in a child process, which
prints a line before and after each grammar: a child that dies names the grammar that
killed it. A grammar the compiler accepts is also run: a matcher over a byte vocabulary,
a few masks and tokens.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from workbench.engine.decoding.grammar import (
    MAX_GBNF_NESTING,
    MAX_GBNF_RULES,
    Grammar,
    GrammarError,
    GrammarTooLargeError,
    SchemaTooLargeError,
)

REPO = Path(__file__).resolve().parents[1]

# Compiles each case of the JSON file argv[1] ({"kind": "gbnf" | "schema", "text": ...}),
# prints "begin I" before and "I VERDICT" after it: "ok", or the GrammarError's class.
CHILD = r"""
import json, sys
import numpy as np
import llguidance
from workbench.engine.decoding.grammar import Grammar, GrammarError, GrammarMatcher, _Vocabulary

class Bytes:  # a vocabulary of the 256 bytes and an end token
    tokens = [bytes([b]) for b in range(256)] + [b"\xffend"]
    special_token_ids, eos_token_id, bos_token_id = [256], 256, None
    def __call__(self, data):
        return list(data)

vocab = _Vocabulary(llguidance.LLTokenizer(llguidance.TokenizerWrapper(Bytes()), n_vocab=257,
                                           eos_token=[256]), 257, np.arange(256, dtype=np.int32))
cases = json.load(open(sys.argv[1]))
for i, case in enumerate(cases):
    print("begin", i, flush=True)
    try:
        if case["kind"] == "gbnf":
            g = Grammar.from_gbnf(case["text"])
        else:
            g = Grammar.from_json_schema(case["text"])
        m = GrammarMatcher(g, vocab)
        for step in range(8):  # walk a little: the first allowed byte, then the last
            allowed = np.nonzero(m.mask()[:256])[0]
            if not len(allowed):
                break
            m.consume(int(allowed[0 if step % 2 else -1]))
        verdict = "ok"
    except GrammarError as e:
        verdict = type(e).__name__
    print(i, verdict, flush=True)
"""


def compile_in_child(cases: list[dict], tmp_path: Path, timeout: float = 300) -> list[str]:
    """Each case's verdict, compiled in one child process; fails naming the case that
    crashed it, if one did."""
    path = tmp_path / f"cases{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps(cases))
    run = subprocess.run([sys.executable, "-c", CHILD, str(path)], cwd=REPO,
                         capture_output=True, text=True, timeout=timeout)
    lines = run.stdout.splitlines()
    begun = [int(line.split()[1]) for line in lines if line.startswith("begin ")]
    if run.returncode != 0:
        culprit = cases[begun[-1]] if begun else None
        pytest.fail(f"the child ended with {run.returncode} on case "
                    f"{begun[-1] if begun else '?'}: {json.dumps(culprit)[:600]}\n"
                    f"{run.stderr[-2000:]}")
    verdicts = [line.split(" ", 1)[1] for line in lines if not line.startswith("begin ")]
    assert len(verdicts) == len(cases), run.stderr[-2000:]
    return verdicts


# -- the reported grammar ---------------------------------------------------------------------
def chain(n: int) -> str:
    """The grammar of the report: n rules, each referring to the next."""
    return "root ::= r0\n" + "".join(f'r{i} ::= "a" r{i + 1} | "b"\n' for i in range(n)) + \
        f'r{n} ::= "c"\n'


def test_a_chain_of_three_thousand_rules_is_refused_not_a_crash():
    """The report's payload (3,000 chained rules, 79 KB) segfaulted the process; now it
    is a clean error in a fresh interpreter, as a server's request would get it."""
    text = chain(3000)
    assert 75_000 < len(text) < 85_000
    code = ("import sys\nfrom workbench.engine.decoding.grammar import Grammar, GrammarError\n"
            "try:\n    Grammar.from_gbnf(sys.stdin.read())\nexcept GrammarError as e:\n"
            "    print(type(e).__name__, isinstance(e, ValueError), e)\n")
    run = subprocess.run([sys.executable, "-c", code], input=text, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert run.stdout.startswith("GrammarTooLargeError True the grammar has 3,002 rules")


def grouped_chain(n: int, k: int) -> str:
    """A chain of n rules, each referring to the next inside k nested groups (each group
    adds ~60% of a rule's stack to the compiler's recursion)."""
    return "root ::= r0\n" + "".join(
        f"r{i} ::= " + '("a" ' * k + f"r{i + 1}" + ' | "q")' * k + ' | "b"\n' for i in range(n)
    ) + f'r{n} ::= "c"\n'


def test_the_largest_chains_and_nestings_within_the_bounds_compile():
    """Shapes that overflowed an 8 MiB stack below the bounds compile (on the compile
    thread's larger stack), and one step past each bound is refused."""
    nested = "root ::= " + '("a" ' * MAX_GBNF_NESTING + '"b"' + ' | "c")' * MAX_GBNF_NESTING
    g = Grammar.from_gbnf(grouped_chain(350, 20))  # 91 KB; overflowed 8 MiB at 250 rules
    assert g.kind == "gbnf"
    Grammar.from_gbnf(chain(MAX_GBNF_RULES - 2))  # root, the chain and its end
    Grammar.from_gbnf(nested)
    with pytest.raises(GrammarTooLargeError, match="rules"):
        Grammar.from_gbnf(chain(MAX_GBNF_RULES - 1))
    with pytest.raises(GrammarTooLargeError, match="nested") as err:
        Grammar.from_gbnf("root ::= " + '("a" ' * (MAX_GBNF_NESTING + 1) + '"b"'
                          + ' | "c")' * (MAX_GBNF_NESTING + 1))
    assert (err.value.line, err.value.column) == (1, 10 + 5 * MAX_GBNF_NESTING)
    with pytest.raises(GrammarTooLargeError, match="characters"):
        Grammar.from_gbnf('root ::= "' + "a" * 200_000 + '"\n')


def ref_chain(n: int) -> dict:
    """A JSON Schema of n definitions, each an array of the next (crashed at ~1,100)."""
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}}
            for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def nested_items(n: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(n):
        schema = {"type": "array", "items": schema}
    return schema


def test_deep_json_schemas_are_refused_not_a_crash():
    assert Grammar.from_json_schema(ref_chain(60)).kind == "json_schema"
    recursive = {"$defs": {"node": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"}
    Grammar.from_json_schema(recursive)  # recursion is no depth: each definition once
    for schema in (ref_chain(3000), nested_items(100_000)):
        with pytest.raises(SchemaTooLargeError, match="deep"):
            Grammar.from_json_schema(schema)
    deep_text = '{"type": "array", "items": ' * 5000 + "{}" + "}" * 5000
    with pytest.raises(SchemaTooLargeError):  # Python's JSON reader recursed too deep
        Grammar.from_json_schema(deep_text)
    with pytest.raises(GrammarError, match="recursion limit"):  # llguidance's own bound
        Grammar.from_json_schema(nested_items(200))


# -- fuzzing ----------------------------------------------------------------------------------
def random_gbnf(rng: random.Random, n_rules: int, max_nesting: int, deep: bool = False
                ) -> str:
    """A random grammar of `n_rules` rules: literals, character classes, references
    (to the next rule half the time: long chains; else anywhere: cycles), groups nested up
    to `max_nesting` (`deep`: the first item of each rule nests that deep), repetitions."""

    def item(i: int, depth: int, first: bool = False) -> str:
        roll = rng.random()
        if deep and first and depth < max_nesting:  # (a group of one alternative is no group)
            text = f'({item(i, depth + 1, first=True)} {item(i, max_nesting)} | "q")'
        elif roll < 0.25:
            text = rng.choice(['"a"', '"bc"', '"\\n"', '[a-z]', '[^"]', '"{"', "[0-9]"])
        elif roll < 0.65 or depth >= max_nesting:
            target = i + 1 if rng.random() < 0.5 and i + 1 < n_rules else rng.randrange(n_rules)
            text = f"r{target}"
        else:
            text = "(" + alternatives(i, depth + 1) + ")"
        return text + rng.choice(["", "", "", "*", "+", "?", "{2}", "{0,3}", "{1,}"])

    def alternatives(i: int, depth: int) -> str:
        # deep groups are single items, so that the nesting reaches `max_nesting`
        if depth > 3:
            return item(i, depth) + (f' | "z{depth}"' if rng.random() < 0.3 else "")
        return " | ".join(" ".join(item(i, depth) for _ in range(rng.randint(1, 3)))
                          for _ in range(rng.randint(1, 3)))

    rules = ["root ::= r0"]
    for i in range(n_rules):
        lead = item(i, 0, first=True) + " " if deep else ""
        rules.append(f"r{i} ::= {lead}{alternatives(i, 0)} | \"e{i % 7}\"")  # each can end
    return "\n".join(rules) + "\n"


def fuzz_cases(seed: int) -> list[dict]:
    rng = random.Random(seed)
    cases = []
    for n_rules in (1, 3, 10, 30, 100, 300, 1000, 1500, 1998, 2001, 3000, 5000, 10_000):
        nesting = rng.choice([2, 4, 8])
        cases.append({"kind": "gbnf", "text": random_gbnf(rng, n_rules, nesting)})
    for nesting in (10, 20, MAX_GBNF_NESTING - 1, MAX_GBNF_NESTING, MAX_GBNF_NESTING + 1,
                    60, 500):
        cases.append({"kind": "gbnf", "text": random_gbnf(rng, 5, nesting, deep=True)})
    for n_rules in (300, 1200):  # many rules, each nested deep
        cases.append({"kind": "gbnf", "text": random_gbnf(rng, n_rules, 12, deep=True)})
    for n_rules in (1998, 2001, 4000):  # compact rules: many within the length bound
        cases.append({"kind": "gbnf", "text": "root ::= r0\n" + "".join(
            f'r{i} ::= r{rng.randrange(n_rules)} "x" | r{min(i + 1, n_rules - 1)} | "y"\n'
            for i in range(n_rules))})
    # chains of references, inside groups (more stack per rule) and not
    for n, k in ((1998, 0), (1000, 5), (350, 20), (3000, 0), (10_000, 0)):
        cases.append({"kind": "gbnf", "text": grouped_chain(n, k)})
    # long alternations and sequences
    for n in (1000, 10_000, 100_000):
        cases.append({"kind": "gbnf", "text": "root ::= " + " | ".join(
            f'"w{i}"' for i in range(n)) + "\n"})
        cases.append({"kind": "gbnf", "text": "root ::= " + " ".join(['"a"'] * n) + "\n"})
    # JSON Schemas: deep literal nesting, $ref chains, wide and deep combinators
    for n in (50, 127, 200, 2000):
        cases.append({"kind": "schema", "text": '{"type": "array", "items": ' * n
                      + '{"type": "integer"}' + "}" * n})
        cases.append({"kind": "schema", "text": json.dumps(ref_chain(n))})
    for n in (30, 120, 1000):
        cases.append({"kind": "schema", "text": '{"allOf": [{}], "anyOf": [' * n
                      + '{"type": "integer"}' + ', {"type": "null"}]}' * n})
    rng.shuffle(cases)
    return cases


def test_fuzzed_grammars_never_crash(tmp_path):
    """A seeded batch of random rule graphs (up to 10,000 rules), deep nestings, long
    alternations and deep JSON Schemas: each compiles or is refused with a GrammarError,
    in a child process that must not die."""
    start = time.perf_counter()
    cases = [case for seed in (44, 45, 46) for case in fuzz_cases(seed)]
    verdicts = compile_in_child(cases, tmp_path)
    unexpected = [(v, c["text"][:200]) for v, c in zip(verdicts, cases)
                  if v not in ("ok", "GrammarError", "SchemaError", "GrammarTooLargeError",
                               "SchemaTooLargeError")]
    assert not unexpected, unexpected
    assert verdicts.count("ok") >= 10 and "GrammarTooLargeError" in verdicts
    assert time.perf_counter() - start < 120


# -- through the server -----------------------------------------------------------------------
HUGE_MINIMUMS = [{"type": "string", "minLength": 1_000_000_000},
                 {"type": "array", "minItems": 1_000_000},
                 {"type": "object", "minProperties": 1_000_000},
                 {"type": "object", "required": ["a"], "properties": {"a": {
                     "type": "array", "minItems": 5000, "items": {"$ref": "#/$defs/word"}}},
                  "$defs": {"word": {"type": "string", "minLength": 100}}}]


@pytest.fixture(scope="module")
def server(smollm2):
    import workbench

    with workbench.serve({"smollm2-135m": smollm2}, port=0) as s:
        yield s


def test_the_server_answers_hostile_grammars_with_a_fast_400(server):
    """The 3,000-rule grammar killed the server process; schemas whose minimums no
    64-token answer can reach ran 26-52 s and returned cut JSON with a 200. Each is a
    400 within 2 s now, and the server goes on answering, a grammar that overflowed the
    stack within the bounds included."""
    hi = [{"role": "user", "content": "hi"}]
    extras = [{"grammar": chain(3000)}] + [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}}
        for s in HUGE_MINIMUMS]
    for extra in extras:
        start = time.monotonic()
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": "smollm2-135m", "messages": hi, "max_tokens": 64, **extra})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"]
        assert time.monotonic() - start < 2, extra
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "smollm2-135m", "messages": hi, "max_tokens": 8,
        "grammar": grouped_chain(350, 20)})
    assert r.status_code == 200, r.text
    assert set(r.json()["choices"][0]["message"]["content"]) <= set("abcq")


def test_a_repetition_past_the_parser_limit_is_a_400_with_a_readable_message(server):
    """`"x"{1000000}` compiles (the count is symbolic) but needs more parser work than
    llguidance's per-token limit at the first token: a 400 within a few seconds whose
    message is one line saying so, not the parser's state dump (a page of internal
    counters), and the server goes on answering."""
    hi = [{"role": "user", "content": "hi"}]
    start = time.monotonic()
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "smollm2-135m", "messages": hi, "max_tokens": 8,
        "grammar": 'root ::= "x"{1000000}'})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "Too many items" in message and "repetition" in message, message
    assert "\n" not in message and "<state>" not in message and len(message) < 400, message
    assert time.monotonic() - start < 10
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "smollm2-135m", "messages": hi, "max_tokens": 4, "grammar": 'root ::= "ok"'})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
