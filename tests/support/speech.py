"""The JFK recording and its words, and the word error rate the transcripts are held to."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.support.shared import shared_file

JFK = ("And so, my fellow Americans, ask not what your country can do for you, "
       "ask what you can do for your country.")
FRENCH = ("Bonjour, je voudrais réserver une table pour deux personnes ce soir. "
          "Le train pour Paris part à huit heures.")


def words(text: str) -> list[str]:
    """Lower-case words without punctuation (hyphens split words)."""
    return re.sub(r"[^\w\s']", " ", text.lower().replace("-", " ")).split()


def wer(hypothesis: str, truth: str) -> float:
    """Word error rate: word-level edit distance over the reference length."""
    h, r = words(hypothesis), words(truth)
    d = np.arange(len(h) + 1)
    for i, rw in enumerate(r, 1):
        prev, d[0] = d[0], i
        for j, hw in enumerate(h, 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (rw != hw))
    return d[len(h)] / max(1, len(r))


def jfk_pcm() -> np.ndarray:
    """../shared's jfk.wav as 16 kHz mono float32 samples."""
    from workbench.engine.audio.pcm import load_audio

    return load_audio(shared_file("data", "whisper", "jfk.wav"))


def espeak_wav(text: str, voice: str, folder: Path) -> Path:
    """`text` spoken by espeak-ng in `voice`, as a 16 kHz mono 16-bit WAV in `folder`
    (the reference's recipe)."""
    if not shutil.which("espeak-ng") or not shutil.which("sox"):
        pytest.fail("espeak-ng and sox are needed (apt-get install espeak-ng sox; "
                    ".ci/run installs them)")
    (folder / "text.txt").write_text(text)
    raw, out = folder / f"raw-{voice}.wav", folder / f"out-{voice}.wav"
    subprocess.run(["espeak-ng", "-v", voice, "-s", "150", "-w", str(raw), "-f",
                    str(folder / "text.txt")], check=True)
    subprocess.run(["sox", str(raw), "-r", "16000", "-c", "1", "-b", "16", str(out)],
                   check=True)
    return out
