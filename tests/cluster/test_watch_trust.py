"""Watches that cannot go silent: a connection that stops answering without a FIN
or RST is noticed at its read deadline, said (/readyz, a metric) while the
cache is not current, and followed by a new list once the path heals; a
malformed object, whatever is wrong with it, is skipped and never stops a
cache."""

from __future__ import annotations

import copy
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from devplugin.cluster.watch import WatchCache
from devplugin.config import KubernetesConfig
from devplugin.extender.app import Extender, serve
from devplugin.extender.serving import ExtenderServer
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.kubelet import ContainerRequest
from devplugin.testing.node import hgx_node
from devplugin.testing.proxy import SilentProxy
from tests.conftest import GPU, HCA, Cluster
from tests.extender_support import put_record
from tests.support import probe
from tests.waiting import wait_until

Start = Callable[..., Cluster]
Running = tuple[Extender, ExtenderServer, list[WatchCache[Any]]]
WATCH, REQUEST, BACKOFF = 2, 1, 1
# Nothing for this long from a live watch means it is dead.
DEADLINE = WATCH + REQUEST
QUICK = {
    "kubernetes.watch_timeout_seconds": WATCH,
    "kubernetes.request_timeout_seconds": REQUEST,
    "kubernetes.watch_backoff_max_seconds": BACKOFF,
}


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def extender_via(url: str, tmp_path: Path, api: ApiServerImitation) -> Running:
    kubeconfig = tmp_path / "extender-kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(api.kubeconfig(url)))
    kube = KubernetesConfig(
        enabled=True,
        kubeconfig=str(kubeconfig),
        watch_timeout_seconds=WATCH,
        request_timeout_seconds=REQUEST,
        watch_backoff_max_seconds=BACKOFF,
    )
    return serve(kube, ("127.0.0.1", 0), stale_after=60.0)


@pytest.fixture
def proxy(api: ApiServerImitation) -> Iterator[SilentProxy]:
    host, port = api.url.removeprefix("http://").split(":")
    running = SilentProxy((host, int(port)))
    running.start()
    yield running
    running.stop()


@pytest.mark.slow
def test_a_silent_api_path_is_noticed_said_and_survived_by_the_daemon_and_the_extender(
    start_cluster: Start, api: ApiServerImitation, proxy: SilentProxy, tmp_path: Path
) -> None:
    cluster = start_cluster(hgx_node(), api=api, api_url=proxy.url, **QUICK)
    extender, server, caches = extender_via(proxy.url, tmp_path, api)
    ext_url = "http://{}:{}".format(*server.address)
    pods = cluster.daemon.pods
    assert pods is not None
    try:
        assert wait_until(lambda: pods.current and extender.ready()[0], timeout=10)
        assert probe(cluster, "/readyz")[0] == 200
        proxy.silence()
        silent_at = time.monotonic()
        # Bound to the node while nothing crosses: neither side can see it.
        cluster.kubelet.admit("during", [ContainerRequest("main", {GPU: 1, HCA: 1})])
        # Both notice by their read deadline, and say so.
        assert wait_until(lambda: not pods.current, timeout=DEADLINE + 3)
        assert wait_until(lambda: get(f"{ext_url}/readyz")[0] == 503, timeout=DEADLINE + 3)
        noticed = time.monotonic() - silent_at
        code, body = probe(cluster, "/readyz")
        assert code == 503
        assert "pod cache not current" in body
        assert 'devplugin_watch_current{cache="pods"} 0.0' in probe(cluster, "/metrics")[1]
        code, body = get(f"{ext_url}/readyz")
        assert "not current" in body
        # Each cache meets its own deadline (they were listed at different moments), so
        # the first 503 may come from any one of them; every one must follow.
        watched = ("nodedevices", "pods", "leases")

        def all_said() -> bool:
            metrics = get(f"{ext_url}/metrics")[1]
            return all(f'devplugin_watch_current{{cache="{c}"}} 0.0' in metrics for c in watched)

        assert wait_until(all_said, timeout=DEADLINE + 3)
        # Allocation goes on meanwhile, planned from the kubelet alone.
        cluster.kubelet.admit("meanwhile", [ContainerRequest("main", {GPU: 2, HCA: 2})])
        outcome = cluster.daemon.core.metrics.pod_aware.labels(GPU, "fallback-not-current")
        assert (
            outcome._value.get()
            + cluster.daemon.core.metrics.pod_aware.labels(HCA, "fallback-not-current")._value.get()
            >= 1
        )
        time.sleep(max(0.0, silent_at + 10 - time.monotonic()))  # the outage lasts 10 s
        proxy.heal()
        healed = time.monotonic()

        def daemon_back() -> bool:
            return pods.current and any(p.name == "during" for p in pods.pods().values())

        def extender_back() -> bool:
            return extender.ready()[0] and any(
                p.name == "during" for p in extender.pods.pods().values()
            )

        # Back within the read deadline plus one list (and a backoff step).
        bound = DEADLINE + REQUEST + BACKOFF + 1
        assert wait_until(daemon_back, timeout=bound)
        daemon_took = time.monotonic() - healed
        assert wait_until(extender_back, timeout=bound)
        extender_took = time.monotonic() - healed
        assert probe(cluster, "/readyz")[0] == 200
        assert get(f"{ext_url}/readyz")[0] == 200
        print(
            f"\nsilent path: noticed after {noticed:.1f}s (deadline {DEADLINE}s); after healing "
            f"the daemon was current in {daemon_took:.1f}s, the extender in {extender_took:.1f}s"
        )
    finally:
        server.stop()
        for cache in caches:
            cache.signal_stop()


# -- malformed objects -------------------------------------------------------------------


