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

A node without a record, or whose record is older than `stale_after`, is
never filtered (scheduling must not stop because a daemon is down) and
scores 0. Results are memoised per (node, record version, pods pending
there, pod shape), so a prioritize after a filter for the same pod costs a
dictionary lookup. Nothing here waits on the network: the caches are read.
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
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from lightkube import Client
from lightkube import operators as op
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from devplugin.allocator import Allocator
from devplugin.cluster.client import Heartbeat, make_client
from devplugin.cluster.lease import NODE_LABEL, Lease, parse_micro_time
from devplugin.cluster.pods import PodCache
from devplugin.cluster.publisher import NodeDevices
from devplugin.cluster.watch import Incomplete, WatchCache
from devplugin.config import KubernetesConfig
from devplugin.model import DeviceKind
from devplugin.placement import (
    Holding,
    NodeState,
    Outcome,
    Requirement,
    Shape,
    check,
    node_from_record,
    place,
    requirement_of,
    scores,
    shape_of,
)
from devplugin.podinfo import PodInfo, parse_pod

log = logging.getLogger(__name__)

MAX_BODY = 32 << 20  # a Nodes list of a few thousand nodes
MEMO = 8192
MAX_REASON = 256


class BadRequest(ValueError):
    pass


@dataclass(frozen=True)
class Record:
    """One node's record as the extender uses it."""

    node: NodeState
    version: str
    updated: float | None  # wall-clock seconds of status.updated
    allocator: Allocator


def record_entry(data: Mapping[str, Any]) -> tuple[str, Record]:
    if not data.get("status"):
        # Created, its first status not written yet (the daemon does both).
        raise Incomplete("no status yet")
    node = node_from_record(data)
    meta = data.get("metadata") or {}
    status = data.get("status") or {}
    updated = None
    stamp = status.get("updated") if isinstance(status, dict) else None
    if isinstance(stamp, str):
        try:
            updated = datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
        except ValueError:
            updated = None
    version = str(meta.get("resourceVersion") or "")
    return node.name, Record(node, version, updated, Allocator(node.topology))


@dataclass(frozen=True)
class NodeLease:
    """A node daemon's heartbeat (cluster/lease.py)."""

    renewed: float | None  # wall-clock seconds of spec.renewTime
    duration: float


def lease_entry(data: Mapping[str, Any]) -> tuple[str, NodeLease]:
    meta, spec = data.get("metadata"), data.get("spec")
    if not isinstance(meta, dict) or not isinstance(spec, dict):
        raise ValueError("metadata and spec must be objects")
    labels = meta.get("labels")
    node = labels.get(NODE_LABEL) if isinstance(labels, dict) else None
    duration = spec.get("leaseDurationSeconds")
    if not isinstance(node, str) or not node:
        raise ValueError(f"no {NODE_LABEL} label")
    if not isinstance(duration, int) or isinstance(duration, bool) or duration < 1:
        raise ValueError("spec.leaseDurationSeconds must be a positive integer")
    return node, NodeLease(parse_micro_time(spec.get("renewTime")), float(duration))


class ExtenderMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "devplugin_extender_requests", "Extender calls by verb and result",
            ["verb", "result"], registry=self.registry,
        )  # fmt: skip
        self.seconds = Histogram(
            "devplugin_extender_seconds", "Extender call handling time", ["verb"],
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0), registry=self.registry,
        )  # fmt: skip
        self.memo = Counter(
            "devplugin_extender_memo", "Placement lookups (hit / miss)", ["result"],
            registry=self.registry,
        )  # fmt: skip
        self.records = Gauge(
            "devplugin_extender_records", "NodeDevices records by state (fresh / stale)",
            ["state"], registry=self.registry,
        )  # fmt: skip
        self.watch_current = Gauge(
            "devplugin_watch_current",
            "1 while an API watch cache is current (listed, and heard from within its bound)",
            ["cache"], registry=self.registry,
        )  # fmt: skip
        self.watch_age = Gauge(
            "devplugin_watch_age_seconds",
            "Seconds since an API watch cache last heard from the API server",
            ["cache"], registry=self.registry,
        )  # fmt: skip


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
    ) -> None:
        self.records = records
        self.pods = pods
        self.leases = leases
        self.gpu, self.hca = gpu, hca
        self.stale_after = stale_after
        self.metrics = metrics or ExtenderMetrics()
        for cache in self._caches():
            self.metrics.watch_current.labels(cache.name).set_function(partial(_current, cache))
            self.metrics.watch_age.labels(cache.name).set_function(cache.age)
        self._wall = wall
        self._lock = threading.Lock()
        self._memo: OrderedDict[tuple[Any, ...], Outcome] = OrderedDict()

    # -- the verbs ---------------------------------------------------------------
    def filter(self, args: Mapping[str, Any]) -> dict[str, Any]:
        pod, names, nodes = self._args(args)
        shape, requirement = self._pod(pod)
        failed: dict[str, str] = {}
        unresolvable: dict[str, str] = {}
        passing: list[str] = []
        for name in names:
            if not shape.wants_devices:
                passing.append(name)
                continue
            record = self._fresh(name)
            if record is None:
                passing.append(name)  # no (fresh) record: never block scheduling on it
                continue
            reason = check(self._outcome(name, record, pod, shape), requirement)
            if reason is None:
                passing.append(name)
                continue
            # Whether evicting pods could ever help: the empty node's answer.
            never = check(self._empty_outcome(name, record, shape), requirement)
            target = unresolvable if never is not None else failed
            target[name] = f"devplugin: {reason}"[:MAX_REASON]
        result: dict[str, Any] = {
            "FailedNodes": failed, "FailedAndUnresolvableNodes": unresolvable, "Error": "",
        }  # fmt: skip
        if nodes is not None:
            keep = set(passing)
            items = [n for n in nodes if _node_name(n) in keep]
            result["Nodes"] = {"apiVersion": "v1", "kind": "NodeList", "items": items}
            result["NodeNames"] = None
        else:
            result["NodeNames"] = passing
            result["Nodes"] = None
        return result

    def prioritize(self, args: Mapping[str, Any]) -> list[dict[str, Any]]:
        pod, names, _ = self._args(args)
        shape, _ = self._pod(pod)
        if not shape.wants_devices:
            return [{"Host": name, "Score": 0} for name in names]
        outcomes: dict[str, Outcome | None] = {}
        for name in names:
            record = self._fresh(name)
            outcomes[name] = self._outcome(name, record, pod, shape) if record else None
        ranked = scores(outcomes)
        return [{"Host": name, "Score": ranked[name]} for name in names]

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

    def _fresh(self, name: str) -> Record | None:
        """The node's record while its daemon is alive: its Lease renewed
        within the duration it promised (a daemon without a Lease, an older
        one, rewrites its record instead: then `updated` is judged)."""
        record = self.records.items().get(name)
        if record is None:
            return None
        lease = self.leases.items().get(name) if self.leases is not None else None
        if lease is not None and lease.renewed is not None:
            alive = self._wall() - lease.renewed <= lease.duration
            return record if alive else None
        if record.updated is None or self._wall() - record.updated > self.stale_after:
            return None
        return record

    def _caches(self) -> list[WatchCache[Any]]:
        caches: list[WatchCache[Any]] = [self.records, self.pods]
        if self.leases is not None:
            caches.append(self.leases)
        return caches

    def _outcome(self, name: str, record: Record, pod: PodInfo, shape: Shape) -> Outcome:
        # The pod watch beats the record: a holder it saw end holds nothing.
        ended = tuple(
            holding for holding in record.node.holdings
            if holding.pod and self.pods.has_ended(holding.uid, holding.namespace, holding.pod)
        )  # fmt: skip
        pending = self._pending(name, record, pod, ended)
        key = (
            name, record.version, tuple((h.namespace, h.pod, h.uid) for h in ended),
            tuple(p.uid for p, _ in pending), shape,
        )  # fmt: skip
        with self._lock:
            found = self._memo.get(key)
            if found is not None:
                self._memo.move_to_end(key)
        if found is not None:
            self.metrics.memo.labels("hit").inc()
            return found
        self.metrics.memo.labels("miss").inc()
        node = record.node.without(ended) if ended else record.node
        for _, pending_shape in pending:
            # Pods bound here that the record does not show yet: placed first.
            ahead = self._place(node, record.allocator, pending_shape)
            if ahead.fits and ahead.free_after is not None:
                node = replace(node, free=ahead.free_after)
        outcome = self._place(node, record.allocator, shape)
        self._remember(key, outcome)
        return outcome

    def _empty_outcome(self, name: str, record: Record, shape: Shape) -> Outcome:
        """The pod on the node with nothing held (memoised like `_outcome`)."""
        key = ("empty", name, record.version, shape)
        with self._lock:
            found = self._memo.get(key)
        if found is None:
            empty = replace(record.node, free=_everything(record.node))
            found = self._place(empty, record.allocator, shape)
            self._remember(key, found)
        return found

    def _remember(self, key: tuple[Any, ...], outcome: Outcome) -> None:
        with self._lock:
            self._memo[key] = outcome
            while len(self._memo) > MEMO:
                self._memo.popitem(last=False)

    @staticmethod
    def _place(node: NodeState, allocator: Allocator, shape: Shape) -> Outcome:
        return place(node, shape, allocator)

    def _pending(
        self, name: str, record: Record, pod: PodInfo, ended: tuple[Holding, ...]
    ) -> list[tuple[PodInfo, Shape]]:
        """Pods bound here that the record does not show holding (a namesake
        of a pod the record shows is another pod)."""
        uids = {h.uid for h in record.node.holdings if h.uid is not None and h not in ended}
        names = {
            (h.namespace, h.pod) for h in record.node.holdings if h.uid is None and h not in ended
        }
        found = []
        for other in self.pods.on_node(name):
            if other.uid == pod.uid or other.uid in uids or (other.namespace, other.name) in names:
                continue
            shape = shape_of(other, self.gpu, self.hca)
            if shape.wants_devices:
                found.append((other, shape))
        return found

    def ready(self) -> tuple[bool, str]:
        """Ready while both caches are current: a frozen view must not steer
        pods (with `ignorable: true` the scheduler goes on without us)."""
        named = {"nodedevices": "NodeDevices records", "pods": "pods", "leases": "node Leases"}
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
        fresh = sum(1 for name in self.records.items() if self._fresh(name) is not None)
        self.metrics.records.labels("fresh").set(fresh)
        self.metrics.records.labels("stale").set(len(self.records.items()) - fresh)


