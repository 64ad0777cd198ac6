"""Sentence-embedding throughput: our Encoder against sentence-transformers, side by side.

    python bench/embed.py [--model minilm-l6] [--threads 2] [--rounds 5] [--sentences 256]

Both run the same checkpoint (all-MiniLM-L6-v2: our GGUF converted from the folder
sentence-transformers loads) on the same thread count, over the same sentences
(5 to 40 words, a fixed pseudo-random mix). Rounds alternate between the two;
for batch size 1 (one `embed` / `encode` call per sentence) and batch size 32
(one call over all sentences, batched by the library) the medians of
sentences/s and their ratio (ours / theirs) are printed, with the lowest cosine
between the two libraries' vectors as a check that both computed the same thing.

Needs `pip install sentence-transformers torch==2.13.0` (the CPU wheel).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from thread_pools import pin_thread_pools


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="minilm-l6",
                   help="registry alias with a source folder (default: minilm-l6)")
    p.add_argument("--dtype", default="f32", choices=("f32", "f16", "q8_0"),
                   help="our GGUF's weight type (default: f32, as the alias pulls it)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sentences", type=int, default=256)
    args = p.parse_args(argv)
    pin_thread_pools(args.threads)  # before NumPy, Numba and torch load

    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    from workbench import Encoder, registry
    from workbench.engine.formats import sources
    from workbench.engine.formats.convert import hf_bert_to_gguf

    torch.set_num_threads(args.threads)
    folder = registry.source_folder(args.model)
    if args.dtype == "f32":
        path = sources.pull(args.model)
    else:
        path = registry.cache_dir() / f"{args.model}.{args.dtype}.gguf"
        if not path.is_file():
            hf_bert_to_gguf(folder, path, dtype=args.dtype)
    ours = Encoder.load(path)
    theirs = SentenceTransformer(str(folder), device="cpu")
    sentences = _sentences(args.sentences)

    def ours_1() -> np.ndarray:
        return np.stack([ours.embed(s) for s in sentences])

    def theirs_1() -> np.ndarray:
        return np.stack([theirs.encode(s, convert_to_numpy=True) for s in sentences])

    def ours_32() -> np.ndarray:
        return ours.embed_batch(sentences, batch_size=32)

    def theirs_32() -> np.ndarray:
        return theirs.encode(sentences, batch_size=32, convert_to_numpy=True)

    print(f"{len(sentences)} sentences, {args.threads} threads, ours: {path.name}, "
          f"theirs: sentence-transformers on torch {torch.__version__}")
    ours_32(), theirs_32()  # warm up: JIT compilation, caches, allocators
    ours.embed(sentences[0]), theirs.encode(sentences[0])

    rates: dict[str, list[float]] = {name: [] for name in ("ours_1", "theirs_1", "ours_32",
                                                            "theirs_32")}
    vectors = {}
    for r in range(args.rounds):
        pairs = [(ours_1, theirs_1), (ours_32, theirs_32)]
        for a, b in pairs:
            for fn in (a, b) if r % 2 == 0 else (b, a):
                start = time.perf_counter()
                vectors[fn.__name__] = fn()
                rates[fn.__name__].append(len(sentences) / (time.perf_counter() - start))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f}/s" for k, v in rates.items()),
              file=sys.stderr)

    def low_cos(a, b) -> float:
        return float(np.min(np.sum(vectors[a] * vectors[b], axis=1)))

    print(f"{'batch':>5} {'ours sent/s':>12} {'s-t sent/s':>12} {'ratio':>6} {'min cos':>8}")
    for bs in (1, 32):
        mine = statistics.median(rates[f"ours_{bs}"])
        other = statistics.median(rates[f"theirs_{bs}"])
        print(f"{bs:>5} {mine:>12.1f} {other:>12.1f} {mine / other:>6.2f} "
              f"{low_cos(f'ours_{bs}', f'theirs_{bs}'):>8.5f}")
    return 0


def _sentences(n: int) -> list[str]:
    """n sentences of 5-40 words from a fixed vocabulary (seeded: the same every run)."""
    import numpy as np

    words = ("the a model runs on local hardware and every token is computed by the engine "
             "people like fast tools that answer quickly while the notebook shows what happens "
             "embeddings map meaning to vectors so similar sentences end up close together "
             "Paris London rivers mountains coffee music 2024 results improved by 3.5% "
             "quietly although however because small large neural network training data").split()
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        k = int(rng.integers(5, 41))
        text = " ".join(rng.choice(words, size=k))
        out.append(text[0].upper() + text[1:] + ".")
    return out


if __name__ == "__main__":
    sys.exit(main())
