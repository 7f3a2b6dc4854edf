"""The pod cache against the API server imitation, over real HTTP."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx2
import pytest
from lightkube import Client, KubeConfig

from devplugin.cluster.pods import PodCache
from devplugin.cluster.watch import WatchTiming
from devplugin.policy.podinfo import parse_pod
from devplugin.testing.apiserver import ApiServerImitation
from tests.waiting import wait_until

NODE = "node-1"


def pod(name: str, node: str = NODE, *, gpus: int = 0, hcas: int = 0, **extra: object) -> dict:
    limits = {k: v for k, v in (("nvidia.com/gpu", gpus), ("rdma/hca", hcas)) if v}
    return {
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "main", "image": "x", "resources": {"limits": limits}}],
            **extra,
        },
    }


def cache_for(api: ApiServerImitation, **options: float) -> PodCache:
    client = Client(config=KubeConfig.from_dict(api.kubeconfig()), timeout=httpx2.Timeout(5.0))
    return PodCache(client, NODE, timing=WatchTiming(server_timeout=2, **options))


def names(cache: PodCache) -> set[str]:
    return {p.name for p in cache.pods().values()}


@pytest.fixture
def running(api: ApiServerImitation) -> Iterator[PodCache]:
    cache = cache_for(api, backoff_initial=0.05, backoff_max=0.2)
    cache.start()
    assert cache.synced.wait(5)
    yield cache
    cache.signal_stop()
    api.cut_watches()
    cache.join(5)


def test_pods_on_this_node_are_listed_then_watched(
    api: ApiServerImitation, running: PodCache
) -> None:
    api.put("pods", pod("a", gpus=2, hcas=1))
    api.put("pods", pod("elsewhere", node="node-2"))
    assert running.wait_for(lambda pods: {p.name for p in pods.values()} == {"a"}, 5)
    (a,) = running.pods().values()
    assert dict(a.containers[0].requests) == {"nvidia.com/gpu": 2, "rdma/hca": 1}
    api.put("pods", {**pod("a", gpus=2, hcas=1), "status": {"phase": "Succeeded"}})
    assert running.wait_for(lambda pods: all(p.terminal for p in pods.values()), 5)
    api.remove("pods", "a", "default")
    assert running.wait_for(lambda pods: not pods, 5)


def test_a_gone_version_means_a_new_list(api: ApiServerImitation, running: PodCache) -> None:
    api.put("pods", pod("a"))
    assert running.wait_for(lambda pods: len(pods) == 1, 5)
    relists = running.relists
    # While the watch is cut, history is compacted: resuming gets 410.
    api.compact()
    api.put("pods", pod("b"))
    api.compact()
    api.cut_watches()
    assert running.wait_for(lambda pods: {p.name for p in pods.values()} == {"a", "b"}, 5)
    assert wait_until(lambda: running.relists > relists)


def test_the_cache_lists_again_after_server_errors(api: ApiServerImitation) -> None:
    api.fail_next(3, 500)
    cache = cache_for(api, backoff_initial=0.05, backoff_max=0.2)
    cache.start()
    try:
        assert cache.synced.wait(5)
        assert cache.errors >= 3
        api.put("pods", pod("a"))
        assert cache.wait_for(lambda pods: len(pods) == 1, 5)
    finally:
        cache.signal_stop()
        api.cut_watches()
        cache.join(5)


def test_a_bad_pod_in_the_watch_is_skipped_with_one_line(
    api: ApiServerImitation, running: PodCache, caplog: pytest.LogCaptureFixture
) -> None:
    bad = pod("bad", gpus=1)
    bad["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "lots"
    bad["metadata"].update({"uid": "uid-bad", "resourceVersion": "999999"})
    with caplog.at_level(logging.WARNING, logger="devplugin.cluster.pods"):
        api.inject_raw_event("pods", "ADDED", {"apiVersion": "v1", "kind": "Pod", **bad})
        api.inject_raw_event("pods", "MODIFIED", {"apiVersion": "v1", "kind": "Pod", **bad})
        api.put("pods", pod("good", gpus=1))
        assert running.wait_for(lambda pods: {p.name for p in pods.values()} == {"good"}, 5)
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1
    assert "default/bad" in lines[0]


def test_waiting_for_a_pod_that_never_comes_is_bounded(running: PodCache) -> None:
    assert not running.wait_for(lambda pods: "missing" in names(running), 0.1)


def test_sidecars_and_requests_are_read_from_the_spec() -> None:
    spec = pod("p", gpus=1)
    spec["metadata"]["uid"] = "u"
    spec["spec"]["initContainers"] = [
        {"name": "prep", "resources": {"requests": {"rdma/hca": "1"}}},
        {"name": "proxy", "restartPolicy": "Always", "resources": {}},
    ]
    parsed = parse_pod(spec)
    assert [c.sidecar for c in parsed.init_containers] == [False, True]
    assert dict(parsed.init_containers[0].requests) == {"rdma/hca": 1}
    with pytest.raises(ValueError, match="device count"):
        parse_pod({**spec, "spec": {**spec["spec"], "containers": [
            {"name": "m", "resources": {"limits": {"rdma/hca": -1}}}]}})  # fmt: skip
