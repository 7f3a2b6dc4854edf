"""The API server down, slow, failing or cutting watches, and bad objects in the
watch: allocation goes on (the fallback), no GetPreferredAllocation waits
longer than the bounded pod wait, and pod-awareness comes back with the server."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from devplugin.cluster.pods import PodCache
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.kubelet import ContainerRequest
from devplugin.testing.node import hgx_node
from tests.conftest import GPU, HCA, Cluster
from tests.waiting import wait_until

Start = Callable[..., Cluster]
_names = itertools.count()


def outcomes(cluster: Cluster) -> dict[str, float]:
    counter = cluster.daemon.core.metrics.pod_aware
    return {
        outcome: sum(counter.labels(r, outcome)._value.get() for r in (GPU, HCA))
        for outcome in ("exact", "fallback-no-pod", "fallback-ambiguous", "fallback-not-current")
    }


def slowest_preferred(cluster: Cluster) -> float:
    """The upper bound of the histogram bucket of the slowest GetPreferredAllocation."""
    histogram = cluster.daemon.core.metrics.preferred_seconds
    worst = 0.0
    for metric in histogram.collect():
        counts: dict[float, float] = {}
        for sample in metric.samples:
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                counts[bound] = counts.get(bound, 0.0) + sample.value
        previous = 0.0
        for bound in sorted(counts):
            if counts[bound] > previous:
                worst = max(worst, bound)
            previous = counts[bound]
    return worst


def synced(start_cluster: Start, api: ApiServerImitation) -> tuple[Cluster, PodCache]:
    """A node whose pod cache has listed the imitation's pods once."""
    cluster = start_cluster(hgx_node(), api=api)
    pods = cluster.daemon.pods
    assert pods is not None
    assert pods.synced.wait(10)
    return cluster, pods


def admit_pair(cluster: Cluster) -> None:
    name = f"p{next(_names)}"
    pod = cluster.kubelet.admit(name, [ContainerRequest("main", {GPU: 2, HCA: 1})])
    assert len(pod.container("main").devices[GPU]) == 2
    assert len(pod.container("main").devices[HCA]) == 1
    cluster.kubelet.remove(name)


def wait_exact(cluster: Cluster) -> None:
    """Pods admitted until one is planned from the pod cache again."""

    def exact_again() -> bool:
        before = outcomes(cluster)["exact"]
        admit_pair(cluster)
        return outcomes(cluster)["exact"] > before

    assert wait_until(exact_again, timeout=20)


@contextmanager
def cutting(api: ApiServerImitation, every: float) -> Iterator[None]:
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(every):
            api.cut_watches()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def test_with_the_api_server_down_allocation_falls_back_then_recovers(
    start_cluster: Start, api: ApiServerImitation
) -> None:
    port = int(api.url.rsplit(":", 1)[1])
    api.stop()
    cluster = start_cluster(hgx_node(), api=api)
    for _ in range(4):
        admit_pair(cluster)
    # The cache never listed: it is not even asked.
    assert outcomes(cluster)["fallback-not-current"] >= 4
    assert outcomes(cluster)["exact"] == 0
    # Every preference was answered within the bounded pod wait (0.1 s).
    assert slowest_preferred(cluster) <= 0.5
    api.start(port)
    wait_exact(cluster)
    assert slowest_preferred(cluster) <= 0.5


def test_a_slow_api_server_never_slows_a_preference_past_the_bound(
    start_cluster: Start, api: ApiServerImitation
) -> None:
    cluster, _pods = synced(start_cluster, api)
    # Every request takes a second; each pod arrives just after the watch
    # was cut, while the cache waits a second for its next watch.
    api.delay = 1.0
    for _ in range(3):
        api.cut_watches()
        admit_pair(cluster)
    assert outcomes(cluster)["fallback-no-pod"] >= 1
    assert slowest_preferred(cluster) <= 0.5
    api.delay = 0.0
    wait_exact(cluster)


def test_server_errors_fall_back_and_the_cache_recovers(
    start_cluster: Start, api: ApiServerImitation
) -> None:
    cluster, pods = synced(start_cluster, api)
    api.fail_next(10_000, code=500)
    api.cut_watches()
    assert wait_until(lambda: not pods.current, timeout=10)
    for _ in range(3):
        admit_pair(cluster)
    assert outcomes(cluster)["fallback-not-current"] >= 3
    assert slowest_preferred(cluster) <= 0.5
    api.clear_failures()
    assert wait_until(lambda: pods.current, timeout=15)
    wait_exact(cluster)


def test_watches_cut_every_half_second_keep_the_cache_current(
    start_cluster: Start, api: ApiServerImitation
) -> None:
    cluster, pods = synced(start_cluster, api)
    relists = pods.relists
    with cutting(api, 0.5):
        before = outcomes(cluster)
        for _ in range(12):
            admit_pair(cluster)
        after = outcomes(cluster)
    # Each cut resumes the watch from the last version; no new list needed.
    assert pods.relists == relists
    assert after["exact"] - before["exact"] >= 20  # two resources x 12 pods, few misses
    assert slowest_preferred(cluster) <= 0.5


@pytest.mark.parametrize(
    "bad",
    [
        {"metadata": {"name": "no-uid", "namespace": "default"}, "spec": {"nodeName": "node-1"}},
        {
            "metadata": {"uid": "u1", "name": "x", "namespace": "default"},
            "spec": {"nodeName": "node-1", "containers": "not a list"},
        },
        {
            "metadata": {"uid": "u2", "name": "y", "namespace": "default"},
            "spec": {
                "nodeName": "node-1",
                "containers": [{"name": "c", "resources": {"limits": {GPU: "lots"}}}],
            },
        },
        {
            "metadata": {"uid": "u3", "name": "z", "namespace": "default"},
            "spec": {"nodeName": "node-1"},
            "status": ["wrong"],
        },
    ],
)
def test_bad_pods_in_the_watch_are_skipped_with_one_line(
    start_cluster: Start,
    api: ApiServerImitation,
    bad: dict[str, object],
    caplog: pytest.LogCaptureFixture,
) -> None:
    cluster, _pods = synced(start_cluster, api)
    with caplog.at_level(logging.WARNING, logger="devplugin.cluster.pods"):
        for _ in range(3):
            api.inject_raw_event("pods", "ADDED", bad)
        wait_exact(cluster)
    skipped = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1
