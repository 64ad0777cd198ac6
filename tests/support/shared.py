"""The test data under ../shared (beside the repository, as CI provides it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[3] / "shared"


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
