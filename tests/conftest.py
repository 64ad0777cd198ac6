"""Shared test fixtures: reference files from ../shared and the real models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared"


def shared_file(*parts: str) -> Path:
    """A file under ../shared; fails the test (never skips) when it is missing."""
    path = SHARED.joinpath(*parts)
    if not path.is_file():
        pytest.fail(f"missing shared test data {path}: the tests expect ../shared beside the "
                    "repository (as CI provides it)")
    return path


def reference(name: str) -> dict:
    """A reference JSON from ../shared/reference."""
    return json.loads(shared_file("reference", name).read_text())


@pytest.fixture(scope="session")
def smollm2():
    from workbench import LLM

    with LLM.load("smollm2-135m") as m:
        yield m


@pytest.fixture(scope="session")
def minilm():
    from workbench import Encoder

    with Encoder.load("minilm-l6") as enc:
        yield enc


@pytest.fixture(scope="session")
def qwen():
    from workbench import LLM

    with LLM.load("qwen2.5-coder-0.5b") as m:
        yield m


@pytest.fixture(scope="session")
def gemma3():
    from workbench import LLM

    with LLM.load("gemma3-270m") as m:
        yield m
