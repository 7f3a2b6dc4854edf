"""The node daemon's heartbeat: one small Lease, renewed every few seconds.

Kubernetes moved the kubelet's own heartbeat from the Node object to a Lease
for the reason this exists: rewriting a multi-kilobyte record every half
minute on thousands of nodes is a steady stream of etcd writes, each fanned
out to every watcher, for no change at all. The NodeDevices record is now
written only when its content changes; this Lease (`coordination.k8s.io/v1`,
named `devplugin-<node>`, labelled `devplugin.io/node=<node>`, owned by the
Node) says the daemon is alive. `spec.renewTime` is stamped at each renewal
and `spec.leaseDurationSeconds` promises the next one within that long; the
scheduler extender treats a node's record as stale past it.

One loop owns the writes: a PUT with the Lease's resourceVersion every
`renew` seconds (a conflict or a missing Lease is read or created again),
errors backed off. Nothing else waits on it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from lightkube import ApiError, Client
from lightkube.generic_resource import create_namespaced_resource

from devplugin.cluster.objects import as_dict, node_owner
from devplugin.loops import Backoff, ThreadLoop

log = logging.getLogger(__name__)

Lease = create_namespaced_resource("coordination.k8s.io", "v1", "Lease", "leases")
_LEASE: Any = Lease
NODE_LABEL = "devplugin.io/node"


def lease_name(node: str) -> str:
    return f"devplugin-{node}"


def micro_time(when: datetime | None = None) -> str:
    """A MicroTime as the API writes it (RFC 3339, microseconds, UTC)."""
    return (when or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_micro_time(text: object) -> float | None:
    """Seconds since the epoch of a (Micro)Time, or None."""
    if not isinstance(text, str):
        return None
    for layout in ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return datetime.strptime(text, layout).replace(tzinfo=UTC).timestamp()
        except ValueError:
            continue
    return None


class LeaseKeeper(ThreadLoop):
    def __init__(
        self,
        client: Client,
        node: str,
        namespace: str,
        *,
        renew: float = 10.0,
        duration: int = 40,
        backoff_max: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # A write gives up at its request timeout: a stop never waits on it long.
        super().__init__(
            "lease",
            backoff=Backoff(1.0, min(backoff_max, renew)),
            join_timeout=0.5,
            failing="Lease not renewed",
        )
        self._client = client
        self._node = node
        self._namespace = namespace
        self._renew = renew
        self._duration = duration
        self._clock = clock
        self._version: str | None = None
        # The Lease's metadata as last read or written: a PUT replaces the
        # whole of it, so a renewal that left out the owner would drop it
        # and the Lease would outlive its Node.
        self._meta: dict[str, Any] = {}
        self.renewals = 0
        # When it was last renewed (or, before the first, when this began).
        self._renewed_at = clock()

    def starting(self) -> None:
        log.info(
            "Lease %s/%s: renewed every %.0fs (valid %ds)",
            self._namespace,
            lease_name(self._node),
            self._renew,
            self._duration,
        )

    def step(self) -> float:
        self.renew_once()
        return self._renew

    def failed(self, exc: Exception) -> None:
        self._version = None

    def recovered(self) -> None:
        log.info("Lease renewed again")

    def renew_once(self) -> None:
        """One renewal: PUT with the known version; read or create on need."""
        for attempt in range(3):
            if self._version is None:
                self._read_or_create()
            body = self._body()
            try:
                written = self._client.replace(body)
            except ApiError as exc:
                if exc.status.code in (404, 409) and attempt < 2:
                    self._version = None
                    continue
                raise
            self._keep(written)
            self.renewals += 1
            self._renewed_at = self._clock()
            return

    def age(self) -> float:
        """Seconds since the last renewal (the devplugin_lease_age_seconds gauge)."""
        return max(0.0, self._clock() - self._renewed_at)

    def _keep(self, obj: Any) -> None:
        meta = dict(as_dict(obj).get("metadata") or {})
        meta.pop("managedFields", None)  # the server's to keep
        self._meta = meta
        self._version = _version_of(obj)

    def _body(self) -> Any:
        labels = dict(self._meta.get("labels") or {})
        labels[NODE_LABEL] = self._node
        return _LEASE(
            apiVersion="coordination.k8s.io/v1",
            kind="Lease",
            metadata={
                **self._meta,
                "name": lease_name(self._node),
                "namespace": self._namespace,
                "labels": labels,
                "resourceVersion": self._version,
            },
            spec={
                "holderIdentity": self._node,
                "leaseDurationSeconds": self._duration,
                "renewTime": micro_time(),
            },
        )

    def _read_or_create(self) -> None:
        try:
            found = self._client.get(Lease, lease_name(self._node), namespace=self._namespace)
        except ApiError as exc:
            if exc.status.code != 404:
                raise
            found = self._create()
        self._keep(found)

    def _create(self) -> Any:
        metadata: dict[str, Any] = {
            "name": lease_name(self._node), "namespace": self._namespace,
            "labels": {NODE_LABEL: self._node},
        }  # fmt: skip
        owner = node_owner(self._client, self._node)
        if owner is not None:
            metadata["ownerReferences"] = [owner]
        body = _LEASE(
            apiVersion="coordination.k8s.io/v1",
            kind="Lease",
            metadata=metadata,
            spec={
                "holderIdentity": self._node,
                "leaseDurationSeconds": self._duration,
                "acquireTime": micro_time(),
                "renewTime": micro_time(),
            },
        )
        try:
            return self._client.create(body)
        except ApiError as exc:
            if exc.status.code != 409:
                raise
            return self._client.get(Lease, lease_name(self._node), namespace=self._namespace)


def _version_of(obj: Any) -> str | None:
    return str(as_dict(obj).get("metadata", {}).get("resourceVersion") or "") or None
