"""Pod-aware first choices: with the pod cache, every GPU+HCA container gets the
best worst GPU-HCA level any choice could give, whatever the shape and order."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from devplugin.alignment import alignment, best_worst_level
from devplugin.model import DeviceKind
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.kubelet import ContainerRequest
from devplugin.testing.layouts import LAYOUTS
from tests.conftest import GPU, HCA, Cluster
from tests.waiting import wait_until

Start = Callable[..., Cluster]
# (GPUs, HCAs) per container: shapes a 1:1 guess gets wrong, and the usual ones.
SHAPES = [(2, 1), (3, 1), (4, 2), (1, 1), (2, 2), (4, 4), (6, 2)]


def free(cluster: Cluster, resource: str) -> set[str]:
    held = cluster.kubelet.allocated().get(resource, set())
    devices = cluster.kubelet.devices(resource)
    return {d for d, record in devices.items() if record.health == "Healthy"} - held


def settle(cluster: Cluster) -> None:
    """The daemon's view of what is free has caught up with the kubelet's."""
    coordinator = cluster.daemon.coordinator
    assert wait_until(
        lambda: (
            (cluster.daemon.monitor.poke() or True)
            and coordinator.free(DeviceKind.GPU) == free(cluster, GPU)
            and coordinator.free(DeviceKind.HCA) == free(cluster, HCA)
        ),
        timeout=10,
    )


def optimal_share(cluster: Cluster, seed: int, events: int = 60) -> tuple[int, int]:
    """Admit and remove a seeded stream of pods; (optimal, GPU+HCA containers)."""
    rng = random.Random(seed)
    topology = cluster.daemon.coordinator.topology
    live: list[str] = []
    optimal = total = 0
    for event in range(events):
        if live and rng.random() < 0.35:
            cluster.kubelet.remove(live.pop(rng.randrange(len(live))))
            settle(cluster)
            continue
        shapes = [rng.choice(SHAPES) for _ in range(rng.choice([1, 1, 2]))]
        free_g, free_h = free(cluster, GPU), free(cluster, HCA)
        if sum(g for g, _ in shapes) > len(free_g) or sum(h for _, h in shapes) > len(free_h):
            continue
        name = f"pod-{seed}-{event}"
        requests = [ContainerRequest(f"c{i}", {GPU: g, HCA: h}) for i, (g, h) in enumerate(shapes)]
        result = cluster.kubelet.admit(name, requests)
        live.append(name)
        for (gpus, hcas), container in zip(shapes, result.containers, strict=True):
            got_g, got_h = container.devices[GPU], container.devices[HCA]
            achieved = alignment(topology, got_g, got_h)
            assert achieved is not None
            best = best_worst_level(topology, free_g, free_h, gpus, hcas)
            total += 1
            optimal += achieved[0] == best
            free_g, free_h = free_g - set(got_g), free_h - set(got_h)
        settle(cluster)
    for name in live:
        cluster.kubelet.remove(name)
    settle(cluster)
    return optimal, total


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dgx-a100", "hgx-h100"])
def test_with_the_pod_cache_every_container_gets_the_optimum(
    start_cluster: Start, api: ApiServerImitation, layout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    blind = start_cluster(LAYOUTS[layout](), **{"pod_resources.min_interval_seconds": 0.01})
    before = [optimal_share(blind, seed) for seed in range(3)]
    aware = start_cluster(
        LAYOUTS[layout](), api=api, **{"pod_resources.min_interval_seconds": 0.01}
    )
    after = [optimal_share(aware, seed) for seed in range(3)]
    assert sum(total for _, total in after) > 0
    assert all(optimal == total for optimal, total in after), (before, after)
    metrics = aware.daemon.metrics.pod_aware
    exact = sum(metrics.labels(resource, "exact")._value.get() for resource in (GPU, HCA))
    assert exact > 0
    with capsys.disabled():
        share = lambda runs: sum(o for o, _ in runs) / sum(t for _, t in runs)  # noqa: E731
        print(f"\n{layout}: optimal share without the pod cache {share(before):.1%}, "
              f"with it {share(after):.1%}")  # fmt: skip
