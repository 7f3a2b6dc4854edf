"""Kubelet stand-ins for the cluster tier's simulated nodes: one thread that
does, for every simulated node, what its kubelet would do with the pods the
real scheduler binds there.

Each pod bound to one of the nodes is admitted by that node's kubelet
simulator (so its daemon chooses the devices), and each pod being deleted
there (or gone already) is stopped, its devices released, and its end
confirmed (deleted with no grace), all within a poll of 20 ms: the scheduler then sees
evictions end as fast as a real node can make them end, which is when its
view and the extender's can differ most."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from devplugin.testing.cluster import SimCluster
from devplugin.testing.controlplane import ApiFailure, ControlPlane
from devplugin.testing.kubelet import AdmissionError, ContainerRequest

GPU, HCA = "nvidia.com/gpu", "rdma/hca"
POLL = 0.02


@dataclass
class Admitted:
    node: str
    uid: str
    priority: int
    gpus: frozenset[str]
    hcas: frozenset[str]


@dataclass
class Kubelets:
    """The stand-ins; `start()` runs their thread, `stop()` ends it."""

    plane: ControlPlane
    nodes: Mapping[str, SimCluster]
    namespace: str = "default"
    admitted: dict[str, Admitted] = field(default_factory=dict)
    ended: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> Kubelets:
        self._thread = threading.Thread(target=self._run, name="tier-kubelets", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        for name in list(self.admitted):
            self._end(name, confirm=True)

    def __enter__(self) -> Kubelets:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def held(self, node: str) -> dict[str, Admitted]:
        with self._lock:
            return {name: a for name, a in self.admitted.items() if a.node == node}

    def _run(self) -> None:
        path = f"/api/v1/namespaces/{self.namespace}/pods"
        while not self._stop.wait(POLL):
            try:
                pods = self.plane.request("GET", path)["items"]
            except (ApiFailure, OSError) as exc:
                self.failures.append(str(exc)[:200])
                continue
            # Ends first, as a kubelet's watch delivers them before the
            # binding the scheduler made once it saw them. A pod deleted with
            # no grace is gone before any poll sees it go.
            listed = {pod["metadata"]["uid"] for pod in pods}
            for name, held in list(self.admitted.items()):
                if held.uid not in listed:
                    self._end(name, confirm=False)
            for pod in pods:
                if pod["metadata"].get("deletionTimestamp"):
                    self._step(pod)
            for pod in pods:
                if not pod["metadata"].get("deletionTimestamp"):
                    self._step(pod)

    def _step(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        name, node = meta["name"], spec.get("nodeName")
        if node not in self.nodes:
            return
        if meta.get("deletionTimestamp"):
            self._end(name, confirm=True)
        elif name not in self.admitted and name not in self.refused:
            self._admit(name, node, meta["uid"], pod)

    def _admit(self, name: str, node: str, uid: str, pod: dict[str, Any]) -> None:
        (container,) = pod["spec"]["containers"]
        limits = (container.get("resources") or {}).get("limits") or {}
        requests = {k: int(v) for k, v in limits.items() if k in (GPU, HCA)}
        try:
            got = self.nodes[node].kubelet.admit(
                name, [ContainerRequest(container["name"], requests)], namespace=self.namespace
            )
        except AdmissionError as exc:
            self.refused[name] = str(exc)
            return
        devices = got.container(container["name"]).devices
        with self._lock:
            self.admitted[name] = Admitted(
                node,
                uid,
                int(pod["spec"].get("priority") or 0),
                frozenset(devices.get(GPU, ())),
                frozenset(devices.get(HCA, ())),
            )

    def _end(self, name: str, *, confirm: bool) -> None:
        with self._lock:
            found = self.admitted.pop(name, None)
        if found is not None:
            self.nodes[found.node].kubelet.remove(name, self.namespace)
            self.ended.append(name)
        if confirm:
            with contextlib.suppress(ApiFailure):
                self.plane.request(
                    "DELETE",
                    f"/api/v1/namespaces/{self.namespace}/pods/{name}?gracePeriodSeconds=0",
                )
