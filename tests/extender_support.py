"""Helpers for the extender's tests: simulated nodes' records and inventories,
pods shaped as the scheduler sends them, Leases, and the extender served
over real HTTP against the API server imitation."""

from __future__ import annotations

import contextlib
import copy
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import yaml

from devplugin.cluster.record import Registration, build_status
from devplugin.cluster.watch import WatchCache
from devplugin.config import KubernetesConfig
from devplugin.extender.app import Extender, serve
from devplugin.extender.serving import ExtenderServer
from devplugin.model import DeviceKind, Health, Inventory, PluginDevice
from devplugin.node.alignment import ContainerAlignment
from devplugin.node.deadline import Deadlines
from devplugin.node.discovery import Discoverer, NvmlGpuSource, Roots
from devplugin.node.resources import ResourceState
from devplugin.policy.allocator import Allocator
from devplugin.policy.node_record import node_from_record
from devplugin.policy.placement import place
from devplugin.policy.pod_request import Shape
from devplugin.policy.podinfo import ContainerInfo, PodInfo
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.fake_nvml import FakeNvml
from devplugin.testing.layouts import LAYOUTS
from devplugin.testing.node import NodeSpec, build_node
from tests.waiting import wait_until

GPU, HCA = "nvidia.com/gpu", "rdma/hca"


def inventory(layout: str | NodeSpec, base: Path, mig_strategy: str = "none") -> Inventory:
    """What the daemon's discovery finds on a simulated node (a layout's
    name, or a spec), its MIG devices served under `mig_strategy`."""
    node = build_node(LAYOUTS[layout]() if isinstance(layout, str) else layout, base)
    deadlines = Deadlines(5)
    source = NvmlGpuSource(FakeNvml.from_file(node.fixture), deadlines)
    discoverer = Discoverer(
        Roots(node.sysfs_root, node.dev_root),
        source,
        deadlines,
        mig_strategy=mig_strategy,
        caps_root=node.caps_root,
    )
    try:
        return discoverer.scan(full=True)
    finally:
        discoverer.close()


def record(
    inv: Inventory,
    name: str = "n1",
    unhealthy: frozenset[str] = frozenset(),
    allocations: list[Any] | None = None,
    served: dict[str, tuple[str, int]] | None = None,
) -> dict[str, Any]:
    def state(ids: list[str]) -> ResourceState:
        devices = tuple(
            PluginDevice(d, Health.UNHEALTHY if d in unhealthy else Health.HEALTHY) for d in ids
        )
        return ResourceState(devices=devices, allocations={})

    states = {
        DeviceKind.GPU: state([g.uuid for g in inv.gpus]),
        DeviceKind.HCA: state([h.device_id for h in inv.hcas]),
    }
    status = build_status(inv, states, allocations or [], Registration(True, "registered"), served)
    return {"metadata": {"name": name, "resourceVersion": "1"}, "status": status}


Running = tuple[Extender, ExtenderServer, list[WatchCache[Any]]]


def stamp(age: float = 0.0) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - age))


def put_record(
    api: ApiServerImitation,
    name: str,
    layout: str,
    base: Path,
    *,
    held: list[ContainerAlignment] | None = None,
    age: float = 0.0,
    served: dict[str, tuple[str, int]] | None = None,
) -> dict[str, Any]:
    inv = inventory(layout, base / name)
    found = record(inv, name, allocations=held, served=served)
    found["status"]["updated"] = stamp(age)
    found["metadata"] = {"name": name}
    api.put("nodedevices", found)
    return found


def pod(name: str, containers: list[dict[str, int]], **annotations: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}",
                     "annotations": dict(annotations), "creationTimestamp": stamp()},
        "spec": {"containers": [
            {"name": f"c{i}", "resources": {"limits": {k: str(v) for k, v in c.items() if v}}}
            for i, c in enumerate(containers)
        ]},
        "status": {"phase": "Pending"},
    }  # fmt: skip


@pytest.fixture
def extender(api: ApiServerImitation, tmp_path: Path) -> Iterator[Running]:
    """The extender over the test's API imitation (modules import this fixture)."""
    yield from running_extender(api, tmp_path)


