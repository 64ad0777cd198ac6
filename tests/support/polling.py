"""Waiting, with a deadline, for something another thread or process does."""

from __future__ import annotations

import time


def wait_for(predicate, timeout: float) -> bool:
    """Poll `predicate` every 20 ms until it holds or `timeout` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()
