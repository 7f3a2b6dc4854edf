"""Every value combination the chart tests render, installed by the real
Helm engine into a real API server of each pinned version: every object
accepted (schemas, defaults, the policy's CEL compiled), then uninstalled."""

from __future__ import annotations

import copy

import pytest
import yaml

from devplugin.testing.controlplane import ControlPlane, build_pin, object_path
from tests.chart_support import CASES
from tests.monitoring_support import alert_rules
from tests.real_cluster.conftest import helm_install
from tests.waiting import wait_until

pytestmark = pytest.mark.cluster

# Served by the Prometheus Operator's CRDs, which this cluster lacks until
# the last test installs them: each case is installed here without them.
NOT_SERVED = {
    "metrics": [("metrics", "serviceMonitor")],
    "monitoring": [("metrics", "serviceMonitor"), ("metrics", "prometheusRule")],
}


def test_every_case_the_chart_renders_is_accepted(control_plane: ControlPlane) -> None:
    # Claim templates go to namespaces the operator names; they must exist.
    for namespace in ("training",):
        ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
        control_plane.request("POST", "/api/v1/namespaces", ns)
    cases = []
    for name, given in sorted(CASES.items()):
        values = copy.deepcopy(given)
        for section, key in NOT_SERVED.get(name, ()):
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


def test_the_monitoring_objects_need_the_operators_crds_and_pass_their_schemas(
    control_plane: ControlPlane,
) -> None:
    cases = [
        {"name": name, "namespace": f"case-{name}-crd", "values": CASES[name]}
        for name in ("metrics", "monitoring")
    ]
    without = helm_install(control_plane, cases)
    assert not without["metrics"]["ok"]
    assert "ServiceMonitor" in without["metrics"]["error"]
    assert not without["monitoring"]["ok"]
    # The operator's own CRDs, as its release ships them (upstream/build.sh).
    folder = build_pin("prometheus-operator")
    for kind in ("servicemonitors", "prometheusrules"):
        crd = yaml.safe_load((folder / f"monitoring.coreos.com_{kind}.yaml").read_text())
        control_plane.apply(crd)
        path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}"

        def established(path: str = path) -> bool:
            found = control_plane.request("GET", path)
            conditions = (found.get("status") or {}).get("conditions") or []
            return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

        assert wait_until(established, timeout=30)
    found = helm_install(control_plane, cases)
    failed = {name: entry.get("error") for name, entry in found.items() if not entry["ok"]}
    assert failed == {}
    # The rules as the chart renders them are stored whole: the operator's
    # schema prunes no field of theirs.
    (rule,) = [
        doc
        for doc in yaml.safe_load_all(found["monitoring"]["manifest"])
        if doc and doc["kind"] == "PrometheusRule"
    ]
    rule["metadata"]["namespace"] = "default"
    control_plane.apply(rule)
    stored = control_plane.request("GET", object_path(rule))
    assert stored["spec"] == rule["spec"]
    assert {r["alert"] for g in stored["spec"]["groups"] for r in g["rules"]} == {
        r["alert"] for r in alert_rules()
    }
    control_plane.request("DELETE", object_path(rule))
