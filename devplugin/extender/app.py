"""`devplugin extender`: a kube-scheduler extender that sends pods where an
aligned GPU+HCA set is free. This module wires it: the watch caches (every
NodeDevices record, node Lease, pod bound to a node, PodDisruptionBudget,
and with --dra the claims, slices and classes), the per-node views and
verdicts over them, the verbs (each module registers its own routes) and
the HTTP front (serving.py).

* resources.py: /scheduler/filter and /scheduler/prioritize;
* claims.py: /scheduler/claims/filter and /scheduler/claims/prioritize;
* preemption.py: /scheduler/preempt;
* liveness.py: which records are trusted (Leases timed by our clock);
* verdicts.py: one verdict per node and pod kind, read by all of them.

A node without a record, whose daemon's Lease has run out, or whose large
layout is still being built, is never filtered (scheduling must not stop
because a daemon is down) and scores 0. Work follows events, not requests
(views.py, answers.py). Nothing here waits on the network: the caches are
read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from lightkube import Client

from devplugin.cluster.client import Heartbeat, make_client
from devplugin.cluster.pods import PodCache
from devplugin.cluster.watch import WatchCache, WatchTiming
from devplugin.config import KubernetesConfig
from devplugin.extender.answers import ChangeLog
from devplugin.extender.budgets import DisruptionBudget, budget_cache
from devplugin.extender.claims import ClaimVerbs
from devplugin.extender.dra_views import DraCaches, DraViews, dra_caches
from devplugin.extender.holds import Holds, Rooms
from devplugin.extender.liveness import (
    Liveness,
    NodeLease,
    Record,
    lease_cache,
    record_cache,
)
from devplugin.extender.metrics import ExtenderMetrics
from devplugin.extender.nominations import Nominations
from devplugin.extender.preemption import PreemptVerb
from devplugin.extender.resources import ResourceVerbs
from devplugin.extender.serving import ExtenderServer, Verb
from devplugin.extender.verdicts import Verdicts
from devplugin.extender.views import Layouts, NodeViews
from devplugin.policy.podinfo import ContainerInfo, PodInfo

CACHE_NAMES = {
    "nodedevices": "NodeDevices records",
    "pods": "pods",
    "leases": "node Leases",
    "resourceclaims": "ResourceClaims",
    "resourceslices": "ResourceSlices",
    "deviceclasses": "DeviceClasses",
    "poddisruptionbudgets": "PodDisruptionBudgets",
}


class Extender:
    """The verbs over the caches (no HTTP here)."""

    def __init__(
        self,
        records: WatchCache[Record],
        pods: PodCache,
        *,
        leases: WatchCache[NodeLease] | None = None,
        names: tuple[str, str] = ("nvidia.com/gpu", "rdma/hca"),
        stale_after: float = 120.0,
        metrics: ExtenderMetrics | None = None,
        wall: Callable[[], float] = time.time,
        layouts: Layouts | None = None,
        clock: Callable[[], float] = time.monotonic,
        dra: tuple[DraViews, DraCaches] | None = None,
        budgets: WatchCache[DisruptionBudget] | None = None,
        rooms: Rooms | None = None,
    ) -> None:
        self.records, self.pods, self.leases, self.budgets = records, pods, leases, budgets
        self.dra = dra
        self.metrics = metrics or ExtenderMetrics()
        for cache in self._caches():
            self.metrics.watch_current.labels(cache.name).set_function(partial(_current, cache))
            self.metrics.watch_age.labels(cache.name).set_function(cache.age)
            self.metrics.watch_lists.labels(cache.name).set_function(
                partial(lambda c: float(c.relists), cache)
            )
            self.metrics.watch_refused.labels(cache.name).set_function(
                partial(lambda c: float(c.skipped), cache)
            )
        self.liveness = Liveness(records, leases, stale_after=stale_after, wall=wall, clock=clock)
        self.layouts = layouts if layouts is not None else Layouts()
        self.views = NodeViews(
            self.layouts,
            on_node=pods.on_node,
            generation=pods.generation,
            has_ended=pods.ended_on,
            gpu=names[0],
            hca=names[1],
        )
        # What the record, Lease and pod watches touch is worked out again.
        changes = ChangeLog()
        records.listen_keys(lambda node, before, after: changes.changed(node))
        if leases is not None:
            leases.listen_keys(lambda node, before, after: changes.changed(node))
        pods.listen_keys(partial(_pod_nodes, changes))
        self.layouts.listen(changes.changed)
        hit, miss = self.metrics.memo.labels("hit"), self.metrics.memo.labels("miss")

        def count(hits: int, asked: int) -> None:
            # Counted once per call: a counter per node would cost more than the lookup.
            if hits:
                hit.inc(hits)
            if asked - hits:
                miss.inc(asked - hits)

        # The rooms preempt answers and the scheduler's nominations hold,
        # and those prioritize answers expect the scheduler to assume.
        if rooms is None:
            rooms = Rooms(Nominations(pods, names, clock), Holds(pods.get, clock))
        self.rooms = rooms
        self.nominations, self.holds = rooms.nominations, rooms.holds
        pods.listen_keys(self.nominations.pod_changed)
        pods.listen_keys(self.holds.pod_changed)
        self.verdicts = Verdicts(
            self.views,
            self.liveness,
            pods.on_node,
            _bound_node(pods),
            changes,
            names=names,
            clock=clock,
            count=count,
            nominations=self.nominations,
            holds=self.holds,
        )
        self.resources = ResourceVerbs(self.verdicts, self.liveness, names)
        self.preemption = PreemptVerb(
            self.verdicts,
            self.liveness,
            pods.on_node,
            budgets,
            self.metrics,
            names=names,
            clock=clock,
        )
        self.claims = ClaimVerbs(dra, self.liveness, clock)
        self.metrics.prime(self.verbs())

    def verbs(self) -> dict[str, Verb]:
        """Path -> verb, as each verb module registers them."""
        return {**self.resources.routes(), **self.claims.routes(), **self.preemption.routes()}

    def _caches(self) -> list[WatchCache[Any]]:
        caches: list[WatchCache[Any]] = [self.records, self.pods]
        if self.leases is not None:
            caches.append(self.leases)
        if self.budgets is not None:
            caches.append(self.budgets)
        if self.dra is not None:
            caches.extend(self.dra[1].all())
        return caches

    def ready(self) -> tuple[bool, str]:
        """Ready while every cache is current: a frozen view must not steer
        pods (with `ignorable: true` the scheduler goes on without us)."""
        for cache in self._caches():
            what = CACHE_NAMES.get(cache.name, cache.name)
            if not cache.synced.is_set():
                return False, f"{what} not listed yet"
            if not cache.current:
                return False, (
                    f"{what} cache not current: nothing from the API server for {cache.age():.0f}s"
                )
        return True, ""

    def count_records(self) -> None:
        fresh, stale = self.liveness.counts()
        self.metrics.records.labels("fresh").set(fresh)
        self.metrics.records.labels("stale").set(stale)


def _bound_node(pods: PodCache) -> Callable[[str], str | None]:
    def bound(uid: str) -> str | None:
        pod = pods.get(uid)
        return pod.node if pod is not None and pod.node else None

    return bound


def _pod_nodes(changes: ChangeLog, uid: str, before: PodInfo | None, after: PodInfo | None) -> None:
    for pod in (before, after):
        if pod is not None and pod.node:
            changes.changed(pod.node)


def _current(cache: WatchCache[Any]) -> float:
    return 1.0 if cache.current else 0.0


def placement_pod(names: Sequence[str], pod: PodInfo) -> PodInfo | None:
    """What placement reads of a pod: None for a pod without device requests;
    else its containers' requests for the device resources only (the named
    ones and any other of their domains: MIG profiles, shared replicas) and
    their whole CPUs, no annotations."""
    domains = {name.split("/", 1)[0] + "/" for name in names}

    def wanted(resource: str) -> bool:
        return resource in names or any(resource.startswith(d) for d in domains)

    def trim(containers: tuple[ContainerInfo, ...]) -> tuple[ContainerInfo, ...]:
        # Only the requests are cut; every other field stays. The whole CPUs
        # matter: where the kubelet aligns, a pod bound but not in its node's
        # record yet is placed ahead on the NUMA node its CPUs can come from.
        return tuple(
            replace(c, requests={k: v for k, v in c.requests.items() if wanted(k)})
            for c in containers
        )

    every = pod.init_containers + pod.containers
    if not any(v for c in every for k, v in c.requests.items() if wanted(k)):
        return None
    return replace(
        pod,
        init_containers=trim(pod.init_containers),
        containers=trim(pod.containers),
        annotations={},
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

    beats = Heartbeat(), Heartbeat(), Heartbeat(), Heartbeat()
    layouts = Layouts()
    records = record_cache(connect(beats[0]), kube, beats[0], layouts)
    pods = pod_cache(connect(beats[1]), kube, beats[1], names)
    leases = lease_cache(connect(beats[2]), lease_namespace, kube, beats[2])
    budgets = budget_cache(connect(beats[3]), WatchTiming.of(kube), beats[3])
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
        names=(names[0], names[1]),
        stale_after=stale_after,
        layouts=layouts,
        dra=claims,
        budgets=budgets,
    )
    server = ExtenderServer(extender, address, tls=tls)
    caches: list[WatchCache[Any]] = [records, pods, leases, budgets]
    if claims is not None:
        caches.extend(claims[1].all())
    for cache in caches:
        cache.start()
    server.start()
    return extender, server, caches
