"""The node finishes a preemption: the extender names the victims that free
an aligned set on a real daemon's node, they end, and 20 ms later the
preemptor's containers are allocated exactly that set."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devplugin.policy.topology import Level
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.kubelet import ContainerRequest
from devplugin.testing.node import hgx_node
from tests.conftest import GPU, HCA, Cluster
from tests.extender_support import Running, call, running_extender
from tests.waiting import wait_until

# The pod watch may take longer than 0.1 s on a loaded machine (as in
# test_fresh_holdings): a preference waits this long for the pod.
WAIT = {"kubernetes.pod_wait_seconds": 1.0}
LOW = [("a", 100), ("b", 0), ("c", 200), ("d", 100)]


def preemptor(name: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "default", "uid": name},
        "spec": {"priority": 1000, "containers": [
            {"name": "main", "resources": {"limits": {GPU: "2", HCA: "2"}}}]},
        "status": {"phase": "Pending"},
    }  # fmt: skip


def holdings(extender: Running, node: str) -> int:
    found = extender[0].records.get(node)
    return len(found.parsed.holdings) if found is not None else -1


def test_the_preemptor_gets_the_aligned_set_its_victims_freed_20_ms_after_they_end(
    start_cluster: Callable[..., Cluster], api: ApiServerImitation, tmp_path: Path
) -> None:
    cluster = start_cluster(hgx_node(), api=api, **WAIT)
    kubelet = cluster.kubelet
    topology = cluster.daemon.core.coordinator.topology
    held: dict[str, frozenset[str]] = {}
    for name, priority in LOW:  # the node full: four 2+2 pods
        pod = kubelet.admit(name, [ContainerRequest("main", {GPU: 2, HCA: 2})], priority=priority)
        devices = pod.container("main").devices
        held[name] = frozenset(devices[GPU]) | frozenset(devices[HCA])
    extender = next(running_extender(api, tmp_path))
    try:
        uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in api.items("pods")}
        assert wait_until(lambda: holdings(extender, kubelet.node_name) == len(LOW), timeout=15)
        assert wait_until(lambda: len(extender[0].pods.pods()) == len(LOW), timeout=10)
        node = kubelet.node_name
        # Lowest first: "b" (0), then one of the two at 100.
        for round_, lowest in enumerate([{"b"}, {"a", "d"}]):
            urgent = preemptor(f"urgent-{round_}")
            _, filtered = call(extender, "filter", {"Pod": urgent, "NodeNames": [node]})
            assert list(filtered["FailedNodes"]) == [node]
            # The scheduler's count-only proposal: every lower pod on the node.
            proposal = {node: {"Pods": [{"UID": uids[n]} for n in held]}}
            args = {"Pod": urgent, "NodeNameToMetaVictims": proposal}
            _, result = call(extender, "preempt", args)
            (victim,) = result["NodeNameToMetaVictims"][node]["Pods"]
            (name,) = [n for n in held if uids[n] == victim["UID"]]
            assert name in lowest
            # The victim ends; 20 ms later the kubelet admits the preemptor.
            kubelet.remove(name)
            time.sleep(0.02)
            request = [ContainerRequest("main", {GPU: 2, HCA: 2})]
            pod = kubelet.admit(f"urgent-{round_}", request, priority=1000)
            gpus, hcas = pod.container("main").devices[GPU], pod.container("main").devices[HCA]
            assert frozenset(gpus) | frozenset(hcas) == held.pop(name)
            assert max(min(topology.level(g, h) for h in hcas) for g in gpus) == Level.PIX
            assert wait_until(lambda: holdings(extender, node) == len(LOW), timeout=15)
    finally:
        extender[1].stop()
        for cache in extender[2]:
            cache.signal_stop()
