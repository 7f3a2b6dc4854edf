"""Kubernetes Events on pods: what each container got and how aligned it is.

`record` only queues (bounded; a full queue drops and counts), so nothing
that reports an allocation waits on the API server. One worker posts the
queued events; a failure is logged once per streak and the event dropped
(events are best effort, as the kubelet's own are).
"""

from __future__ import annotations

import contextlib
import logging
import queue
from collections.abc import Callable
from typing import Any

from lightkube import Client
from lightkube.generic_resource import create_namespaced_resource

from devplugin.cluster.record import now_stamp
from devplugin.loops import ThreadLoop
from devplugin.node.alignment import ContainerAlignment
from devplugin.node.metrics import Metrics

log = logging.getLogger(__name__)

RawEvent = create_namespaced_resource("", "v1", "Event", "events")
_EVENT: Any = RawEvent
QUEUE = 256
COMPONENT = "devplugin"


def describe(item: ContainerAlignment) -> tuple[str, str]:
    """(reason, message) for a container's devices."""
    parts = []
    if item.gpus:
        parts.append(f"{len(item.gpus)} GPU{'s' if len(item.gpus) != 1 else ''}")
    if item.hcas:
        parts.append(f"{len(item.hcas)} HCA{'s' if len(item.hcas) != 1 else ''}")
    what = " + ".join(parts)
    if item.worst is not None:
        return "Aligned", f"Aligned: {what}, worst GPU-HCA level {item.worst.name}"
    return "Allocated", f"Allocated: {what}"


class EventRecorder(ThreadLoop):
    def __init__(
        self,
        client: Client,
        node: str,
        uid_of: Callable[[str, str], str | None],
        *,
        metrics: Metrics | None = None,
    ) -> None:
        # A post gives up at its request timeout: a stop never waits on it long.
        super().__init__("events", join_timeout=0.5)
        self._client = client
        self._node = node
        self._uid_of = uid_of
        self._metrics = metrics
        self._queue: queue.Queue[ContainerAlignment | None] = queue.Queue(QUEUE)
        self._posting_failed = False
        self.posted = 0

    def record(self, item: ContainerAlignment) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._count("dropped")

    def signal_stop(self) -> None:
        super().signal_stop()
        # On a full queue the worker sees the stop once it drains a slot.
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)

    def run(self) -> None:
        # A queue worker, not rounds: each item is posted once, best effort
        # (as the kubelet's own events), never retried.
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._post(item)
                self.posted += 1
                self._count("ok")
                if self._posting_failed:
                    log.info("pod events are posted again")
                    self._posting_failed = False
            except Exception as exc:  # noqa: BLE001 - best effort, as the kubelet's events
                self._count("failed")
                if not self._posting_failed:
                    log.warning("pod event not posted (%s: %s)", type(exc).__name__, str(exc)[:200])
                    self._posting_failed = True

    def _post(self, item: ContainerAlignment) -> None:
        reason, message = describe(item)
        now = now_stamp()
        involved = {
            "apiVersion": "v1", "kind": "Pod", "namespace": item.namespace, "name": item.pod,
            "fieldPath": f"spec.containers{{{item.container}}}",
        }  # fmt: skip
        uid = self._uid_of(item.namespace, item.pod)
        if uid:
            involved["uid"] = uid
        event = _EVENT(
            apiVersion="v1",
            kind="Event",
            metadata={"generateName": f"{item.pod}.", "namespace": item.namespace},
            involvedObject=involved,
            reason=reason,
            message=f"{message} (container {item.container})",
            type="Normal",
            count=1,
            firstTimestamp=now,
            lastTimestamp=now,
            source={"component": COMPONENT, "host": self._node},
            reportingComponent=COMPONENT,
            reportingInstance=self._node,
        )
        self._client.create(event, namespace=item.namespace)

    def _count(self, result: str) -> None:
        if self._metrics is not None:
            self._metrics.pod_events.labels(result).inc()
