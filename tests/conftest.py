"""Shared fixtures: the real models, each loaded once per session (helpers and builders
that several modules use live in tests/support/)."""

from __future__ import annotations

import pytest


def _model_fixture(name: str, kind: str, alias: str):
    """A session fixture `name`: `workbench.<kind>.load(alias)`, closed after the last test."""

    @pytest.fixture(scope="session", name=name)
    def loaded():
        import workbench

        with getattr(workbench, kind).load(alias) as model:
            yield model

    return loaded


smollm2 = _model_fixture("smollm2", "LLM", "smollm2-135m")
minilm = _model_fixture("minilm", "Encoder", "minilm-l6")
qwen = _model_fixture("qwen", "LLM", "qwen2.5-coder-0.5b")
gemma3 = _model_fixture("gemma3", "LLM", "gemma3-270m")


@pytest.fixture(scope="module")
def engines(smollm2, minilm):
    """What the server tests serve, by model id: a chat model, an embedder, Whisper."""
    from workbench import WhisperModel

    with WhisperModel.load("whisper-tiny.en") as whisper:
        yield {"smollm2-135m": smollm2, "minilm-l6": minilm, "whisper-tiny.en": whisper}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items):
    """A browser test is slow too: the inner loop, `-m "not slow"`, leaves it out."""
    for item in items:
        if item.get_closest_marker("browser") is not None:
            item.add_marker(pytest.mark.slow)
