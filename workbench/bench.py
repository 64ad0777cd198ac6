"""`workbench bench`: our engine against llama.cpp on the same GGUF, side by side.

Runs `LLM` and llama-cpp-python (the Python binding of llama.cpp) on the same
model file with the same number of threads, llama.cpp in a child process of its own
(two thread pools in one process can slow each other down), warms both up, then
alternates them round by round and prints the medians and their ratio:

- prefill tokens/s for a `--prompt-tokens` (512) token prompt;
- decode tokens/s over `--decode-tokens` (128) greedy tokens, after a short prompt
  and after the `--prompt-tokens` one (where attention reads the cache of that many
  positions for every token; llama.cpp keeps its cache in fp16, we keep fp32);
- sampled decode tokens/s: the same after a short prompt at temperature 1 with every
  filter off (what the server does for a request that leaves them out), each engine's
  own sampler (llama.cpp's chain of temperature and dist);
- time to first token of a short chat prompt (nothing cached);
- peak resident memory while generating (each engine alone in a child process);
- aggregate decode tokens/s with N = 1, 4, 8, 16 sequences decoded together
  (`LLM.generate_batch`; llama.cpp's batch API with one sequence id each).

Every figure comes with its limit: the host's read bandwidth, measured first (NumPy
summing a buffer far larger than the caches, on the benchmark's threads), and for each
decode row the share of it each engine used: the bytes a token reads (every weight
but the token embedding's unread rows, and the keys and values of the context: fp32
ours, fp16 llama.cpp's) times its tokens/s.

llama-cpp-python is not a dependency of workbench; install it with

    pip install llama-cpp-python    # builds llama.cpp from source: ~10 minutes on 2 cores

Thread counts are fixed through NUMBA_NUM_THREADS / OMP_NUM_THREADS before
NumPy and Numba start, so `--threads` must be decided at launch (the command
line does that).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

PARALLEL = (1, 4, 8, 16)
# Plain-text openings that a small model continues for a long while.
PROMPTS = [
    "The history of the printing press begins",
    "def quicksort(items):",
    "Once upon a time, in a village by the sea,",
    "The three laws of thermodynamics are",
    "Photosynthesis is the process by which",
    "Dear hiring manager, I am writing to apply",
    "The recipe calls for flour, sugar and",
    "In 1969 the first humans landed on",
]
# Pause before each measurement: an engine's worker threads keep spinning for a
# while after a call, which would slow the other engine's next run.
SETTLE_S = 0.5
CHAT = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
INSTALL_HINT = ("llama-cpp-python is needed for the side-by-side benchmark:\n"
                "    pip install llama-cpp-python\n"
                "(it builds llama.cpp from source: about 10 minutes on 2 cores)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="workbench bench", description=__doc__.split("\n\n")[1],
                                epilog=INSTALL_HINT,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="alias, .gguf path or hf:// URL (default: the default model)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--device", default="auto",
                   help="our engine's device: auto, cpu, cuda, metal or mlx (llama.cpp runs "
                        "on whatever its build uses)")
    p.add_argument("--rounds", type=int, default=3, help="runs per measurement (median)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--parallel", type=int, nargs="*", default=list(PARALLEL),
                   metavar="N", help="sequence counts for aggregate decode (default 1 4 8 16)")
    p.add_argument("--no-rss", action="store_true", help="skip the peak-memory child processes")
    p.add_argument("--rss-child", choices=["workbench", "llama.cpp"], help=argparse.SUPPRESS)
    return p


def set_threads(n: int) -> None:
    """Fix the thread pools of Numba and BLAS, where they have not started: in a process
    that has imported Numba already (`main` called from a notebook) its variable stays as
    it is, since Numba refuses to compile anything once it differs from the running
    pool's size."""
    for var in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        if var == "NUMBA_NUM_THREADS" and "numba" in sys.modules:
            continue
        os.environ[var] = str(n)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    set_threads(args.threads)
    from workbench import registry

    if not args.rss_child:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print(INSTALL_HINT, file=sys.stderr)
            return 1
    path = str(registry.resolve(args.model or registry.DEFAULT_MODEL))
    if args.rss_child:
        print(json.dumps(_rss_child(args.rss_child, path, args)))
        return 0
    bench = Bench(path, args)
    try:
        bench.run()
    finally:
        bench.peer.close()
    return 0


