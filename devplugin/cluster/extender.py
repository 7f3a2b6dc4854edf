"""`devplugin extender`: a kube-scheduler extender that sends pods where an
aligned GPU+HCA set is free.

It watches every NodeDevices record and every pod bound to a node (pods a
record does not show yet are placed on their node first, as its daemon
will), and answers the kube-scheduler's extender calls
(`k8s.io/kube-scheduler/extender/v1`; the Go types carry no JSON tags, so
the field names are the Go names):

* POST /scheduler/filter: ExtenderArgs {Pod, Nodes | NodeNames} ->
  ExtenderFilterResult {Nodes | NodeNames, FailedNodes,
  FailedAndUnresolvableNodes, Error}.
* POST /scheduler/prioritize: ExtenderArgs -> HostPriorityList
  [{Host, Score}], Score 0..10.
* POST /scheduler/claims/filter and /scheduler/claims/prioritize: the same
  for pods that ask for devices through ResourceClaims (with --dra). The
  scheduler calls an extender whose `managedResources` is set only for
  pods that request one of them (HTTPExtender.IsInterested), so the chart
  names this one without: it is asked about every pod and answers at once
  (everything passes, every score 0) for one without claims. For a pod
  with claims it predicts, node by node, what the allocator will pick
  (dra_views.py), filters out nodes where that is nothing, and ranks the
  rest by the worst GPU+HCA pair of that choice.

A node without a record, whose daemon's Lease has run out, or whose large
layout is still being built, is never filtered (scheduling must not stop
because a daemon is down) and scores 0. Work follows events, not requests
(`views.py`): a record or pod change makes that node's view be rebuilt on
its next use, each pod shape placed once; a call then costs a few lookups
per node. Nothing here waits on the network: the caches are read.

Requests are bounded: bodies up to MAX_BODY, at most IN_FLIGHT_BYTES of
them decoded at once, CONCURRENT calls handled at once with a listen
backlog of BACKLOG; JSON that cannot be decoded (nested too deeply
included) is a 400.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import partial
from http.server import BaseHTTPRequestHandler
from typing import Any, ClassVar

from lightkube import Client
from lightkube import operators as op
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from devplugin.cluster.client import Heartbeat, make_client
from devplugin.cluster.dra_views import DraCaches, DraViews, dra_caches, pod_claims
from devplugin.cluster.lease import NODE_LABEL, Lease, lease_name, parse_micro_time
from devplugin.cluster.pods import PodCache
from devplugin.cluster.publisher import NodeDevices
from devplugin.cluster.views import MAX_REASON, Layouts, NodeViews, parse_record
from devplugin.cluster.watch import Incomplete, WatchCache, WatchTiming
from devplugin.config import KubernetesConfig
from devplugin.policy.dra_predict import Prediction, ranks
from devplugin.policy.placement import (
    Outcome,
    ParsedRecord,
    Requirement,
    Shape,
    check,
    requirement_of,
    scores,
    shape_of,
)
from devplugin.policy.podinfo import ContainerInfo, PodInfo, parse_pod
from devplugin.web import BoundedHandler, BoundedServer, Listener

log = logging.getLogger(__name__)

# Request bodies. A NodeNames call (the chart's scheduler profile is
# nodeCacheCapable) is about 20 bytes a node; a full Nodes list about 5 KiB a
# node, and decoded it takes about ten times its size. The chart's limit is
# 512 MiB: bodies at most MAX_BODY, and at most IN_FLIGHT_BYTES of bodies
# read and decoded at once (a larger one waits its turn, up to BODY_WAIT
# seconds, then gets a 503), keep requests within about 200 MiB of it.
MAX_BODY = 16 << 20
IN_FLIGHT_BYTES = 20 << 20
BODY_WAIT = 10.0
# Calls answered at once; a call whose body has arrived waits up to
# SLOT_WAIT for one, then gets a 503 (the scheduler retries). Bodies are
# read before a slot is taken, each within REQUEST_TIMEOUT as a whole.
CONCURRENT = 8
SLOT_WAIT = 5.0
REQUEST_TIMEOUT = 30.0
# A connection with no request for this long is closed (the scheduler opens
# new ones freely; idle ones only hold threads).
IDLE_TIMEOUT = 5.0
# Connections at once (a thread each); more are closed at once.
MAX_CONNECTIONS = 256
BACKLOG = 128
# /healthz fails once every call slot has been busy this long.
FULL_FOR = 10.0
# A prioritize for a pod takes the per-node answers its filter made this
# recently (the scheduler filters and then scores in one cycle, on one
# snapshot of the cluster taken before both); answers for this many pods
# are kept.
REUSE_FOR = 1.0
REUSED_PODS = 16


class CycleMemo:
    """Per pod, the per-node answers its last filter made: what the
    prioritize of the same scheduling cycle scores."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._kept: OrderedDict[tuple[str, str], tuple[float, dict[str, Any]]] = OrderedDict()

    def keep(self, kind: str, uid: str, answers: dict[str, Any]) -> None:
        with self._lock:
            self._kept[(kind, uid)] = (self._clock(), answers)
            self._kept.move_to_end((kind, uid))
            while len(self._kept) > REUSED_PODS:
                self._kept.popitem(last=False)

    def take(self, kind: str, uid: str, names: Sequence[str]) -> dict[str, Any] | None:
        """The answers for these nodes, if the pod's filter made them all
        within REUSE_FOR; None otherwise."""
        with self._lock:
            found = self._kept.get((kind, uid))
        if found is None or self._clock() - found[0] > REUSE_FOR:
            return None
        answers = found[1]
        try:
            return {name: answers[name] for name in names}
        except KeyError:
            return None