def running_extender(
    api: ApiServerImitation, tmp_path: Path, *, dra: bool = False
) -> Iterator[Running]:
    """The extender, serving on a free local port, over the API imitation
    (with its claims verbs when `dra`)."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(api.kubeconfig()))
    kube = KubernetesConfig(enabled=True, kubeconfig=str(kubeconfig))
    running = serve(kube, ("127.0.0.1", 0), stale_after=60.0, dra=dra)
    yield running
    running[1].stop()
    for cache in running[2]:
        cache.signal_stop()


def call(running: Running, verb: str, body: Any, raw: bytes | None = None) -> tuple[int, Any]:
    return post(running[1].address, verb, body, raw)


def post(
    address: tuple[str, int], verb: str, body: Any, raw: bytes | None = None
) -> tuple[int, Any]:
    """A verb called over HTTP on an extender front at `address`: (status, answer)."""
    host, port = address
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://{host}:{port}/scheduler/{verb}",
        data=data,
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def synced(running: Running, names: set[str]) -> None:
    records = running[0].records
    assert wait_until(lambda: names <= set(records.items()), timeout=10)
    assert wait_until(lambda: running[0].ready()[0], timeout=10)


def lease(api: ApiServerImitation, node: str, age: float, namespace: str = "default") -> None:
    renewed = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime(time.time() - age))
    api.put("leases", {
        "metadata": {"name": f"devplugin-{node}", "namespace": namespace,
                     "labels": {"devplugin.io/node": node}},
        "spec": {"holderIdentity": node, "leaseDurationSeconds": 40, "renewTime": renewed},
    })  # fmt: skip


def twin(running: Running) -> Extender:
    """A fresh computation over the same caches: an extender with nothing
    kept (no views, verdicts or tables), reading what `running` reads."""
    ext = running[0]
    return Extender(
        ext.records,
        ext.pods,
        leases=ext.leases,
        budgets=ext.budgets,
        dra=ext.dra,
        layouts=ext.layouts,
        stale_after=ext.liveness.stale_after,
        # The same facts as `running` holds now: its preempt answers'
        # plans, its prioritize answers' holds.
        rooms=ext.rooms.copy(),
    )


def verbs_agree(running: Running, verb: str, args: dict[str, Any]) -> Any:
    """`verb`'s answer from the long-lived extender, asserted equal to a
    fresh computation's."""
    path = f"/scheduler/{verb}"
    fresh_one = twin(running)  # before the call: a preempt answer adds a plan
    kept = running[0].verbs()[path](args)
    fresh = fresh_one.verbs()[path](args)
    assert kept == fresh, (verb, kept, fresh)
    return kept


@contextlib.contextmanager
def asking(api: ApiServerImitation, running: Running, body: dict[str, Any]) -> Iterator[None]:
    """The pod `body` exists (pending) while the block asks about it, and
    is deleted after: the room a preempt answer plans for it goes with it,
    so the next question starts from the same facts."""
    asker = copy.deepcopy(body)
    uid = asker["metadata"]["uid"]
    api.put("pods", asker)
    assert wait_until(lambda: running[0].pods.get(uid) is not None, timeout=10)
    try:
        yield
    finally:
        api.remove("pods", asker["metadata"]["name"], asker["metadata"]["namespace"])
        nominations = running[0].nominations
        assert wait_until(lambda: all(p.uid != uid for p in nominations.plans()), timeout=10)


def ask_preempt(api: ApiServerImitation, running: Running, args: dict[str, Any]) -> tuple[int, Any]:
    """One preempt question, from a pod that exists while it asks (`asking`)."""
    with asking(api, running, args["Pod"]):
        return call(running, "preempt", args)


def fill(
    api: ApiServerImitation,
    node: str,
    layout: str,
    base: Path,
    holders: list[tuple[str, int, int, int, dict[str, str]]],
) -> None:
    """Bind pods (name, GPUs, HCAs, priority, labels) to `node`, each on the
    devices its daemon would give it, and write the record that says so."""
    state = node_from_record(record(inventory(layout, base / f"{node}-plan")))
    allocator = Allocator(state.topology)
    held = []
    for name, gpus, hcas, priority, labels in holders:
        outcome = place(state, Shape(((gpus, hcas),), gpus, hcas), allocator)
        assert outcome.fits
        assert outcome.free_after is not None
        taken = {k: outcome.taken(state.free) & state.topology.id_set(k) for k in DeviceKind}
        state = replace(state, free=outcome.free_after)
        bound = pod(name, [{GPU: gpus, HCA: hcas}])
        bound["spec"]["nodeName"] = node
        bound["spec"]["priority"] = priority
        bound["metadata"]["labels"] = labels
        bound["status"] = {"phase": "Running", "startTime": "2026-12-01T00:00:00Z"}
        uid = api.put("pods", bound)["metadata"]["uid"]
        gpu_ids = tuple(sorted(taken[DeviceKind.GPU]))
        hca_ids = tuple(sorted(taken[DeviceKind.HCA]))
        held.append(ContainerAlignment("default", name, "c0", gpu_ids, hca_ids, None, None, uid))
    put_record(api, node, layout, base, held=held)


def uids(api: ApiServerImitation) -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in api.items("pods")}


def meta(nodes: dict[str, list[str]]) -> dict[str, Any]:
    return {
        node: {"Pods": [{"UID": u} for u in victims], "NumPDBViolations": 0}
        for node, victims in nodes.items()
    }


# -- the pod cache's answers, as a rules test sets them


def info(
    uid: str, priority: int = 0, *, node: str = "", nominated: str = "", grace: int = 30
) -> PodInfo:
    requests = MappingProxyType({GPU: 2, HCA: 2})
    return PodInfo(
        uid=uid,
        namespace="default",
        name=uid,
        node=node,
        phase="Pending",
        created=uid,
        deleting=False,
        init_containers=(),
        containers=(ContainerInfo("c", requests),),
        priority=priority,
        nominated=nominated,
        grace=grace,
    )


@dataclass
class Pods:
    """The pod cache's answers, as a test sets them."""

    by_uid: dict[str, PodInfo] = field(default_factory=dict)

    def get(self, key: str) -> PodInfo | None:
        return self.by_uid.get(key)

    def on_node(self, node: str) -> tuple[PodInfo, ...]:
        return tuple(p for p in self.by_uid.values() if p.node == node)

    def nominated(self) -> Mapping[str, tuple[PodInfo, ...]]:
        found: dict[str, list[PodInfo]] = {}
        for p in self.by_uid.values():
            if p.nominated and not p.node:
                found.setdefault(p.nominated, []).append(p)
        return {node: tuple(pods) for node, pods in found.items()}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now
