"""The chart's node policy, enforced by a real API server: a daemon's
identity (a token bound to its pod on one node) writes its own node's
record, Lease, slices and labels, and nothing of another node's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from devplugin.testing.controlplane import ApiFailure, ControlPlane
from tests.real_cluster.conftest import DRA_NAMESPACE, DRA_RELEASE, NAMESPACE, RELEASE
from tests.real_cluster.nodes import add_node, eventually, node_token, who_am_i

pytestmark = pytest.mark.cluster

ACCOUNT = f"{RELEASE}-devplugin"


def _record(node: str) -> dict[str, Any]:
    meta = {"name": node, "labels": {"devplugin.io/node": node}}
    return {"apiVersion": "devplugin.io/v1alpha1", "kind": "NodeDevices", "metadata": meta,
            "spec": {}}  # fmt: skip


def _lease(node: str, duration: int = 40) -> dict[str, Any]:
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": f"devplugin-{node}", "namespace": NAMESPACE,
                         "labels": {"devplugin.io/node": node}},
            "spec": {"holderIdentity": node, "leaseDurationSeconds": duration}}  # fmt: skip


def _slice(node: str, driver: str = "devplugin.io") -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"generateName": f"{node}-"},
            "spec": {"driver": driver, "nodeName": node,
                     "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": "gpu-0"}]}}  # fmt: skip


def _refused(write: Callable[[], Any], why: str) -> None:
    with pytest.raises(ApiFailure) as failure:
        write()
    assert failure.value.code in (403, 422), failure.value.text
    assert why in failure.value.text, failure.value.text


def test_a_node_identity_writes_only_its_own_nodes_objects(installed: ControlPlane) -> None:
    plane = installed
    for node in ("pol-a", "pol-b"):
        add_node(plane, node, {}, {"team": "x"})
    token = node_token(plane, NAMESPACE, ACCOUNT, "pol-a")
    user = who_am_i(plane, token)
    assert user["username"] == f"system:serviceaccount:{NAMESPACE}:{ACCOUNT}"
    assert user["extra"]["authentication.kubernetes.io/node-name"] == ["pol-a"]

    def as_a(method: str, path: str, body: Any = None, **kw: Any) -> Any:
        return plane.request(method, path, body, token=token, **kw)

    records = "/apis/devplugin.io/v1alpha1/nodedevices"

    # The policy is served once the API server has compiled it: until then
    # the other node's record could be written. Wait for its first refusal.
    def refuses() -> bool:
        try:
            as_a("POST", records + "?dryRun=All", _record("pol-b"))
        except ApiFailure as exc:
            return exc.code in (403, 422) and "may write only its own" in exc.text
        return False

    assert eventually(refuses, timeout=60)

    # Its own record, Lease, slices and labels: written.
    as_a("POST", records, _record("pol-a"))
    leases = f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases"
    as_a("POST", leases, _lease("pol-a"))
    merge = {"content_type": "application/merge-patch+json"}
    labelled = as_a(
        "PATCH",
        "/api/v1/nodes/pol-a",
        {"metadata": {"labels": {"devplugin.io/gpu.count": "8"}}},
        **merge,
    )
    assert labelled["metadata"]["labels"]["devplugin.io/gpu.count"] == "8"

    # Another node's: refused, with the policy's reason.
    _refused(lambda: as_a("POST", records, _record("pol-b")), "may write only its own NodeDevices")
    _refused(lambda: as_a("POST", leases, _lease("pol-b")), "only the Lease devplugin-pol-a")
    _refused(
        lambda: as_a(
            "PATCH",
            "/api/v1/nodes/pol-b",
            {"metadata": {"labels": {"devplugin.io/gpu.count": "8"}}},
            **merge,
        ),
        "may write only its own Node",
    )
    # On its own Node: no foreign label, no taint, no finalizer, no owner.
    for patch in (
        {"metadata": {"labels": {"team": "y"}}},
        {"spec": {"taints": [{"key": "x", "effect": "NoSchedule"}]}},
        {"metadata": {"finalizers": ["devplugin.io/hold"]}},
        {
            "metadata": {
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "ConfigMap", "name": "gone", "uid": "0"}
                ]
            }
        },
    ):
        _refused(
            lambda p=patch: as_a("PATCH", "/api/v1/nodes/pol-a", p, **merge),  # type: ignore[misc]
            "may change only labels under devplugin.io/",
        )
    _refused(
        lambda: as_a("POST", leases, _lease("pol-a", 3600)),
        "between 1 and 300 seconds",
    )
    # The administrator is not the policy's business.
    plane.request("POST", records, _record("pol-b"))


def test_a_dra_node_identity_publishes_only_its_own_pool(dra_installed: ControlPlane) -> None:
    plane = dra_installed
    for node in ("slc-a", "slc-b"):
        add_node(plane, node, {})
    token = node_token(plane, DRA_NAMESPACE, f"{DRA_RELEASE}-devplugin", "slc-a")
    slices = "/apis/resource.k8s.io/v1/resourceslices"

    def post(body: dict[str, Any], dry: bool = False) -> Any:
        return plane.request("POST", slices + ("?dryRun=All" if dry else ""), body, token=token)

    def refuses() -> bool:
        try:
            post(_slice("slc-b"), dry=True)
        except ApiFailure as exc:
            return "only ResourceSlices of its own node" in exc.text
        return False

    assert eventually(refuses, timeout=60)
    created = post(_slice("slc-a"))
    assert created["spec"]["nodeName"] == "slc-a"
    _refused(lambda: post(_slice("slc-b")), "only ResourceSlices of its own node")
    _refused(lambda: post(_slice("slc-a", "other.example.com")), "only the pool slc-a")