def read_bandwidth(threads: int, size_mb: int = 512, rounds: int = 5) -> float:
    """The host's memory read bandwidth in GB/s: the best of `rounds` sums of a
    `size_mb` buffer split over `threads` threads (NumPy releases the GIL while it
    sums)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    buf = np.ones(size_mb * 2**20 // 8, dtype=np.float64)
    parts = np.array_split(buf, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(rounds):
            t = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - t)
    return buf.nbytes / best / 1e9


def bytes_per_token(m, context: int, kv_bytes_per_value: int = 4) -> int:
    """The bytes one decoded token reads from memory at `context` positions: every weight
    tensor (of the token embedding one row, unless it is also the output head) and the
    context's keys and values (`kv_bytes_per_value` each: 4 for our fp32 cache, 2 for
    llama.cpp's fp16)."""
    tensors = m._gguf.tensors
    total = 0
    for name, t in tensors.items():
        if name == "token_embd.weight" and "output.weight" in tensors:
            total += t.data.nbytes // t.shape[0]  # one row looked up
        else:
            total += t.data.nbytes
    cfg = m.config
    return total + context * 2 * cfg.n_layer * cfg.n_head_kv * cfg.head_dim * kv_bytes_per_value


def decode_rate(completion) -> float:
    """Tokens/s of a running `Completion` from its first token to its last: the prompt,
    read before the first token, is left out."""
    events = completion.iter_events()
    next(events)  # the prompt is prefilled and the first token chosen
    t = time.perf_counter()
    k = sum(1 for ev in events if ev.id is not None)
    return k / (time.perf_counter() - t)


