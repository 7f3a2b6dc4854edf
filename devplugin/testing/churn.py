"""A seeded stream of pods arriving and leaving, through the kubelet simulator.

Run once with devplugin's preferred allocation and once with the kubelet's
own pick (`allocation.preferred: false`, which makes the simulator take the
first free devices in id order: naive first fit). Both runs see the same
events: whether a pod fits depends only on device counts. For every
container holding GPUs and HCAs it records whether the worst GPU-to-HCA
level was the best achievable given what was free, and whether it was the
best achievable on an empty node.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field

from devplugin.alignment import alignment, best_worst_level
from devplugin.model import DeviceKind
from devplugin.testing.cluster import GPU, HCA, SimCluster
from devplugin.testing.kubelet import ContainerRequest, KubeletSimulator
from devplugin.testing.node import NodeSpec

# (GPUs, HCAs) per container, with weights: mostly GPUDirect pairs, some
# shared-NIC shapes, some single-resource pods.
SHAPES = [(1, 1), (2, 2), (4, 4), (2, 1), (4, 2), (1, 0), (0, 1), (8, 8)]
WEIGHTS = [5, 5, 3, 2, 2, 2, 1, 1]


@dataclass
class ChurnOutcome:
    containers: int = 0
    optimal: int = 0  # best achievable given what was free
    ideal: int = 0  # best achievable on an empty node
    levels: Counter[str] = field(default_factory=Counter)

    @property
    def optimal_share(self) -> float:
        return self.optimal / self.containers if self.containers else 1.0

    @property
    def ideal_share(self) -> float:
        return self.ideal / self.containers if self.containers else 1.0


def _free(kubelet: KubeletSimulator, resource: str) -> set[str]:
    held = kubelet.allocated().get(resource, set())
    return {d for d, rec in kubelet.devices(resource).items() if rec.health == "Healthy"} - held


def _settle(cluster: SimCluster) -> None:
    """Wait until the daemon's PodResources view has caught up with releases."""
    coordinator = cluster.daemon.coordinator
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        # Allocations younger than the bookkeeping grace need a later poll.
        cluster.daemon.monitor.poke()
        if coordinator.free(DeviceKind.GPU) == _free(cluster.kubelet, GPU) and coordinator.free(
            DeviceKind.HCA
        ) == _free(cluster.kubelet, HCA):
            return
        time.sleep(0.01)


def run_churn(spec: NodeSpec, seed: int, *, preferred: bool, events: int = 60) -> ChurnOutcome:
    rng = random.Random(seed)
    settings = {
        "allocation.preferred": preferred,
        "pod_resources.min_interval_seconds": 0.01,
        # The simulator records allocations as Allocate returns.
        "pod_resources.bookkeeping_grace_seconds": 0.05,
    }
    outcome = ChurnOutcome()
    with SimCluster(spec, settings=settings, seed=seed) as cluster:
        kubelet = cluster.kubelet
        topology = cluster.daemon.coordinator.topology
        every_gpu, every_hca = set(topology.ids(DeviceKind.GPU)), set(topology.ids(DeviceKind.HCA))
        live: list[str] = []
        for event in range(events):
            if live and rng.random() < 0.4:
                kubelet.remove(live.pop(rng.randrange(len(live))))
                _settle(cluster)
                continue
            gpus, hcas = rng.choices(SHAPES, WEIGHTS)[0]
            free_g, free_h = _free(kubelet, GPU), _free(kubelet, HCA)
            if gpus > len(free_g) or hcas > len(free_h):
                continue
            name = f"pod-{event}"
            request = ContainerRequest("main", {GPU: gpus, HCA: hcas})
            container = kubelet.admit(name, [request]).container("main")
            live.append(name)
            if not (gpus and hcas):
                continue
            achieved = alignment(topology, container.devices[GPU], container.devices[HCA])
            assert achieved is not None
            outcome.containers += 1
            outcome.levels[achieved[0].name] += 1
            if achieved[0] == best_worst_level(topology, free_g, free_h, gpus, hcas):
                outcome.optimal += 1
            if achieved[0] == best_worst_level(topology, every_gpu, every_hca, gpus, hcas):
                outcome.ideal += 1
    return outcome
