"""The cluster side of one node's daemon, assembled: the pod watch and what
it lends the node core, the event recorder, the NodeDevices record with
its Lease, and what the DRA front-end needs of the API (a claim reader and
the ResourceSlice writer). Without API access every part is absent and
the node serves from the kubelet alone.

The parts that talk to the API server are imported where they are built,
only once the API is enabled: a daemon without it never loads the API
client and its HTTP stack (7 MiB of its idle memory)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from devplugin.cluster.record import Registration, Stamps, build_status
from devplugin.cluster.required import BelowRequired
from devplugin.config import Config, lease_namespace, node_name
from devplugin.loops import Loop
from devplugin.model import DeviceKind, Inventory
from devplugin.node.alignment import ContainerAlignment
from devplugin.node.core import NodeCore
from devplugin.node.ledger import Ledger
from devplugin.node.metrics import Metrics
from devplugin.node.resources import ResourceState
from devplugin.policy.claims import ClaimReader, ClaimReadError
from devplugin.policy.podinfo import PodInfo
from devplugin.wire.nodedevices import API_VERSION, KIND

if TYPE_CHECKING:
    from lightkube import Client

    from devplugin.cluster.allocated import AllocatedClaims
    from devplugin.cluster.awareness import PodAwareness
    from devplugin.cluster.events import EventRecorder
    from devplugin.cluster.lease import LeaseKeeper
    from devplugin.cluster.node_labels import NodeFacts, NodeLabeller
    from devplugin.cluster.pods import PodCache
    from devplugin.cluster.publisher import RecordPublisher
    from devplugin.cluster.slices import Desired, SlicePublisher
    from devplugin.cluster.watch import WatchCache

log = logging.getLogger(__name__)


class _NoApi:
    """Claims cannot be read without API access: every prepare fails (and
    the kubelet retries), nothing is handed out unchecked."""

    def get(self, namespace: str, name: str) -> Any:
        raise ClaimReadError("no Kubernetes API access")

    def on_node(self, driver: str, pool: str) -> Any:
        raise ClaimReadError("no Kubernetes API access")


@dataclass(frozen=True)
class StatusInputs:
    """What the NodeDevices record is made of, each a plain callable that
    reads the last judged state (no I/O)."""

    inventory: Callable[[], Inventory]
    states: Callable[[], Mapping[DeviceKind, ResourceState]]
    holders: Callable[[], list[ContainerAlignment]]
    registered: Callable[[], dict[str, bool]]
    # Device id -> (resource name, replicas), as the kubelet is served them.
    served: Callable[[], Mapping[str, tuple[str, int]]] = dict
    # What the kubelet aligns, and its NUMA nodes (node/kubelet_facts.py).
    kubelet: Callable[[], dict[str, Any]] = dict
    numa: Callable[[], list[dict[str, int]]] = list


def node_status(
    inputs: StatusInputs,
    uid_of: Callable[[str, str], str | None] | None,
    kubelet_version: str = "",
) -> dict[str, Any]:
    """The NodeDevices status from the last judged state and the holdings
    as the events left them."""
    registered = inputs.registered()
    missing = sorted(name for name, ok in registered.items() if not ok)
    registration = Registration(
        registered=bool(registered) and not missing,
        message=(
            f"not registered: {', '.join(missing)}"
            if missing
            else f"registered: {', '.join(sorted(registered))}"
        ),
    )
    containers = inputs.holders()
    if uid_of is not None:
        # Holders only PodResources named: their uid from the pod cache.
        containers = [
            replace(c, uid=uid_of(c.namespace, c.pod)) if c.uid is None and c.pod else c
            for c in containers
        ]
    kubelet = inputs.kubelet()
    if kubelet_version:
        kubelet = {**kubelet, "version": kubelet_version[:64]}
    return build_status(
        inputs.inventory(),
        inputs.states(),
        containers,
        registration,
        inputs.served(),
        kubelet=kubelet,
        numa=inputs.numa(),
    )


def _pod_ended(ledger: Ledger, pods: PodCache, pod: PodInfo) -> None:
    live = pods.uid_of(pod.namespace, pod.name)
    ledger.pod_ended(
        pod.namespace, pod.name, pod.uid, successor=live is not None and live != pod.uid
    )


@dataclass
class ClusterSide:
    config: Config
    pods: PodCache | None = None
    # Writes (the record, events, slices) on their own connection: the pod
    # watch's is closed to end it at stop.
    writer: Client | None = None
    awareness: PodAwareness | None = None
    events: EventRecorder | None = None
    publisher: RecordPublisher | None = None
    lease: LeaseKeeper | None = None
    labeller: NodeLabeller | None = None
    node_watch: WatchCache[NodeFacts] | None = None
    allocations: AllocatedClaims | None = None
    # The record's stamps, shared by its writer and the status endpoint.
    stamps: Stamps = field(default_factory=Stamps)

    @classmethod
    def connect(cls, config: Config) -> ClusterSide:
        """The API clients and the pod watch, when the API is enabled."""
        kube = config.kubernetes
        if not kube.enabled:
            return cls(config)
        from devplugin.cluster.client import Heartbeat, make_client
        from devplugin.cluster.pods import PodCache
        from devplugin.cluster.watch import WatchTiming

        heartbeat = Heartbeat()
        client = make_client(kube, heartbeat=heartbeat)
        if client is None:
            return cls(config)
        pods = PodCache(client, node_name(config), timing=WatchTiming.of(kube), heartbeat=heartbeat)
        return cls(config, pods=pods, writer=make_client(kube))

    def witness(
        self, ledger: Ledger, metrics: Metrics, names: Mapping[DeviceKind, str]
    ) -> PodAwareness | None:
        """The pod watch's view of who holds what, lent to the node core."""
        if self.pods is None:
            return None
        from devplugin.cluster.awareness import PodAwareness

        config = self.config
        self.awareness = PodAwareness(
            self.pods,
            ledger,
            dict(names),
            wait=config.kubernetes.pod_wait_seconds,
            metrics=metrics,
            pair_seconds=config.allocation.pairing_window_seconds,
            claim_seconds=config.kubernetes.claim_seconds,
        )
        return self.awareness

    def attach(self, core: NodeCore) -> None:
        """Pod events move the holdings before any reader sees the change;
        new holders become pod events."""
        pods, config = self.pods, self.config
        if pods is None:
            return
        pods.listen(core.lifecycle.releases.reconsider)
        pods.on_ended(partial(_pod_ended, core.ledger, pods))
        ledger = core.ledger
        pods.on_started(lambda pod: ledger.pod_started(pod.namespace, pod.name, pod.uid))
        core.metrics.watch_current.labels("pods").set_function(lambda: float(pods.current))
        core.metrics.watch_age.labels("pods").set_function(pods.age)
        core.metrics.watch_lists.labels("pods").set_function(lambda: float(pods.relists))

        def pod_of(namespace: str, name: str) -> PodInfo | None:
            uid = pods.uid_of(namespace, name)
            return pods.pods().get(uid) if uid is not None else None

        core.monitor.on_new(BelowRequired(pod_of, core.metrics))
        if self.writer is not None and config.kubernetes.events:
            from devplugin.cluster.events import EventRecorder

            self.events = EventRecorder(
                self.writer, node_name(config), pods.uid_of, metrics=core.metrics
            )
            core.monitor.on_new(self.events.record)

    def claim_reader(self) -> ClaimReader:
        """Claims read with the DRA deadline, on a connection of their own."""
        kube, dra = self.config.kubernetes, self.config.dra
        if not kube.enabled:
            return _NoApi()
        from devplugin.cluster.claims import ApiClaimReader
        from devplugin.cluster.client import make_client

        reads = make_client(replace(kube, request_timeout_seconds=dra.claim_timeout_seconds))
        return ApiClaimReader(reads) if reads is not None else _NoApi()

    def follow_allocations(
        self, reader: ClaimReader, *, driver: str, pool: str, changed: Callable[[], None]
    ) -> AllocatedClaims | None:
        """The devices the scheduler allocated here, from the claims of the
        node's pods (None without the pod watch)."""
        if self.pods is None:
            return None
        from devplugin.cluster.allocated import AllocatedClaims

        resync = self.config.kubernetes.record_resync_seconds
        self.allocations = AllocatedClaims(
            self.pods, reader, driver=driver, pool=pool, changed=changed, resync=resync
        )
        return self.allocations

    def slice_publisher(self, desired: Desired, metrics: Metrics) -> SlicePublisher | None:
        kube = self.config.kubernetes
        if self.writer is None:
            return None
        from devplugin.cluster.client import make_client
        from devplugin.cluster.slices import SlicePublisher, slice_cache
        from devplugin.cluster.watch import WatchTiming

        watcher = make_client(kube)
        if watcher is None:
            return None
        node = node_name(self.config)
        return SlicePublisher(
            self.writer,
            slice_cache(watcher, node, WatchTiming.of(kube)),
            driver=self.config.dra.driver,
            node=node,
            desired=desired,
            metrics=metrics,
        )

    def record(self, inputs: StatusInputs) -> dict[str, Any]:
        """The NodeDevices record as it would be published now (the status
        endpoint's /record), holders named by the pod watch where there is one."""
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": node_name(self.config) or socket.gethostname()},
            "status": self.stamps.apply(self._status(inputs)),
        }

    def _status(self, inputs: StatusInputs) -> dict[str, Any]:
        """The record's status now, holders named by the pod watch where
        there is one (what the writer publishes and /record serves)."""
        return node_status(
            inputs, self.pods.uid_of if self.pods is not None else None, self._kubelet_version()
        )

    def _kubelet_version(self) -> str:
        """The kubelet's version as its Node says (the node watch's), where watched."""
        if self.node_watch is None:
            return ""
        facts = self.node_watch.items().get(node_name(self.config))
        return facts.kubelet_version if facts is not None else ""

    def publish_record(self, inputs: StatusInputs, core: NodeCore) -> None:
        """The NodeDevices record and its Lease, when the config asks."""
        kube, writer = self.config.kubernetes, self.writer
        if writer is None or not kube.node_devices:
            return
        from devplugin.cluster.lease import LeaseKeeper
        from devplugin.cluster.publisher import RecordPublisher

        node = node_name(self.config)
        self.publisher = RecordPublisher(
            writer,
            node,
            partial(self._status, inputs),
            min_interval=kube.record_min_interval_seconds,
            resync=kube.record_resync_seconds,
            metrics=core.metrics,
            stamps=self.stamps,
        )
        core.ledger.listen(self.publisher.poke)
        self.lease = LeaseKeeper(
            writer,
            node,
            lease_namespace(self.config),
            renew=kube.lease_renew_seconds,
            duration=kube.lease_duration_seconds,
        )
        core.metrics.lease_age.set_function(self.lease.age)
        core.metrics.lease_duration.set(kube.lease_duration_seconds)

    def label_node(self, inventory: Callable[[], Inventory], core: NodeCore) -> None:
        """The devplugin.io/ labels on this node's Node, when the config asks;
        every judgement (a scan, a hotplug) pokes it."""
        kube, writer = self.config.kubernetes, self.writer
        if writer is None or not kube.node_labels:
            return
        from devplugin.cluster.client import make_client
        from devplugin.cluster.node_labels import NodeLabeller, inventory_labels, node_cache
        from devplugin.cluster.watch import WatchTiming

        strategy = self.config.resources.gpu.mig.strategy
        labeller = NodeLabeller(
            writer,
            node_name(self.config),
            lambda: inventory_labels(inventory(), None if strategy == "none" else strategy),
        )
        core.pipeline.on_judged(labeller.poke)
        self.labeller = labeller
        watcher = make_client(kube)
        if watcher is not None:
            self.node_watch = node_cache(watcher, node_name(self.config), WatchTiming.of(kube))
            labeller.follow(self.node_watch)

    @property
    def loops(self) -> list[Loop]:
        """In start order: the pod watch first, the record's writers after."""
        found: list[Loop | None] = [
            self.pods,
            self.allocations,
            self.events,
            self.publisher,
            self.lease,
            self.node_watch,
            self.labeller,
        ]
        return [loop for loop in found if loop is not None]

    def close(self) -> None:
        if self.writer is not None:
            try:
                self.writer.close()
            except Exception:
                log.debug("closing the API writer failed", exc_info=True)
