"""The warm-up helper process (`workbench.engine.runtime.warmup`): it builds the CPU model of a
decoder file, as `LLM` does, and runs the kernel tasks it is given, so that the decode
step's kernels compile on another core while the first prompt's compile here."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence

from workbench.engine.formats.gguf import open_gguf
from workbench.engine.models.families import DECODERS
from workbench.kernels.cache import KernelCacheWarning


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m workbench.engine.models.kernel_helper llm PATH MAX_LEN 3,4,5` runs tasks
    3, 4 and 5 of the model's `kernel_tasks()`, printing "done I" after each."""
    kind, path, max_len, indices = argv if argv is not None else sys.argv[1:]
    if kind != "llm":
        raise SystemExit(f"no helper tasks for {kind!r} models")

    def report(caught: list[warnings.WarningMessage]) -> None:
        """The cache's warnings, for the parent to show (this process's stderr is not)."""
        for w in caught:
            if isinstance(w.message, KernelCacheWarning):
                text = " ".join(str(w.message).split())
                print(f"warning {w.message.kind} {text}", flush=True)
        caught.clear()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", KernelCacheWarning)
        gguf = open_gguf(path)
        model = DECODERS[gguf.architecture](gguf, int(max_len))  # the CPU model `LLM` makes
        tasks = model.kernel_tasks()
        report(caught)
        for i in map(int, indices.split(",")):
            tasks[i].run()
            report(caught)
            print(f"done {i}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
