"""Waiting on a condition with a deadline (never a bare sleep as synchronisation)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], bool], timeout: float = 5.0, step: float = 0.01) -> bool:
    """Poll `condition` until it holds or `timeout` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(step)
    return condition()
