"""Time the quantized CPU matmul kernels against NumPy fp32 `x @ W.T`.

    python bench/bench_kernels.py                       # all kernel types, all shapes, T=1 and 128
    python bench/bench_kernels.py --types Q8_0 Q4_K --T 1 --shapes 49152x576

For each (type, N x K, T) it prints the median time (the smallest of
`--rounds` medians) of
`QuantizedWeight.matmul` (the dispatching object the model calls), of NumPy's
fp32 `x @ W.T` on the dequantized matrix, and their ratio (numpy / kernel:
> 1 means the quantized kernel is faster).

Weights are random blocks. To time what a model sees (weights streamed from
memory, not sitting in the 32 MiB L3), each measurement cycles through enough
copies of the matrix to exceed `--working-set` MiB, for both contenders.
Numbers on a 2-core machine shared with other work are noisy: a busy
neighbour shows up as medians near multiples of the 4 ms scheduler tick.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from workbench.kernels.cpu import KERNEL_TYPES
from workbench.kernels.linear import QuantizedWeight
from workbench.kernels.quants import dequantize

SHAPES = {  # (N, K): output rows x inputs
    "smollm2": [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)],
    "qwen": [(896, 896), (128, 896), (4864, 896), (896, 4864), (151936, 896)],
}
# fp16 fields per block (byte offsets): kept finite so random blocks make sane weights
_F16_FIELDS = {
    "Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}


def random_weight(qtype: GGMLQuantizationType, n: int, k: int,
                  rng: np.random.Generator) -> np.ndarray:
    """(n, bytes_per_row) uint8 random blocks of `qtype` with small finite fp16 scales."""
    if qtype in (GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        w = rng.standard_normal((n, k)).astype(np.float32)
        if qtype == GGMLQuantizationType.F16:
            return w.astype(np.float16).view(np.uint8)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    bs, ts = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n * (k // bs), ts), dtype=np.uint8)  # (blocks, type_size)
    for off in _F16_FIELDS[qtype.name]:
        scale = (rng.standard_normal(raw.shape[0]) * 0.01).astype(np.float16)
        raw[:, off : off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, k // bs * ts)


def median_ms(fn, argsets: list, repeat: int, budget_s: float = 3.0) -> float:
    """Median wall time (ms) of fn(*args), cycling through `argsets` (after a warm-up).

    Runs `repeat` times, fewer (at least 3) when that would exceed `budget_s`.
    """
    time.sleep(0.1)  # let BLAS/OpenMP worker threads of the previous measurement stop spinning
    for args in argsets[:2]:
        fn(*args)
    t0 = time.perf_counter()
    fn(*argsets[0])
    warm = time.perf_counter() - t0
    repeat = max(3, min(repeat, int(budget_s / max(warm, 1e-6))))
    times = []
    for i in range(repeat):
        args = argsets[i % len(argsets)]
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="*", default=[t.name for t in KERNEL_TYPES])
    ap.add_argument("--shapes", nargs="*", default=["smollm2", "qwen"],
                    help="'smollm2', 'qwen', or NxK")
    ap.add_argument("--T", nargs="*", type=int, default=[1, 128])
    ap.add_argument("--repeat", type=int, default=20, help="timed calls per median")
    ap.add_argument("--rounds", type=int, default=2, help="medians taken; the smallest is shown")
    ap.add_argument("--working-set", type=float, default=96.0, help="MiB cycled per measurement")
    args = ap.parse_args()

    shapes: list[tuple[int, int]] = []
    for s in args.shapes:
        shapes += SHAPES[s] if s in SHAPES else [tuple(int(v) for v in s.split("x"))]
    rng = np.random.default_rng(0)
    print(f"{'type':6} {'N x K':>12} {'T':>4} {'kernel ms':>10} {'numpy fp32 ms':>14} {'ratio':>6}")
    for name in args.types:
        qtype = GGMLQuantizationType[name]
        for n, k in shapes:
            if k % GGML_QUANT_SIZES[qtype][0]:
                continue
            raw = random_weight(qtype, n, k, rng)
            n_q = max(1, min(16, int(args.working_set * 2**20 // raw.nbytes)))
            n_f = max(1, min(16, int(args.working_set * 2**20 // (n * k * 4))))
            copies = [raw] + [raw.copy() for _ in range(n_q - 1)]
            weights = [QuantizedWeight.from_gguf_tensor(c, qtype, (n, k)) for c in copies]
            w32 = dequantize(raw, qtype)
            dense = [w32 if i == 0 else w32.copy() for i in range(n_f)]
            for T in args.T:
                x = rng.standard_normal((T, k)).astype(np.float32)
                t_kernel, t_numpy = np.inf, np.inf
                for _ in range(args.rounds):  # min over rounds of the medians: robust to neighbours
                    t_kernel = min(t_kernel, median_ms(lambda w, x: w.matmul(x),
                                                       [(w, x) for w in weights], args.repeat))
                    t_numpy = min(t_numpy, median_ms(lambda w, x: x @ w.T,
                                                     [(w, x) for w in dense], args.repeat))
                print(f"{name:6} {n:>6}x{k:<5} {T:>4} {t_kernel:>10.3f} {t_numpy:>14.3f} "
                      f"{t_numpy / t_kernel:>6.2f}", flush=True)
            del weights, dense, w32


if __name__ == "__main__":
    main()
