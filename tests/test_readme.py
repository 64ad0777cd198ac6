"""The README's Python examples, run as written: every ```python block, top to bottom,
in one namespace (a block uses what the ones before it made), in a folder holding the
audio files they name. A renamed argument or a changed return shape fails here."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.support.shared import shared_file
from tests.support.speech import FRENCH, espeak_wav

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of a Markdown text, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)


def test_the_readme_has_python_examples():
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 7 and all(b.strip() for b in blocks)


def test_readme_examples_run(tmp_path, monkeypatch):
    shutil.copy(shared_file("data", "whisper", "jfk.wav"), tmp_path / "speech.wav")
    shutil.copy(espeak_wav(FRENCH, "fr", tmp_path), tmp_path / "fr.wav")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    try:
        for i, block in enumerate(python_blocks(README.read_text())):
            code = compile(block, f"README.md, python block {i + 1}", "exec")
            exec(code, namespace)  # noqa: S102  (our own README)
        # what the examples promise, checked on what they made
        assert namespace["c"].finish_reason in ("stop", "length")
        assert str(namespace["t"]).lower().startswith("and so")
        assert namespace["M"].shape == (3, 384)
        assert namespace["base"].detect_language("fr.wav")[0] == "fr"
    finally:
        for name in ("server",):
            if name in namespace:
                namespace[name].stop()
        for value in list(namespace.values()):
            if hasattr(value, "close") and type(value).__name__ in (
                    "LLM", "Encoder", "WhisperModel"):
                value.close()
