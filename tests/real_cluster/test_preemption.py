"""Preemption by the real kube-scheduler, with the chart's scheduler
configuration (the extender's preempt verb) and a real daemon.

* Counts do not fit: the scheduler's dry run finds count-only victims and
  asks the extender, whose victims free an aligned set; the scheduler
  deletes them (this tier's kubelet stands in to confirm their end) and
  the preemptor gets the best level any eviction gives, with the fewest
  victims that give it.
* Counts fit but the alignment the pod requires is not free: the
  scheduler's dry run re-runs only its own filters, reprieves every
  victim, and never asks the extender. The pod waits, nobody is evicted:
  that is how a real cluster behaves (docs/scheduling.md says so)."""

from __future__ import annotations

import contextlib
import itertools
import random
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from devplugin.node.alignment import alignment, best_worst_level
from devplugin.testing.churn import free_now
from devplugin.testing.cluster import SimCluster
from devplugin.testing.controlplane import ApiFailure, ControlPlane, kubeconfig
from devplugin.testing.kubelet import ContainerRequest
from devplugin.testing.layouts import LAYOUTS
from devplugin.testing.node import devices_from_spec
from devplugin.testing.scheduler import call_extender, pending_pod
from tests.real_cluster.cluster_support import (
    SCHEDULER_NAME,
    chart_extender,
    chart_scheduler_config,
    preempt_answers,
    verb_calls,
)
from tests.real_cluster.conftest import NAMESPACE, RELEASE
from tests.real_cluster.nodes import GPU, HCA, add_node, delete_pod, eventually, node_token

pytestmark = pytest.mark.cluster

# Low-priority pods of these shapes, drawn in a seeded order, fill an HGX
# node until a GPU and an HCA are free but no pair of them is PIX (the
# daemon's own choices decide when).
SHAPES = [(1, 0), (0, 1), (2, 0), (0, 2), (3, 0), (2, 1), (1, 2), (3, 1)]


def _pod(name: str, node: str, gpus: int, hcas: int, priority: str, **annotations: str) -> Any:
    limits = {k: str(v) for k, v in ((GPU, gpus), (HCA, hcas)) if v}
    container = {"name": "main", "image": "tier/none",
                 "resources": {"limits": limits, "requests": limits}}  # fmt: skip
    spec = {"schedulerName": SCHEDULER_NAME, "priorityClassName": priority,
            "nodeSelector": {"kubernetes.io/hostname": node},
            "containers": [container]}  # fmt: skip
    meta = {"name": name, "namespace": "default", "annotations": annotations}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


