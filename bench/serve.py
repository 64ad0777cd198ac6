"""Serving throughput: our OpenAI-compatible server against llama-cpp-python's, side by side.

    pip install 'llama-cpp-python[server]'   # builds llama.cpp from source (~10 min on 2 cores)
    python bench/serve.py [--model smollm2-135m] [--threads 2] [--requests 16] [--max-tokens 32]

Both servers run in this process on loopback ports, on the same GGUF with the
same thread count, one generation at a time (ours: `max_concurrent=1` with a
queue; llama-cpp-python serializes requests itself). For each concurrency
level (1, 4, 16 client threads) each server answers `--requests` short,
distinct, greedy chat completions (`repeat_penalty` 1.0, since llama.cpp's
server defaults to 1.1); the table gives requests/s, p50 and p99 latency and
generated tokens/s (medians over `--rounds`), and the ratio ours / llama.cpp
of requests/s. Any answer other than 200 is counted and printed.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="alias or .gguf path")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--concurrency", default="1,4,16", help="client threads per level")
    p.add_argument("--requests", type=int, default=16, help="requests per level")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args(argv)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                "NUMBA_NUM_THREADS"):
        os.environ[var] = str(args.threads)  # before NumPy and Numba load

    import httpx

    import workbench
    from workbench import LLM

    levels = [int(c) for c in args.concurrency.split(",")]
    m = LLM.load(args.model)
    servers = {"workbench": workbench.serve(m, model_id="m", port=0, max_concurrent=1,
                                            max_queue=max(levels) + 1)}
    try:
        servers["llama.cpp"] = _llama_cpp_server(m.path, args.threads)
    except ImportError:
        print("llama-cpp-python[server] is not installed (pip install "
              "'llama-cpp-python[server]'): timing ours alone", file=sys.stderr)
    try:
        rows = {}
        for name, server in servers.items():
            _one(httpx, server.url, 0, args.max_tokens)  # warm-up
            for level in levels:
                runs = [_level(httpx, server.url, level, args.requests, args.max_tokens)
                        for _ in range(args.rounds)]
                rows[name, level] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    finally:
        for server in servers.values():
            server.stop()
    _print(rows, servers, levels)
    return 0


def _one(httpx, url: str, i: int, max_tokens: int) -> tuple[int, float, int]:
    """One chat completion: (status, seconds, generated tokens)."""
    body = {"model": "m", "temperature": 0, "max_tokens": max_tokens, "repeat_penalty": 1.0,
            "messages": [{"role": "user", "content": f"Name a fruit. (#{i})"}]}
    start = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    seconds = time.perf_counter() - start
    tokens = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0
    return r.status_code, seconds, tokens


def _level(httpx, url: str, clients: int, n: int, max_tokens: int) -> dict[str, float]:
    results: list[tuple[int, float, int]] = []
    lock = threading.Lock()
    todo = iter(range(n))

    def client() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            result = _one(httpx, url, i, max_tokens)
            with lock:
                results.append(result)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    latencies = sorted(s for _, s, _ in results)
    return {"rps": n / wall, "p50": latencies[len(latencies) // 2],
            "p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "tok_s": sum(t for _, _, t in results) / wall,
            "errors": sum(status != 200 for status, _, _ in results)}


class _Uvicorn:
    """llama_cpp.server's app on a loopback port, on a thread (the `Server` interface)."""

    def __init__(self, app):
        import uvicorn

        self._socket = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._socket]}, daemon=True)
        self._thread.start()
        while not self._server.started:
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._socket.close()


def _llama_cpp_server(path, threads: int) -> _Uvicorn:
    from llama_cpp.server.app import create_app
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    model = ModelSettings(model=str(path), model_alias="m", n_ctx=4096, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    return _Uvicorn(create_app(server_settings=ServerSettings(), model_settings=[model]))


def _print(rows: dict, servers: dict, levels: list[int]) -> None:
    print(f"{'server':<10} {'clients':>7} {'req/s':>7} {'p50 s':>7} {'p99 s':>7} "
          f"{'tok/s':>7} {'errors':>6}")
    for (name, level), r in rows.items():
        print(f"{name:<10} {level:>7} {r['rps']:>7.2f} {r['p50']:>7.2f} {r['p99']:>7.2f} "
              f"{r['tok_s']:>7.1f} {int(r['errors']):>6}")
    if "llama.cpp" in servers:
        ratios = [f"{n}: {rows['workbench', n]['rps'] / rows['llama.cpp', n]['rps']:.2f}"
                  for n in levels]
        print("requests/s, ours / llama.cpp, by clients: " + ", ".join(ratios))


if __name__ == "__main__":
    sys.exit(main())