def _current(cache: WatchCache[Any]) -> float:
    return 1.0 if cache.current else 0.0


def _everything(node: NodeState) -> Mapping[DeviceKind, frozenset[str]]:
    return {kind: node.topology.id_set(kind) for kind in DeviceKind}


def _node_name(node: Mapping[str, Any]) -> str | None:
    meta = node.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    return name if isinstance(name, str) and name else None


def record_cache(
    client: Client, kube: KubernetesConfig | None = None, heartbeat: Heartbeat | None = None
) -> WatchCache[Record]:
    kube = kube or KubernetesConfig()
    return WatchCache(
        client, NodeDevices, record_entry, name="nodedevices", namespaced=False,
        backoff_max=kube.watch_backoff_max_seconds, server_timeout=kube.watch_timeout_seconds,
        read_margin=kube.request_timeout_seconds, heartbeat=heartbeat,
    )  # fmt: skip


def lease_cache(
    client: Client, namespace: str, kube: KubernetesConfig | None = None,
    heartbeat: Heartbeat | None = None,
) -> WatchCache[NodeLease]:  # fmt: skip
    kube = kube or KubernetesConfig()
    return WatchCache(
        client, Lease, lease_entry, name="leases", namespaced=True, namespace=namespace,
        labels={NODE_LABEL: op.exists()}, backoff_max=kube.watch_backoff_max_seconds,
        server_timeout=kube.watch_timeout_seconds, read_margin=kube.request_timeout_seconds,
        heartbeat=heartbeat,
    )  # fmt: skip


def pod_cache(
    client: Client, kube: KubernetesConfig | None = None, heartbeat: Heartbeat | None = None
) -> PodCache:
    kube = kube or KubernetesConfig()
    return PodCache(
        client, None, backoff_max=kube.watch_backoff_max_seconds,
        server_timeout=kube.watch_timeout_seconds, read_margin=kube.request_timeout_seconds,
        heartbeat=heartbeat,
    )  # fmt: skip


# -- HTTP --------------------------------------------------------------------------------


