"""The monitoring tier: a real Prometheus (Debian's package) scrapes a
running daemon on a simulated node and a running extender, both over the
API server imitation, and evaluates the chart's rules (their `for` cut to
seconds). A device goes unhealthy and a cleanup fails: the alerts go
pending, then firing, through Prometheus's own API, and nothing else
fires. Every metric the docs name is there with its documented labels and
no label of unbounded values; every dashboard query parses and returns
data."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.kubelet import ContainerRequest
from devplugin.testing.node import hgx_node
from tests.conftest import GPU, HCA, Cluster
from tests.extender_support import Running, call, pod, running_extender, synced
from tests.monitoring_support import (
    BOUNDED_LABELS,
    alert_rules,
    documented_metrics,
    panel_queries,
)
from tests.prometheus_support import Prometheus, Target, running_prometheus
from tests.support import hook
from tests.waiting import wait_until

pytestmark = pytest.mark.prometheus

Start = Callable[..., Cluster]
NODE = "node-1"
# Labels every target carries (the Prometheus Operator's, and Prometheus's own).
TARGET_LABELS = frozenset({"__name__", "job", "instance", "namespace", "pod"})
# A bounded label has at most this many values across the whole tier.
MOST_VALUES = 16


@dataclass
class Monitored:
    cluster: Cluster
    extender: Running
    prometheus: Prometheus


@pytest.fixture
def monitored(start_cluster: Start, api: ApiServerImitation, tmp_path: Path) -> Iterator[Monitored]:
    # The node's Node, as a real cluster has it (labels and the Lease's owner).
    api.put("nodes", {"metadata": {"name": NODE}})
    cluster = start_cluster(
        hgx_node(),
        api=api,
        node_name=NODE,
        **{
            "resources.gpu.hooks.cleanup": hook(tmp_path / "cleanup.log", "fail"),
            "lifecycle.cleanup_retry_initial_seconds": 30.0,
            "kubernetes.lease_renew_seconds": 1.0,
        },
    )
    (tmp_path / "extender").mkdir()
    extenders = running_extender(api, tmp_path / "extender")
    extender = next(extenders)
    try:
        assert cluster.daemon.status is not None
        targets = [
            Target(cluster.daemon.status.bound[0], "gpu-operator", "devplugin-node-1"),
            Target(extender[1].address, "devplugin", "devplugin-extender-0"),
        ]
        with running_prometheus(tmp_path / "prometheus", targets) as server:
            yield Monitored(cluster, extender, server)
    finally:
        next(extenders, None)


def _scraped(prometheus: Prometheus) -> bool:
    up = prometheus.query("up")
    return len(up) == 2 and all(sample["value"][1] == "1" for sample in up)


def _traffic(monitored: Monitored) -> None:
    """Allocations on the node and calls to each extender verb."""
    kubelet = monitored.cluster.kubelet
    kubelet.admit("train", [ContainerRequest("main", {GPU: 2, HCA: 2})], order=[GPU, HCA])
    kubelet.admit("infer", [ContainerRequest("main", {GPU: 1, HCA: 1})], order=[HCA, GPU])
    synced(monitored.extender, {NODE})
    args = {"Pod": pod("next", [{GPU: 2, HCA: 2}]), "NodeNames": [NODE]}
    for _ in range(3):
        assert call(monitored.extender, "filter", args)[0] == 200
        assert call(monitored.extender, "prioritize", args)[0] == 200
        preempt = {"Pod": pod("big", [{GPU: 8, HCA: 8}]), "NodeNameToMetaVictims": {}}
        assert call(monitored.extender, "preempt", preempt)[0] == 200


def test_an_unhealthy_device_and_a_failing_cleanup_raise_their_alerts(
    monitored: Monitored,
) -> None:
    prometheus, cluster = monitored.prometheus, monitored.cluster
    assert wait_until(lambda: _scraped(prometheus), timeout=30), prometheus.logged()
    # Every rule loaded and evaluates without error.
    groups = prometheus.get("/api/v1/rules")["groups"]
    loaded = {rule["name"]: rule for group in groups for rule in group["rules"]}
    assert set(loaded) == {rule["alert"] for rule in alert_rules()}
    assert wait_until(
        lambda: all(
            r["health"] == "ok"
            for g in prometheus.get("/api/v1/rules")["groups"]
            for r in g["rules"]
        ),
        timeout=10,
    )
    # A port goes down (an HCA Unhealthy); a GPU pod ends and its cleanup
    # fails (both GPUs quarantined).
    hca = cluster.node.hcas[5]
    (hca.directory / "infiniband" / hca.name / "ports" / "1" / "state").write_text("1: DOWN\n")
    cluster.kubelet.admit("short", [ContainerRequest("main", {GPU: 2})])
    cluster.kubelet.remove("short")
    watched = {
        "DevpluginDevicesUnhealthy",
        "DevpluginCleanupsFailing",
        "DevpluginDevicesQuarantined",
    }
    seen: dict[str, list[str]] = {name: [] for name in watched}

    def all_firing() -> bool:
        for name, states in prometheus.alerts().items():
            if name in seen and (not seen[name] or seen[name][-1] not in states):
                seen[name].extend(sorted(states))
        return all(seen[name] and seen[name][-1] == "firing" for name in watched)

    assert wait_until(all_firing, timeout=60, step=0.2), seen
    for name in watched:
        assert seen[name][0] == "pending", (name, seen[name])
    # The alerts name the node's daemon and the devices' resource.
    firing = prometheus.get("/api/v1/alerts")["alerts"]
    unhealthy = {a["labels"]["resource"] for a in firing if a["labels"]["alertname"] in watched}
    assert unhealthy == {GPU, HCA}
    assert {a["labels"]["pod"] for a in firing} == {"devplugin-node-1"}
    # Nothing else is wrong: no other alert pending or firing.
    assert set(prometheus.alerts()) == watched


def test_every_documented_metric_is_served_with_its_labels_and_bounded_values(
    monitored: Monitored,
) -> None:
    prometheus = monitored.prometheus
    assert wait_until(lambda: _scraped(prometheus), timeout=30), prometheus.logged()
    _traffic(monitored)
    documented = documented_metrics()
    assert set().union(*documented.values()) <= BOUNDED_LABELS

    def series() -> list[dict[str, str]]:
        found: list[dict[str, str]] = prometheus.get(
            "/api/v1/series", **{"match[]": '{__name__=~"devplugin_.+"}'}
        )
        return found

    assert wait_until(lambda: len(series()) > 100, timeout=20)
    labels_of: dict[str, set[frozenset[str]]] = {}
    values: dict[str, set[str]] = {}
    for one in series():
        name = _documented_as(one["__name__"], documented)
        assert name is not None, f"{one['__name__']} is served but not documented"
        own = frozenset(one) - TARGET_LABELS - {"le"}
        labels_of.setdefault(name, set()).add(own)
        for label in own:
            values.setdefault(label, set()).add(one[label])
    missing = set(documented) - set(labels_of)
    assert not missing, f"documented but not served: {sorted(missing)}"
    for name, label_sets in labels_of.items():
        assert label_sets == {documented[name]}, (name, label_sets, documented[name])
    for label, seen in values.items():
        assert label in BOUNDED_LABELS, label
        assert len(seen) <= MOST_VALUES, (label, sorted(seen))


def _documented_as(series: str, documented: Mapping[str, object]) -> str | None:
    """The documented metric a series belongs to: itself, a histogram's
    _bucket, _sum and _count, a counter's or histogram's _created (the
    client's start time of the series)."""
    base = re.sub(r"_(bucket|sum|count|created)$", "", series)
    for name in (series, base, f"{base}_total"):
        if name in documented:
            return name
    return None


def test_every_dashboard_query_parses_and_returns_data(monitored: Monitored) -> None:
    prometheus = monitored.prometheus
    assert wait_until(lambda: _scraped(prometheus), timeout=30), prometheus.logged()
    # Prometheus scraped before the traffic and scrapes again after it: a
    # rate over the window the queries are given is above zero.
    _traffic(monitored)
    empty: list[str] = []
    for title, query in panel_queries():
        expr = (
            query.replace("$namespace", ".*")
            .replace("$pod", ".*")
            .replace("$__rate_interval", "30s")
        )

        def answered(expr: str = expr) -> bool:
            return bool(prometheus.query(expr))

        if not wait_until(answered, timeout=10):
            empty.append(f"{title}: {expr}")
    assert not empty, empty
    # The dashboard's variables: the label values they list exist.
    for label in ("namespace", "pod"):
        found = prometheus.get(f"/api/v1/label/{label}/values", **{"match[]": "devplugin_devices"})
        assert found == ["devplugin-node-1"] if label == "pod" else ["gpu-operator"]