class BadRequest(ValueError):
    pass


class Busy(RuntimeError):
    """Too much request data in flight: answered 503, the scheduler retries."""


class Budget:
    """Bytes of request bodies in flight (a request larger than the whole
    budget runs alone)."""

    def __init__(self, total: int) -> None:
        self._total = total
        self._used = 0
        self._cond = threading.Condition()

    def take(self, amount: int, wait: float) -> bool:
        amount = min(amount, self._total)
        with self._cond:
            if not self._cond.wait_for(lambda: self._used + amount <= self._total, wait):
                return False
            self._used += amount
            return True

    def give(self, amount: int) -> None:
        with self._cond:
            self._used -= min(amount, self._total)
            self._cond.notify_all()


class Slots(Budget):
    """The call slots (a budget of one per call), and since when all of
    them have been taken."""

    def __init__(self, count: int, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(count)
        self._clock = clock
        self.full_since: float | None = None

    def take_one(self, wait: float) -> bool:
        if not self.take(1, wait):
            return False
        with self._cond:
            if self._used == self._total and self.full_since is None:
                self.full_since = self._clock()
        return True

    def give_one(self) -> None:
        with self._cond:
            self.full_since = None
        self.give(1)

    def stuck(self) -> float:
        """How long every slot has been taken (0 when one is free)."""
        since = self.full_since
        return 0.0 if since is None else self._clock() - since


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


class ExtenderMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "devplugin_extender_requests",
            "Extender calls by verb and result",
            ["verb", "result"],
            registry=self.registry,
        )
        self.seconds = Histogram(
            "devplugin_extender_seconds",
            "Extender call handling time",
            ["verb"],
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
            registry=self.registry,
        )
        self.memo = Counter(
            "devplugin_extender_memo",
            "Placement lookups (hit / miss)",
            ["result"],
            registry=self.registry,
        )
        self.records = Gauge(
            "devplugin_extender_records",
            "NodeDevices records by state (fresh / stale)",
            ["state"],
            registry=self.registry,
        )
        self.watch_current = Gauge(
            "devplugin_watch_current",
            "1 while an API watch cache is current (listed, and heard from within its bound)",
            ["cache"],
            registry=self.registry,
        )
        self.watch_age = Gauge(
            "devplugin_watch_age_seconds",
            "Seconds since an API watch cache last heard from the API server",
            ["cache"],
            registry=self.registry,
        )
        self.watch_refused = Gauge(
            "devplugin_watch_refused_objects",
            "Objects an API watch cache refused (a malformed record, a forged Lease) since start",
            ["cache"],
            registry=self.registry,
        )


