"""Allocations the kubelet may not have recorded yet.

The kubelet updates its own bookkeeping (what PodResources reports) just
after an Allocate returns, so a poll that starts right after an Allocate can
still miss those devices. Until a poll has seen a device, or `grace` seconds
of polls have passed without it, an allocated device is counted as taken.
Callers hold their own lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from devplugin.model import DeviceKind

BOOKKEEPING_GRACE = 5.0


@dataclass
class _Entry:
    kind: DeviceKind
    ids: set[str]
    at: float


class RecentAllocations:
    def __init__(self, grace: float = BOOKKEEPING_GRACE) -> None:
        self._grace = grace
        self._entries: list[_Entry] = []

    def add(self, kind: DeviceKind, ids: Iterable[str], at: float) -> None:
        self._entries.append(_Entry(kind, set(ids), at))

    def confirm(self, held: Mapping[DeviceKind, Iterable[str]], polled_at: float) -> None:
        """A poll that began at `polled_at` answered `held`."""
        seen = {kind: set(ids) for kind, ids in held.items()}
        kept: list[_Entry] = []
        for entry in self._entries:
            if entry.at <= polled_at:
                entry.ids -= seen.get(entry.kind, set())
                if polled_at - entry.at > self._grace:
                    continue
            if entry.ids:
                kept.append(entry)
        self._entries = kept

    def ids(self, kind: DeviceKind) -> set[str]:
        found: set[str] = set()
        for entry in self._entries:
            if entry.kind is kind:
                found |= entry.ids
        return found
