"""Which nodes' records the extender may trust: a record is read only while
its daemon is alive (its Lease renewed within the duration it promised, or,
for a daemon without a Lease, the record rewritten recently).

Leases are timed by the extender's own clock (LeaseClock): a forged or
skewed renewTime buys nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any

from lightkube import Client
from lightkube import operators as op

from devplugin.cluster.client import Heartbeat
from devplugin.cluster.lease import NODE_LABEL, Lease, lease_name, parse_micro_time
from devplugin.cluster.watch import Incomplete, WatchCache, WatchTiming
from devplugin.config import KubernetesConfig
from devplugin.extender.views import Layouts, parse_record
from devplugin.policy.node_record import ParsedRecord
from devplugin.wire.resources import NodeDevices


@dataclass(frozen=True)
class Record:
    """One node's record as the extender uses it."""

    parsed: ParsedRecord
    version: str  # the record's resourceVersion: which one the extender holds
    updated: float | None  # wall-clock seconds of status.updated


def record_entry(layouts: Layouts, data: Mapping[str, Any]) -> tuple[str, Record]:
    """Parse a record (linear in its devices) and see its layout built."""
    if not data.get("status"):
        # Created, its first status not written yet (the daemon does both).
        raise Incomplete("no status yet")
    parsed = parse_record(data)
    status = data.get("status") or {}
    updated = None
    stamp = status.get("updated") if isinstance(status, dict) else None
    if isinstance(stamp, str):
        try:
            updated = datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
        except ValueError:
            updated = None
    meta = data.get("metadata") or {}
    version = str(meta.get("resourceVersion") or "")
    return parsed.name, Record(layouts.want(parsed), version, updated)


# A Lease promising more than this is held to it (the chart's daemons
# promise 40 s).
MAX_LEASE_SECONDS = 300.0
# How far ahead of the extender's clock a renewTime may be at first sight.
CLOCK_SKEW = 5.0


@dataclass(frozen=True)
class NodeLease:
    """A node daemon's heartbeat (cluster/lease.py), timed by the extender."""

    # When (the extender's monotonic clock) this version of the Lease was
    # first seen: a renewal is a new version, whatever time it says it is.
    seen: float
    duration: float


class LeaseClock:
    """The Lease watch's entry function, with memory: each node's Lease
    counts from when the extender saw its version change, never from the
    time it carries (a forged or skewed renewTime in 2099 buys nothing).
    At first sight (a start, a re-list) its renewTime may only make it
    older: one that says it was renewed long ago, or later than now (past
    CLOCK_SKEW), is stale until it changes. Only the
    Lease the daemon writes for a node (`devplugin-<node>`) counts for it."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._clock, self._wall = clock, wall
        self._seen: dict[str, tuple[str, float]] = {}

    def __call__(self, data: Mapping[str, Any]) -> tuple[str, NodeLease]:
        meta, spec = data.get("metadata"), data.get("spec")
        if not isinstance(meta, dict) or not isinstance(spec, dict):
            raise ValueError("metadata and spec must be objects")
        labels = meta.get("labels")
        node = labels.get(NODE_LABEL) if isinstance(labels, dict) else None
        duration = spec.get("leaseDurationSeconds")
        if not isinstance(node, str) or not node:
            raise ValueError(f"no {NODE_LABEL} label")
        if meta.get("name") != lease_name(node):
            raise ValueError(
                f"labelled for node {node[:100]} but not named {lease_name(node)[:120]}"
            )
        if not isinstance(duration, int) or isinstance(duration, bool) or duration < 1:
            raise ValueError("spec.leaseDurationSeconds must be a positive integer")
        renewed = parse_micro_time(spec.get("renewTime"))
        if renewed is None:
            raise ValueError("spec.renewTime is not a time")
        version = str(meta.get("resourceVersion") or "")
        now = self._clock()
        known = self._seen.get(node)
        if known is not None and known[0] == version:
            seen = known[1]
        elif known is None:
            age = self._wall() - renewed
            # Claiming a renewal in the future is no renewal at all.
            seen = now - age if age >= -CLOCK_SKEW else float("-inf")
        else:
            seen = now
        self._seen[node] = (version, seen)
        return node, NodeLease(seen, min(float(duration), MAX_LEASE_SECONDS))


Fresh = Callable[[str], Record | None]


class Liveness:
    """Per node, its record while its daemon is alive."""

    def __init__(
        self,
        records: WatchCache[Record],
        leases: WatchCache[NodeLease] | None,
        *,
        stale_after: float,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.records, self.leases = records, leases
        self.stale_after = stale_after
        self._wall, self._clock = wall, clock

    def fresh(self, until: dict[str, float] | None = None) -> Fresh:
        """Its Lease renewed within the duration it promised (a daemon
        without a Lease, an older one, rewrites its record instead: then
        `updated` is judged, and one dated in the future counts as written
        now). The clocks are read once and the maps bound: for a loop over
        every node of a call. `until`, when given, gets for each fresh node
        when (on the monotonic clock) it goes stale unless an event comes
        first."""
        now, mono, stale_after = self._wall(), self._clock(), self.stale_after
        records = self.records.getter()
        leases = self.leases.getter() if self.leases is not None else None

        def fresh(name: str) -> Record | None:
            record = records(name)
            if record is None:
                return None
            lease = leases(name) if leases is not None else None
            if lease is not None:
                if mono - lease.seen > lease.duration:
                    return None
                if until is not None:
                    until[name] = lease.seen + lease.duration
                return record
            updated = record.updated
            if updated is None or now - min(updated, now) > stale_after:
                return None
            if until is not None:
                until[name] = mono + stale_after - (now - min(updated, now))
            return record

        return fresh

    def counts(self) -> tuple[int, int]:
        """(fresh, stale) records."""
        records = self.records.items()
        is_fresh = self.fresh()
        fresh = sum(1 for name in records if is_fresh(name) is not None)
        return fresh, len(records) - fresh


def record_cache(
    client: Client,
    kube: KubernetesConfig | None = None,
    heartbeat: Heartbeat | None = None,
    layouts: Layouts | None = None,
) -> WatchCache[Record]:
    kube = kube or KubernetesConfig()
    return WatchCache(
        client,
        NodeDevices,
        partial(record_entry, layouts or Layouts()),
        name="nodedevices",
        namespaced=False,
        timing=WatchTiming.of(kube),
        heartbeat=heartbeat,
    )


def lease_cache(
    client: Client,
    namespace: str,
    kube: KubernetesConfig | None = None,
    heartbeat: Heartbeat | None = None,
) -> WatchCache[NodeLease]:
    kube = kube or KubernetesConfig()
    return WatchCache(
        client,
        Lease,
        LeaseClock(),
        name="leases",
        namespaced=True,
        namespace=namespace,
        labels={NODE_LABEL: op.exists()},
        timing=WatchTiming.of(kube),
        heartbeat=heartbeat,
    )
