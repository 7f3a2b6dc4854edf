"""Hotplug: udev add/remove events for PCI and RDMA devices trigger a rescan.

`pyudev` is used when a udev netlink socket can be opened; otherwise (some
containers, tests) the daemon relies on its periodic rescan alone. Any object
with pyudev's `Monitor.poll(timeout)` interface can be handed in instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
from collections.abc import Callable
from typing import Any

from devplugin.loops import Backoff, ThreadLoop

log = logging.getLogger(__name__)

SUBSYSTEMS = ("pci", "infiniband", "infiniband_verbs", "infiniband_mad")
ACTIONS = frozenset({"add", "remove", "bind", "unbind"})
POLL_SECONDS = 0.2


def udev_monitor() -> Any | None:
    """A started pyudev monitor for the subsystems above, or None."""
    try:
        import pyudev

        context = pyudev.Context()
        monitor = pyudev.Monitor.from_netlink(context)
        for subsystem in SUBSYSTEMS:
            monitor.filter_by(subsystem)
        monitor.start()
    except Exception as exc:  # noqa: BLE001 - any failure means "no udev here"
        log.info("udev not available (%s); relying on periodic rescans", exc)
        return None
    return monitor


class HotplugWatcher(ThreadLoop):
    """Calls `on_event` with a description of every relevant udev event."""

    def __init__(self, monitor: Any, on_event: Callable[[str], None]) -> None:
        # Periodic rescans go on while udev fails: no hurry to ask it again.
        super().__init__(
            "hotplug",
            backoff=Backoff(5.0, 5.0),
            join_timeout=5.0,
            failing="udev monitor failed; periodic rescans continue",
        )
        self._monitor = monitor
        self._on_event = on_event
        # A pipe that wakes the select below at once when asked to stop.
        self._wake_r, self._wake_w = os.pipe()

    def signal_stop(self) -> None:
        if self.stopping:
            return
        super().signal_stop()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self._thread is not None and self._thread.is_alive():
            return
        if self._wake_w >= 0:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

    def _poll(self) -> Any:
        """The next event, or None; returns early when stopped."""
        fileno = getattr(self._monitor, "fileno", None)
        if fileno is None:
            # Not interruptible: the timeout bounds how long a stop waits.
            return self._monitor.poll(timeout=POLL_SECONDS)
        readable, _, _ = select.select([fileno(), self._wake_r], [], [])
        if self._wake_r in readable:
            return None
        return self._monitor.poll(timeout=0)

    def starting(self) -> None:
        log.info("hotplug watcher started")

    def step(self) -> float:
        device = self._poll()
        action = getattr(device, "action", None)
        if device is None or action not in ACTIONS:
            return 0.0
        what = f"{action} {getattr(device, 'subsystem', '?')} {getattr(device, 'sys_name', '?')}"
        log.info("hotplug event: %s", what)
        self._on_event(what)
        return 0.0
