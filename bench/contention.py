"""Speed beside busy programs: our engine and llama.cpp, quiet, beside 1 and 2 busy
processes, and beside a busy thread of our own process, in one run.

    python bench/contention.py [--model smollm2-135m] [--rounds 3] [--threads N]

A notebook never has the machine to itself: the browser, JupyterLab's server and
whatever else is open share the cores. Each load level starts its busy processes (a
Python loop each, as a busy browser tab or an indexer would be), then measures, round
by round and alternating the engines. The last level is a thread of this process running
a Python loop, as a notebook cell runs while a chat streams or `serve()` answers: it
contends for the GIL as well as a core (llama.cpp, in its own process, sees only the
busy core). Measured:

- decode tokens/s: 128 greedy tokens after a short prompt (end tokens banned);
- prefill tokens/s: a 512-token prompt;
- `chat_json` seconds: a short object under a JSON Schema (ours only: llama.cpp has no
  such call);

for our engine with core sharing (`workbench.engine.runtime.cores`, the default) and without
it (every thread, every step), and llama.cpp (llama-cpp-python, in a child process with
the same threads). Printed: each row's median and its fraction of the same engine's
quiet speed. Run it on an otherwise quiet machine: the busy processes are the load.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from workbench.bench import PROMPTS, SETTLE_S, PeerProcess, decode_rate, set_threads

LOADS = ("quiet", "1 busy", "2 busy", "thread")  # beside the engines (see `busy`)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"},
                                           "country": {"type": "string"},
                                           "population": {"type": "integer"}},
          "required": ["city", "country", "population"]}
QUESTION = [{"role": "user", "content": "Describe Paris as JSON."}]


@contextlib.contextmanager
def busy(load: str) -> Iterator[None]:
    """The load `load` names while the block runs: processes that each keep one core busy
    ("1 busy", "2 busy"), or one thread of this process running a Python loop ("thread")."""
    n = {"1 busy": 1, "2 busy": 2}.get(load, 0)
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    stop = threading.Event()
    thread = threading.Thread(target=_spin, args=(stop,), daemon=True)
    if load == "thread":
        thread.start()
    try:
        time.sleep(1.0)  # the load is running
        yield
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()
        for proc in procs:
            proc.kill()
            proc.wait()


def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        pass


class Ours:
    def __init__(self, model: str, prompt_tokens: int, decode_tokens: int):
        from workbench import LLM

        self.m = LLM.load(model, kv_cache_size=prompt_tokens + decode_tokens + 64)
        self.m.warmup.wait()
        filler = self.m.tokenize("The quick brown fox jumps over the lazy dog. " * 200)
        self.long_ids = filler[:prompt_tokens]
        self.no_eos = {int(t): float("-inf") for t in self.m.tokenizer.eot_ids}
        self.decode_tokens = decode_tokens
        self.chat_json()  # warm: grammar compiled, kernels run once

    def share_cores(self, on: bool) -> None:
        share = self.m._scheduler._cores
        if share is not None:
            share.set_enabled(on)

    def decode(self) -> float:
        self.m.reset()
        return decode_rate(self.m.generate(PROMPTS[0], max_tokens=self.decode_tokens,
                                           temperature=0, logit_bias=self.no_eos))

    def prefill(self) -> float:
        self.m.reset()
        t = time.perf_counter()
        next(iter(self.m.generate(self.long_ids, max_tokens=1, temperature=0).iter_events()))
        return len(self.long_ids) / (time.perf_counter() - t)

    def chat_json(self) -> float:
        self.m.reset()
        t = time.perf_counter()
        self.m.chat_json(QUESTION, SCHEMA, temperature=0, max_tokens=64)
        return time.perf_counter() - t


def median_of(fn: Callable[[], float], rounds: int) -> float:
    values = []
    for _ in range(rounds):
        time.sleep(SETTLE_S)
        values.append(fn())
    return statistics.median(values)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--no-peer", action="store_true", help="skip llama.cpp")
    args = p.parse_args(argv)
    set_threads(args.threads)
    ours = Ours(args.model, args.prompt_tokens, args.decode_tokens)
    peer = None
    if not args.no_peer:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("llama.cpp's rows skipped: pip install llama-cpp-python", file=sys.stderr)
        else:
            from workbench.engine.formats import sources

            peer = PeerProcess(str(sources.resolve(args.model)),
                               args.prompt_tokens + args.decode_tokens + 64, args,
                               [int(t) for t in ours.long_ids], "")
    print(f"{ours.m.path.name}, {args.threads} threads, {os.cpu_count()} cores, "
          f"{args.rounds} rounds per cell")
    rows: dict[tuple[str, str], dict[int, float]] = {}
    for load in LOADS:
        with busy(load):
            for engine in ("ours, sharing", "ours, all threads", "llama.cpp"):
                if engine == "llama.cpp":
                    if peer is None:
                        continue
                    cells = {"decode tok/s": lambda: peer.measure("decode"),
                             "prefill tok/s": lambda: peer.measure("prefill")}
                else:
                    ours.share_cores(engine == "ours, sharing")
                    cells = {"decode tok/s": ours.decode, "prefill tok/s": ours.prefill,
                             "chat_json s": ours.chat_json}
                for what, fn in cells.items():
                    rows.setdefault((engine, what), {})[load] = median_of(fn, args.rounds)
    ours.share_cores(True)
    head = f"{'':<20} {'':<14}" + "".join(f"{n:>18}" for n in LOADS)
    print(head)
    for (engine, what), by_load in rows.items():
        quiet = by_load["quiet"]
        cells = []
        for n in LOADS:
            v = by_load[n]
            # the fraction of the quiet speed (for seconds: quiet time over this time)
            frac = (quiet / v) if what.endswith(" s") else (v / quiet)
            cells.append(f"{v:9.2f}       " if n == "quiet" else f"{v:9.2f} ({frac:4.0%})")
        print(f"{engine:<20} {what:<14}" + "".join(f"{c:>18}" for c in cells))
    if peer is not None:
        peer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