class Bench:
    def __init__(self, path: str, args: argparse.Namespace):
        from workbench import LLM

        self.args = args
        self.path = path
        n_ctx = max(args.prompt_tokens + args.decode_tokens + 64, 1024)
        self.ours = LLM.load(path, device=args.device, kv_cache_size=n_ctx)
        filler = self.ours.tokenize("The quick brown fox jumps over the lazy dog. " * 200)
        self.long_ids = filler[: args.prompt_tokens]
        # no end-of-turn tokens: every run generates exactly the tokens asked for
        self.no_eos = {int(t): float("-inf") for t in self.ours.tokenizer.eot_ids}
        self.chat_text = self.ours.apply_chat_template(CHAT)
        self.peer = PeerProcess(path, n_ctx, args, [int(t) for t in self.long_ids],
                                self.chat_text)

    # -- single sequence ----------------------------------------------------------------------
    def ours_prefill(self) -> float:
        self.ours.reset()
        t = time.perf_counter()
        next(iter(self.ours.generate(self.long_ids, max_tokens=1, temperature=0).iter_events()))
        return len(self.long_ids) / (time.perf_counter() - t)

    def ours_decode(self, after_long: bool = False, sampled: bool = False) -> float:
        """Decode speed after a short prompt, or after the `--prompt-tokens` one (where
        attention reads that much more cache per token); greedy, or `sampled` at
        temperature 1 with every filter off."""
        self.ours.reset()
        n = self.args.decode_tokens
        prompt = self.long_ids if after_long else PROMPTS[0]
        return decode_rate(self.ours.generate(prompt, max_tokens=n,
                                              temperature=1.0 if sampled else 0, seed=0,
                                              logit_bias=self.no_eos))

    def ours_ttft(self) -> float:
        self.ours.reset()
        t = time.perf_counter()
        next(iter(self.ours.generate(self.chat_text, max_tokens=8, temperature=0)))
        return (time.perf_counter() - t) * 1e3

    # -- N sequences --------------------------------------------------------------------------
    def ours_parallel(self, n: int) -> float:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
        t = time.perf_counter()
        outs = self.ours.generate_batch(prompts, max_tokens=self.args.decode_tokens,
                                        temperature=0, logit_bias=self.no_eos)
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)

    # -- report -------------------------------------------------------------------------------
    def run(self) -> None:
        a = self.args
        rows: list[tuple[str, Callable[[], float], Callable[[], float], str]] = [
            (f"prefill tok/s ({len(self.long_ids)} tokens)", self.ours_prefill,
             lambda: self.peer.measure("prefill"), "higher"),
            (f"decode tok/s ({a.decode_tokens} tokens)", self.ours_decode,
             lambda: self.peer.measure("decode"), "higher"),
            (f"  the same after {len(self.long_ids)} tokens", lambda: self.ours_decode(True),
             lambda: self.peer.measure("decode", True), "higher"),
            ("sampled decode tok/s (temperature 1)", lambda: self.ours_decode(sampled=True),
             lambda: self.peer.measure("decode", False, True), "higher"),
            ("time to first token ms (chat)", self.ours_ttft,
             lambda: self.peer.measure("ttft"), "lower"),
        ]
        rows += [(f"{n} sequences: aggregate tok/s", lambda n=n: self.ours_parallel(n),
                  lambda n=n: self.peer.measure("parallel", n), "higher") for n in a.parallel]
        # the positions a decoded token reads, on average, for the two decode rows
        contexts = {rows[1][0]: 8 + a.decode_tokens // 2,
                    rows[2][0]: len(self.long_ids) + a.decode_tokens // 2}
        size_mb = os.path.getsize(self.path) / 1e6
        bandwidth = read_bandwidth(a.threads)
        print(f"{os.path.basename(self.path)} ({size_mb:.0f} MB), {a.threads} threads, "
              f"workbench on {self.ours.device.peek()}, "
              f"median of {a.rounds} runs after a warm-up")
        print(f"host read bandwidth {bandwidth:.1f} GB/s (NumPy, {a.threads} threads)")
        print(f"{'':36}{'workbench':>11}{'llama.cpp':>11}{'ratio':>8}")
        for name, ours, peer, better in rows:
            ra, rb = [], []
            for i in range(a.rounds + 1):  # round 0 warms up (JIT caches, page cache, pools)
                for fn, results in ((ours, ra), (peer, rb)):
                    time.sleep(SETTLE_S)
                    value = fn()
                    if i:
                        results.append(value)
            ma, mb = statistics.median(ra), statistics.median(rb)
            used = ""
            if name in contexts and self.ours.device.peek() == "cpu":
                ours_gb = ma * bytes_per_token(self.ours, contexts[name]) / 1e9
                peer_gb = mb * bytes_per_token(self.ours, contexts[name], 2) / 1e9
                used = (f"; bandwidth used {ours_gb / bandwidth:.0%} and "
                        f"{peer_gb / bandwidth:.0%}")
            print(f"{name:<36}{ma:11.1f}{mb:11.1f}{ma / mb:8.2f}   ({better} is better"
                  f"{used})", flush=True)
        if not a.no_rss:
            ours_mb = self._child_rss("workbench")
            peer_mb = self._child_rss("llama.cpp")
            print(f"{'peak RSS MB (generating)':<36}{ours_mb:11.1f}{peer_mb:11.1f}"
                  f"{ours_mb / peer_mb:8.2f}   (lower is better; target <= 1.5 x file + 300"
                  f" = {1.5 * size_mb + 300:.0f})")
        print("ratio = workbench / llama.cpp")

    def _child_rss(self, engine: str) -> float:
        a = self.args
        cmd = [sys.executable, "-m", "workbench.bench", "--rss-child", engine, "--model",
               self.path, "--threads", str(a.threads), "--device", a.device,
               "--prompt-tokens", str(a.prompt_tokens),
               "--decode-tokens", str(a.decode_tokens)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])["peak_rss_mb"]


