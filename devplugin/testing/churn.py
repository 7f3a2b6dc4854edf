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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from devplugin.model import DeviceKind
from devplugin.node.alignment import alignment, best_alignment, best_worst_level
from devplugin.policy.topology import Level, Topology
from devplugin.testing.cluster import GPU, HCA, SimCluster
from devplugin.testing.kubelet import (
    AdmissionError,
    ContainerRequest,
    KubeletSimulator,
    PodResult,
)
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
    # Some device was reported Unhealthy during the run (a read past its
    # deadline on a loaded machine fails closed): pods may not have fit.
    faults: int = 0

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
    coordinator = cluster.daemon.core.coordinator
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        # Allocations younger than the bookkeeping grace need a later poll.
        cluster.daemon.core.monitor.poke()
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
        topology = cluster.daemon.core.coordinator.topology
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
        outcome.faults = sum(
            health != "Healthy"
            for resource in (GPU, HCA)
            for _, devices in kubelet.history(resource)
            for health in devices.values()
        )
    return outcome


# -- a real-time stream: pods milliseconds apart, no waiting for the daemon -----------

# (GPUs, HCAs) per app container: shapes a 1:1 guess gets wrong, and the usual ones.
MIXED = [(2, 1), (3, 1), (4, 2), (1, 1), (2, 2), (4, 4), (6, 2)]


def mixed_pod(rng: random.Random) -> list[ContainerRequest]:
    """One or two app containers of mixed shapes; some pods with a sidecar or
    an init container holding devices, some with a single-resource container."""
    containers = [
        ContainerRequest(f"c{i}", _limits(rng.choice(MIXED))) for i in range(rng.choice([1, 1, 2]))
    ]
    extra = rng.random()
    if extra < 0.15:
        side = ContainerRequest(
            "side", _limits(rng.choice([(1, 1), (2, 1)])), init=True, sidecar=True
        )
        containers.insert(0, side)
    elif extra < 0.3:
        prep = ContainerRequest("prep", _limits(rng.choice([(1, 1), (2, 1), (1, 0)])), init=True)
        containers.insert(0, prep)
    elif extra < 0.4:
        containers.append(ContainerRequest("solo", _limits(rng.choice([(2, 0), (0, 1)]))))
    return containers


def _limits(shape: tuple[int, int]) -> dict[str, int]:
    return {GPU: shape[0], HCA: shape[1]}


@dataclass
class StreamTally:
    """GPU+HCA containers and how many got the exhaustive optimum (worst
    GPU-HCA level, then the sum) for what was free when they were admitted."""

    containers: int = 0
    optimal: int = 0
    pods: int = 0
    deletions: int = 0
    misses: list[str] = field(default_factory=list)

    def add(self, other: StreamTally) -> None:
        self.containers += other.containers
        self.optimal += other.optimal
        self.pods += other.pods
        self.deletions += other.deletions
        self.misses.extend(other.misses)

    def __str__(self) -> str:
        share = self.optimal / self.containers if self.containers else 1.0
        return f"{self.optimal}/{self.containers} ({share:.1%})"


def free_now(kubelet: KubeletSimulator, resource: str) -> set[str]:
    """What the kubelet would offer right now: healthy and held by nobody."""
    held = kubelet.allocated().get(resource, set())
    return {d for d, rec in kubelet.devices(resource).items() if rec.health == "Healthy"} - held


