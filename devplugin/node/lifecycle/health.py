"""Health as a small state machine per device.

Each check reports what the hardware looks like now (a port state, a device
node, an NVML handle); events (XIDs) report faults between checks. A device
that was found unhealthy for any reason stays Unhealthy until it has
recovered: after `good_checks` consecutive good checks (`auto`), or only once
its cleanup hook has succeeded (`after_cleanup`). Nothing is unhealthy
forever: a recovered device is Healthy again.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from devplugin.model import Health


class Recovery(enum.Enum):
    AUTO = "auto"
    AFTER_CLEANUP = "after_cleanup"


@dataclass(frozen=True)
class Verdict:
    health: Health
    reason: str = ""


HEALTHY = Verdict(Health.HEALTHY)


class HealthTracker:
    """Latched faults and good-check streaks, keyed by device id. Thread-safe."""

    def __init__(self, recovery: Recovery = Recovery.AUTO, good_checks: int = 1) -> None:
        self._recovery = recovery
        self._good_checks = good_checks
        self._lock = threading.Lock()
        self._faults: dict[str, str] = {}
        self._streak: dict[str, int] = {}
        # Good checks a latched fault needs before auto recovery.
        self._required: dict[str, int] = {}

    def observe(self, device_id: str, healthy: bool, reason: str = "") -> bool:
        """One check's result; returns whether the device recovered with it."""
        with self._lock:
            if not healthy:
                self._latch(device_id, reason or "unhealthy", self._good_checks)
                return False
            if device_id not in self._faults:
                return False
            self._streak[device_id] = self._streak.get(device_id, 0) + 1
            needed = self._required.get(device_id, self._good_checks)
            if self._recovery is Recovery.AUTO and self._streak[device_id] >= needed:
                self._clear(device_id)
                return True
            return False

    def fault(self, device_id: str, reason: str, good_checks: int | None = None) -> None:
        """A fault seen between checks (an XID): latched like a failed check,
        optionally needing more good checks than a plain failed check."""
        with self._lock:
            self._latch(device_id, reason, good_checks or self._good_checks)

    def _latch(self, device_id: str, reason: str, needed: int) -> None:
        required = self._required.get(device_id, 0)
        # A plain failed check on top of a stronger fault (an XID that needs
        # 30 good checks) keeps the stronger fault's reason and requirement.
        if device_id not in self._faults or needed >= required:
            self._faults[device_id] = reason
        self._streak[device_id] = 0
        self._required[device_id] = max(needed, required)

    def _clear(self, device_id: str) -> None:
        self._faults.pop(device_id, None)
        self._required.pop(device_id, None)

    def cleaned(self, device_id: str) -> bool:
        """A cleanup hook succeeded; in after_cleanup mode this is the recovery."""
        with self._lock:
            if self._recovery is Recovery.AFTER_CLEANUP and device_id in self._faults:
                self._clear(device_id)
                return True
            return False

    def verdict(self, device_id: str) -> Verdict:
        with self._lock:
            reason = self._faults.get(device_id)
        return HEALTHY if reason is None else Verdict(Health.UNHEALTHY, reason)

    def verdicts(self) -> dict[str, Verdict]:
        """Every latched fault, as one snapshot."""
        with self._lock:
            return {device: Verdict(Health.UNHEALTHY, r) for device, r in self._faults.items()}

    def faulted(self) -> set[str]:
        with self._lock:
            return set(self._faults)

    def forget(self, present: Iterable[str]) -> None:
        """Drop state for devices that are gone (hot-unplugged)."""
        keep = set(present)
        with self._lock:
            for device_id in [d for d in self._faults if d not in keep]:
                self._clear(device_id)
            for device_id in [d for d in self._streak if d not in keep]:
                del self._streak[device_id]
