"""The peers tier (`python -m pytest -m peers`, after `pip install -e '.[peers]'`): every
stored golden (tests/goldens) equals what its live peer answers today. The gate never
runs these; it compares against the stored goldens."""

from __future__ import annotations

import pytest

from tests.goldens.registry import compare, load_stored, producers

pytestmark = pytest.mark.peers


@pytest.mark.parametrize("name", list(producers()))
def test_live_peer_equals_stored_golden(name):
    live = producers()[name]()
    problems = compare(load_stored(name), live)
    assert not problems, f"{name}: the live peer no longer gives the stored golden: " \
        + "; ".join(problems) + f" (regenerate with `python -m tests.goldens {name}` and " \
        "explain the change)"
