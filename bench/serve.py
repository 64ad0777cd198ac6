"""Serving under concurrent load: our OpenAI-compatible server against llama_cpp.server.

    pip install 'llama-cpp-python[server]'   # builds llama.cpp from source (~10 min on 2 cores)
    python bench/serve.py [--model smollm2-135m] [--threads 2] [--concurrency 1,4,8,16]
                          [--requests N] [--max-tokens 128] [--repeats 1]
                          [--max-concurrent K] [--shared-prefix after|only|off]
                          [--full-answers]

Both servers run one at a time, each on an ephemeral 127.0.0.1 port, over the same
GGUF with the same thread count: ours in this process, llama_cpp.server in a child
process (see `LlamaCppServer`). Ours is `workbench.serve(m)` with the
server's default `max_concurrent` (`--max-concurrent` sets another); llama_cpp.server
runs one generation at a time, started with `interrupt_requests=False` (its default
ends a running stream with [DONE] as soon as another request waits).

Levels: for each client count, that many threads of a child process (see `main`), in
a closed loop, each with its own `openai.OpenAI` client, send `--requests` streaming
chat completions (default max(16, 2 x the largest client count), the same requests at
every level, so that levels compare the same prompts and answers): greedy, repeat_penalty 1.0
(llama_cpp.server defaults to 1.1), `--max-tokens` each (128: greedy SmolLM2 answers
these in ~35 tokens on average, so few are cut; a cap of 32 cuts most and leaves the
run mostly prompt reading), `stream_options={"include_usage": True}`. User messages mix
lengths (a question alone, or after ~40, ~100 or ~200 tokens of a fixed text, by
request index) and start with a tag unique to level, run and request, so none repeats
or shares more than the template with the one before. TTFT: from sending to the first
chunk with content. Completion tokens: the final usage chunk's; a server that sends
none (llama_cpp.server ignores `stream_options`) is counted by content chunks, marked
`*`. Runs alternate the servers' order across `--repeats`; per level the table shows
medians over repeats of aggregate completion tokens/s (all tokens / wall time), TTFT
p50 and p95 (nearest rank: with 16 requests p95 is the slowest), tokens per
request, and failed requests summed over repeats (expected: 0). `--full-answers` sends
`logit_bias` of -100 on the model's end tokens with every level's request, so that each
answer runs to `--max-tokens` in both servers: a decode-heavy mix. Then issue 30's
targets, PASS or FAIL: ours@8 / ours@1 tok/s >= 2.0, ours@8 / llama.cpp@8 tok/s >= 1.5,
ours p95 TTFT@8 / p50 TTFT@1 <= 3 (and, for reference, p95@8 / p95@1 and p95@1 / p50@1:
the spread of one client's TTFTs over the mix of prompt lengths).

Ceiling: our levels run under `workbench.engine.runtime.profiling`, which times each prefill
and decode pass of the engine. From level 1 and level 8 it takes the prompt tokens
read and tokens generated per request, prefill ms per token, and the median decode
pass with 1 row and with 8 rows, and prints the 8 / 1 ratio a scheduler would reach
if every pass at 8 clients were full and nothing else took time: reading prompts is
compute-bound and costs the same per token at any batch, so the mix of prompt and
answer lengths bounds the ratio whatever the scheduling.

Shared prefix (`--shared-prefix after`, the default, runs it after the levels; `only`
alone): a ~1,000-token system prompt of fixed text, 8 requests with it and different
short questions, one after another (the first pays the prefill, later ones should
not), then 8 at once under a fresh system prompt. Printed per server: each TTFT, the
first / median-of-later ratio; for ours the prompt tokens the engine prefilled
(`LLM.prefilled_tokens`: the measure in the concurrent phase, where later requests
also wait for earlier ones) and this process's RSS growth across our phases. The load
is printed before (flagged when other processes use the cores) and after the run.
Without llama-cpp-python ours is timed alone, with a hint.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import socket
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from thread_pools import pin_thread_pools

# A pause before each run: an engine's threads spin a while after a call, slowing the next.
SETTLE_S = 0.5
INSTALL_HINT = ("llama-cpp-python[server] is not installed, so only our server is timed; for "
                "the side-by-side run: pip install 'llama-cpp-python[server]' (~10 min build)")
TEXT = ("The harbour town woke early. Fishing boats slid out past the breakwater while "
        "the bakery on the corner pulled the first trays of bread from its ovens, and the "
        "smell drifted down to the quay where gulls argued over scraps. By seven the market "
        "stalls were up: crates of mackerel on ice, bunches of carrots with soil still on "
        "them, jars of honey from the hills behind the town, and a man selling rope and "
        "hooks who had sold rope and hooks from the same spot for forty years. The "
        "schoolchildren crossed the square in twos and threes, the church bell rang the "
        "hour a minute late as it always did, and the ferry from the island sounded its "
        "horn as it rounded the point, bringing the post, two tourists, and a crate of "
        "chickens that nobody admitted to having ordered.").split()
QUESTIONS = ("Name a fruit.", "What colour is the sky?", "Count to five.",
             "Give a word that rhymes with boat.", "What is two plus three?",
             "Name a large animal.", "Say hello in French.", "Name a month of the year.")
CONTEXT_WORDS = (0, 30, 75, 150)  # ~0, 40, 100 and 200 tokens before the question
RULES = ("Answer in one short sentence unless the user asks for more detail.",
         "Prefer plain words to jargon, and explain any technical term you must use.",
         "If a question is ambiguous, state the reading you chose before answering it.",
         "Never invent facts: say that you do not know when you are not sure.",
         "Quote numbers with their units, and round them to a sensible precision.",
         "Keep lists to at most five items, each on its own line.")
SYSTEM_RULES = 48  # numbered rules in the shared system prompt: about 1,000 tokens


def user_message(tag: str, i: int) -> str:
    """Request i's user message: a unique tag, 0-150 words of TEXT (by i), a question."""
    words = CONTEXT_WORDS[i % len(CONTEXT_WORDS)]
    context = " ".join(TEXT[(i + k) % len(TEXT)] for k in range(words))
    question = QUESTIONS[(i // len(CONTEXT_WORDS)) % len(QUESTIONS)]
    return f"[{tag}#{i}] " + (f"Read this: {context}\n\n" if context else "") + question


def system_prompt(tag: str) -> str:
    """The shared-prefix test's long system prompt: a tag, then SYSTEM_RULES fixed rules."""
    lines = [f"Rule {k + 1}: {RULES[k % len(RULES)]}" for k in range(SYSTEM_RULES)]
    return f"Session {tag}. You are a careful assistant. Follow these rules.\n" + \
        "\n".join(lines)


def stream_chat(client, messages: list[dict], max_tokens: int,
                bias: dict[str, float] | None = None) -> dict:
    """One streaming chat completion (`bias`: its logit_bias). Returns ok, status (0:
    transport error), ttft (s), tokens (usage's completion_tokens, else the count of
    content chunks), usage (whether the server sent usage), prompt_tokens (usage's, else
    None) and seconds."""
    import openai

    start = time.perf_counter()
    ttft, chunks, usage, prompt = None, 0, None, None
    try:
        stream = client.chat.completions.create(
            model="m", messages=messages, stream=True, stream_options={"include_usage": True},
            temperature=0, max_tokens=max_tokens, extra_body={"repeat_penalty": 1.0},
            **({"logit_bias": bias} if bias else {}))
        for chunk in stream:
            if chunk.usage is not None:
                usage, prompt = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
            for choice in chunk.choices:
                if choice.delta is not None and choice.delta.content:
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    chunks += 1
    except openai.APIStatusError as exc:
        print(f"  {exc.status_code}: {str(exc)[:200]}", file=sys.stderr)
        return {"ok": False, "status": exc.status_code}
    except openai.APIError as exc:
        print(f"  transport error: {exc!r}", file=sys.stderr)
        return {"ok": False, "status": 0}
    return {"ok": True, "status": 200, "ttft": ttft if ttft is not None else math.nan,
            "tokens": usage if usage is not None else chunks, "usage": usage is not None,
            "prompt_tokens": prompt, "seconds": time.perf_counter() - start}


def _client(base_url: str):
    import openai

    return openai.OpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=600)


@dataclass
class EngineTimes:
    """What our engine's passes took during one level (`workbench.engine.runtime.profiling`)."""

    prompt_tokens: int  # read by prefill passes (prompt beginnings reused are not read)
    generated: int  # tokens sampled
    prefill_s: float  # all prefill passes
    decode_ms: dict[int, float]  # rows of a decode pass -> its median duration

    @classmethod
    def of(cls, rec) -> EngineTimes:
        passes: dict[int, list[float]] = {}
        for s in rec.spans:
            if s.name == "decode":
                passes.setdefault(int(s.args.get("tokens", 0)), []).append(s.dur_ns / 1e6)
        prefill = rec.phases().get("prefill", (0.0, 0, 0))
        return cls(prompt_tokens=prefill[2], generated=rec.generated_tokens(),
                   prefill_s=prefill[0],
                   decode_ms={k: statistics.median(v) for k, v in sorted(passes.items())})


def print_ceiling(ones: list[EngineTimes], eights: list[EngineTimes], requests: int) -> None:
    """The 8 / 1 client token-rate ratio at full 8-row passes and no other cost: per
    repeat, from level 1's and level 8's passes; the median over repeats."""
    pairs = [(one, eight) for one, eight in zip(ones, eights)
             if 1 in one.decode_ms and 8 in eight.decode_ms and one.prompt_tokens]
    if not pairs:
        print(f"  {'ceiling of ours 8 / 1 for this mix':<44} n/a (no full 8-row passes)")
        return
    rows = []  # (ceiling, prompt tokens, generated, prefill ms/token, 1-row ms, 8-row ms)
    for one, eight in pairs:
        per_token = one.prefill_s * 1e3 / one.prompt_tokens  # prefill ms per prompt token
        prompt, answer = one.prompt_tokens / requests, one.generated / requests  # a request's
        alone = prompt * per_token + answer * one.decode_ms[1]  # ms a request, one client
        full = prompt * per_token + answer * eight.decode_ms[8] / 8  # in full 8-row passes
        rows.append((alone / full, prompt, answer, per_token, one.decode_ms[1],
                     eight.decode_ms[8]))
    ceiling, prompt, answer, per_token, one_row, eight_rows = \
        sorted(rows)[(len(rows) - 1) // 2]  # the median repeat (the lower of two)
    print(f"  {'ceiling of ours 8 / 1 for this mix':<44} {ceiling:6.2f}  (per request "
          f"{prompt:.0f} prompt tokens read at {per_token:.2f} ms, {answer:.0f} generated; "
          f"a decode pass: {one_row:.1f} ms for 1 row, {eight_rows:.1f} ms for 8)")


def run_level(base_url: str, clients: int, n: int, max_tokens: int, tag: str,
              bias: dict[str, float] | None = None) -> dict:
    """`n` requests from `clients` threads in a closed loop, each taking the next request
    index in turn (`bias`: their logit_bias); aggregate tok/s, TTFT p50/p95, tokens per
    request, failures."""
    results: list[dict] = []
    lock = threading.Lock()
    todo = iter(range(n))

    def worker() -> None:
        with _client(base_url) as client:
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                msgs = [{"role": "user", "content": user_message(tag, i)}]
                result = stream_chat(client, msgs, max_tokens, bias)
                with lock:
                    results.append(result)

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ok = [r for r in results if r["ok"]]
    ttfts = sorted(r["ttft"] for r in ok)
    tokens = sum(r["tokens"] for r in ok)
    return {"tok_s": tokens / wall, "p50": _percentile(ttfts, 50), "p95": _percentile(ttfts, 95),
            "tok_req": tokens / max(1, len(ok)), "errors": n - len(ok),
            "usage": all(r["usage"] for r in ok)}


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (nan when empty)."""
    if not sorted_values:
        return math.nan
    return sorted_values[max(0, math.ceil(q / 100 * len(sorted_values)) - 1)]


def shared_prefix(base_url: str, name: str, max_tokens: int, m=None) -> None:
    """The shared-prefix test against one server: 8 requests one after another, then 8
    at once, each phase under its own ~1,000-token system prompt; `m` (ours) adds the
    engine's prefilled-token count and this process's RSS growth."""
    rss0 = _rss_mib()
    for phase in ("sequential", "concurrent"):
        system = {"role": "system", "content": system_prompt(f"{name}-{phase}")}
        convs = [[system, {"role": "user", "content": q}] for q in QUESTIONS]
        prefilled = m.prefilled_tokens if m is not None else 0
        time.sleep(SETTLE_S)
        if phase == "sequential":
            with _client(base_url) as client:
                results = [stream_chat(client, conv, max_tokens) for conv in convs]
        else:
            results = _all_at_once(base_url, convs, max_tokens)
        ttfts = [r["ttft"] if r["ok"] else math.nan for r in results]
        order = ttfts if phase == "sequential" else sorted(ttfts)
        print(f"{name:<10} {phase:<10} TTFT s ("
              + ("in order sent" if phase == "sequential" else "fastest first") + "): "
              + " ".join(f"{t:.3f}" for t in order)
              + f"   first / median of later: {order[0] / statistics.median(order[1:]):.2f}x",
              flush=True)
        if m is not None:
            print(f"{'':<10} {phase:<10} prefilled {m.prefilled_tokens - prefilled} tokens "
                  f"for 8 prompts of {results[0].get('prompt_tokens')} tokens each", flush=True)
    if m is not None:
        print(f"{'':<10} RSS growth across our phases: {_rss_mib() - rss0:+.1f} MiB", flush=True)


def _load_line(when: str) -> str:
    """The 1-minute load average; before the run also the cores' busy share over one
    second (psutil), flagged above 50% (or a load above half the cores without psutil):
    other processes then share the cores and the numbers are not comparable."""
    load, cores, busy = os.getloadavg()[0], os.cpu_count() or 1, None
    try:
        import psutil
        busy = psutil.cpu_percent(interval=1) / 100 if when == "before" else None
    except ImportError:
        pass
    flag = when == "before" and (busy if busy is not None else load / cores) > 0.5
    return (f"{when}: load average {load:.2f} on {cores} cores"
            + (f", {busy:.0%} busy over 1 s" if busy is not None else "")
            + ("  <- other processes use the cores: numbers not comparable" if flag else ""))


def _all_at_once(base_url: str, convs: list[list[dict]], max_tokens: int) -> list[dict]:
    """One request per conversation, each from its own thread, released together."""
    results: list = [None] * len(convs)
    barrier = threading.Barrier(len(convs))

    def one(k: int) -> None:
        with _client(base_url) as client:
            barrier.wait()
            results[k] = stream_chat(client, convs[k], max_tokens)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(convs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _rss_mib() -> float:
    """This process's resident memory in MiB (psutil, else /proc/self/statm)."""
    try:
        import psutil
        return psutil.Process().memory_info().rss / 2**20
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class LlamaCppServer:
    """llama_cpp.server in a child process on 127.0.0.1 (a free port), with the `Server`
    interface used here: `.base_url`, `.stop()`, `.is_running`.

    A child, not a thread of this process, so that the two servers share the cores but
    not an interpreter (its GIL) or libgomp: in this process llama.cpp's OpenMP threads
    formed a second team once it had answered, and before `import workbench` set
    libgomp's spin (`workbench/__init__.py`) that halved our decode passes' speed
    (6.6 -> 12.9 ms a one-row pass)."""

    def __init__(self, path: str, threads: int, n_ctx: int):
        import importlib.util
        import subprocess

        from workbench.bench import has_amx

        if importlib.util.find_spec("llama_cpp.server") is None:
            raise ImportError("llama_cpp.server")
        with socket.create_server(("127.0.0.1", 0)) as probe:
            port = probe.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        launcher = [sys.executable, str(Path(__file__).with_name("llama_cpp_server.py"))]
        if has_amx():
            launcher.append("--no-extra-buffers")
        self._process = subprocess.Popen(
            [*launcher, "--model", path, "--model_alias", "m",
             "--n_ctx", str(n_ctx), "--n_threads", str(threads),
             "--n_threads_batch", str(threads), "--interrupt_requests", "False",
             "--verbose", "False", "--host", "127.0.0.1", "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("llama_cpp.server did not start") from None
                time.sleep(0.1)

    @property
    def is_running(self) -> bool:
        return self._process.poll() is None

    def stop(self) -> None:
        self._process.terminate()
        try:
            self._process.wait(10)
        except Exception:  # noqa: BLE001 - a server that will not stop is killed
            self._process.kill()


def print_level(runs: dict, names: list[str], level: int) -> None:
    """One table block: per server, the medians over repeats at `level` clients."""
    print(f"\n{'server':<10} {'clients':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p95':>9} "
          f"{'tok/req':>8} {'errors':>6}")
    for name in names:
        rs = runs[name, level]
        med = {k: statistics.median(r[k] for r in rs)
               for k in ("tok_s", "p50", "p95", "tok_req")}
        mark = "" if all(r["usage"] for r in rs) else "*"
        print(f"{name:<10} {level:>7} {med['tok_s']:>8.1f} {med['p50']:>8.3f}s "
              f"{med['p95']:>8.3f}s {med['tok_req']:>7.1f}{mark:1} "
              f"{sum(r['errors'] for r in rs):>6}", flush=True)


def print_summary(runs: dict) -> None:
    """Issue 30's three target ratios, PASS or FAIL (n/a when a level was not run), and
    TTFT ratios for reference."""
    def med(name: str, level: int, key: str) -> float | None:
        rs = runs.get((name, level))
        return statistics.median(r[key] for r in rs) if rs else None

    def line(text: str, a: float | None, b: float | None, target: float, at_least: bool) -> None:
        if a is None or b is None or not b:
            print(f"  {text:<44} n/a")
            return
        ok = a / b >= target if at_least else a / b <= target
        print(f"  {text:<44} {a / b:6.2f}  (target {'>=' if at_least else '<='} {target})  "
              f"{'PASS' if ok else 'FAIL'}")

    print("\nsummary (issue 30 targets)")
    ours = "workbench"
    line("ours tok/s: 8 clients / 1 client", med(ours, 8, "tok_s"), med(ours, 1, "tok_s"),
         2.0, True)
    line("tok/s at 8 clients: ours / llama.cpp", med(ours, 8, "tok_s"),
         med("llama.cpp", 8, "tok_s"), 1.5, True)
    line("ours TTFT: p95 at 8 clients / p50 at 1", med(ours, 8, "p95"), med(ours, 1, "p50"),
         3.0, False)
    for text, a, b in (("ours TTFT: p95 at 8 clients / p95 at 1", (8, "p95"), (1, "p95")),
                       ("ours TTFT at 1 client: p95 / p50", (1, "p95"), (1, "p50"))):
        a, b = med(ours, *a), med(ours, *b)
        if a is not None and b:
            print(f"  {text:<44} {a / b:6.2f}  (for reference)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="alias or .gguf path")
    p.add_argument("--threads", type=int, default=2, help="threads of both engines")
    p.add_argument("--concurrency", default="1,4,8,16", help="client threads per level")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per level and run (default max(8, 2 x clients))")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request")
    p.add_argument("--repeats", type=int, default=1, help="runs per level (medians)")
    p.add_argument("--max-concurrent", type=int, default=None,
                   help="our server's max_concurrent (default: the server's default)")
    p.add_argument("--shared-prefix", choices=("after", "only", "off"), default="after",
                   help="the shared-prefix test: after the levels, alone, or not at all")
    p.add_argument("--n-ctx", type=int, default=2048, help="llama.cpp's context size")
    p.add_argument("--full-answers", action="store_true",
                   help="every level's answer runs to --max-tokens (end tokens biased -100)")
    args = p.parse_args(argv)
    pin_thread_pools(args.threads)  # before NumPy and Numba load

    import workbench
    from workbench import LLM
    from workbench.engine.runtime import profiling

    levels = [] if args.shared_prefix == "only" else \
        list(dict.fromkeys(int(c) for c in args.concurrency.split(",")))
    m = LLM.load(args.model)
    extra = {} if args.max_concurrent is None else {"max_concurrent": args.max_concurrent}
    servers = {"workbench": workbench.serve(m, model_id="m", port=0,
                                            max_queue=max(levels + [8]) + 1, **extra)}
    try:
        servers["llama.cpp"] = LlamaCppServer(str(m.path), args.threads, args.n_ctx)
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
    n_requests = args.requests or max([16] + [2 * c for c in levels])
    bias = {str(t): -100.0 for t in m.tokenizer.eot_ids} if args.full_answers else None
    print(f"workbench from {os.path.dirname(os.path.dirname(workbench.__file__))}: "
          f"{os.path.basename(m.path)}, {args.threads} threads, max_tokens {args.max_tokens}, "
          f"median of {args.repeats} run(s); {n_requests} requests per level"
          + ("; full answers (end tokens biased -100)" if bias else "")
          + f"; ours max_concurrent {args.max_concurrent or 'default'}\n" + _load_line("before"))
    runs: dict[tuple[str, int], list[dict]] = {}
    # the clients run in a child process of their own: as threads of this one they took
    # the GIL from our server (8-row decode passes 21-25 ms with the clients outside,
    # ~30 ms inside), which llama_cpp.server, in its own process, would not pay
    clients = multiprocessing.get_context("spawn").Pool(1)
    engine_times: dict[int, list[EngineTimes]] = {}  # ours, per level, one per repeat
    try:
        for name, server in servers.items():  # warm-up
            with _client(server.base_url) as client:
                r = stream_chat(client, [{"role": "user", "content": "Hi."}], args.max_tokens)
            if not r["ok"]:
                print(f"{name}: the warm-up request failed ({r['status']})", file=sys.stderr)
        for level in levels:
            for rep in range(args.repeats):
                order = list(servers) if rep % 2 == 0 else list(reversed(servers))
                for name in order:
                    time.sleep(SETTLE_S)
                    with profiling.recording() as rec:
                        run = clients.apply(run_level, (servers[name].base_url, level,
                                                        n_requests, args.max_tokens,
                                                        f"c{level}r{rep}", bias))
                    if name == "workbench":
                        engine_times.setdefault(level, []).append(EngineTimes.of(rec))
                    runs.setdefault((name, level), []).append(run)
                    print(f"{name}, {level} clients: {run['tok_s']:.1f} tok/s", file=sys.stderr)
            print_level(runs, list(servers), level)
        if levels:
            if any(not r["usage"] for rs in runs.values() for r in rs):
                print("* no usage chunk from this server: tokens are its content chunks")
            print_summary(runs)
            print_ceiling(engine_times.get(1, []), engine_times.get(8, []), n_requests)
        if args.shared_prefix != "off":
            print(f"\nshared prefix: 8 requests with one ~1,000-token system prompt, "
                  f"max_tokens {min(args.max_tokens, 16)}")
            for name, server in servers.items():
                shared_prefix(server.base_url, name, min(args.max_tokens, 16),
                              m if name == "workbench" else None)
    finally:
        clients.terminate()
        print(_load_line("after"))
        for name, server in servers.items():
            server.stop()
            if server.is_running:
                print(f"{name}: the server thread did not stop", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
