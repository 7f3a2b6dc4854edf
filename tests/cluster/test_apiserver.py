"""The API server imitation speaks the wire format a maintained client expects.

Driven with lightkube (the client the daemon will use) over real HTTP:
list with a field selector and its resourceVersion, watch from a version,
410 Gone after compaction, conflicts on stale writes, the status
subresource, and the injected faults the daemon's error paths need.
"""

from __future__ import annotations

import threading

import httpx2
import pytest
from lightkube import ApiError, Client, KubeConfig

from devplugin.cluster.pods import RawPod
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.wire.resources import NodeDevices
from tests.waiting import wait_until


def pod(name: str, node: str, namespace: str = "default") -> dict[str, object]:
    return {
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "x"}]},
    }


@pytest.fixture
def client(api: ApiServerImitation) -> Client:
    config = KubeConfig.from_dict(api.kubeconfig())
    return Client(config=config, field_manager="devplugin", timeout=httpx2.Timeout(5.0))


def test_list_filters_by_node_and_carries_a_resource_version(
    api: ApiServerImitation, client: Client
) -> None:
    api.put("pods", pod("a", "node-1"))
    api.put("pods", pod("b", "node-2", namespace="team"))
    api.put("pods", pod("c", "node-1", namespace="team"))
    listed = client.list(RawPod, namespace="*", fields={"spec.nodeName": "node-1"})
    names = sorted(p.metadata.name for p in listed)
    assert names == ["a", "c"]
    assert int(listed.resourceVersion) >= 103


def test_watch_from_a_version_sees_what_came_after(api: ApiServerImitation, client: Client) -> None:
    api.put("pods", pod("before", "node-1"))
    listed = client.list(RawPod, namespace="*", fields={"spec.nodeName": "node-1"})
    list(listed)
    version = listed.resourceVersion
    seen: list[tuple[str, str]] = []
    done = threading.Event()

    def watch() -> None:
        for kind, obj in client.watch(
            RawPod, namespace="*", fields={"spec.nodeName": "node-1"}, resource_version=version
        ):
            seen.append((kind, obj.metadata.name))
            if len(seen) == 3:
                done.set()
                return

    threading.Thread(target=watch, daemon=True).start()
    api.put("pods", pod("other-node", "node-2"))
    api.put("pods", pod("new", "node-1"))
    api.put("pods", {**pod("new", "node-1"), "status": {"phase": "Running"}})
    api.remove("pods", "new", "default")
    assert done.wait(5)
    assert seen == [("ADDED", "new"), ("MODIFIED", "new"), ("DELETED", "new")]


def test_a_watch_from_a_compacted_version_is_gone(api: ApiServerImitation, client: Client) -> None:
    api.put("pods", pod("a", "node-1"))
    api.compact()
    with pytest.raises(ApiError) as failure:
        next(iter(client.watch(RawPod, namespace="*", resource_version="100")))
    assert failure.value.status.code == 410


def test_writes_with_a_stale_version_conflict_and_status_is_a_subresource(
    api: ApiServerImitation, client: Client
) -> None:
    created = client.create(
        NodeDevices(metadata={"name": "node-1"}, spec={"x": 1}, status={"devices": []})
    )
    assert created.metadata.resourceVersion
    assert created.status is None  # a create does not set status (a subresource)
    fresh = client.get(NodeDevices, "node-1").to_dict()
    fresh["status"] = {"devices": [{"id": "GPU-1"}]}
    fresh["spec"] = {"x": 2}
    updated = client.replace(NodeDevices.Status.from_dict(fresh), "node-1")
    assert updated.status == {"devices": [{"id": "GPU-1"}]}
    assert updated["spec"] == {"x": 1}
    fresh["status"] = {"devices": []}
    with pytest.raises(ApiError) as failure:
        # `fresh` still carries the version before the last write.
        client.replace(NodeDevices.Status.from_dict(fresh), "node-1")
    assert failure.value.status.code == 409
    with pytest.raises(ApiError) as exists:
        client.create(NodeDevices(metadata={"name": "node-1"}))
    assert exists.value.status.code == 409


