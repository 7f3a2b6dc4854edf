"""Pod-aware first choices: with the pod cache, every GPU+HCA container gets the
best worst GPU-HCA level any choice could give, whatever the shape and order."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from devplugin.model import DeviceKind
from devplugin.node.alignment import alignment, best_worst_level
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.churn import mixed_pod, reused
from devplugin.testing.kubelet import AdmissionError, ContainerRequest
from devplugin.testing.layouts import LAYOUTS
from tests.conftest import GPU, HCA, Cluster
from tests.waiting import wait_until

Start = Callable[..., Cluster]


def free(cluster: Cluster, resource: str) -> set[str]:
    held = cluster.kubelet.allocated().get(resource, set())
    devices = cluster.kubelet.devices(resource)
    return {d for d, record in devices.items() if record.health == "Healthy"} - held


def all_healthy(cluster: Cluster) -> bool:
    return all(
        record.health == "Healthy"
        for resource in (GPU, HCA)
        for record in cluster.kubelet.devices(resource).values()
    )


def settle(cluster: Cluster) -> None:
    """The daemon's view of what is free has caught up with the kubelet's."""
    coordinator = cluster.daemon.core.coordinator
    assert wait_until(
        lambda: (
            (cluster.daemon.core.monitor.poke() or True)
            and coordinator.free(DeviceKind.GPU) == free(cluster, GPU)
            and coordinator.free(DeviceKind.HCA) == free(cluster, HCA)
        ),
        timeout=10,
    )


@dataclass
class Share:
    optimal: int = 0  # GPU+HCA containers at the best level their choice allowed
    total: int = 0
    # Containers the kubelet gave some devices of a finished init container:
    # counted apart (the daemon is not told which devices will be reused).
    reuse_optimal: int = 0
    reuse_total: int = 0


def optimal_share(cluster: Cluster, seed: int, events: int = 60) -> Share:
    """Admit and remove a seeded stream of pods; count who got the optimum."""
    rng = random.Random(seed)
    topology = cluster.daemon.core.coordinator.topology
    live: list[str] = []
    share = Share()
    for event in range(events):
        if live and rng.random() < 0.35:
            cluster.kubelet.remove(live.pop(rng.randrange(len(live))))
            settle(cluster)
            continue
        requests = mixed_pod(rng)
        free_g, free_h = free(cluster, GPU), free(cluster, HCA)
        if sum(c.requests[GPU] for c in requests) > len(free_g) or sum(
            c.requests[HCA] for c in requests
        ) > len(free_h):
            continue
        name = f"pod-{seed}-{event}"
        try:
            result = cluster.kubelet.admit(name, requests)
        except AdmissionError:
            # Only a device turning Unhealthy meanwhile (a stalled read on a
            # loaded machine fails closed) may explain it; then go on.
            assert not all_healthy(cluster), name
            assert wait_until(lambda: all_healthy(cluster), timeout=30)
            continue
        live.append(name)
        by_name = {c.name: c for c in requests}
        reusable: dict[str, set[str]] = {GPU: set(), HCA: set()}
        # The simulator's results come in admission order.
        for container in result.containers:
            request = by_name[container.name]
            gpus, hcas = request.requests[GPU], request.requests[HCA]
            got_g, got_h = container.devices.get(GPU, ()), container.devices.get(HCA, ())
            must_g = reused(reusable[GPU], got_g, gpus)
            must_h = reused(reusable[HCA], got_h, hcas)
            if gpus and hcas:
                achieved = alignment(topology, got_g, got_h)
                assert achieved is not None
                best = best_worst_level(
                    topology,
                    free_g | must_g,
                    free_h | must_h,
                    gpus,
                    hcas,
                    must_gpus=must_g,
                    must_hcas=must_h,
                )
                hit = achieved[0] == best
                if must_g or must_h:
                    share.reuse_total += 1
                    share.reuse_optimal += hit
                else:
                    share.total += 1
                    share.optimal += hit
            free_g, free_h = free_g - set(got_g), free_h - set(got_h)
            for resource, got in ((GPU, got_g), (HCA, got_h)):
                if request.init and not request.sidecar:
                    reusable[resource] |= set(got)
                else:
                    reusable[resource] -= set(got)
        settle(cluster)
    for name in live:
        cluster.kubelet.remove(name)
    settle(cluster)
    return share


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dgx-a100", "hgx-h100"])
def test_with_the_pod_cache_every_container_gets_the_optimum(
    start_cluster: Start, api: ApiServerImitation, layout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    blind = start_cluster(LAYOUTS[layout](), **{"pod_resources.min_interval_seconds": 0.01})
    before = [optimal_share(blind, seed) for seed in range(3)]
    # What is measured is the plan made knowing the pod: the kubelet admits each
    # pod once the daemon's watch has it (on a starved CI core the watch can lag
    # the simulator by more than the wait; that case is tested apart).
    aware = start_cluster(
        LAYOUTS[layout](), api=api, **{"pod_resources.min_interval_seconds": 0.01}
    )
    watched(aware)
    after = [optimal_share(aware, seed) for seed in range(3)]
    assert sum(run.total for run in after) > 0
    outcomes = {
        f"{resource} {sample.labels['outcome']}": sample.value
        for resource in (GPU, HCA)
        for metric in aware.daemon.core.metrics.registry.collect()
        if metric.name == "devplugin_pod_aware_choices"
        for sample in metric.samples
        if sample.labels.get("resource") == resource and sample.name.endswith("_total")
    }
    assert all(run.optimal == run.total for run in after), (after, outcomes)
    assert sum(run.reuse_total for run in after) > 0
    assert all(run.reuse_optimal == run.reuse_total for run in after), (before, after)
    metrics = aware.daemon.core.metrics.pod_aware
    exact = sum(metrics.labels(resource, "exact")._value.get() for resource in (GPU, HCA))
    assert exact > 0
    with capsys.disabled():
        print(
            f"\n{layout}: optimal without the pod cache {pct(before)}, with it {pct(after)}; "
            f"containers reusing init devices {pct(before, True)} -> {pct(after, True)}"
        )


def watched(cluster: Cluster) -> None:
    """The kubelet admits a pod only once the daemon's pod watch has it."""
    pods = cluster.daemon.pods
    assert pods is not None

    def seen(namespace: str, name: str) -> None:
        assert wait_until(lambda: pods.uid_of(namespace, name) is not None, timeout=10)

    cluster.kubelet.after_bind = seen


