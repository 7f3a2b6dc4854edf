"""The devplugin.io/ labels the real daemon keeps on its own Node, written
over HTTP to the API server imitation: what they say, that nothing else on
the Node is touched, and that they follow the devices."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightkube import ApiError

from devplugin.cluster.client import make_client
from devplugin.cluster.node_labels import NodeLabeller, node_cache
from devplugin.cluster.watch import WatchTiming
from devplugin.config import KubernetesConfig
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.node import hgx_node, replug, unplug_hca
from tests.conftest import Cluster
from tests.waiting import wait_until

Start = Callable[..., Cluster]
FOREIGN = {
    "kubernetes.io/hostname": "node-1",
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",  # GPU Feature Discovery's
    "devplugin.io/node-pool": "left-over",  # ours once, no device calls for it now
}


def labels(api: ApiServerImitation, name: str = "node-1") -> dict[str, str]:
    found = api.get("nodes", name) or {}
    return dict(found.get("metadata", {}).get("labels") or {})


def ours(api: ApiServerImitation, name: str = "node-1") -> dict[str, str]:
    return {k: v for k, v in labels(api, name).items() if k.startswith("devplugin.io/")}


def test_the_daemon_labels_its_node_by_its_devices_and_leaves_other_labels(
    start_cluster: Start, api: ApiServerImitation
) -> None:
    api.put("nodes", {"metadata": {"name": "node-1", "labels": dict(FOREIGN)}})
    start_cluster(hgx_node(), api=api)
    wanted = {
        "devplugin.io/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "devplugin.io/gpu.count": "8",
        "devplugin.io/gpu.memory": "81559",
        "devplugin.io/hca.count": "8",
    }
    assert wait_until(lambda: ours(api) == wanted, timeout=10), ours(api)
    found = labels(api)
    assert found["kubernetes.io/hostname"] == "node-1"
    assert found["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"


def test_a_label_follows_its_devices_away_and_back_at_the_rescan(
    start_cluster: Start, api: ApiServerImitation, tmp_path: Path
) -> None:
    api.put("nodes", {"metadata": {"name": "node-1"}})
    cluster = start_cluster(hgx_node(), api=api)
    assert wait_until(lambda: ours(api).get("devplugin.io/hca.count") == "8", timeout=10)
    stashed = [unplug_hca(cluster.node, f"mlx5_{i}", tmp_path / f"stash{i}") for i in range(8)]
    cluster.daemon.rescan()
    assert wait_until(lambda: "devplugin.io/hca.count" not in ours(api), timeout=5), ours(api)
    assert ours(api)["devplugin.io/gpu.count"] == "8"
    replug(stashed[0])
    cluster.daemon.rescan()
    assert wait_until(lambda: ours(api).get("devplugin.io/hca.count") == "1", timeout=5)


def _labeller(api: ApiServerImitation, tmp_path: Path, wanted: dict[str, str]) -> NodeLabeller:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(api.kubeconfig()))
    client = make_client(KubernetesConfig(enabled=True, kubeconfig=str(kubeconfig)))
    assert client is not None
    return NodeLabeller(client, "node-1", lambda: wanted, resync=3600.0)


def test_a_label_changed_between_read_and_patch_is_read_again_not_overwritten(
    api: ApiServerImitation, tmp_path: Path
) -> None:
    api.put("nodes", {"metadata": {"name": "node-1", "labels": {"team": "a"}}})
    labeller = _labeller(api, tmp_path, {"devplugin.io/gpu.count": "8"})
    real_get = labeller._client.get
    raced = threading.Event()

    def get_then_someone_writes(*args: Any, **kwargs: Any) -> Any:
        found = real_get(*args, **kwargs)
        if not raced.is_set():
            raced.set()
            changed = {"team": "b", "devplugin.io/stale": "x"}
            api.put("nodes", {"metadata": {"name": "node-1", "labels": changed}})
        return found

    labeller._client.get = get_then_someone_writes  # type: ignore[method-assign]
    assert labeller.sync_once()
    # The first patch named the old version and was refused; the second was
    # built from the Node as the other writer left it.
    assert labels(api) == {"team": "b", "devplugin.io/gpu.count": "8"}
    assert labeller.patches == 1


def test_only_changes_cost_requests_and_a_resync_puts_back_a_removed_label(
    api: ApiServerImitation, tmp_path: Path
) -> None:
    api.put("nodes", {"metadata": {"name": "node-1"}})
    labeller = _labeller(api, tmp_path, {"devplugin.io/gpu.count": "8"})
    assert labeller.sync_once()
    before = len(api.requests)
    for _ in range(20):
        assert not labeller.sync_once()
    assert len(api.requests) == before
    api.put("nodes", {"metadata": {"name": "node-1", "labels": {}}})
    labeller._resync = 0.0
    assert labeller.sync_once()
    assert ours(api) == {"devplugin.io/gpu.count": "8"}


def test_a_missing_node_fails_the_step_and_labels_land_once_it_exists(
    api: ApiServerImitation, tmp_path: Path
) -> None:
    labeller = _labeller(api, tmp_path, {"devplugin.io/gpu.count": "8"})
    with pytest.raises(ApiError):
        labeller.sync_once()
    api.put("nodes", {"metadata": {"name": "node-1"}})
    assert labeller.sync_once()
    assert ours(api) == {"devplugin.io/gpu.count": "8"}


def test_the_api_server_imitation_refuses_an_invalid_label_value(
    api: ApiServerImitation, tmp_path: Path
) -> None:
    api.put("nodes", {"metadata": {"name": "node-1"}})
    labeller = _labeller(api, tmp_path, {"devplugin.io/gpu.product": "-bad value-"})
    with pytest.raises(ApiError) as refused:
        labeller.sync_once()
    assert refused.value.status.code == 422
    assert ours(api) == {}


def test_a_node_selector_on_the_labels_picks_the_model_the_daemons_labelled(
    start_cluster: Start, api: ApiServerImitation
) -> None:
    from devplugin.testing.layouts import dgx_a100
    from devplugin.testing.scheduler import selector_fits

    for name in ("h100-node", "a100-node"):
        api.put("nodes", {"metadata": {"name": name}})
    start_cluster(hgx_node(), api=api, node_name="h100-node")
    start_cluster(dgx_a100(), api=api, node_name="a100-node")
    assert wait_until(lambda: "devplugin.io/gpu.family" in ours(api, "a100-node"), timeout=10)
    assert wait_until(lambda: "devplugin.io/gpu.count" in ours(api, "h100-node"), timeout=10)
    assert ours(api, "a100-node")["devplugin.io/gpu.family"] == "ampere"
    selector = {"spec": {"nodeSelector": {"devplugin.io/gpu.product": "NVIDIA-A100-SXM4-80GB"}}}
    affinity = {"spec": {"affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [
                {"key": "devplugin.io/gpu.family", "operator": "NotIn", "values": ["ampere"]},
                {"key": "devplugin.io/gpu.memory", "operator": "Gt", "values": ["40000"]},
            ]},
        ]},
    }}}}  # fmt: skip
    fits = {
        name: (
            selector_fits(selector, labels(api, name)),
            selector_fits(affinity, labels(api, name)),
        )
        for name in ("h100-node", "a100-node")
    }
    assert fits == {"h100-node": (False, True), "a100-node": (True, False)}
    # A term on the node's name (matchFields: metadata.name, as a DaemonSet's
    # pods are pinned), alone or with label expressions (issue 39, difference 6).
    by_name = {"spec": {"affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["a100-node"]}]},
        ]},
    }}}}  # fmt: skip
    terms = by_name["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert [selector_fits(by_name, labels(api, n), n) for n in ("h100-node", "a100-node")] == [
        False,
        True,
    ]
    terms[0]["matchExpressions"] = [{"key": "devplugin.io/gpu.count", "operator": "Exists"}]
    terms[0]["matchFields"][0]["operator"] = "NotIn"
    assert [selector_fits(by_name, labels(api, n), n) for n in ("h100-node", "a100-node")] == [
        True,
        False,
    ]
    # Two values, or a label operator, on a field: the term matches nothing.
    terms[0]["matchFields"] = [{"key": "metadata.name", "operator": "In", "values": ["a", "b"]}]
    assert not selector_fits(by_name, labels(api, "a100-node"), "a100-node")


def test_labels_are_back_within_seconds_of_a_node_deleted_and_created_again(
    api: ApiServerImitation, tmp_path: Path
) -> None:
    api.put("nodes", {"metadata": {"name": "node-1", "uid": "first"}})
    labeller = _labeller(api, tmp_path, {"devplugin.io/gpu.count": "8"})
    kubeconfig = tmp_path / "kubeconfig"
    watcher = make_client(KubernetesConfig(enabled=True, kubeconfig=str(kubeconfig)))
    assert watcher is not None
    nodes = node_cache(watcher, "node-1", WatchTiming())
    labeller.follow(nodes)
    nodes.start()
    labeller.start()
    try:
        assert wait_until(lambda: ours(api) == {"devplugin.io/gpu.count": "8"}, timeout=10)
        # The Node goes and comes back bare (a node re-registered): the
        # resync is an hour away, the watch says so now.
        api.remove("nodes", "node-1")
        api.put("nodes", {"metadata": {"name": "node-1", "uid": "second"}})
        assert wait_until(lambda: ours(api) == {"devplugin.io/gpu.count": "8"}, timeout=5)
        # A label of ours removed by hand comes back as soon.
        api.put("nodes", {"metadata": {"name": "node-1", "uid": "second", "labels": {"x": "y"}}})
        assert wait_until(lambda: ours(api) == {"devplugin.io/gpu.count": "8"}, timeout=5)
        assert labels(api)["x"] == "y"
    finally:
        labeller.stop()
        nodes.stop()
