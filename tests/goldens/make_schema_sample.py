"""The goldens `schema-sample-closer-off-smollm2` and `schema-sample-closer-off-qwen`: the
token ids of the 78 generations per model of the JSONSchemaBench sample
(tests/test_grammar.py::test_schema_sample_generations_all_end_valid: a greedy and a
seeded run per schema), each run alone, one after the other, with the closer off.

No peer made these: our own engine did, at the commit in `peer`. The test runs the 78
together, in one batch with the closer on, and checks that every run the model ended
itself has these very tokens: the closer changed nothing in a run it did not close, and
a run in a batch is the run alone (tests/test_batch_invariance.py).

The ids depend on how the host's vector instructions round (`peer["cpu"]`, `host_cpu()`:
Numba compiles the kernels for the host, 8 rows of x per multi-row pass with AVX-512, 4
with AVX2). On a host of another kind the test makes the same reference itself, the
closer off, in one batch.

Each run starts from an empty cache (`LLM.reset`), so its prompt is read whole.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.goldens import Golden

MODELS = {"smollm2": "smollm2-135m", "qwen": "qwen2.5-coder-0.5b"}
ROOT = Path(__file__).resolve().parents[2]


def host_cpu() -> str:
    """The host's CPU as Numba compiles for it: its name and its vector extensions."""
    from llvmlite.binding import get_host_cpu_features, get_host_cpu_name

    vector = sorted(k for k, on in get_host_cpu_features().items()
                    if on and k.startswith(("avx", "fma", "amx", "sse")))
    return f"{get_host_cpu_name()}: {' '.join(vector)}"


def engine_commit() -> str:
    """The repository's commit, with "+changes" when tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()

    commit = git("rev-parse", "HEAD")
    return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def make_smollm2() -> Golden:
    """SmolLM2-135M's runs (about 5 minutes on 2 cores)."""
    return closer_off_runs("smollm2")


def make_qwen() -> Golden:
    """Qwen2.5-Coder-0.5B's runs (about 10 minutes on 2 cores)."""
    return closer_off_runs("qwen")


def closer_off_runs(name: str) -> Golden:
    """Run the sample's 78 generations of one model, one at a time, closer off."""
    from tests.test_grammar import sample_runs
    from workbench import LLM
    alias = MODELS[name]
    runs, ids, reasons = [], [], []
    with LLM.load(alias) as llm:
        sha256 = llm.file_sha256
        for path, _, grammar, messages, options in sample_runs():
            llm.reset()
            c = llm.chat(messages, schema=grammar, closing=False, **options)
            runs.append({"schema": path.name, "messages": messages, "options": options})
            ids.append(c.token_ids)
            reasons.append(c.finish_reason)
    return Golden(
        peer={"workbench": engine_commit(), "cpu": host_cpu()},
        inputs={"model": alias, "model_sha256": sha256,
                "runs": runs},
        outputs={"token_ids": ids, "finish_reasons": reasons})


GOLDENS = {"schema-sample-closer-off-smollm2": make_smollm2,
           "schema-sample-closer-off-qwen": make_qwen}
