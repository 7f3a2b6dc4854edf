"""The check loop's port bookkeeping under concurrent callers: a scan that
began before a port read never leaves its older port states behind as the
newest (which made the next port read see a change that was not one, and
a device judged from it go through a second cleanup)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from devplugin.node.checks import CheckLoop
from tests.waiting import wait_until

UP = (("mlx5_0", 1, "4: ACTIVE", "5: LinkUp"),)
DOWN = (("mlx5_0", 1, "1: DOWN", "3: Disabled"),)


def _inventory(states: tuple[tuple[str, int, str, str], ...]) -> Any:
    ports = [SimpleNamespace(number=n, state=s, phys_state=p) for _, n, s, p in states]
    return SimpleNamespace(hcas=[SimpleNamespace(name="mlx5_0", ports=ports)])


class _Discoverer:
    """Scans that report what `scan_states` says when they begin, and can be
    held before they return; port reads that report `live`."""

    def __init__(self) -> None:
        self.live = UP
        self.scan_states = UP
        self.hold = threading.Event()
        self.hold.set()
        self.scanning = threading.Event()
        self.ports_read = threading.Event()
        self.deadlines = SimpleNamespace(stuck=dict)
        self.incomplete: list[str] = []

    def scan(self, full: bool = True) -> Any:
        found = _inventory(self.scan_states)
        self.scanning.set()
        assert self.hold.wait(10)
        return found

    def port_states(self) -> Any:
        self.ports_read.set()
        return self.live


def test_a_scan_older_than_a_port_read_never_wins(tmp_path: object) -> None:
    discoverer = _Discoverer()
    ingested: list[Any] = []
    pipeline = SimpleNamespace(ingest=ingested.append)
    checks = CheckLoop(
        discoverer,  # type: ignore[arg-type]
        pipeline,  # type: ignore[arg-type]
        interval=1.0,
        rescan=10.0,
        stale_after=60.0,
        port_interval=1.0,
    )
    checks.check()  # ports up
    # A scan begins while the port is down, and is slow to return...
    discoverer.scan_states = DOWN
    discoverer.hold.clear()
    scan = threading.Thread(target=checks.check)
    scan.start()
    assert discoverer.scanning.wait(5)
    # ... the port comes back and the port watch reads it meanwhile.
    discoverer.live = UP
    changed: list[bool] = []
    read = threading.Thread(target=lambda: changed.append(checks.ports_changed()))
    read.start()
    # The read may not happen while the scan is in flight (it waits for it);
    # if it does, it is newer than the scan's states all the same.
    discoverer.ports_read.wait(0.5)
    discoverer.hold.set()
    scan.join(5)
    read.join(5)
    assert wait_until(lambda: len(changed) == 1, timeout=5)
    # The read came after the scan: the newest states are up, and reading
    # them again is no change.
    assert checks._ports == UP
    assert not checks.ports_changed()
