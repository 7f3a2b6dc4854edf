"""Every value combination the chart tests render, installed by the real
Helm engine into a real API server of each pinned version: every object
accepted (schemas, defaults, the policy's CEL compiled), then uninstalled."""

from __future__ import annotations

import copy

import pytest

from devplugin.testing.controlplane import ControlPlane
from tests.chart_support import CASES
from tests.real_cluster.conftest import helm_install

pytestmark = pytest.mark.cluster

# Served by the Prometheus operator's CRDs, which this cluster lacks: the
# case is installed without it, and once with it to show how it fails.
NOT_SERVED = {"metrics": ("metrics", "serviceMonitor")}


def test_every_case_the_chart_renders_is_accepted(control_plane: ControlPlane) -> None:
    # Claim templates go to namespaces the operator names; they must exist.
    for namespace in ("training",):
        ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
        control_plane.request("POST", "/api/v1/namespaces", ns)
    cases = []
    for name, given in sorted(CASES.items()):
        values = copy.deepcopy(given)
        if name in NOT_SERVED:
            section, key = NOT_SERVED[name]
            values[section][key]["enabled"] = False
        namespace = "case-" + name.replace(".", "-")
        cases.append({"name": name, "namespace": namespace, "values": values})
    found = helm_install(control_plane, cases)
    failed = {name: entry.get("error") for name, entry in found.items() if not entry["ok"]}
    assert failed == {}
    assert set(found) == set(CASES)
    # Each release held the objects it rendered (then it was uninstalled).
    for entry in found.values():
        assert "kind: DaemonSet" in entry["manifest"] or "kind: ServiceAccount" in entry["manifest"]


def test_a_service_monitor_needs_the_prometheus_operators_crds(
    control_plane: ControlPlane,
) -> None:
    found = helm_install(
        control_plane,
        [{"name": "monitor", "namespace": "case-monitor", "values": CASES["metrics"]}],
    )["monitor"]
    assert not found["ok"]
    assert "ServiceMonitor" in found["error"]
