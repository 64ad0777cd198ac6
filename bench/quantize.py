"""Benchmark files in the formats people download, made with llama.cpp's own quantizer.

    python bench/quantize.py [--model qwen2.5-coder-0.5b] [--types Q8_0 Q4_0] [--out DIR]

Writes `<file stem>.<TYPE>.gguf` for each type next to the source model in the model
cache (or in `--out`), with `llama_model_quantize` from llama-cpp-python (the
[peers] extra), unless the file is there already, and prints the paths for
`workbench bench --model PATH`. The Qwen2.5-Coder file we pull is llama.cpp's Q4_K_M
mix already (its rows of 896 do not split into the 256-wide K-quant blocks, so most
tensors are Q5_0, the embedding Q8_0): this makes the Q8_0 and Q4_0 versions. The source
is requantized (`allow_requantize`), so they are a little less exact than files made
from the original fp16 weights, which does not matter for speed. They stay out of the
repository.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from workbench import registry
from workbench.engine.formats import sources

TYPES = ("Q8_0", "Q4_0")


def quantize(source: Path, target: Path, kind: str, threads: int) -> None:
    """Write `source` quantized to `kind` (llama.cpp's name: Q8_0, Q4_K_M, Q4_0 ...) at
    `target`."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.allow_requantize = True
    params.nthread = threads
    partial = target.with_name(f".{target.name}.partial")
    code = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(),
                                          ctypes.byref(params))
    if code != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize failed ({code}) for {kind}")
    partial.replace(target)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--types", nargs="+", default=list(TYPES), metavar="TYPE")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is needed: pip install -e '.[peers]'", file=sys.stderr)
        return 1
    source = sources.resolve(args.model)
    out = args.out or registry.cache_dir()
    out.mkdir(parents=True, exist_ok=True)
    stem = source.stem.split(".Q")[0]
    for kind in args.types:
        target = out / f"{stem}.{kind}.gguf"
        if not target.is_file():
            t = time.perf_counter()
            quantize(source, target, kind, args.threads)
            print(f"made {target.name} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
        print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