class Node:
    def __init__(self, plane: ControlPlane, stack: ExitStack, name: str) -> None:
        self.plane, self.name = plane, name
        spec = LAYOUTS["hgx-h100"]()
        gpus, hcas = devices_from_spec(spec)
        add_node(plane, name, {GPU: len(gpus), HCA: len(hcas)})
        token = node_token(plane, NAMESPACE, f"{RELEASE}-devplugin", name)
        self.sim = stack.enter_context(
            SimCluster(
                spec,
                node_name=name,
                settings={"kubernetes.lease_namespace": NAMESPACE},
                kubeconfig=kubeconfig(plane.server, plane.pki.ca, token=token),
            )
        )
        base = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=plane.folder))
        self.url = stack.enter_context(chart_extender(plane, base))
        plane.start_scheduler(chart_scheduler_config(plane, self.url))
        self.held: dict[str, tuple[set[str], set[str]]] = {}
        records = f"/apis/devplugin.io/v1alpha1/nodedevices/{name}"
        assert eventually(lambda: bool(plane.request("GET", records).get("status")), timeout=30)

    def run(self, name: str, gpus: int, hcas: int) -> tuple[set[str], set[str]]:
        """The pod bound here, admitted by the kubelet: its devices."""
        assert eventually(lambda: bool(self.pod(name)["spec"].get("nodeName")), timeout=60), (
            self.why(name)
        )
        requests = {k: v for k, v in ((GPU, gpus), (HCA, hcas)) if v}
        got = self.sim.kubelet.admit(name, [ContainerRequest("main", requests)]).container("main")
        self.held[name] = (set(got.devices.get(GPU, ())), set(got.devices.get(HCA, ())))
        return self.held[name]

    def recorded(self) -> bool:
        """Whether the node's record shows exactly the pods held here."""
        found = self.plane.request("GET", f"/apis/devplugin.io/v1alpha1/nodedevices/{self.name}")
        shown = {a["pod"] for a in (found.get("status") or {}).get("allocations", [])}
        return shown == set(self.held)

    def pod(self, name: str) -> dict[str, Any]:
        found: dict[str, Any] = self.plane.request("GET", f"/api/v1/namespaces/default/pods/{name}")
        return found

    def why(self, name: str) -> str:
        conditions = (self.pod(name).get("status") or {}).get("conditions") or []
        return "; ".join(str(c.get("message")) for c in conditions)

    def confirm_ends(self) -> list[str]:
        """What the kubelet does when a pod is deleted: stop it, release its
        devices, and confirm the end. The pods it ended."""
        pods = self.plane.request(
            "GET", f"/api/v1/namespaces/default/pods?fieldSelector=spec.nodeName={self.name}"
        )["items"]
        ended = []
        for pod in pods:
            name = pod["metadata"]["name"]
            if pod["metadata"].get("deletionTimestamp") and name in self.held:
                self.sim.kubelet.remove(name)
                del self.held[name]
                with contextlib.suppress(ApiFailure):
                    delete_pod(self.plane, name)
                ended.append(name)
        return ended


_nodes = itertools.count()


