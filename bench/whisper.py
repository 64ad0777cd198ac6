"""Speech-to-text speed: our WhisperModel against faster-whisper and whisper.cpp, side by side.

    python bench/whisper.py [--model whisper-tiny.en] [--threads 2] [--rounds 5] [--beam-size 1]

Clips: JFK (11 s, ../shared/data/whisper/jfk.wav) and 60 s made of JFK and espeak-ng
speech (the Whisper tests' sentences) with short pauses. Engines, all on the same
thread count, all greedy (or `--beam-size`), English, no timestamps, no VAD:

- ours: `WhisperModel.load(alias)` (the whisper.cpp `.bin` our converter made);
- faster-whisper int8 and float32 on the CTranslate2 folder the alias was converted from;
- whisper.cpp through pywhispercpp on the same `.bin` file as ours.

Rounds alternate between engines; the medians of wall time per clip, the ratio to ours
(theirs / ours: above 1 means we are faster) and each engine's transcript of JFK are
printed. Needs `pip install faster-whisper pywhispercpp`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from thread_pools import pin_thread_pools

SHARED = Path(__file__).resolve().parents[2] / "shared"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="whisper-tiny.en")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--beam-size", type=int, default=1)
    args = p.parse_args(argv)
    pin_thread_pools(args.threads)  # before NumPy, Numba and CTranslate2 load

    import numpy as np
    from faster_whisper import WhisperModel as FasterWhisper
    from pywhispercpp.model import Model as WhisperCpp

    from workbench import WhisperModel, registry
    from workbench.engine.audio.pcm import load_audio
    from workbench.engine.formats import sources

    bin_path = sources.pull(args.model)
    folder = registry.source_folder(args.model)
    jfk = load_audio(SHARED / "data" / "whisper" / "jfk.wav")
    clips = {"jfk 11s": jfk, "mixed 60s": _sixty_seconds(jfk)}

    ours = WhisperModel.load(bin_path)
    fw = {kind: FasterWhisper(str(folder), device="cpu", compute_type=kind,
                              cpu_threads=args.threads) for kind in ("int8", "float32")}
    beam = args.beam_size
    cpp_params = {"beam_search": {"beam_size": beam, "patience": -1.0}} if beam > 1 else {}
    cpp = WhisperCpp(str(bin_path), params_sampling_strategy=0 if beam == 1 else 1,
                     n_threads=args.threads, print_progress=False, print_realtime=False,
                     language="en", **cpp_params)

    def run_ours(pcm):
        return str(ours.transcribe(pcm, beam_size=beam))

    def run_fw(kind):
        def run(pcm):
            segments, _ = fw[kind].transcribe(pcm, language="en", beam_size=beam,
                                              temperature=0.0, vad_filter=False,
                                              condition_on_previous_text=False)
            return " ".join(s.text.strip() for s in segments)
        return run

    def run_cpp(pcm):
        return " ".join(s.text.strip() for s in cpp.transcribe(pcm.astype(np.float32)))

    engines = {"ours": run_ours, "faster-whisper int8": run_fw("int8"),
               "faster-whisper float32": run_fw("float32"), "whisper.cpp": run_cpp}
    texts: dict[str, str] = {}
    for name, fn in engines.items():  # warm-up (JIT, caches), and the JFK transcripts
        texts[name] = fn(jfk)
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for clip, pcm in clips.items():
            for name in order:
                start = time.perf_counter()
                engines[name](pcm)
                times.setdefault((name, clip), []).append(time.perf_counter() - start)
        print(f"round {r + 1} done", file=sys.stderr)

    print(f"{args.model}, {args.threads} threads, beam {beam}, medians of {args.rounds} rounds")
    print(f"{'engine':<24}" + "".join(f"{clip + ' s':>12}{'theirs/ours':>12}"
                                       for clip in clips))
    for name in engines:
        row = f"{name:<24}"
        for clip in clips:
            t = statistics.median(times[(name, clip)])
            mine = statistics.median(times[("ours", clip)])
            row += f"{t:>12.3f}{t / mine:>12.2f}"
        print(row)
    print()
    for name, text in texts.items():
        print(f"{name:<24} {text}")
    return 0


def _sixty_seconds(jfk):
    """60 s: JFK, espeak-ng sentences and pauses (JFK alone when espeak-ng is missing)."""
    import numpy as np

    from workbench.engine.audio.pcm import load_audio

    parts = [jfk, np.zeros(8000, np.float32)]
    if shutil.which("espeak-ng"):
        with tempfile.TemporaryDirectory() as tmp:
            text = ("The quick brown fox jumps over the lazy dog. Please call the office "
                    "before noon on Friday to confirm the meeting. Speech recognition works "
                    "best when the audio is clear and the speaker talks slowly.")
            wav = Path(tmp) / "speech.wav"
            subprocess.run(["espeak-ng", "-v", "en-us", "-s", "150", "-w", str(wav), text],
                           check=True)
            parts += [load_audio(wav), np.zeros(8000, np.float32)]
    pcm = np.concatenate(parts)
    reps = int(np.ceil(60 * 16000 / len(pcm)))
    return np.tile(pcm, reps)[: 60 * 16000]


if __name__ == "__main__":
    sys.exit(main())