class LlamaCppSide:
    """llama.cpp's side of each row, run in `PeerProcess`'s child: the same measurements
    as `Bench`'s own, through llama-cpp-python."""

    def __init__(self, path: str, n_ctx: int, threads: int, decode_tokens: int,
                 long_ids: list[int], chat_text: str):
        self.peer = load_llama_cpp(path, n_ctx=n_ctx, n_batch=512, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)
        self.threads, self.decode_tokens = threads, decode_tokens
        self.long_ids, self.chat_text = long_ids, chat_text

    def prefill(self) -> float:
        self.peer.reset()
        t = time.perf_counter()
        self.peer.eval(self.long_ids)
        _peer_greedy(self.peer)
        return len(self.long_ids) / (time.perf_counter() - t)

    def decode(self, after_long: bool = False, sampled: bool = False) -> float:
        """`Bench.ours_decode` on llama.cpp: the argmax of each token's logits, or with
        `sampled` a draw of llama.cpp's own sampler chain at temperature 1 with no filter
        (temp, then dist)."""
        import llama_cpp

        peer = self.peer
        peer.reset()
        peer.eval(self.long_ids if after_long
                  else peer.tokenize(PROMPTS[0].encode(), add_bos=False))
        chain = None
        if sampled:
            chain = llama_cpp.llama_sampler_chain_init(
                llama_cpp.llama_sampler_chain_default_params())
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(1.0))
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_dist(0))
        try:
            n = self.decode_tokens
            t = time.perf_counter()
            for _ in range(n - 1):
                peer.eval([_peer_greedy(peer) if chain is None
                           else llama_cpp.llama_sampler_sample(chain, peer.ctx, -1)])
            return (n - 1) / (time.perf_counter() - t)
        finally:
            if chain is not None:
                llama_cpp.llama_sampler_free(chain)

    def ttft(self) -> float:
        self.peer.reset()
        t = time.perf_counter()
        stream = self.peer.create_completion(self.chat_text, max_tokens=8, temperature=0,
                                             stream=True)
        next(iter(stream))
        elapsed = (time.perf_counter() - t) * 1e3
        for _ in stream:
            pass
        return elapsed

    def parallel(self, n: int) -> float:
        return _llama_cpp_parallel(self.peer, [PROMPTS[i % len(PROMPTS)] for i in range(n)],
                                   self.decode_tokens, self.threads)


def load_llama_cpp(path: str, **options):
    """llama-cpp-python's `Llama(path, **options)`; on CPUs with AMX without llama.cpp's
    extra buffer types (its AMX repacking), which crash any batch of more than one token
    in llama-cpp-python 0.3.36 (seen on a Xeon with AMX: a segfault at the first prompt)."""
    from unittest import mock

    import llama_cpp

    if not has_amx():
        return llama_cpp.Llama(path, **options)
    defaults = llama_cpp.llama_cpp.llama_model_default_params

    def without_extra_bufts():
        params = defaults()
        params.use_extra_bufts = False
        return params

    with mock.patch.object(llama_cpp.llama_cpp, "llama_model_default_params",
                           without_extra_bufts):
        return llama_cpp.Llama(path, **options)


def has_amx() -> bool:
    """Whether the CPU has AMX tiles (where llama-cpp-python needs `load_llama_cpp`'s
    workaround)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False


class PeerProcess:
    """`LlamaCppSide` in a child process: llama.cpp's worker threads and ours never share
    a process (sharing one, our one-sequence batched decode was once measured at a third
    of its speed), and the rows still alternate between the two. The child inherits the
    thread settings (`set_threads`)."""

    def __init__(self, path: str, n_ctx: int, args: argparse.Namespace, long_ids: list[int],
                 chat_text: str):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_peer, daemon=True, args=(
            child, (path, n_ctx, args.threads, args.decode_tokens, long_ids, chat_text)))
        self._proc.start()
        child.close()
        self._reply()  # loaded

    def measure(self, row: str, *args) -> float:
        """Run `LlamaCppSide.<row>(*args)` in the child; its result."""
        try:
            self._conn.send((row, args))
        except OSError:
            pass  # the child is gone: the reply below says how it ended
        return self._reply()

    def _reply(self):
        try:
            ok, value = self._conn.recv()
        except (EOFError, OSError):  # the child ended, or its end of the pipe broke
            self._proc.join(5)
            raise RuntimeError(f"the llama.cpp process ended (exit code "
                               f"{self._proc.exitcode})") from None
        if not ok:
            raise RuntimeError(f"llama.cpp side: {value}")
        return value

    def close(self) -> None:
        self._conn.close()
        self._proc.join(10)


def _serve_peer(conn, options: tuple) -> None:
    """The child's loop: load llama.cpp, then answer each (row, args) with (ok, value)."""
    try:
        side = LlamaCppSide(*options)
        conn.send((True, None))
        while True:
            try:
                row, args = conn.recv()
            except EOFError:
                return
            try:
                conn.send((True, getattr(side, row)(*args)))
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                conn.send((False, f"{type(exc).__name__}: {exc}"))
    except Exception as exc:  # noqa: BLE001 - the load failed
        conn.send((False, f"{type(exc).__name__}: {exc}"))


