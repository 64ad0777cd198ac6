"""GPU speed: our CuPy engine against PyTorch (transformers) on the same weights, one card.

    python bench/gpu.py [--json PATH] [--budget 400] [--files smollm2-q4_1,qwen-q8_0]

Builds random-weight GGUF files of real models' shapes (SmolLM2-135M in Q4_1, Q8_0
and F16; Qwen2.5-0.5B in Q8_0: `tests/hf_to_gguf.py`, with vocabularies padded to
the real sizes), loads each into `LLM` on CUDA, and loads the same weights (each
matrix rounded through the file's format, then bf16) into transformers'
Llama/Qwen2 model, run two ways: plain `generate`, and a static cache with
`torch.compile` (mode "reduce-overhead": CUDA graphs) where it compiles within the
budget. The PyTorch speed of a shape does not depend on the values, so each shape's
PyTorch rows are measured once and every file of that shape is compared with them.

Rows (medians of `--rounds` after a warm-up; every answer greedy, end tokens off):

- decode tok/s of 1 sequence (the tokens after the first), and aggregate decode of 8,
  32 and 64 sequences decoded together (`generate_batch` / a batched `generate`:
  every generated token over the whole call, 16-token prompts);
- prefill tok/s at 512 and 2048 tokens, and TTFT (ms) of a 128-token prompt; where our
  engine reads that prompt with the decode step's recordings (up to
  `RECORDED_PREFILL_ROWS` tokens), also without them ("unrecorded": the layers'
  kernels one by one), so that one run on a card tells which is faster;
- 32 concurrent requests through the scheduler (threads calling `generate`, the
  server's path) against one request alone, and whether each request's greedy answer
  equals the same request alone;
- our ratio to the faster PyTorch path on each row (for TTFT, theirs over ours);
- with time left: greedy ids on the card against our CPU engine on the same file.

Everything runs under one wall-clock budget (`--budget`, seconds): rows that would not
fit are printed as skipped, and a row that runs past its share is cancelled and shown
as "> N s". Needs CuPy, PyTorch and transformers (the GPU machines have them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# the real models' shapes (their config.json), built with random weights
SHAPES = {
    "smollm2-135m": ("llama", "LlamaForCausalLM", dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)),
    "qwen2.5-0.5b": ("qwen2", "Qwen2ForCausalLM", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)),
}
# file name -> (shape, format of its matrices)
FILES = {
    "smollm2-q4_1": ("smollm2-135m", "Q4_1"),
    "smollm2-q8_0": ("smollm2-135m", "Q8_0"),
    "smollm2-f16": ("smollm2-135m", "F16"),
    "qwen-q8_0": ("qwen2.5-0.5b", "Q8_0"),
}
# a tiny stand-in shape for trying the script on a machine without a GPU (--tiny)
TINY = ("llama", "LlamaForCausalLM", dict(
    vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True))

BATCHES = (8, 32, 64)
PREFILLS = (512, 2048)
PROMPT = 16  # tokens of each decode row's prompt
TTFT_PROMPT = 128
CONCURRENT = 32
CHECK_TOKENS = 32  # greedy tokens compared with our CPU engine
CPU_CHECK_S = 30  # what a CPU check may need (its kernels compile on a cold cache)
COMPILE_S = 150  # what torch.compile of one batch size may need (seen: about 100 s, H200)
FIRST_ID = 300  # prompts draw ids above the byte symbols, merges and the end token


# -- the files -----------------------------------------------------------------------------

def padded_vocab(n: int):
    """`tiny_vocab()` padded to n tokens with plain tokens that no merge reaches."""
    from gguf import TokenType

    from tests.hf_to_gguf import Vocab, tiny_vocab

    v = tiny_vocab()
    extra = n - len(v.tokens)
    return Vocab(v.tokens + [f"fill{i}" for i in range(extra)],
                 v.token_types + [int(TokenType.NORMAL)] * extra, v.merges, v.eos_id)


def build_model(shape: tuple, seed: int):
    """A transformers model of `shape` with random weights (float32, on the host)."""
    import torch
    import transformers

    arch, cls_name, fields = shape
    cls = getattr(transformers, cls_name)
    config_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    torch.manual_seed(seed)
    model = cls(config_cls(**fields)).eval()
    return arch, model


def write_file(arch: str, model, qtype_name: str, path: Path) -> None:
    """The model's GGUF in `qtype_name` (its matrices rounded through that format in
    place first, so that PyTorch computes with exactly the file's weights)."""
    from gguf import GGMLQuantizationType

    from tests.hf_to_gguf import snap_to_qtype, write_gguf

    qtype = GGMLQuantizationType[qtype_name]
    snap_to_qtype(model, qtype)
    write_gguf(model, path, arch, qtype, padded_vocab(model.config.vocab_size))