def pct(runs: list[Share], reuse: bool = False) -> str:
    hit = sum(r.reuse_optimal if reuse else r.optimal for r in runs)
    total = sum(r.reuse_total if reuse else r.total for r in runs)
    return f"{hit}/{total} ({hit / total:.1%})" if total else "0/0"


@pytest.mark.parametrize("order", [(GPU, HCA), (HCA, GPU)], ids=["gpu-first", "hca-first"])
@pytest.mark.parametrize("layout", ["dgx-a100", "hgx-h100"])
def test_an_app_container_reusing_an_init_containers_gpu_is_planned_around_it(
    start_cluster: Start, api: ApiServerImitation, layout: str, order: tuple[str, str]
) -> None:
    # The kubelet gives `main` the GPU `prep` got, whatever is preferred:
    # main's HCA (asked first or second) must sit best for that GPU plus one more.
    cluster = start_cluster(LAYOUTS[layout](), api=api)
    watched(cluster)
    topology = cluster.daemon.core.coordinator.topology
    free_g, free_h = free(cluster, GPU), free(cluster, HCA)
    pod = cluster.kubelet.admit(
        "p",
        [
            ContainerRequest("prep", {GPU: 1}, init=True),
            ContainerRequest("main", {GPU: 2, HCA: 1}),
        ],
        order=order,
    )
    prep, main = pod.container("prep").devices, pod.container("main").devices
    assert set(prep[GPU]) <= set(main[GPU])
    achieved = alignment(topology, main[GPU], main[HCA])
    assert achieved is not None
    best = best_worst_level(topology, free_g, free_h, 2, 1, must_gpus=prep[GPU])
    assert achieved[0] == best, (prep, main)


@pytest.mark.parametrize("order", [(GPU, HCA), (HCA, GPU)], ids=["gpu-first", "hca-first"])
def test_a_pod_reaching_the_watch_between_a_containers_two_calls_still_pairs_them(
    start_cluster: Start, api: ApiServerImitation, order: tuple[str, str]
) -> None:
    # The watch lags the kubelet: the first call names no pod, its Allocate no
    # holder. The pod arrives before the second call, which must still be
    # planned against what the first got, not as a new container's first.
    cluster = start_cluster(LAYOUTS["hgx-h100"](), api=api)
    pods = cluster.daemon.pods
    assert pods is not None
    assert wait_until(lambda: pods.current)
    topology = cluster.daemon.core.coordinator.topology
    free_g, free_h = free(cluster, GPU), free(cluster, HCA)
    api.hold_watches()

    def caught_up(container: str, resource: str) -> None:
        if resource == order[0]:
            api.release_watches()
            assert wait_until(lambda: any(p.name == "p" for p in pods.pods().values()))

    cluster.kubelet.between_resources = caught_up
    pod = cluster.kubelet.admit("p", [ContainerRequest("main", {GPU: 2, HCA: 2})], order=order)
    main = pod.container("main").devices
    achieved = alignment(topology, main[GPU], main[HCA])
    assert achieved is not None
    fixed = {"must_gpus": main[GPU]} if order[0] == GPU else {"must_hcas": main[HCA]}
    best = best_worst_level(topology, free_g, free_h, 2, 2, **fixed)
    assert achieved[0] == best, main
