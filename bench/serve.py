"""Serving throughput: our OpenAI-compatible server against llama-cpp-python's, side by side.

    pip install 'llama-cpp-python[server]'   # builds llama.cpp from source (~10 min on 2 cores)
    python bench/serve.py [--model smollm2-135m] [--threads 2] [--concurrency 1,4,16]
                          [--requests 16] [--max-tokens 32] [--repeats 1]

Both servers run in this process, each on an ephemeral 127.0.0.1 port, over the
same GGUF with the same thread count and one generation at a time (ours:
`workbench.serve(max_concurrent=1)` with a queue longer than the most clients;
llama_cpp.server serializes requests itself). After one warm-up request each,
every concurrency level sends `--requests` non-streaming chat completions from
that many client threads (one keep-alive connection each): a short user message
that differs per request ("Name a fruit. (#i)"), greedy (temperature 0,
repeat_penalty 1.0 since llama_cpp.server defaults to 1.1), `--max-tokens` each.
Runs alternate between the two servers and are repeated `--repeats` times.

Printed, one block of rows as each level finishes: per server, the medians over
repeats of requests/s, p50 and p99 request latency (p99 of a few requests is
close to the slowest), generated tokens/s (completion tokens over wall time) and
tokens per request (greedy answers can differ between the engines, and so can
their lengths), the non-200 answers summed over all repeats (expected: 0), and
ours / llama.cpp for requests/s; then how many requests got the same text from
both servers. Without llama-cpp-python it prints why and times ours alone.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time

from thread_pools import pin_thread_pools

# A pause before each run: an engine's worker threads keep spinning for a while after
# a call, which would slow the other server's next run.
SETTLE_S = 0.5
HEADER = (f"{'server':<10} {'clients':>7} {'req/s':>7} {'p50 s':>7} {'p99 s':>7} "
          f"{'tok/s':>7} {'tok/req':>7} {'non-200':>7} {'ratio':>6}")
INSTALL_HINT = ("llama-cpp-python[server] is not installed, so only our server is timed; "
                "for the side-by-side run:\n"
                "    pip install 'llama-cpp-python[server]'\n"
                "(it builds llama.cpp from source: about 10 minutes on 2 cores)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="alias or .gguf path")
    p.add_argument("--threads", type=int, default=2, help="threads of both engines")
    p.add_argument("--concurrency", default="1,4,16", help="client threads per level")
    p.add_argument("--requests", type=int, default=16, help="requests per level and run")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each request")
    p.add_argument("--repeats", type=int, default=1, help="runs per level (medians)")
    p.add_argument("--n-ctx", type=int, default=2048, help="llama.cpp's context size")
    args = p.parse_args(argv)
    pin_thread_pools(args.threads)  # before NumPy and Numba load

    import workbench
    from workbench import LLM

    levels = list(dict.fromkeys(int(c) for c in args.concurrency.split(",")))
    m = LLM.load(args.model)
    servers = {"workbench": workbench.serve(m, model_id="m", port=0, max_concurrent=1,
                                            max_queue=max(levels) + 1)}
    try:
        servers["llama.cpp"] = LlamaCppServer(str(m.path), args.threads, args.n_ctx)
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
    print(f"{os.path.basename(m.path)}, {args.threads} threads, {args.requests} requests "
          f"per level, max_tokens {args.max_tokens}, median of {args.repeats} run(s)")
    runs: dict[tuple[str, int], list[dict]] = {}
    texts: dict[str, dict[int, str]] = {name: {} for name in servers}
    try:
        for name, server in servers.items():
            status, _, _, _ = _request(server.base_url, None, 0, args.max_tokens)  # warm-up
            if status != 200:
                print(f"{name}: the warm-up request got {status}", file=sys.stderr)
        print(HEADER, flush=True)
        for level in levels:
            for r in range(args.repeats):
                order = list(servers) if r % 2 == 0 else list(reversed(servers))
                for name in order:
                    time.sleep(SETTLE_S)
                    run = _run(servers[name].base_url, level, args.requests, args.max_tokens)
                    runs.setdefault((name, level), []).append(run)
                    texts[name].update(run.pop("texts"))
                    print(f"{name}, {level} clients, run {r + 1}: {run['rps']:.2f} req/s",
                          file=sys.stderr, flush=True)
            _print_level(runs, list(servers), level)
    finally:
        for name, server in servers.items():
            server.stop()
            if server.is_running:
                print(f"{name}: the server thread did not stop", file=sys.stderr)
    if "llama.cpp" in servers:
        print("ratio = workbench / llama.cpp requests/s (higher is better)")
    if len(texts) == 2:
        a, b = texts.values()
        same = sum(a[i] == b.get(i) for i in a)
        print(f"same text from both servers: {same} of {len(a)} requests")
    return 0


def _request(base_url: str, client, i: int, max_tokens: int) -> tuple[int, float, int, str]:
    """One chat completion: (HTTP status or 0 on a transport error, seconds, completion
    tokens, text)."""
    import httpx

    body = {"model": "m", "temperature": 0, "repeat_penalty": 1.0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": f"Name a fruit. (#{i})"}]}
    start = time.perf_counter()
    try:
        if client is None:
            r = httpx.post(f"{base_url}/chat/completions", json=body, timeout=600)
        else:
            r = client.post(f"{base_url}/chat/completions", json=body)
    except httpx.HTTPError as exc:
        print(f"request {i}: {exc!r}", file=sys.stderr)
        return 0, time.perf_counter() - start, 0, ""
    seconds = time.perf_counter() - start
    if r.status_code != 200:
        print(f"request {i}: {r.status_code} {r.text[:200]}", file=sys.stderr)
        return r.status_code, seconds, 0, ""
    data = r.json()
    return 200, seconds, data["usage"]["completion_tokens"], \
        data["choices"][0]["message"]["content"]


def _run(base_url: str, clients: int, n: int, max_tokens: int) -> dict:
    """`n` requests from `clients` threads, each taking the next request index in turn."""
    import httpx

    results: list[tuple[int, tuple[int, float, int, str]]] = []
    lock = threading.Lock()
    todo = iter(range(n))

    def client() -> None:
        with httpx.Client(timeout=600) as http:
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                result = _request(base_url, http, i, max_tokens)
                with lock:
                    results.append((i, result))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ok = sorted(seconds for _, (status, seconds, _, _) in results if status == 200)
    return {"rps": n / wall,
            "p50": statistics.median(ok) if ok else float("nan"),
            "p99": ok[min(len(ok) - 1, round(0.99 * (len(ok) - 1)))] if ok else float("nan"),
            "tok_s": sum(r[2] for _, r in results) / wall,
            "tok_req": sum(r[2] for _, r in results) / max(1, len(ok)),
            "errors": n - len(ok),
            "texts": {i: r[3] for i, r in results if r[0] == 200}}


class LlamaCppServer:
    """llama_cpp.server's app served by uvicorn on a daemon thread on 127.0.0.1 (a free
    port), with the `Server` interface used here: `.base_url`, `.stop()`, `.is_running`."""

    def __init__(self, path: str, threads: int, n_ctx: int):
        import uvicorn
        from llama_cpp.server.app import create_app
        from llama_cpp.server.settings import ModelSettings, ServerSettings

        model = ModelSettings(model=path, model_alias="m", n_ctx=n_ctx, n_threads=threads,
                              n_threads_batch=threads, verbose=False)
        app = create_app(server_settings=ServerSettings(), model_settings=[model])
        self._socket = socket.create_server(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self._socket.getsockname()[1]}/v1"
        config = uvicorn.Config(app, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=3)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="llama-cpp-serve",
                                        kwargs={"sockets": [self._socket]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("llama_cpp.server did not start")
            time.sleep(0.01)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._socket.close()


def _print_level(runs: dict[tuple[str, int], list[dict]], names: list[str], level: int) -> None:
    def med(name: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[name, level])

    for name in names:
        ratio = ""
        if name == "workbench" and "llama.cpp" in names:
            ratio = f"{med(name, 'rps') / med('llama.cpp', 'rps'):6.2f}"
        errors = sum(run["errors"] for run in runs[name, level])
        print(f"{name:<10} {level:>7} {med(name, 'rps'):>7.2f} {med(name, 'p50'):>7.2f} "
              f"{med(name, 'p99'):>7.2f} {med(name, 'tok_s'):>7.1f} {med(name, 'tok_req'):>7.1f} "
              f"{errors:>7} {ratio:>6}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