class Extender:
    """The decisions, over the caches (no HTTP here)."""

    def __init__(
        self,
        records: WatchCache[Record],
        pods: PodCache,
        *,
        leases: WatchCache[NodeLease] | None = None,
        gpu: str = "nvidia.com/gpu",
        hca: str = "rdma/hca",
        stale_after: float = 120.0,
        metrics: ExtenderMetrics | None = None,
        wall: Callable[[], float] = time.time,
        layouts: Layouts | None = None,
        clock: Callable[[], float] = time.monotonic,
        dra: tuple[DraViews, DraCaches] | None = None,
    ) -> None:
        self.records = records
        self.pods = pods
        self.leases = leases
        self.dra = dra
        self.gpu, self.hca = gpu, hca
        self.stale_after = stale_after
        self.metrics = metrics or ExtenderMetrics()
        for cache in self._caches():
            self.metrics.watch_current.labels(cache.name).set_function(partial(_current, cache))
            self.metrics.watch_age.labels(cache.name).set_function(cache.age)
            self.metrics.watch_refused.labels(cache.name).set_function(
                partial(lambda c: float(c.skipped), cache)
            )
        self._wall = wall
        self._clock = clock
        self.layouts = layouts if layouts is not None else Layouts()
        self.views = NodeViews(
            self.layouts,
            on_node=pods.on_node,
            generation=pods.generation,
            has_ended=pods.has_ended,
            gpu=gpu,
            hca=hca,
        )
        self._hit = self.metrics.memo.labels("hit")
        self._miss = self.metrics.memo.labels("miss")
        self.cycles = CycleMemo(clock)

    # -- the verbs ---------------------------------------------------------------
    def filter(self, args: Mapping[str, Any]) -> dict[str, Any]:
        pod, names, nodes = self._args(args)
        shape, requirement = self._pod(pod)
        failed: dict[str, str] = {}
        unresolvable: dict[str, str] = {}
        passing: list[str] = []
        if not shape.wants_devices:
            passing = list(names)
        else:
            fresh = self._freshness()
            records: dict[str, Record | None] = {}
            outcomes, hits = self.views.outcomes(names, fresh, shape, pod.uid, seen=records)
            relaxed = not requirement.required or requirement.level is None
            failing: dict[str, str] = {}
            for name in names:
                outcome = outcomes[name]
                if outcome is None or (relaxed and outcome.fits):
                    # No usable record (never block scheduling on it), or what
                    # check() would say without the call.
                    passing.append(name)
                    continue
                reason = outcome.reason if not outcome.fits else check(outcome, requirement)
                if reason is None:
                    passing.append(name)
                else:
                    failing[name] = reason
            answers = self.views.failures(failing, records, shape, requirement, pod.uid)
            for name, (message, never) in answers.items():
                (unresolvable if never else failed)[name] = message
            self._count(hits, len(names))
            self.cycles.keep("resources", pod.uid, outcomes)
        return _filter_result(passing, failed, unresolvable, nodes)

    def prioritize(self, args: Mapping[str, Any]) -> list[dict[str, Any]]:
        pod, names, _ = self._args(args)
        shape, _ = self._pod(pod)
        if not shape.wants_devices:
            return [{"Host": name, "Score": 0} for name in names]
        kept = self.cycles.take("resources", pod.uid, names)
        if kept is not None:
            ranked = scores(kept)
            return [{"Host": name, "Score": ranked[name]} for name in names]
        outcomes, hits = self._outcomes(names, shape, pod.uid)
        self._count(hits, len(names))
        ranked = scores(outcomes)
        return [{"Host": name, "Score": ranked[name]} for name in names]

    def claims_filter(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """Filter for pods with ResourceClaims: a node passes unless the
        allocator's walk there finds nothing for the pod's claims."""
        pod, names, nodes = self._args(args)
        predictions = self._predictions(args, names)
        if predictions:
            self.cycles.keep("claims", pod.uid, predictions)
        failed = {
            name: "devplugin: the pod's ResourceClaims cannot be allocated here"
            for name, prediction in predictions.items()
            if prediction is not None and not prediction.fits
        }
        passing = [name for name in names if name not in failed]
        return _filter_result(passing, failed, {}, nodes)

    def claims_prioritize(self, args: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Scores for pods with ResourceClaims: by the worst pair, then the
        sum over pairs, of what the allocator will pick on each node."""
        pod, names, _ = self._args(args)
        kept = self.cycles.take("claims", pod.uid, names)
        scored = ranks(kept if kept is not None else self._predictions(args, names))
        return [{"Host": name, "Score": scored.get(name, 0)} for name in names]

    def _predictions(
        self, args: Mapping[str, Any], names: list[str]
    ) -> dict[str, Prediction | None]:
        """Per node, the allocator's choice for the pod's claims; nothing
        (every node None) for a pod without claims or with one not known."""
        if self.dra is None:
            return {}
        views, caches = self.dra
        claims = pod_claims(args["Pod"], caches.claims)
        if not claims:
            return {}
        return views.predictions(names, claims)

    def _count(self, hits: int, asked: int) -> None:
        # Counted once per call: a counter per node would cost more than the lookup.
        if hits:
            self._hit.inc(hits)
        if asked - hits:
            self._miss.inc(asked - hits)

    # -- pieces ------------------------------------------------------------------------
    def _args(
        self, args: Mapping[str, Any]
    ) -> tuple[PodInfo, list[str], list[dict[str, Any]] | None]:
        if not isinstance(args, dict):
            raise BadRequest("the body must be a JSON object (ExtenderArgs)")
        raw_pod = args.get("Pod")
        if not isinstance(raw_pod, dict):
            raise BadRequest("Pod: required, an object")
        data = dict(raw_pod)
        meta = data.get("metadata")
        if isinstance(meta, dict) and not meta.get("uid"):
            data["metadata"] = {**meta, "uid": f"{meta.get('namespace')}/{meta.get('name')}"}
        try:
            pod = parse_pod(data)
        except ValueError as exc:
            raise BadRequest(f"Pod: {exc}") from exc
        names = args.get("NodeNames")
        nodes = args.get("Nodes")
        if names is not None:
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise BadRequest("NodeNames: must be a list of names")
            return pod, list(names), None
        if isinstance(nodes, dict):
            items = nodes.get("items") or []
            if not isinstance(items, list) or not all(isinstance(n, dict) for n in items):
                raise BadRequest("Nodes.items: must be a list of nodes")
            found = [_node_name(n) for n in items]
            if not all(found):
                raise BadRequest("Nodes.items: a node without metadata.name")
            return pod, [str(n) for n in found], items
        raise BadRequest("one of NodeNames or Nodes is required")

    def _pod(self, pod: PodInfo) -> tuple[Shape, Requirement]:
        shape = shape_of(pod, self.gpu, self.hca)
        try:
            requirement = requirement_of(pod.annotations)
        except ValueError as exc:
            raise BadRequest(f"Pod annotations: {exc}") from exc
        return shape, requirement

    def _outcomes(
        self, names: Sequence[str], shape: Shape, uid: str
    ) -> tuple[dict[str, Outcome | None], int]:
        """Every node's outcome (None: no fresh record), and the memo hits."""
        return self.views.outcomes(names, self._freshness(), shape, uid)

    def _freshness(self) -> Callable[[str], Record | None]:
        """Per node, its record while its daemon is alive: its Lease renewed
        within the duration it promised (a daemon without a Lease, an older
        one, rewrites its record instead: then `updated` is judged, and one
        dated in the future counts as written now). The clocks are read once
        and the maps bound: for a loop over every node of a call."""
        now, mono, stale_after = self._wall(), self._clock(), self.stale_after
        records = self.records.getter()
        leases = self.leases.getter() if self.leases is not None else None

        def fresh(name: str) -> Record | None:
            record = records(name)
            if record is None:
                return None
            lease = leases(name) if leases is not None else None
            if lease is not None:
                return record if mono - lease.seen <= lease.duration else None
            updated = record.updated
            if updated is None or now - min(updated, now) > stale_after:
                return None
            return record

        return fresh

    def _caches(self) -> list[WatchCache[Any]]:
        caches: list[WatchCache[Any]] = [self.records, self.pods]
        if self.leases is not None:
            caches.append(self.leases)
        if self.dra is not None:
            caches.extend(self.dra[1].all())
        return caches

    def ready(self) -> tuple[bool, str]:
        """Ready while both caches are current: a frozen view must not steer
        pods (with `ignorable: true` the scheduler goes on without us)."""
        named = {
            "nodedevices": "NodeDevices records",
            "pods": "pods",
            "leases": "node Leases",
            "resourceclaims": "ResourceClaims",
            "resourceslices": "ResourceSlices",
            "deviceclasses": "DeviceClasses",
        }
        for cache in self._caches():
            what = named.get(cache.name, cache.name)
            if not cache.synced.is_set():
                return False, f"{what} not listed yet"
            if not cache.current:
                return False, (
                    f"{what} cache not current: nothing from the API server for {cache.age():.0f}s"
                )
        return True, ""

    def count_records(self) -> None:
        records = self.records.items()
        is_fresh = self._freshness()
        fresh = sum(1 for name in records if is_fresh(name) is not None)
        self.metrics.records.labels("fresh").set(fresh)
        self.metrics.records.labels("stale").set(len(records) - fresh)


def _current(cache: WatchCache[Any]) -> float:
    return 1.0 if cache.current else 0.0


def _filter_result(
    passing: list[str],
    failed: dict[str, str],
    unresolvable: dict[str, str],
    nodes: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    """ExtenderFilterResult, in the form it was asked in (names, or the
    passing Node objects)."""
    result: dict[str, Any] = {"FailedNodes": failed, "FailedAndUnresolvableNodes": unresolvable}
    result["Error"] = ""
    if nodes is not None:
        keep = set(passing)
        items = [n for n in nodes if _node_name(n) in keep]
        result["Nodes"] = {"apiVersion": "v1", "kind": "NodeList", "items": items}
        result["NodeNames"] = None
    else:
        result["NodeNames"] = passing
        result["Nodes"] = None
    return result


def _node_name(node: Mapping[str, Any]) -> str | None:
    meta = node.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    return name if isinstance(name, str) and name else None


def placement_pod(names: Sequence[str], pod: PodInfo) -> PodInfo | None:
    """What placement reads of a pod: None for a pod without device requests;
    else its containers' requests for the two resources only, no annotations."""
    wanted = set(names)

    def trim(containers: tuple[ContainerInfo, ...]) -> tuple[ContainerInfo, ...]:
        return tuple(
            ContainerInfo(c.name, {k: v for k, v in c.requests.items() if k in wanted}, c.sidecar)
            for c in containers
        )

    every = pod.init_containers + pod.containers
    if not any(v for c in every for k, v in c.requests.items() if k in wanted):
        return None
    return replace(
        pod,
        init_containers=trim(pod.init_containers),
        containers=trim(pod.containers),
        annotations={},
    )


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


def pod_cache(
    client: Client,
    kube: KubernetesConfig | None = None,
    heartbeat: Heartbeat | None = None,
    names: Sequence[str] = ("nvidia.com/gpu", "rdma/hca"),
) -> PodCache:
    kube = kube or KubernetesConfig()
    return PodCache(
        client,
        None,
        timing=WatchTiming.of(kube),
        heartbeat=heartbeat,
        keep=partial(placement_pod, names),
    )


# -- HTTP --------------------------------------------------------------------------------


class ExtenderServer:
    """The HTTP(S) front: the two verbs, /healthz, /readyz, /metrics."""

    def __init__(
        self,
        extender: Extender,
        address: tuple[str, int],
        *,
        tls: tuple[str, str] | None = None,
        timeout: float = REQUEST_TIMEOUT,
        idle: float = IDLE_TIMEOUT,
        full_for: float = FULL_FOR,
    ) -> None:
        self.extender = extender
        self.slots = Slots(CONCURRENT)
        handler = _handler(extender, self.slots, full_for)
        context = None
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
        self._server = _Server(address, handler, context, timeout, idle)
        self._listener = Listener(self._server, "extender-http")

    @property
    def address(self) -> tuple[str, int]:
        return self._listener.address

    def start(self) -> None:
        self._listener.start()

    @property
    def connections(self) -> int:
        return self._server.open

    def stop(self) -> None:
        self._listener.stop()


class _Server(BoundedServer):
    """TLS, when on, is negotiated in each connection's own thread (with the
    connection's timeout): a client that never finishes its handshake holds
    only its thread, never the accept loop."""

    request_queue_size = BACKLOG

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        context: ssl.SSLContext | None,
        timeout: float,
        idle: float,
    ) -> None:
        super().__init__(
            address,
            handler,
            max_connections=MAX_CONNECTIONS,
            request_timeout=timeout,
            idle_timeout=idle,
        )
        self._context = context
        self._timeout = timeout

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self._context is not None:
            request.settimeout(self._timeout)
            request = self._context.wrap_socket(request, server_side=True)
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("extender connection from %s failed", client_address, exc_info=True)


class ExtenderHandler(BoundedHandler):
    """The extender's verbs and probes; `_handler` makes one subclass per
    served extender with what it answers from."""

    protocol_version = "HTTP/1.1"
    extender: ClassVar[Extender]
    slots: ClassVar[Slots]
    full_for: ClassVar[float]
    budget: ClassVar[Budget]
    verbs: ClassVar[dict[str, Callable[[Mapping[str, Any]], Any]]]

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        verb = self.verbs.get(path)
        if verb is None:
            self._send(404, {"Error": f"no such verb: {path[:100]}"})
            return
        self._serve(path.rsplit("/", 1)[1], verb)

    def _serve(self, name: str, verb: Callable[[Mapping[str, Any]], Any]) -> None:
        started = time.perf_counter()
        try:
            answer = self._call(verb)
        except BadRequest as exc:
            self.extender.metrics.requests.labels(name, "bad-request").inc()
            self._send(400, {"Error": str(exc)[: MAX_REASON * 4]})
            return
        except Busy as exc:
            self.extender.metrics.requests.labels(name, "busy").inc()
            self.close_connection = True  # the body was not read
            self._send(503, {"Error": str(exc)})
            return
        except Exception as exc:  # answer, log, keep serving
            log.exception("extender %s failed", name)
            self.extender.metrics.requests.labels(name, "error").inc()
            self._send(500, {"Error": f"{type(exc).__name__}: {exc}"[:MAX_REASON]})
            return
        self.extender.metrics.seconds.labels(name).observe(time.perf_counter() - started)
        self.extender.metrics.requests.labels(name, "ok").inc()
        self.reply(200, answer, "application/json")

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            stuck = self.slots.stuck()
            if stuck > self.full_for:
                self._text(503, f"every call slot busy for {stuck:.0f}s\n")
            else:
                self._text(200, "ok\n")
        elif path == "/readyz":
            ok, why = self.extender.ready()
            self._text(200 if ok else 503, "ok\n" if ok else why + "\n")
        elif path == "/metrics":
            self.extender.count_records()
            data = generate_latest(self.extender.metrics.registry)
            self.reply(200, data, "text/plain; version=0.0.4")
        else:
            self._text(404, "not found\n")

    def _call(self, verb: Callable[[Mapping[str, Any]], Any]) -> Any:
        """Read, decode and answer within the body budget (the decoded
        body and the answer built from it live only this long)."""
        length_text = self.headers.get("Content-Length")
        if length_text is None or not length_text.isdigit():
            self.close_connection = True
            raise BadRequest("Content-Length required")
        length = int(length_text)
        if length > MAX_BODY:
            self.close_connection = True
            raise BadRequest(
                f"body larger than {MAX_BODY} bytes (a scheduler sending whole Nodes "
                "should be nodeCacheCapable)"
            )
        if not self.budget.take(length, BODY_WAIT):
            raise Busy(f"too many large requests at once; retry ({length} bytes waiting)")
        try:
            # The whole body first (by the request's deadline), then a slot:
            # a client that trickles its body holds its own thread only.
            raw = self.rfile.read(length)
            if len(raw) < length:
                self.close_connection = True
                raise BadRequest("body shorter than its Content-Length")
            if not self.slots.take_one(SLOT_WAIT):
                raise Busy("every call slot is busy; retry")
            try:
                return self._answer(verb, raw)
            finally:
                self.slots.give_one()
        finally:
            self.budget.give(length)

    def _answer(self, verb: Callable[[Mapping[str, Any]], Any], raw: bytes) -> bytes:
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise BadRequest(f"body is not JSON: {reason[:100]}") from exc
        del raw
        try:
            return json.dumps(verb(body)).encode()
        except RecursionError as exc:
            raise BadRequest("a value nested too deeply") from exc

    def _send(self, code: int, body: Any) -> None:
        self.reply(code, json.dumps(body).encode(), "application/json")

    def _text(self, code: int, text: str) -> None:
        self.reply(code, text.encode(), "text/plain; charset=utf-8")

    def log_message(self, format: str, *args: object) -> None:
        log.debug("extender http: " + format, *args)


def _handler(extender: Extender, slots: Slots, full_for: float) -> type[BaseHTTPRequestHandler]:
    verbs: dict[str, Callable[[Mapping[str, Any]], Any]] = {
        "/scheduler/filter": extender.filter,
        "/scheduler/prioritize": extender.prioritize,
        "/scheduler/claims/filter": extender.claims_filter,
        "/scheduler/claims/prioritize": extender.claims_prioritize,
    }
    attributes = {
        "extender": extender, "slots": slots, "full_for": full_for,
        "budget": Budget(IN_FLIGHT_BYTES), "verbs": verbs,
    }  # fmt: skip
    return type("Handler", (ExtenderHandler,), attributes)


def serve(
    kube: KubernetesConfig,
    address: tuple[str, int],
    *,
    stale_after: float,
    tls: tuple[str, str] | None = None,
    names: Sequence[str] = ("nvidia.com/gpu", "rdma/hca"),
    lease_namespace: str = "default",
    dra: bool = False,
    device_taints: bool = True,
) -> tuple[Extender, ExtenderServer, list[WatchCache[Any]]]:
    """Wire and start the caches (each on its own client, whose transport
    tells it when the server last answered) and the HTTP server (the CLI's
    and tests' entry)."""

    def connect(heartbeat: Heartbeat) -> Client:
        client = make_client(kube, heartbeat=heartbeat)
        if client is None:
            raise RuntimeError("no Kubernetes API access")
        return client

    beats = Heartbeat(), Heartbeat(), Heartbeat()
    layouts = Layouts()
    records = record_cache(connect(beats[0]), kube, beats[0], layouts)
    pods = pod_cache(connect(beats[1]), kube, beats[1], names)
    leases = lease_cache(connect(beats[2]), lease_namespace, kube, beats[2])
    claims: tuple[DraViews, DraCaches] | None = None
    if dra:
        views = DraViews(device_taints=device_taints)
        dra_beats = Heartbeat(), Heartbeat(), Heartbeat()
        clients = [connect(beat) for beat in dra_beats]
        claims = views, dra_caches(views, clients, WatchTiming.of(kube), dra_beats)
    extender = Extender(
        records,
        pods,
        leases=leases,
        gpu=names[0],
        hca=names[1],
        stale_after=stale_after,
        layouts=layouts,
        dra=claims,
    )
    server = ExtenderServer(extender, address, tls=tls)
    caches: list[WatchCache[Any]] = [records, pods, leases]
    if claims is not None:
        caches.extend(claims[1].all())
    for cache in caches:
        cache.start()
    server.start()
    return extender, server, caches
