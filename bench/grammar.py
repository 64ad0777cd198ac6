"""Grammar overhead: mask time per token, constrained against free decoding, and llama.cpp.

    python bench/grammar.py [--model smollm2-135m] [--rounds 3] [--tokens 96]

1. Mask time. For every schema of the JSONSchemaBench sample in
   ../shared/data/grammar/schemas/ that compiles, each valid instance is fed to a
   fresh matcher token by token (SmolLM2's vocabulary) and the mask before every
   token is timed: mean, p50 and p99 over all steps, and per schema group.
2. Decode speed. For a few prompts with a schema each, the same model decodes
   `--tokens` tokens constrained by the schema and unconstrained (end tokens banned so
   both run the full length), alternating round by round; the medians of decode
   tokens/s (first token to last, prefill excluded) and their ratio are printed.
3. Against llama.cpp (llama-cpp-python, skipped when it is not installed): the same
   prompts, plus llama.cpp's json.gbnf, decoded greedily under the grammar by both
   engines from the same model file and prompt tokens, alternating round by round.
   llama.cpp gets the schema through its own converter (`LlamaGrammar.from_json_schema`),
   and as many threads as our engine's pool (NUMBA_NUM_THREADS, all cores by default).
   Printed: each engine's constrained and free decode tokens/s (medians) and the
   ratio of the constrained rates.
4. Closing cost. Each schema of the sample, asked for greedily at max_tokens
   `--closing-tokens` (128: many answers run on and are closed at the budget): the
   closer's time per token (`TokenEvent.closing_ms`, the start plan included in the
   first step) beside the mask's: mean, p50 and p99, and how many answers were closed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import numba
import numpy as np

from workbench import LLM, Grammar
from workbench.bench import load_llama_cpp
from workbench.engine.decoding.grammar import SchemaError
from workbench.engine.formats import sources

GRAMMARS = Path(__file__).resolve().parents[2] / "shared" / "data" / "grammar"
SCHEMAS = GRAMMARS / "schemas"
# (prompt, schema) pairs whose answers run long enough to time the decode loop
DECODE_CASES = [
    ("Describe three people as JSON.", {"type": "array", "items": {
        "type": "object", "properties": {"name": {"type": "string"},
                                         "age": {"type": "integer"},
                                         "city": {"type": "string"}},
        "required": ["name", "age", "city"]}}),
    ("Write a JSON recipe for pancakes.", {"type": "object", "properties": {
        "title": {"type": "string"}, "ingredients": {"type": "array", "items": {
            "type": "string"}}, "steps": {"type": "array", "items": {"type": "string"}}},
        "required": ["title", "ingredients", "steps"]}),
    ("List some facts about the moon in JSON.", {"type": "object",
                                                 "additionalProperties": {"type": "string"}}),
]


def mask_times(model: LLM) -> None:
    if not SCHEMAS.is_dir():
        sys.exit(f"missing {SCHEMAS}: the benchmark expects ../shared beside the repository")
    tok = model.tokenizer
    all_steps: list[float] = []
    groups: dict[str, list[float]] = {}
    refused = []
    for path in sorted(SCHEMAS.glob("*.json")):
        data = json.loads(path.read_text())
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                grammar = Grammar.from_json_schema(data["schema"])
        except SchemaError as e:
            refused.append(f"{path.name}: {e}")
            continue
        for test in data["tests"]:
            if not test["valid"]:
                continue
            m = grammar.matcher(tok, model.config.n_vocab)
            for token in tok.encode(json.dumps(test["data"]), add_bos=False):
                m.mask()
                if m.accepts([token]) != 1:
                    break  # keys in another order than the schema's: timed up to here
            group = path.name.split("---")[0].split("_")[0]
            groups.setdefault(group, []).extend(m.mask_times)
            all_steps.extend(m.mask_times)
    ms = np.asarray(all_steps) * 1e3
    print(f"mask time per token, {len(ms)} steps over "
          f"{len(list(SCHEMAS.glob('*.json'))) - len(refused)} schemas "
          f"(vocabulary {model.config.n_vocab}):")
    print(f"  mean {ms.mean():.3f} ms   p50 {np.median(ms):.3f} ms   "
          f"p99 {np.percentile(ms, 99):.3f} ms   max {ms.max():.3f} ms")
    for group, times in sorted(groups.items()):
        g = np.asarray(times) * 1e3
        print(f"  {group:<16} {len(g):>6} steps   p50 {np.median(g):.3f} ms   "
              f"p99 {np.percentile(g, 99):.3f} ms")
    for line in refused:
        print(f"  not compiled: {line}")


def decode_rate(model: LLM, prompt: str, tokens: int, schema=None, closing: bool = True
                ) -> tuple[float, int]:
    """Decode tokens/s from the first generated token to the last, and the token count."""
    ban = {t: -float("inf") for t in model.tokenizer.eot_ids}
    c = model.chat([{"role": "user", "content": prompt}], max_tokens=tokens, temperature=0,
                   schema=schema, logit_bias=None if schema is not None else ban,
                   closing=closing)
    stamps = [time.perf_counter() for ev in c.iter_events() if ev.id is not None]
    n = len(stamps)
    return ((n - 1) / (stamps[-1] - stamps[0]) if n > 1 else float("nan")), n


def decode_speed(model: LLM, rounds: int, tokens: int) -> None:
    print(f"\ndecode tokens/s, greedy, up to {tokens} tokens, median of {rounds} rounds:")
    print(f"  {'prompt':<42} {'tokens':>6} {'constrained':>12} {'free':>8} {'ratio':>6}")
    ratios = []
    for prompt, schema in DECODE_CASES:
        grammar = Grammar.from_json_schema(schema)
        decode_rate(model, prompt, 8, grammar, closing=False)  # warm up both paths
        decode_rate(model, prompt, 8)
        constrained, free, n = [], [], 0
        for _ in range(rounds):
            rate, n = decode_rate(model, prompt, tokens, grammar)
            constrained.append(rate)
            free.append(decode_rate(model, prompt, n)[0])  # the same number of tokens
        c, f = statistics.median(constrained), statistics.median(free)
        ratios.append(c / f)
        print(f"  {prompt[:42]:<42} {n:>6} {c:>12.1f} {f:>8.1f} {c / f:>6.2f}")
    print(f"  median ratio constrained / free: {statistics.median(ratios):.2f}")


def peer_rate(peer, ids: list[int], tokens: int, grammar=None, eot: Sequence[int] = ()
              ) -> tuple[float, int]:
    """llama.cpp's greedy decode tokens/s (first token to last) and token count; with no
    grammar the end tokens are banned, so it runs the full `tokens`."""
    from llama_cpp import LogitsProcessorList

    def no_end(_ids, scores):
        scores[list(eot)] = -np.inf
        return scores

    peer.reset()
    stamps: list[float] = []
    for token in peer.generate(ids, temp=0.0, grammar=grammar,
                               logits_processor=None if grammar else LogitsProcessorList([no_end])):
        if token in eot:
            break
        stamps.append(time.perf_counter())
        if len(stamps) == tokens:
            break
    n = len(stamps)
    return ((n - 1) / (stamps[-1] - stamps[0]) if n > 1 else float("nan")), n


def versus_llama_cpp(model: LLM, path: str, rounds: int, tokens: int, threads: int) -> None:
    try:
        from llama_cpp import LlamaGrammar
    except ImportError:
        print("\nllama-cpp-python is not installed: no comparison with llama.cpp "
              "(pip install llama-cpp-python)")
        return
    peer = load_llama_cpp(path, n_ctx=1024, n_threads=threads, n_threads_batch=threads,
                          verbose=False)
    json_gbnf = (GRAMMARS / "gbnf" / "json.gbnf").read_text()
    cases = [(prompt, Grammar.from_json_schema(schema),
              LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False))
             for prompt, schema in DECODE_CASES]
    cases.append(("Describe a cat as a JSON object.", Grammar.from_gbnf(json_gbnf),
                  LlamaGrammar.from_string(json_gbnf, verbose=False)))
    eot = [int(t) for t in model.tokenizer.eot_ids]
    print(f"\nconstrained greedy decode against llama.cpp, tokens/s, up to {tokens} tokens, "
          f"median of {rounds} rounds:")
    print(f"  {'prompt':<40} {'tokens':>11} {'ours':>7} {'free':>7} {'llama.cpp':>10} "
          f"{'free':>7} {'ours/llama.cpp':>15}")
    ratios = []
    for prompt, ours_grammar, peer_grammar in cases:
        ids = model.tokenize(model.apply_chat_template([{"role": "user", "content": prompt}]))
        decode_rate(model, prompt, 8, ours_grammar, closing=False)  # warm up both engines
        peer_rate(peer, ids, 8, peer_grammar, eot)
        runs: dict[str, list[float]] = {"ours": [], "ours_free": [], "peer": [], "peer_free": []}
        n_ours = n_peer = 0
        for _ in range(rounds):
            rate, n_ours = decode_rate(model, prompt, tokens, ours_grammar)
            runs["ours"].append(rate)
            runs["ours_free"].append(decode_rate(model, prompt, n_ours)[0])
            rate, n_peer = peer_rate(peer, ids, tokens, peer_grammar, eot)
            runs["peer"].append(rate)
            runs["peer_free"].append(peer_rate(peer, ids, n_peer, None, eot)[0])
        med = {k: statistics.median(v) for k, v in runs.items()}
        ratios.append(med["ours"] / med["peer"])
        print(f"  {prompt[:40]:<40} {n_ours:>5}/{n_peer:<5} {med['ours']:>7.1f} "
              f"{med['ours_free']:>7.1f} {med['peer']:>10.1f} {med['peer_free']:>7.1f} "
              f"{ratios[-1]:>15.2f}")
    print(f"  median ratio of constrained rates, ours / llama.cpp: {statistics.median(ratios):.2f}"
          f"  (tokens: ours/llama.cpp; greedy runs differ where their logits do)")


def closing_cost(model: LLM, tokens: int) -> None:
    """The closer's time per token beside the mask's, over the sample's schemas."""
    closing, masks, closed, runs = [], [], {}, 0
    for path in sorted(SCHEMAS.glob("*.json")):
        schema = json.loads(path.read_text())["schema"]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                grammar = Grammar.from_json_schema(schema)
        except SchemaError:
            continue
        messages = [{"role": "user", "content": f"Write a JSON example of: "
                                                f"{schema.get('title') or path.stem}"}]
        c = model.chat(messages, schema=grammar, max_tokens=tokens, temperature=0)
        for ev in c.events:
            if ev.closing_ms is not None:
                closing.append(ev.closing_ms)
                masks.append(ev.mask_ms)
        runs += 1
        closed[c.closed_early] = closed.get(c.closed_early, 0) + 1
    cl, mk = np.asarray(closing), np.asarray(masks)
    print(f"\nclosing cost, {runs} schemas at max_tokens {tokens}, greedy, {len(cl)} steps:")
    for name, ms in (("closer", cl), ("mask", mk)):
        print(f"  {name:<7} mean {ms.mean():.3f} ms   p50 {np.median(ms):.3f} ms   "
              f"p99 {np.percentile(ms, 99):.3f} ms   max {ms.max():.1f} ms")
    print("  ended: " + ", ".join(f"{'by the model' if k is None else 'closed: ' + k} {n}"
                                  for k, n in closed.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--closing-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    path = str(sources.resolve(args.model))
    model = LLM.load(path)
    mask_times(model)
    decode_speed(model, args.rounds, args.tokens)
    versus_llama_cpp(model, path, args.rounds, args.tokens, numba.config.NUMBA_NUM_THREADS)
    closing_cost(model, args.closing_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
