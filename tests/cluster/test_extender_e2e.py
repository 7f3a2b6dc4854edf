"""End to end: three simulated nodes of different topologies, each with the
real daemon and its kubelet simulator, one API server imitation, the
`devplugin extender` process, and a scheduler imitation that filters by
counts, asks the extender over HTTP as the kube-scheduler does
(nodeCacheCapable: NodeNames), binds to the best-scored node and lets that
node's kubelet admit the pod."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devplugin.node.alignment import alignment, best_worst_level
from devplugin.policy.topology import Level
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.extender_proc import extender_process
from devplugin.testing.kubelet import ContainerRequest
from devplugin.testing.layouts import LAYOUTS
from devplugin.testing.scheduler import choose_node, pending_pod
from tests.conftest import GPU, HCA, Cluster
from tests.waiting import wait_until

Start = Callable[..., Cluster]
NODES = {"hgx": "hgx-h100", "pcie": "pcie-server", "asym": "asymmetric"}


def free(cluster: Cluster, resource: str) -> set[str]:
    held = cluster.kubelet.allocated().get(resource, set())
    devices = cluster.kubelet.devices(resource)
    return {d for d, r in devices.items() if r.health == "Healthy"} - held


@pytest.fixture
def extender_url(api: ApiServerImitation, tmp_path: Path) -> Iterator[str]:
    with (
        (tmp_path / "extender.log").open("w") as log,
        extender_process(api, tmp_path, stale_after=60, output=log, within=20) as url,
    ):
        yield url


def schedule(url: str, clusters: dict[str, Cluster], name: str, gpus: int, hcas: int) -> str | None:
    """The kube-scheduler's part: fit by counts, then the extender's filter and
    prioritize; the highest score wins (ties: the first name)."""
    fits = [
        node for node, cluster in sorted(clusters.items())
        if len(free(cluster, GPU)) >= gpus and len(free(cluster, HCA)) >= hcas
    ]  # fmt: skip
    return choose_node(url, pending_pod(name, {GPU: gpus, HCA: hcas}), fits)


@pytest.mark.slow
def test_pods_land_where_the_best_aligned_set_is(
    start_cluster: Start, api: ApiServerImitation, extender_url: str
) -> None:
    settings = {"kubernetes.record_min_interval_seconds": 0.1,
                "pod_resources.min_interval_seconds": 0.05}  # fmt: skip
    clusters = {
        node: start_cluster(LAYOUTS[layout](), api=api, node_name=node, **settings)
        for node, layout in NODES.items()
    }
    # Every node's record is out before the first pod is scheduled.
    assert wait_until(
        lambda: all((api.get("nodedevices", node) or {}).get("status") for node in clusters),
        timeout=10,
    )
    stream = [(4, 4), (2, 1), (4, 2), (2, 2), (1, 1), (3, 1), (2, 1), (4, 4), (1, 1)]
    placed = decisive = 0
    for index, (gpus, hcas) in enumerate(stream):
        name = f"job-{index}"
        # The best level any node could give this shape right now.
        best: dict[str, Level] = {}
        for node, cluster in clusters.items():
            g, h = free(cluster, GPU), free(cluster, HCA)
            if len(g) >= gpus and len(h) >= hcas:
                topology = cluster.daemon.core.coordinator.topology
                best[node] = best_worst_level(topology, g, h, gpus, hcas)
        target = schedule(extender_url, clusters, name, gpus, hcas)
        if not best:
            assert target is None
            continue
        assert target is not None
        assert best[target] == min(best.values()), (name, target, best)
        # Where first fit by counts would have gone instead.
        decisive += best[min(best)] > best[target]
        cluster = clusters[target]
        container = cluster.kubelet.admit(name, [ContainerRequest("main", {GPU: gpus, HCA: hcas})])
        got = container.container("main").devices
        achieved = alignment(cluster.daemon.core.coordinator.topology, got[GPU], got[HCA])
        assert achieved is not None
        assert achieved[0] == best[target], (name, target, achieved, best)
        placed += 1
        # The record shows it before the next pod is scheduled.
        assert wait_until(
            lambda target=target, name=name: any(
                a["pod"] == name
                for a in (api.get("nodedevices", target) or {})
                .get("status", {})
                .get("allocations", [])
            ),
            timeout=10,
        )
    assert placed >= 6
    assert decisive > 0  # the stream does tell the extender's choice from first fit