@pytest.fixture
def node(installed: ControlPlane) -> Iterator[Node]:
    plane = installed
    for name, value in (("tier-low", 100), ("tier-high", 1000)):
        with contextlib.suppress(ApiFailure):
            plane.request("POST", "/apis/scheduling.k8s.io/v1/priorityclasses", {
                "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                "metadata": {"name": name}, "value": value})  # fmt: skip
    with ExitStack() as stack:
        found = Node(plane, stack, f"pre{plane.bins.minor[1]}-{next(_nodes)}")
        try:
            yield found
        finally:
            for name in list(found.held):
                with contextlib.suppress(ApiFailure):
                    delete_pod(plane, name)
            with contextlib.suppress(ApiFailure):
                plane.request("DELETE", f"/api/v1/nodes/{found.name}")


def _fill(node: Node) -> None:
    rng = random.Random(0)
    topology = node.sim.daemon.core.coordinator.topology
    for index in range(16):
        gpus, hcas = rng.choice(SHAPES)
        free_g, free_h = free_now(node.sim.kubelet, GPU), free_now(node.sim.kubelet, HCA)
        if len(free_g) < gpus + 1 or len(free_h) < hcas + 1:
            continue  # keep a GPU and an HCA free
        name = f"{node.name}-low-{index}"
        body = _pod(name, node.name, gpus, hcas, "tier-low")
        node.plane.request("POST", "/api/v1/namespaces/default/pods", body)
        node.run(name, gpus, hcas)
        free_g, free_h = free_now(node.sim.kubelet, GPU), free_now(node.sim.kubelet, HCA)
        if best_worst_level(topology, free_g, free_h, 1, 1).name != "PIX":
            # The extender offers as victims only holders its record shows:
            # a node in service, not one whose last admission is seconds old.
            assert eventually(node.recorded, timeout=30), "the record never showed the pods"
            return
    pytest.fail("the low-priority pods never left a GPU and an HCA free apart")


def test_a_pod_whose_counts_fit_but_alignment_does_not_waits_and_evicts_nobody(
    node: Node,
) -> None:
    _fill(node)
    plane = node.plane
    name = f"{node.name}-aligned"
    required = {"devplugin.io/alignment": "PIX", "devplugin.io/alignment-policy": "required"}
    pod = _pod(name, node.name, 1, 1, "tier-high", **required)
    # Once the node's record shows the last admission, the extender fails
    # the node and calls it unresolvable: the pod fits there by counts, so
    # the scheduler's dry run would reprieve every victim (the imitation's
    # verdict, checked below against what the real scheduler does).
    pending = pending_pod(name, {GPU: 1, HCA: 1}, uid="probe")
    pending["metadata"]["annotations"] = pod["metadata"]["annotations"]
    pending["spec"]["priority"] = 1000  # as admission sets it from the class
    verdicts: list[Any] = []

    def unresolvable() -> bool:
        body = {"Pod": pending, "NodeNames": [node.name]}
        verdicts.append(call_extender(node.url, "filter", body))
        return node.name in verdicts[-1]["FailedAndUnresolvableNodes"]

    assert eventually(unresolvable, timeout=20), verdicts[-1]
    assert verdicts[-1]["FailedNodes"] == {}
    asked = verb_calls(node.url, "filter", "ok"), verb_calls(node.url, "preempt")
    plane.request("POST", "/api/v1/namespaces/default/pods", pod)
    assert eventually(lambda: "Unschedulable" in str(node.pod(name)["status"]), timeout=30)
    # The scheduler asked the extender's filter (whose refusal the pod's
    # status shows), and never its preempt verb.
    assert eventually(lambda: verb_calls(node.url, "filter", "ok") > asked[0], timeout=10)
    # A while on, it is still pending and every low-priority pod still runs:
    # the dry run reprieved them all, and the preempt verb was never asked.
    assert not eventually(lambda: bool(node.pod(name)["spec"].get("nodeName")), timeout=10)
    assert node.confirm_ends() == []
    assert all(not node.pod(low).get("metadata", {}).get("deletionTimestamp") for low in node.held)
    assert "PIX" in node.why(name)
    assert verb_calls(node.url, "preempt") == asked[1]


def test_a_pod_that_does_not_fit_by_counts_preempts_the_fewest_for_the_best_level(
    node: Node,
) -> None:
    _fill(node)
    plane = node.plane
    topology = node.sim.daemon.core.coordinator.topology
    free_g, free_h = free_now(node.sim.kubelet, GPU), free_now(node.sim.kubelet, HCA)
    want = (4, 2)
    # The best level any eviction gives, and the fewest victims giving it.
    lows = dict(node.held)
    every_g = free_g.union(*(g for g, _ in lows.values()))
    every_h = free_h.union(*(h for _, h in lows.values()))
    target = best_worst_level(topology, every_g, every_h, *want)
    fewest = next(
        size
        for size in range(1, len(lows) + 1)
        for chosen in itertools.combinations(lows, size)
        if len(g := free_g.union(*(lows[c][0] for c in chosen))) >= want[0]
        and len(h := free_h.union(*(lows[c][1] for c in chosen))) >= want[1]
        and best_worst_level(topology, g, h, *want) == target
    )
    name = f"{node.name}-big"
    asked = verb_calls(node.url, "filter", "ok"), verb_calls(node.url, "preempt", "ok")
    plane.request(
        "POST", "/api/v1/namespaces/default/pods", _pod(name, node.name, *want, "tier-high")
    )
    ended: list[str] = []
    assert eventually(lambda: bool(ended.extend(node.confirm_ends()) or ended), timeout=60), (
        node.why(name)
    )
    # The scheduler deletes its victims together; give the rest a moment.
    eventually(lambda: bool(ended.extend(node.confirm_ends())), timeout=3)
    gpus, hcas = node.run(name, *want)
    achieved = alignment(topology, gpus, hcas)
    assert achieved is not None
    assert achieved[0] == target
    assert len(ended) == fewest, ended
    # Through the extender: its filter asked, its preempt verb once.
    assert verb_calls(node.url, "filter", "ok") > asked[0]
    outcomes = {o: preempt_answers(node.url, o) for o in ("victims", "waiting", "none", "untold")}
    assert verb_calls(node.url, "preempt", "ok") == asked[1] + 1, outcomes
