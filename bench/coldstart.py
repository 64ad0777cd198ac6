"""Cold start: how long a new user waits for the first answer, and how long later runs wait.

    python bench/coldstart.py [--models smollm2-135m qwen2.5-coder-0.5b minilm-l6 whisper-tiny.en]

Each model runs in a fresh process with an empty kernel cache (a new HOME and
NUMBA_CACHE_DIR in a temporary folder; the models themselves are pulled
beforehand into the usual model cache, which the child reads through
$WORKBENCH_CACHE), then once more in another fresh process that finds the cache
warm. Each process times, from its start: importing workbench, loading the
model, the first token (LLMs: the first streamed piece of a chat answer) and the
first whole answer (a chat answer of up to 32 tokens, an embedding, the
transcript of JFK's 11 s speech from ../shared/data/whisper/jfk.wav).
The kernels compile in the loading process's background thread (`warming`),
started by `load`; the first call waits for what it needs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T0 = time.perf_counter()
MODELS = ["smollm2-135m", "qwen2.5-coder-0.5b", "minilm-l6", "whisper-tiny.en"]
JFK = Path(__file__).resolve().parents[2] / "shared" / "data" / "whisper" / "jfk.wav"
CHAT = [{"role": "system", "content": "You are helpful and concise."},
        {"role": "user", "content": "What is the capital of France?"}]


def child(alias: str) -> dict:
    """Run in the measured process: the timings in seconds since it started."""
    import workbench
    from workbench import LLM, Encoder, WhisperModel

    t = {"import": time.perf_counter() - T0}
    kind = workbench.registry.MODELS[alias].kind
    if kind == "whisper":
        model = WhisperModel.load(alias)
        t["load"] = time.perf_counter() - T0
        answer = str(model.transcribe(str(JFK)))
        t["first token"] = t["answer"] = time.perf_counter() - T0
    elif kind == "encoder":
        model = Encoder.load(alias)
        t["load"] = time.perf_counter() - T0
        answer = f"{model.embed('A man is eating food.')[:3]}"
        t["first token"] = t["answer"] = time.perf_counter() - T0
    else:
        model = LLM.load(alias)
        t["load"] = time.perf_counter() - T0
        pieces = iter(model.chat(CHAT, temperature=0, max_tokens=32))
        answer = next(pieces)
        t["first token"] = time.perf_counter() - T0
        answer += "".join(pieces)
        t["answer"] = time.perf_counter() - T0
    model.warmup.wait()
    t["warm-up"] = model.warmup.seconds
    t["text"] = answer.strip()[:60]
    return t


def measure(alias: str, home: Path) -> dict:
    """Run `child(alias)` in a new process whose home and kernel cache are in `home`."""
    from workbench import registry

    env = {**os.environ, "HOME": str(home), "NUMBA_CACHE_DIR": str(home / "numba"),
           "WORKBENCH_CACHE": str(registry.cache_dir())}
    run = subprocess.run([sys.executable, __file__, "--child", alias], env=env,
                         capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"{alias} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="*", default=MODELS)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    from workbench.engine.formats import sources

    if not JFK.is_file():
        raise SystemExit(f"missing {JFK}: the benchmark expects ../shared beside the repository")
    for alias in args.models:
        sources.pull(alias)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "?") if os.path.exists("/proc/cpuinfo") else "?"
    print(f"{os.cpu_count()} CPUs ({cpu}); seconds from process start")
    print(f"{'model':<20}{'cache':<7}{'import':>8}{'load':>8}{'1st token':>11}{'answer':>9}"
          f"{'warm-up':>9}  answer")
    for alias in args.models:
        with tempfile.TemporaryDirectory(prefix="coldstart-") as tmp:
            for cache in ("cold", "warm"):
                t = measure(alias, Path(tmp))
                print(f"{alias:<20}{cache:<7}{t['import']:8.1f}{t['load']:8.1f}"
                      f"{t['first token']:11.1f}{t['answer']:9.1f}{t['warm-up']:9.1f}  "
                      f"{t['text']!r}", flush=True)


if __name__ == "__main__":
    main()