def timed_stream(
    kubelet: KubeletSimulator,
    topology: Topology,
    seed: int,
    *,
    arrivals: int,
    gap: float = 0.02,
    delete_share: float = 0.4,
    prefix: str = "pod",
    settle: Callable[[], None] | None = None,
) -> StreamTally:
    """Pods arrive `gap` seconds apart; before each arrival, with probability
    `delete_share` (or whenever the pod would not fit), a live pod is deleted
    half a gap earlier. Nothing waits for the daemon to catch up. Every
    GPU+HCA container is judged against the exhaustive optimum for what the
    kubelet had free at its admission (devices a finished init container of
    the same pod leaves behind are ones the kubelet gives first: forced)."""
    rng = random.Random(seed)
    tally = StreamTally()
    live: list[str] = []
    start = time.monotonic()
    for index in range(arrivals):
        pod = mixed_pod(rng)
        need_g = _need(pod, GPU)
        need_h = _need(pod, HCA)
        fits = need_g <= len(free_now(kubelet, GPU)) and need_h <= len(free_now(kubelet, HCA))
        _until(start + (index + 0.5) * gap)
        if live and (rng.random() < delete_share or not fits):
            kubelet.remove(live.pop(rng.randrange(len(live))))
            tally.deletions += 1
        _until(start + (index + 1) * gap)
        if settle is not None:
            settle()
        free_g, free_h = free_now(kubelet, GPU), free_now(kubelet, HCA)
        if need_g > len(free_g) or need_h > len(free_h):
            continue
        name = f"{prefix}-{seed}-{index}"
        try:
            result = kubelet.admit(name, pod)
        except AdmissionError:
            # Only devices turning Unhealthy meanwhile may explain it (a read
            # past its deadline on a loaded machine fails closed).
            continue
        live.append(name)
        tally.pods += 1
        _judge(tally, topology, name=name, pod=pod, result=result, free_g=free_g, free_h=free_h)
    for name in live:
        kubelet.remove(name)
    return tally


def _need(pod: list[ContainerRequest], resource: str) -> int:
    """Devices the pod holds at once (init containers' are reused by later ones)."""
    held = sum(c.requests.get(resource, 0) for c in pod if not c.init or c.sidecar)
    init = max((c.requests.get(resource, 0) for c in pod if c.init and not c.sidecar), default=0)
    return max(held, init)


def _until(moment: float) -> None:
    wait = moment - time.monotonic()
    if wait > 0:
        time.sleep(wait)


def _judge(
    tally: StreamTally,
    topology: Topology,
    *,
    name: str,
    pod: list[ContainerRequest],
    result: PodResult,
    free_g: set[str],
    free_h: set[str],
) -> None:
    by_name = {c.name: c for c in pod}
    reusable: dict[str, set[str]] = {GPU: set(), HCA: set()}
    for container in result.containers:
        request = by_name[container.name]
        gpus, hcas = request.requests.get(GPU, 0), request.requests.get(HCA, 0)
        got_g, got_h = container.devices.get(GPU, ()), container.devices.get(HCA, ())
        must_g = reused(reusable[GPU], got_g, gpus)
        must_h = reused(reusable[HCA], got_h, hcas)
        if gpus and hcas:
            achieved = alignment(topology, got_g, got_h)
            best = best_alignment(
                topology,
                free_g | must_g,
                free_h | must_h,
                gpus,
                hcas,
                must_gpus=must_g,
                must_hcas=must_h,
            )
            tally.containers += 1
            if achieved == best:
                tally.optimal += 1
            else:
                tally.misses.append(
                    f"{name}/{container.name} ({gpus},{hcas}) order {','.join(container.order)}: "
                    f"got {_shown(achieved)}, best {_shown(best)}"
                )
        free_g, free_h = free_g - set(got_g), free_h - set(got_h)
        for resource, got in ((GPU, got_g), (HCA, got_h)):
            if request.init and not request.sidecar:
                reusable[resource] |= set(got)
            else:
                reusable[resource] -= set(got)


def reused(reusable: set[str], got: Iterable[str], count: int) -> set[str]:
    """What the kubelet took from a pod's reusable devices for a request of
    `count`: as many as it asks, from those, first (which ones, where there
    are more, no one chooses: devicesToAllocate takes them from a Go set),
    so the container's devices that were reusable."""
    taken = reusable & set(got)
    assert len(taken) == min(count, len(reusable)), (sorted(reusable), sorted(got), count)
    return taken


def _shown(found: tuple[Level, int] | None) -> str:
    return f"{found[0].name}/{found[1]}" if found is not None else "-"