class ExtenderServer:
    """The HTTP(S) front: the two verbs, /healthz, /readyz, /metrics."""

    def __init__(
        self,
        extender: Extender,
        address: tuple[str, int],
        *,
        tls: tuple[str, str] | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.extender = extender
        handler = _handler(extender, timeout)
        context = None
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
        self._server = _Server(address, handler, context, timeout)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
            name="extender-http", daemon=True,
        )  # fmt: skip
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Server(ThreadingHTTPServer):
    """TLS, when on, is negotiated in each connection's own thread (with the
    connection's timeout): a client that never finishes its handshake holds
    only its thread, never the accept loop."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        context: ssl.SSLContext | None,
        timeout: float,
    ) -> None:
        super().__init__(address, handler)
        self._context = context
        self._timeout = timeout

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self._context is not None:
            request.settimeout(self._timeout)
            request = self._context.wrap_socket(request, server_side=True)
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("extender connection from %s failed", client_address, exc_info=True)


def _handler(extender: Extender, timeout: float) -> type[BaseHTTPRequestHandler]:
    verbs: dict[str, Callable[[Mapping[str, Any]], Any]] = {
        "/scheduler/filter": extender.filter,
        "/scheduler/prioritize": extender.prioritize,
    }

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            self.connection.settimeout(timeout)

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0]
            verb = verbs.get(path)
            if verb is None:
                self._send(404, {"Error": f"no such verb: {path[:100]}"})
                return
            name = path.rsplit("/", 1)[1]
            started = time.perf_counter()
            try:
                body = self._body()
                answer = verb(body)
            except BadRequest as exc:
                extender.metrics.requests.labels(name, "bad-request").inc()
                self._send(400, {"Error": str(exc)[: MAX_REASON * 4]})
                return
            except Exception as exc:  # answer, log, keep serving
                log.exception("extender %s failed", name)
                extender.metrics.requests.labels(name, "error").inc()
                self._send(500, {"Error": f"{type(exc).__name__}: {exc}"[:MAX_REASON]})
                return
            extender.metrics.seconds.labels(name).observe(time.perf_counter() - started)
            extender.metrics.requests.labels(name, "ok").inc()
            self._send(200, answer)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                self._text(200, "ok\n")
            elif path == "/readyz":
                ok, why = extender.ready()
                self._text(200 if ok else 503, "ok\n" if ok else why + "\n")
            elif path == "/metrics":
                extender.count_records()
                data = generate_latest(extender.metrics.registry)
                self._raw(200, data, "text/plain; version=0.0.4")
            else:
                self._text(404, "not found\n")

        def _body(self) -> Any:
            length_text = self.headers.get("Content-Length")
            if length_text is None or not length_text.isdigit():
                raise BadRequest("Content-Length required")
            length = int(length_text)
            if length > MAX_BODY:
                raise BadRequest(f"body larger than {MAX_BODY} bytes")
            raw = self.rfile.read(length)
            try:
                return json.loads(raw)
            except (ValueError, UnicodeDecodeError) as exc:
                raise BadRequest(f"body is not JSON: {str(exc)[:100]}") from exc

        def _send(self, code: int, body: Any) -> None:
            self._raw(code, json.dumps(body).encode(), "application/json")

        def _text(self, code: int, text: str) -> None:
            self._raw(code, text.encode(), "text/plain; charset=utf-8")

        def _raw(self, code: int, data: bytes, kind: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("extender http: " + format, *args)

    return Handler


def serve(
    kube: KubernetesConfig,
    address: tuple[str, int],
    *,
    stale_after: float,
    tls: tuple[str, str] | None = None,
    names: Sequence[str] = ("nvidia.com/gpu", "rdma/hca"),
    lease_namespace: str = "default",
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
    records = record_cache(connect(beats[0]), kube, beats[0])
    pods = pod_cache(connect(beats[1]), kube, beats[1])
    leases = lease_cache(connect(beats[2]), lease_namespace, kube, beats[2])
    extender = Extender(
        records, pods, leases=leases, gpu=names[0], hca=names[1], stale_after=stale_after
    )
    server = ExtenderServer(extender, address, tls=tls)
    caches: list[WatchCache[Any]] = [records, pods, leases]
    for cache in caches:
        cache.start()
    server.start()
    return extender, server, caches
