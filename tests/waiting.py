"""Waiting on a condition with a deadline (never a bare sleep as synchronisation)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def wait_until(condition: Callable[[], bool], timeout: float = 5.0, step: float = 0.01) -> bool:
    """Poll `condition` until it holds or `timeout` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(step)
    return condition()


def log_entries(log: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of a log a hook may be writing right now (a
    line not yet ended with a newline is left for the next read)."""
    if not log.exists():
        return []
    text = log.read_text()
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line]