def test_a_put_replaces_the_metadata_but_what_the_system_keeps(
    api: ApiServerImitation, client: Client
) -> None:
    """As apiserver registry/rest/update.go: labels, annotations and owners
    are the body's; uid, creationTimestamp and generation stay."""
    owner = {"apiVersion": "v1", "kind": "Node", "name": "node-1", "uid": "u-1"}
    meta = {"name": "node-1", "labels": {"a": "1"}, "ownerReferences": [owner]}
    created = client.create(NodeDevices(metadata=meta, spec={"x": 1})).to_dict()
    body = {
        "apiVersion": "devplugin.io/v1alpha1", "kind": "NodeDevices", "spec": {"x": 2},
        "metadata": {"name": "node-1", "labels": {"b": "2"}, "uid": None,
                     "creationTimestamp": "2001-01-01T00:00:00Z",
                     "resourceVersion": created["metadata"]["resourceVersion"]},
    }  # fmt: skip
    body["metadata"].pop("uid")
    replaced = client.replace(NodeDevices.from_dict(body)).to_dict()["metadata"]
    assert replaced["labels"] == {"b": "2"}
    assert "ownerReferences" not in replaced  # dropped: the body left it out
    assert replaced["uid"] == created["metadata"]["uid"]
    assert replaced["creationTimestamp"] == created["metadata"]["creationTimestamp"]


def test_injected_failures_cuts_and_delays(api: ApiServerImitation, client: Client) -> None:
    api.fail_next(1, 500)
    with pytest.raises(ApiError) as failure:
        client.get(NodeDevices, "missing")
    assert failure.value.status.code == 500
    with pytest.raises(ApiError) as missing:
        client.get(NodeDevices, "missing")
    assert missing.value.status.code == 404
    done = threading.Event()

    def watch() -> None:
        for _ in client.watch(RawPod, namespace="*"):
            if done.is_set():
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    assert wait_until(lambda: any("watch" in path for _, path in api.requests))
    api.cut_watches()
    # lightkube re-opens a watch the server ended cleanly: a new request arrives.
    count = sum("watch" in path for _, path in api.requests)
    assert wait_until(lambda: sum("watch" in path for _, path in api.requests) > count)
    # An event ends the watcher (a watch ends only when its reader stops).
    done.set()
    for index in range(100):  # whichever watch is open (it may be reopening) sees one
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"p{index}", "namespace": "default"}}  # fmt: skip
        api.put("pods", pod)
        watcher.join(0.1)
        if not watcher.is_alive():
            break
    assert not watcher.is_alive()


def test_traffic_is_counted_by_resource_and_verb(api: ApiServerImitation, client: Client) -> None:
    """What the fleet bench reports: requests and bytes each way per
    (resource, verb), watch events included."""
    created = client.create(NodeDevices(metadata={"name": "node-1"}, spec={"x": 1}))
    client.get(NodeDevices, "node-1")
    client.replace(NodeDevices(metadata=created.metadata, spec={"x": 2}), "node-1")
    list(client.list(NodeDevices))
    events = client.watch(RawPod, namespace="*", resource_version="100")
    api.put("pods", pod("a", "node-1"))
    next(iter(events))
    traffic = api.traffic
    assert traffic[("nodedevices", "create")][0] == 1
    assert traffic[("nodedevices", "update")][0] == 1
    assert traffic[("nodedevices", "get")][0] == 1
    assert traffic[("nodedevices", "list")][0] == 1
    # A write's body is counted in, its answer out; a read sends no body.
    assert traffic[("nodedevices", "create")][1] > 20
    assert traffic[("nodedevices", "create")][2] > traffic[("nodedevices", "create")][1] // 2
    assert traffic[("nodedevices", "get")][1] == 0
    watched = traffic[("pods", "watch")]
    assert watched[0] == 1
    assert watched[2] > len('{"type":"ADDED"}')


def test_lists_come_in_pages_each_after_the_last_key_all_at_the_first_version(
    api: ApiServerImitation, client: Client
) -> None:
    # "a-b" sorts between "a" and "b" as a namespace, not as text with the name.
    for namespace in ("a", "a-b", "b"):
        for i in range(7):
            api.put("pods", pod(f"p{i}", "n1", namespace))
    listed = client.list(RawPod, namespace="*", chunk_size=4)
    seen = [(p.metadata.namespace, p.metadata.name) for p in listed]
    assert len(seen) == len(set(seen)) == 21
    assert seen == sorted(seen)
    whole = client.list(RawPod, namespace="*")
    assert [(p.metadata.namespace, p.metadata.name) for p in whole] == seen
    assert listed.resourceVersion == whole.resourceVersion
    # A write between pages: the pages go on after their last key; the
    # version is the first page's, so a watch from it replays the write.
    pages = client.list(RawPod, namespace="a", chunk_size=3)
    iterator = iter(pages)
    first = [next(iterator) for _ in range(3)]
    api.put("pods", pod("p9", "n1", "a"))
    rest = list(iterator)
    assert len(first) + len(rest) == 8
    now = client.list(RawPod)
    list(now)
    assert int(pages.resourceVersion) < int(now.resourceVersion)
    server = api.kubeconfig()["clusters"][0]["cluster"]["server"]
    answer = httpx2.get(f"{server}/api/v1/pods?limit=2&continue=not-a-token", timeout=5)
    assert answer.status_code == 400
    assert "continue" in answer.json()["message"]
