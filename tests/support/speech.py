"""The JFK recording and its words, and the word error rate the transcripts are held to."""

from __future__ import annotations

import re

import numpy as np

from tests.support.shared import shared_file

JFK = ("And so, my fellow Americans, ask not what your country can do for you, "
       "ask what you can do for your country.")


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
    from workbench.engine.audio import load_audio

    return load_audio(shared_file("data", "whisper", "jfk.wav"))