# -- timing --------------------------------------------------------------------------------

class Budget:
    """One wall-clock budget for the whole run; each row asks for its share."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


class Row:
    """One measured quantity: the median of its rounds, or why there is none."""

    def __init__(self, value: float | None = None, note: str = ""):
        self.value, self.note = value, note

    def __str__(self) -> str:
        if self.value is None:
            return self.note or "-"
        return f"{self.value:,.0f}" if self.value >= 100 else f"{self.value:.3g}"


def measure(fn: Callable[[float], float], rounds: int, budget: Budget, limit: float) -> Row:
    """Median of `rounds` calls of fn(limit) after one warm-up call; fn returns the value
    or raises TimeoutError. Skipped when the budget has less than `limit` seconds left."""
    if budget.left() < limit:
        return Row(note="skipped (budget)")
    values = []
    try:
        fn(limit)  # warm-up: kernels compiled, graphs recorded
        for _ in range(rounds):
            if budget.left() < limit:
                break
            values.append(fn(limit))
    except TimeoutError as e:
        return Row(note=f"> {e.args[0]:.0f} s")
    except Exception as e:  # a failing row is reported, the others still run
        return Row(note=f"error: {type(e).__name__}: {str(e)[:80]}")
    return Row(statistics.median(values)) if values else Row(note="skipped (budget)")


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(FIRST_ID, vocab, size=(n, length)).tolist()


# -- our engine ----------------------------------------------------------------------------

class Ours:
    """`LLM` on the device, greedy, end tokens off (every call makes all its tokens)."""

    def __init__(self, path: Path, device: str):
        from workbench import LLM

        self.m = LLM.load(path, device=device, kv_cache_size=max(PREFILLS) + 128,
                          max_batch=max(BATCHES))
        self.vocab = self.m.config.n_vocab
        self.seed = 0

    def step_kind(self) -> str:
        """How the decode step ran: fused (six launches a llama layer) or one kernel per
        operation, recorded or not, and how many sequences one launch takes."""
        model = self.m.model
        if not getattr(model, "_recording", False):
            return "not recorded (each kernel launched from Python)"
        kind = "fused" if model._fused else "unfused"
        return f"{kind}, recorded, up to {model.step_rows} sequences a launch"

    def _prompts(self, n: int, length: int) -> list[list[int]]:
        self.seed += 1  # fresh prompts each round: nothing reused from the slots
        return random_prompts(n, length, self.vocab, self.seed)

    def _generate(self, prompt, tokens: int, cancel=None):
        return self.m.generate(prompt, max_tokens=tokens, temperature=0, stop_tokens=[],
                               cancel=cancel)

    def decode(self, n: int, tokens: int) -> Callable[[float], float]:
        def run(limit: float) -> float:
            from workbench.bench import decode_rate
            from workbench.engine.cancel import Cancelled

            prompts = self._prompts(n, PROMPT)
            cancel = threading.Event()
            timer = threading.Timer(limit, cancel.set)
            timer.start()
            try:
                if n == 1:
                    return decode_rate(self._generate(prompts[0], tokens, cancel))
                t = time.perf_counter()
                outs = self.m.generate_batch(prompts, max_tokens=tokens, temperature=0,
                                             stop_tokens=[], cancel=cancel)
                return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)
            except Cancelled:
                raise TimeoutError(limit) from None
            finally:
                timer.cancel()
        return run

    def prefill(self, length: int, recorded: bool = True) -> Callable[[float], float]:
        def run(limit: float) -> float:
            with self.prompts_recorded(recorded):
                return length / self._first_token(length)
        return run

    def ttft_ms(self, limit: float, recorded: bool = True) -> float:
        with self.prompts_recorded(recorded):
            return self._first_token(TTFT_PROMPT) * 1e3

    def reads_recorded(self, length: int) -> bool:
        """Whether a prompt of `length` tokens is read by the decode step's recordings
        (`DeviceLlamaModel.recorded_prefill_rows`) on this file."""
        model = self.m.model
        if not hasattr(model, "_prefills_recorded"):
            return False
        return model._prefills_recorded(length, n_slots=2)  # the scheduler's pool: many

    @contextmanager
    def prompts_recorded(self, on: bool):
        """Prompts read by the recordings (where they are) or, `on` False, by the layers'
        kernels one by one: both are measured, to set the model's threshold from a card."""
        model, was = self.m.model, getattr(self.m.model, "recorded_prefill_rows", None)
        if not on and was is not None:
            model.recorded_prefill_rows = 0
        try:
            yield
        finally:
            if was is not None:
                model.recorded_prefill_rows = was

    def _first_token(self, length: int) -> float:
        prompt = self._prompts(1, length)[0]
        self.m.reset()
        t = time.perf_counter()
        next(iter(self._generate(prompt, 1).iter_events()))
        return time.perf_counter() - t

    def concurrent(self, n: int, tokens: int, limit: float) -> dict:
        """n requests at once through the scheduler (a thread each, as the server's
        handlers call it) against each alone: aggregate and single token rates, and
        whether every request's greedy answer equals its answer alone."""
        prompts = self._prompts(n, PROMPT)
        deadline = time.monotonic() + limit
        _ = self._generate(prompts[0], 4).token_ids  # warm: recordings, kernels
        alone, rates = [], []
        for p in prompts:
            if time.monotonic() > deadline:
                return {"note": f"> {limit:.0f} s (alone runs)"}
            t = time.perf_counter()
            alone.append(self._generate(p, tokens).token_ids)
            rates.append(tokens / (time.perf_counter() - t))
        one_rate = statistics.median(rates)
        together: list = [None] * n
        start = threading.Barrier(n + 1)

        def worker(i: int) -> None:
            start.wait()
            together[i] = self._generate(prompts[i], tokens).token_ids

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
        for th in threads:
            th.start()
        start.wait()
        t = time.perf_counter()
        for th in threads:
            th.join(max(1.0, deadline - time.monotonic()))
        wall = time.perf_counter() - t
        if any(th.is_alive() for th in threads):
            return {"note": f"> {limit:.0f} s (concurrent run)"}
        rate = sum(len(x) for x in together) / wall
        return {"one": one_rate, "concurrent": rate, "ratio": rate / one_rate,
                "equal_alone": sum(a == b for a, b in zip(alone, together))}

    def greedy(self, prompt: list[int], tokens: int) -> list[int]:
        self.m.reset()
        return list(self._generate(prompt, tokens).token_ids)

    def close(self) -> None:
        self.m.close()


