"""Prompt-lookup drafting (`draft="ngram"`) against plain decoding, on an editing task.

    python bench/lookup.py [--model qwen2.5-coder-0.5b] [--rounds 3] [--draft-tokens 4]

A chat asks the model to rewrite a short Python function with one change (rename a
variable, add type hints): the answer copies most of the prompt, which is where prompt
lookup pays. Each round runs the same greedy chat plainly and with `draft="ngram"`,
alternating, and checks that the two answers are identical token for token. Printed:
the median decode tokens/s of each (first token to last: the prefill is the same for
both and left out), their ratio, the acceptance rate and the target passes per token.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence

from workbench import LLM
from workbench.bench import decode_rate

FUNCTION = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, x in enumerate(values):
        total += x
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''
TASKS = [
    f"Rename the variable `total` to `running_sum` in this function. Reply with the whole "
    f"function only.\n\n```python\n{FUNCTION}```",
    f"Add type hints (list[float], int, returns list[float]) to this function. Reply with "
    f"the whole function only.\n\n```python\n{FUNCTION}```",
]


def chat_rate(m: LLM, messages: list[dict], max_tokens: int, **draft) -> tuple[float, object]:
    """Tokens/s from the first token to the last, and the finished completion."""
    c = m.chat(messages, temperature=0, max_tokens=max_tokens, **draft)
    return decode_rate(c), c


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=200)
    args = p.parse_args(argv)
    m = LLM.load(args.model)
    m.warmup.wait()
    print(f"{m.path.name}, greedy, up to {args.max_tokens} tokens, "
          f"{args.draft_tokens} proposals per round")
    for task in TASKS:
        messages = [{"role": "user", "content": task}]
        chat_rate(m, messages, 8)  # warm-up: kernels, caches
        plain, lookup = [], []
        for _ in range(args.rounds):
            rate, want = chat_rate(m, messages, args.max_tokens)
            plain.append(rate)
            rate, got = chat_rate(m, messages, args.max_tokens, draft="ngram",
                                    draft_tokens=args.draft_tokens)
            lookup.append(rate)
            if got.token_ids != want.token_ids:
                print("the answers differ: prompt lookup changed the greedy output",
                      file=sys.stderr)
                return 1
        u = got.usage
        a, b = statistics.median(plain), statistics.median(lookup)
        print(f"\n{task.split('.')[0]}: {len(want.token_ids)} tokens, identical")
        print(f"  plain  {a:7.1f} tok/s")
        print(f"  ngram  {b:7.1f} tok/s   {b / a:.2f}x   acceptance "
              f"{u.acceptance_rate:.0%}, "
              f"{got.draft_counts.target_passes / len(got.token_ids):.2f} passes per token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