def _llama_cpp_parallel(peer, prompts: list[str], steps: int, threads: int) -> float:
    """Greedy-decode `steps` tokens for each prompt with llama.cpp's batch API (one sequence
    id per prompt, one `llama_decode` per step for all of them); aggregate tokens/s,
    prefill included, as `ours_parallel` measures it."""
    import llama_cpp
    import numpy as np

    n = len(prompts)
    toks = [peer.tokenize(p.encode(), add_bos=False) for p in prompts]
    params = llama_cpp.llama_context_default_params()
    params.n_seq_max = n
    params.n_ctx = n * (max(len(t) for t in toks) + steps + 16)
    params.n_batch = params.n_ubatch = max(512, sum(len(t) for t in toks))
    params.n_threads = params.n_threads_batch = threads
    params.kv_unified = True
    model = peer._model.model
    n_vocab = peer.n_vocab()
    t0 = time.perf_counter()
    ctx = llama_cpp.llama_init_from_model(model, params)
    batch = llama_cpp.llama_batch_init(params.n_batch, 0, n)
    try:
        # prefill: every prompt in one batch, logits at each prompt's last token
        k = 0
        last = []
        for s, ids in enumerate(toks):
            for p, tok in enumerate(ids):
                batch.token[k], batch.pos[k], batch.n_seq_id[k] = tok, p, 1
                batch.seq_id[k][0] = s
                batch.logits[k] = p == len(ids) - 1
                k += 1
            last.append(k - 1)
        batch.n_tokens = k
        _decode(ctx, batch)
        pos = [len(t) for t in toks]
        generated = 0
        for _ in range(steps):
            nxt = [int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i),
                                             shape=(n_vocab,)).argmax()) for i in last]
            generated += n
            for s in range(n):
                batch.token[s], batch.pos[s], batch.n_seq_id[s] = nxt[s], pos[s], 1
                batch.seq_id[s][0] = s
                batch.logits[s] = True
                pos[s] += 1
            batch.n_tokens = n
            last = list(range(n))
            if generated < n * steps:
                _decode(ctx, batch)
        return generated / (time.perf_counter() - t0)
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)


def _peer_greedy(peer) -> int:
    """The argmax of llama.cpp's logits for the last token it evaluated (`Llama.scores` is
    left unwritten without `logits_all` in llama-cpp-python 0.3)."""
    import llama_cpp
    import numpy as np

    logits = llama_cpp.llama_get_logits_ith(peer.ctx, -1)
    return int(np.ctypeslib.as_array(logits, shape=(peer.n_vocab(),)).argmax())


def _decode(ctx, batch) -> None:
    import llama_cpp

    rc = llama_cpp.llama_decode(ctx, batch)
    if rc != 0:
        raise RuntimeError(f"llama_decode failed with code {rc}")


def _rss_child(engine: str, path: str, args: argparse.Namespace) -> dict:
    """Load one engine, prefill the long prompt and decode; report this process's peak RSS."""
    n_ctx = args.prompt_tokens + args.decode_tokens + 64
    text = "The quick brown fox jumps over the lazy dog. " * 200
    if engine == "workbench":
        from workbench import LLM

        m = LLM.load(path, device=args.device, kv_cache_size=n_ctx)
        ids = m.tokenize(text)[: args.prompt_tokens]
        m.generate(ids, max_tokens=args.decode_tokens, temperature=0).wait()
    else:
        m = load_llama_cpp(path, n_ctx=n_ctx, n_threads=args.threads,
                           n_threads_batch=args.threads, verbose=False)
        ids = m.tokenize(text.encode(), add_bos=False)[: args.prompt_tokens]
        m.create_completion(ids, max_tokens=args.decode_tokens, temperature=0)
    return {"peak_rss_mb": _peak_rss_mb()}


def _peak_rss_mb() -> float:
    """This process's peak resident memory. Linux: VmHWM (ru_maxrss would include the
    parent's memory at fork, which Linux carries over exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024


if __name__ == "__main__":
    sys.exit(main())
