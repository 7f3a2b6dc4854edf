"""Keeps this node's NodeDevices record in step with what the daemon knows.

One loop owns the writes. When told something changed (`poke`: the
holdings moved), and every `check_interval` besides, it builds the status
from the daemon's last judged state (no hardware, no network) and, when it
differs from what was last written, writes it through the status
subresource, never more often than `min_interval`: a change right after a
write waits for the interval, and every change made meanwhile goes out in
that one write. Each write carries the
record's resourceVersion: a conflict (409) means someone else wrote in
between, so the record is read again and the write retried. A record that
is missing (never created, or deleted) is created, owned by the Node when
the Node can be read, so it goes away with the node. Every `resync` seconds
the record is read even without a change, which is how a deleted record
comes back; it is written only when what it says changed (the daemon's
liveness is a small Lease, `lease.py`). Errors back off; the daemon's RPCs
never wait on any of this.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from lightkube import ApiError, Client

from devplugin.cluster.objects import as_dict, node_owner
from devplugin.cluster.record import Stamps
from devplugin.loops import Backoff, ThreadLoop
from devplugin.node.metrics import Metrics
from devplugin.wire.nodedevices import API_VERSION, KIND
from devplugin.wire.resources import NodeDevices

log = logging.getLogger(__name__)

# Generic resources are dicts; their typed constructors want model objects.
_RECORD: Any = NodeDevices
_RECORD_STATUS: Any = NodeDevices.Status

StatusSource = Callable[[], dict[str, Any]]


class RecordPublisher(ThreadLoop):
    def __init__(
        self,
        client: Client,
        node: str,
        source: StatusSource,
        *,
        check_interval: float = 0.5,
        min_interval: float = 1.0,
        resync: float = 30.0,
        backoff_max: float = 30.0,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        stamps: Stamps | None = None,
    ) -> None:
        # A write gives up at its request timeout: a stop never waits on it long.
        super().__init__(
            "record",
            backoff=Backoff(check_interval, backoff_max),
            join_timeout=0.5,
            failing="NodeDevices record not written",
        )
        self._client = client
        self._node = node
        self._source = source
        self._check = check_interval
        self._min_interval = min_interval
        self._resync = resync
        self._metrics = metrics
        self._clock = clock
        self._written: dict[str, Any] | None = None
        # A change seen but not written yet (held back by min_interval).
        self._pending = False
        self._version: str | None = None
        self._last_write = float("-inf")
        self._last_read = float("-inf")
        self._stamps = stamps or Stamps()
        self.writes = 0

    def starting(self) -> None:
        log.info("NodeDevices record for %s: publishing", self._node)

    def step(self) -> float:
        self.sync_once()
        if self._pending:
            # Held back by min_interval: write the moment it allows.
            return max(0.0, self._last_write + self._min_interval - self._clock())
        return self._check

    def failed(self, exc: Exception) -> None:
        self._count("error")
        self._version = None  # read it again before the next write

    def recovered(self) -> None:
        log.info("NodeDevices record written again")

    def sync_once(self) -> bool:
        """Write the status if it changed (or the record needs checking); True if written."""
        status = self._source()
        now = self._clock()
        due_read = now - self._last_read >= self._resync
        self._pending = status != self._written
        if not self._pending and not due_read and self._version is not None:
            return False
        if self._pending and now - self._last_write < self._min_interval:
            return False
        if self._version is None or due_read:
            self._read_or_create()
            # Written only when its content changes: liveness is the Lease's
            # job, not a rewrite of the whole record.
            self._pending = status != self._written
            if not self._pending:
                return False
        self._write(status)
        return True

    def _read_or_create(self) -> None:
        self._last_read = self._clock()
        try:
            found = self._client.get(NodeDevices, self._node)
        except ApiError as exc:
            if exc.status.code != 404:
                raise
            found = self._create()
        data = as_dict(found)
        self._version = str(data.get("metadata", {}).get("resourceVersion") or "") or None
        existing = data.get("status")
        # What is there now is what was "written" (it may be another daemon's
        # older status after a restart: then it differs and is rewritten).
        self._written = _comparable(existing) if isinstance(existing, dict) else None

    def _create(self) -> Any:
        metadata: dict[str, Any] = {"name": self._node, "labels": {"devplugin.io/node": self._node}}
        owner = node_owner(self._client, self._node, what="record")
        if owner is not None:
            metadata["ownerReferences"] = [owner]
        body = _RECORD(apiVersion=API_VERSION, kind=KIND, metadata=metadata, spec={})
        try:
            created = self._client.create(body)
        except ApiError as exc:
            if exc.status.code != 409:
                raise
            created = self._client.get(NodeDevices, self._node)  # created meanwhile
        log.info("NodeDevices record %s created%s", self._node, "" if owner else " (no Node owner)")
        return created

    def _write(self, status: dict[str, Any]) -> None:
        for attempt in range(3):
            body = _RECORD_STATUS(
                apiVersion=API_VERSION,
                kind=KIND,
                metadata={"name": self._node, "resourceVersion": self._version},
                status=self._stamps.apply(status),
            )
            try:
                written = self._client.replace(body, self._node)
            except ApiError as exc:
                if exc.status.code == 409 and attempt < 2:
                    self._count("conflict")
                    self._read_or_create()
                    continue
                if exc.status.code == 404 and attempt < 2:
                    self._version = None
                    self._read_or_create()
                    continue
                raise
            data = as_dict(written)
            self._version = str(data.get("metadata", {}).get("resourceVersion") or "") or None
            self._written = status
            self._pending = False
            self._last_write = self._clock()
            self.writes += 1
            self._count("ok")
            return

    def _count(self, result: str) -> None:
        if self._metrics is not None:
            self._metrics.record_writes.labels(result).inc()


def _comparable(status: dict[str, Any]) -> dict[str, Any]:
    """A written status without the writer's stamps, to compare with a fresh one."""
    plain = {k: v for k, v in status.items() if k != "updated"}
    plain["conditions"] = [
        {k: v for k, v in c.items() if k != "lastTransitionTime"}
        for c in status.get("conditions", [])
        if isinstance(c, dict)
    ]
    return plain
