"""Node daemons on simulated hardware writing to a real API server, each
with its own node's identity: what they write validates against the real
schemas and passes the real node policy, the Lease keeps its owner through
renewals, and the real garbage collector removes a deleted Node's objects."""

from __future__ import annotations

from typing import Any

import pytest

from devplugin.testing.cluster import SimCluster
from devplugin.testing.controlplane import ApiFailure, ControlPlane, kubeconfig
from devplugin.testing.dra_cluster import DraSimNode
from devplugin.testing.node import hgx_node
from tests.real_cluster.conftest import DRA_NAMESPACE, DRA_RELEASE, NAMESPACE, RELEASE
from tests.real_cluster.nodes import GPU, HCA, add_node, eventually, node_token

pytestmark = pytest.mark.cluster


def _get(plane: ControlPlane, path: str) -> Any:
    try:
        return plane.request("GET", path)
    except ApiFailure as exc:
        if exc.code == 404:
            return None
        raise


def test_a_daemon_writes_its_record_lease_and_labels_and_they_go_with_its_node(
    installed: ControlPlane,
) -> None:
    plane = installed
    node = "dmn-a"
    add_node(plane, node, {GPU: 8, HCA: 8})
    token = node_token(plane, NAMESPACE, f"{RELEASE}-devplugin", node)
    settings = {
        "kubernetes.lease_namespace": NAMESPACE,
        "kubernetes.lease_renew_seconds": 0.3,
    }
    record_path = f"/apis/devplugin.io/v1alpha1/nodedevices/{node}"
    lease_path = f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/devplugin-{node}"
    with SimCluster(
        hgx_node(),
        settings=settings,
        node_name=node,
        kubeconfig=kubeconfig(plane.server, plane.pki.ca, token=token),
    ):
        # The record: its status accepted by the CRD's schema.
        assert eventually(
            lambda: (
                ((_get(plane, record_path) or {}).get("status") or {})
                .get("summary", {})
                .get("gpusTotal")
                == 8
            ),
            timeout=30,
        )
        record = _get(plane, record_path)
        assert [o["kind"] for o in record["metadata"]["ownerReferences"]] == ["Node"]
        assert len(record["status"]["devices"]) == 16
        # What the extender judges devices by survives the API server's
        # pruning: the resource each device is served under.
        assert {d.get("resource") for d in record["status"]["devices"]} == {GPU, HCA}
        # The Lease, renewed several times by PUT, keeps its Node owner.
        first = _get(plane, lease_path) if eventually(lambda: _get(plane, lease_path)) else None
        assert first is not None
        assert eventually(
            lambda: (
                int(_get(plane, lease_path)["metadata"]["resourceVersion"])
                > int(first["metadata"]["resourceVersion"]) + 2
            ),
            timeout=20,
        )
        renewed = _get(plane, lease_path)
        assert renewed["metadata"]["ownerReferences"][0]["name"] == node
        assert renewed["metadata"]["ownerReferences"] == first["metadata"]["ownerReferences"]
        # Its labels on its Node.
        assert eventually(
            lambda: (
                (_get(plane, f"/api/v1/nodes/{node}")["metadata"]["labels"]).get(
                    "devplugin.io/gpu.count"
                )
                == "8"
            ),
            timeout=20,
        )
    # The daemon gone, its Node deleted: the garbage collector removes the
    # record and the Lease the Node owns.
    plane.request("DELETE", f"/api/v1/nodes/{node}")
    assert eventually(lambda: _get(plane, lease_path) is None, timeout=60)
    assert eventually(lambda: _get(plane, record_path) is None, timeout=60)


def test_a_dra_daemon_publishes_slices_the_real_api_accepts(dra_installed: ControlPlane) -> None:
    plane = dra_installed
    node = "dmn-dra"
    add_node(plane, node, {})
    token = node_token(plane, DRA_NAMESPACE, f"{DRA_RELEASE}-devplugin", node)
    settings = {"kubernetes.lease_namespace": DRA_NAMESPACE}
    with DraSimNode(
        hgx_node(),
        None,
        node_name=node,
        kubeconfig=kubeconfig(plane.server, plane.pki.ca, token=token),
        settings=settings,
    ):

        def devices() -> list[dict[str, Any]]:
            found = plane.request(
                "GET", f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName={node}"
            )
            return [d for s in found["items"] for d in s["spec"]["devices"]]

        assert eventually(lambda: len(devices()) == 16, timeout=30)
        gpu = next(d for d in devices() if d["name"].startswith("gpu-"))
        assert gpu["attributes"]["numaNode"] == {"int": 0}  # the driver's own domain
        standard = {k for d in devices() for k in d["attributes"] if "kubernetes.io" in k}
        assert standard == {"resource.kubernetes.io/pcieRoot", "resource.kubernetes.io/pciBusID"}
    # The Node gone, the garbage collector takes its slices (they name it owner).
    plane.request("DELETE", f"/api/v1/nodes/{node}")
    assert eventually(lambda: devices() == [], timeout=60)