def _wrong(path: str, value: object) -> Callable[[dict[str, Any]], None]:
    """Put `value` at a dotted path of a record's status (list indices allowed)."""

    def apply(record: dict[str, Any]) -> None:
        node: Any = record["status"]
        parts = path.split(".")
        for part in parts[:-1]:
            node = node[int(part)] if part.isdigit() else node[part]
        last = parts[-1]
        if last.isdigit():
            node[int(last)] = value
        else:
            node[last] = value

    return apply


BAD_RECORDS = {
    "nvlinkPeers is a number": _wrong("devices.0.nvlinkPeers", 5),
    "a peer is a string": _wrong("devices.0.nvlinkPeers", ["x"]),
    "devices is a number": _wrong("devices", 5),
    "a device is a string": _wrong("devices.0", "gpu"),
    "topologyPath is a number": _wrong("devices.0.topologyPath", 7),
    "a path entry is a list": _wrong("devices.1.topologyPath", [[1], "a", "b", "c"]),
    "pciAddress is a list": _wrong("devices.0.pciAddress", ["0000:1a:00.0"]),
    "allocations is an object": _wrong("allocations", {"a": 1}),
    "an allocation is a number": _wrong("allocations", [5]),
    "allocation devices is a number": _wrong("allocations", [{"pod": "p", "devices": 5}]),
    "status is a list": lambda record: record.update(status=[1, 2]),
}


@pytest.mark.parametrize("damage", list(BAD_RECORDS.values()), ids=list(BAD_RECORDS))
def test_a_record_with_a_wrong_type_is_skipped_and_others_keep_updating(
    api: ApiServerImitation, tmp_path: Path, damage: Callable[[dict[str, Any]], None]
) -> None:
    good = put_record(api, "good", "hgx-h100", tmp_path)
    bad = put_record(api, "bad", "hgx-h100", tmp_path)
    extender, server, caches = extender_via(api.url, tmp_path, api)
    records = extender.records
    try:
        assert wait_until(lambda: {"good", "bad"} <= set(records.items()), timeout=10)
        broken = copy.deepcopy(bad)
        damage(broken)
        api.put("nodedevices", broken)
        before = records.skipped
        assert wait_until(lambda: records.skipped > before, timeout=5)
        for round_ in range(3):
            # Every later update of another record still lands.
            changed = copy.deepcopy(good)
            changed["status"]["allocations"] = [{
                "namespace": "default", "pod": f"p{round_}", "container": "main",
                "devices": [changed["status"]["devices"][round_]["id"]], "worstLevel": "",
            }]  # fmt: skip
            version = api.put("nodedevices", changed)["metadata"]["resourceVersion"]
            assert wait_until(lambda v=version: records.items()["good"].version == v, timeout=5)
        # The damaged record is not believed, nor what it said before it was
        # damaged; mended, it is again.
        assert "bad" not in records.items()
        assert wait_until(lambda: extender.ready()[0], timeout=5)
        mended = api.put("nodedevices", copy.deepcopy(bad))["metadata"]["resourceVersion"]

        def landed() -> bool:
            found = records.items().get("bad")
            return found is not None and found.version == mended

        assert wait_until(landed, timeout=5)
        assert records.current
    finally:
        server.stop()
        for cache in caches:
            cache.signal_stop()


BAD_PODS = [
    {"metadata": {"uid": "a", "name": "a", "namespace": "default"},
     "spec": {"nodeName": "node-1", "containers": [5]}},
    {"metadata": {"uid": "b", "name": "b", "namespace": "default"},
     "spec": {"nodeName": "node-1", "initContainers": 5}},
    {"metadata": {"uid": "c", "name": "c", "namespace": "default"},
     "spec": {"nodeName": "node-1", "containers": [{"name": "m", "resources": {"limits": "x"}}]}},
    {"metadata": {"uid": "d", "name": "d", "namespace": "default"},
     "spec": {"nodeName": "node-1", "containers": [{"name": 5}]}},
    {"metadata": {"uid": "e", "name": "e", "namespace": "default"},
     "spec": {"nodeName": "node-1", "containers": []}, "status": ["x"]},
    # Last: the client cannot even decode its metadata; the watch starts over.
    {"metadata": {"uid": "f", "name": "f", "namespace": "default", "annotations": 3},
     "spec": {"nodeName": "node-1", "containers": []}},
]  # fmt: skip


def test_pods_wrong_in_any_way_are_skipped_and_the_pod_cache_goes_on(
    start_cluster: Start, api: ApiServerImitation
) -> None:
    cluster = start_cluster(hgx_node(), api=api)
    pods = cluster.daemon.pods
    assert pods is not None
    assert pods.synced.wait(10)
    relists = pods.relists
    for bad in BAD_PODS:
        api.inject_raw_event("pods", "ADDED", {"apiVersion": "v1", "kind": "Pod", **bad})
    # One (metadata not an object) cannot even be decoded: the watch lists
    # again, and stays current meanwhile; the rest are skipped one by one.
    assert wait_until(lambda: pods.relists > relists and pods.skipped >= len(BAD_PODS))
    assert pods.current
    pod = cluster.kubelet.admit("good", [ContainerRequest("main", {GPU: 2, HCA: 1})])
    assert wait_until(lambda: any(p.name == "good" for p in pods.pods().values()), timeout=5)
    assert pods.current
    assert len(pod.container("main").devices[GPU]) == 2
    exact = cluster.daemon.core.metrics.pod_aware.labels(GPU, "exact")._value.get()
    exact += cluster.daemon.core.metrics.pod_aware.labels(HCA, "exact")._value.get()
    assert exact >= 1
