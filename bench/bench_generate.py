"""Decode and prefill speed: workbench against llama.cpp (llama-cpp-python), side by side.

Same GGUF file, same thread count, greedy decoding, in one process. Each round
times both engines back to back; the medians and their ratio are printed.

    pip install llama-cpp-python   # builds llama.cpp from source (~10 min on 2 cores)
    python bench/bench_generate.py [--model smollm2-135m] [--threads 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=500)
    args = ap.parse_args()
    # before NumPy / Numba / llama.cpp start their thread pools
    os.environ.setdefault("NUMBA_NUM_THREADS", str(args.threads))
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    from llama_cpp import Llama

    from workbench import LLM

    ours = LLM.load(args.model, kv_cache_size=2048)
    peer = Llama(str(ours.path), n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads,
                 verbose=False)
    prompt = "The capital of France is"
    long_ids = (ours.tokenize("The quick brown fox jumps over the lazy dog. ") * 100)
    long_ids = long_ids[: args.prompt_tokens]
    n = args.decode_tokens

    def ours_decode() -> float:
        ours._cache.reset()  # no prefix reuse between rounds
        c = ours.generate(prompt, max_tokens=n, temperature=0, stop_tokens=[])
        it = iter(c)
        next(it)  # first token: prefill done
        t = time.perf_counter()
        k = sum(1 for _ in it)
        return k / (time.perf_counter() - t)

    def peer_decode() -> float:
        peer.reset()
        toks = peer.tokenize(prompt.encode(), add_bos=False)
        peer.eval(toks)
        t = time.perf_counter()
        for _ in range(n - 1):
            tok = int(peer.scores[peer.n_tokens - 1].argmax())
            peer.eval([tok])
        return (n - 1) / (time.perf_counter() - t)

    def ours_prefill() -> float:
        cache = ours.new_cache(len(long_ids) + 1)
        t = time.perf_counter()
        ours._prefill(long_ids, cache)
        return len(long_ids) / (time.perf_counter() - t)

    def peer_prefill() -> float:
        peer.reset()
        t = time.perf_counter()
        peer.eval(long_ids)
        return len(long_ids) / (time.perf_counter() - t)

    for fn in (ours_decode, peer_decode, ours_prefill, peer_prefill):  # warm up (JIT, caches)
        fn()
    rows = {"decode tok/s": (ours_decode, peer_decode),
            f"prefill tok/s ({len(long_ids)} tokens)": (ours_prefill, peer_prefill)}
    print(f"{ours.path.name}, {args.threads} threads, {args.rounds} rounds, medians")
    for name, (a, b) in rows.items():
        ra, rb = [], []
        for _ in range(args.rounds):
            ra.append(a())
            rb.append(b())
        ma, mb = statistics.median(ra), statistics.median(rb)
        print(f"{name:<28} workbench {ma:8.1f}   llama.cpp {mb:8.1f}   ratio {ma / mb:5.2f}")


if __name__ == "__main__":
    main()
