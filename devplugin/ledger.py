"""One ledger of which devices are taken, read by the allocator and by cleanup.

Two sources say a device is taken: the kubelet's PodResources answer (what
every container held when the poll began) and our own Allocates since. The
kubelet records an allocation only just after Allocate returns, so a poll
that began before (or just after) an Allocate can miss its devices; such a
device stays "recently allocated" until a poll that began after it has seen
it, or `grace` seconds of polls have passed without it.

Bounded whatever PodResources does: there is one entry per physical device
(Allocate validates ids before recording them, so only devices the node
serves get here), and an entry not confirmed by any poll expires after
`max_age` seconds even when every poll fails.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from devplugin.model import DeviceKind

BOOKKEEPING_GRACE = 5.0
MAX_AGE = 300.0


@dataclass(frozen=True)
class Holdings:
    """What one PodResources answer said, per container and per kind."""

    # (namespace, pod, container) -> kind -> physical device ids
    containers: Mapping[tuple[str, str, str], Mapping[DeviceKind, tuple[str, ...]]] = field(
        default_factory=dict
    )

    def held(self, kind: DeviceKind) -> frozenset[str]:
        return frozenset(
            device for kinds in self.containers.values() for device in kinds.get(kind, ())
        )


class Ledger:
    """Thread-safe; every method is O(devices) at most and never blocks on I/O."""

    def __init__(
        self,
        *,
        grace: float = BOOKKEEPING_GRACE,
        max_age: float = MAX_AGE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._grace = grace
        self._max_age = max(max_age, grace)
        self._clock = clock
        self._lock = threading.Lock()
        self._holdings = Holdings()
        self._held: dict[DeviceKind, frozenset[str]] = {k: frozenset() for k in DeviceKind}
        # (kind, device) -> when it was last allocated and not yet seen held.
        self._recent: dict[tuple[DeviceKind, str], float] = {}
        self._version = 0

    @property
    def version(self) -> int:
        """Changes whenever `taken` may have changed (for callers' caches)."""
        with self._lock:
            self._expire_locked(self._clock())
            return self._version

    def allocated(self, kind: DeviceKind, ids: Iterable[str]) -> None:
        now = self._clock()
        with self._lock:
            for device in ids:
                self._recent[(kind, device)] = now
            self._expire_locked(now)
            self._version += 1

    def observe(self, holdings: Holdings, polled_at: float) -> None:
        """A PodResources poll that began at `polled_at` answered `holdings`."""
        with self._lock:
            self._holdings = holdings
            self._held = {kind: holdings.held(kind) for kind in DeviceKind}
            for key, at in list(self._recent.items()):
                if at > polled_at:
                    continue  # allocated after the poll began: it proves nothing
                kind, device = key
                if device in self._held[kind] or polled_at - at > self._grace:
                    del self._recent[key]
            self._expire_locked(self._clock())
            self._version += 1

    def taken(self, kind: DeviceKind) -> frozenset[str]:
        """Held per the last poll, or allocated since and not yet confirmed."""
        with self._lock:
            self._expire_locked(self._clock())
            recent = [device for (k, device) in self._recent if k is kind]
            return self._held[kind].union(recent) if recent else self._held[kind]

    def holdings(self) -> Holdings:
        with self._lock:
            return self._holdings

    def __len__(self) -> int:
        """Entries kept besides the last answer: the bounded part."""
        with self._lock:
            self._expire_locked(self._clock())
            return len(self._recent)

    def _expire_locked(self, now: float) -> None:
        if not self._recent:
            return
        stale = [key for key, at in self._recent.items() if now - at > self._max_age]
        for key in stale:
            del self._recent[key]
        if stale:
            self._version += 1