# -- PyTorch ---------------------------------------------------------------------------------

class Torch:
    """The same weights in bf16 on the card: transformers' `generate`, eager or compiled."""

    def __init__(self, model, device: str):
        import torch

        self.torch = torch
        self.device = device
        self.model = model.to(device=device, dtype=torch.bfloat16).eval()
        self.vocab = model.config.vocab_size
        self.seed = 10_000
        self.compiled = False

    def _sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def _ids(self, n: int, length: int):
        self.seed += 1
        return self.torch.tensor(random_prompts(n, length, self.vocab, self.seed),
                                 device=self.device)

    def _generate(self, ids, tokens: int) -> float:
        torch = self.torch
        extra = {"cache_implementation": "static"} if self.compiled else {}
        self._sync()
        t = time.perf_counter()
        with torch.no_grad():
            self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                max_new_tokens=tokens, min_new_tokens=tokens,
                                do_sample=False, pad_token_id=0, **extra)
        self._sync()
        return time.perf_counter() - t

    def decode(self, n: int, tokens: int) -> Callable[[float], float]:
        def run(limit: float) -> float:
            ids = self._ids(n, PROMPT)
            if n == 1 and not self.compiled:  # the tokens after the first, as ours
                return (tokens - 1) / (self._generate(ids, tokens) - self._generate(ids, 1))
            # compiled: one call (a second length would compile its own static cache); the
            # 16-token prefill inside it costs about one decode step of the 128
            return n * tokens / self._generate(ids, tokens)
        return run

    def prefill(self, length: int) -> Callable[[float], float]:
        def run(limit: float) -> float:
            return length / self._first_token(length)
        return run

    def ttft_ms(self, limit: float) -> float:
        return self._first_token(TTFT_PROMPT) * 1e3

    def _first_token(self, length: int) -> float:
        torch = self.torch
        ids = self._ids(1, length)
        self._sync()
        t = time.perf_counter()
        with torch.no_grad():
            logits = self.model(ids, logits_to_keep=1).logits
            int(logits[0, -1].argmax())  # the first token, on the host
        return time.perf_counter() - t



# -- the run -----------------------------------------------------------------------------------

def table(rows: list[tuple[str, Row, Row, Row, str]]) -> str:
    """rows: (what, ours, torch eager, torch compiled, ratio) -> aligned text (notes cut
    short; the JSON keeps them whole)."""
    def cell(r: Row) -> str:
        text = str(r)
        return text if len(text) <= 28 else text[:27] + "…"

    head = ("", "ours", "torch", "torch.compile", "ours/best")
    cells = [head] + [(w, cell(a), cell(b), cell(c), r) for w, a, b, c, r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(5)]
    return "\n".join("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i])
                               for i, c in enumerate(r)) for r in cells)


def ratio(ours: Row, *peers: Row, lower_is_better: bool = False) -> str:
    best = [p.value for p in peers if p.value is not None]
    if ours.value is None or not best:
        return "-"
    if lower_is_better:
        return f"{min(best) / ours.value:.2f}x"
    return f"{ours.value / max(best):.2f}x"


def speed_rows(engine: Ours | Torch, tokens: int, rounds: int, budget: Budget, end: float,
               shares: int) -> dict[str, Row]:
    """The decode, prefill and TTFT rows of one engine (ours on one file, or PyTorch on
    one shape), each given a 1/`shares` share of the time left until `end`."""
    def share() -> float:
        return max(5.0, (end - time.monotonic()) / shares)

    rows = {"decode 1": measure(engine.decode(1, tokens), rounds, budget, share())}
    for n in BATCHES:
        rows[f"decode {n}"] = measure(engine.decode(n, tokens // 2), 1, budget, share())
    for n in PREFILLS:
        rows[f"prefill {n}"] = measure(engine.prefill(n), rounds, budget, share())
    rows["ttft ms"] = measure(engine.ttft_ms, rounds, budget, share())
    if isinstance(engine, Ours):  # the prompts the recordings read, also read without them
        for n in PREFILLS:
            if engine.reads_recorded(n):
                rows[f"prefill {n} unrecorded"] = measure(engine.prefill(n, recorded=False),
                                                          rounds, budget, share())
        if engine.reads_recorded(TTFT_PROMPT):
            rows["ttft ms unrecorded"] = measure(
                lambda limit: engine.ttft_ms(limit, recorded=False), rounds, budget, share())
    return rows


def compiled_row(peer: Torch, n: int, tokens: int, rounds: int, budget: Budget) -> Row:
    """Decode of n sequences with a static cache, which transformers' `generate` compiles
    (`torch.compile`, mode "reduce-overhead": CUDA graphs); each batch size compiles anew."""
    peer.compiled = True
    return measure(peer.decode(n, tokens if n == 1 else tokens // 2), rounds if n == 1 else 1,
                   budget, COMPILE_S)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--files", default=",".join(FILES),
                   help=f"which files, comma-separated (of {', '.join(FILES)})")
    p.add_argument("--budget", type=float, default=400.0, help="seconds for the whole run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=128,
                   help="tokens per sequence in the decode rows")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile path")
    p.add_argument("--tiny", action="store_true",
                   help="a tiny shape on this machine's CPU (trying the script without a GPU)")
    p.add_argument("--commit", default="", help="the commit measured, for the record")
    args = p.parse_args(argv)
    names = [f for f in args.files.split(",") if f]
    for f in names:
        if f not in FILES:
            p.error(f"unknown file {f!r}: choose from {', '.join(FILES)}")
    budget = Budget(args.budget)
    device = "cpu" if args.tiny else "cuda"

    import torch

    card = torch.cuda.get_device_name(0) if device == "cuda" else "cpu (--tiny)"
    results: dict = {"card": card, "commit": args.commit, "budget_s": args.budget,
                     "decode_tokens": args.decode_tokens, "files": {}}
    print(f"card: {card}; torch {torch.__version__}; budget {args.budget:.0f} s", flush=True)
    tokens, work = args.decode_tokens, Path(tempfile.mkdtemp(prefix="wb-gpu-bench-"))

    def save() -> None:  # after every phase: a run cut short keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1, default=lambda r: r.value))

    # 1. our engine on every file: the rows this benchmark is for come first
    ours_by_file: dict[str, dict[str, Row]] = {}
    models: dict[str, object] = {}  # shape -> the transformers model of its first file
    checks: dict[str, tuple[Path, list[int], list[int]]] = {}
    for i, name in enumerate(names):
        shape_name, qtype = FILES[name]
        # this file's share of what is left, keeping a third for PyTorch
        end = time.monotonic() + max(45.0, budget.left() * 0.6 / (len(names) - i))
        t0 = time.perf_counter()
        arch, model = build_model(TINY if args.tiny else SHAPES[shape_name], seed=1 + i)
        path = work / f"{name}.gguf"
        write_file(arch, model, qtype, path)
        models.setdefault(shape_name, model)
        built, t0 = time.perf_counter() - t0, time.perf_counter()
        ours = Ours(path, device)
        size_mb = path.stat().st_size / 1e6
        print(f"\n{name}: {'tiny' if args.tiny else shape_name} shape, {qtype}, {size_mb:.0f} MB "
              f"(built in {built:.0f} s, loaded on {device} in {time.perf_counter() - t0:.1f} s)",
              flush=True)
        o = ours_by_file[name] = speed_rows(ours, tokens, args.rounds, budget, end, 10)
        print("  " + "; ".join(f"{k} {v}" for k, v in o.items()), flush=True)
        step = ours.step_kind()
        print(f"  decode step: {step}", flush=True)
        conc = (ours.concurrent(CONCURRENT, tokens // 2, max(10.0, end - time.monotonic()))
                if budget.left() > 30 else {"note": "skipped (budget)"})
        if "ratio" in conc:
            print(f"  scheduler: {CONCURRENT} concurrent requests {conc['concurrent']:,.0f} tok/s"
                  f" against one alone {conc['one']:,.0f} tok/s ({conc['ratio']:.1f}x); "
                  f"{conc['equal_alone']}/{CONCURRENT} answers equal to the request alone",
                  flush=True)
        else:
            print(f"  scheduler: {conc['note']}", flush=True)
        prompt = random_prompts(1, PROMPT, ours.vocab, seed=99)[0]
        checks[name] = (path, prompt, ours.greedy(prompt, CHECK_TOKENS))
        ours.close()
        results["files"][name] = {"shape": shape_name, "format": qtype,
                                  "bytes": path.stat().st_size, "scheduler": conc,
                                  "decode_step": step}
        save()

    # 2. PyTorch once per shape (its speed does not depend on the values), eager first
    peers: dict[str, tuple[Torch, dict[str, Row], dict[str, Row]]] = {}
    for shape_name, model in models.items():
        end = time.monotonic() + budget.left() / (2 * len(models))
        peer = Torch(model, device)
        peers[shape_name] = (peer, speed_rows(peer, tokens, args.rounds, budget, end, 7),
                              {})
    if not args.no_compile and device == "cuda":  # one sequence on every shape, then 8
        for n in (1, 8):
            for peer, _, compiled in peers.values():
                compiled[f"decode {n}"] = compiled_row(peer, n, tokens, args.rounds, budget)

    # 3. the tables
    for name in names:
        shape_name = FILES[name][0]
        _, eager, compiled = peers[shape_name]
        o, rows = ours_by_file[name], []
        for what in o:
            e, c = eager.get(what, Row()), compiled.get(what, Row())
            rows.append((what, o[what], e, c,
                         ratio(o[what], e, c, lower_is_better=what.startswith("ttft"))))
        print(f"\n{name} ({shape_name}, {FILES[name][1]}) on {card}\n{table(rows)}", flush=True)
        results["files"][name]["rows"] = {
            what: {"ours": a.value, "torch": b.value, "torch_compile": c.value, "ratio": r,
                   "notes": [x.note for x in (a, b, c) if x.note]}
            for what, a, b, c, r in rows}
    save()

    # 4. with time left: our CPU engine's greedy ids on the same files (its kernels compile)
    for name, (path, prompt, device_ids) in checks.items():
        if device == "cuda" and budget.left() > CPU_CHECK_S:
            cpu = Ours(path, "cpu")
            cpu_ids = cpu.greedy(prompt, CHECK_TOKENS)
            cpu.close()
            same = next((j for j, (a, b) in enumerate(zip(device_ids, cpu_ids)) if a != b),
                        CHECK_TOKENS)
            print(f"{name}: greedy ids on cuda and cpu, the first {same} of {CHECK_TOKENS} "
                  f"equal", flush=True)
            results["files"][name]["cpu_equal_prefix"] = same
        path.unlink()
    save()
    print(f"\n{args.budget - budget.left():.0f} s in all", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
