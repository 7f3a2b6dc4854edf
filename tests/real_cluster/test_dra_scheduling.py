"""DRA on the real components: pods asking for the chart's claim templates
get their claims made by the real resourceclaim controller and allocated
by the real kube-scheduler, on both pinned versions, on a node whose NUMA
nodes are known and on one whose are not. Each allocation is held against
the allocator imitation given the same slices, classes and claims in use:
the same devices for every request, and every pair at the best level free."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any

import pytest

from devplugin.model import Inventory
from devplugin.policy.topology import Topology
from devplugin.testing.controlplane import ApiFailure, ControlPlane, kubeconfig
from devplugin.testing.dra_cluster import DraSimNode
from devplugin.testing.dra_scheduler import Allocator, node_ids, pair_levels, taken_devices
from devplugin.testing.node import NodeSpec, devices_from_spec, hgx_node
from tests.real_cluster.conftest import DRA_NAMESPACE, DRA_RELEASE
from tests.real_cluster.nodes import (
    DEFAULT_SCHEDULER,
    add_node,
    decision,
    delete_pod,
    eventually,
    node_token,
)

pytestmark = pytest.mark.cluster

DRIVER = "devplugin.io"
NAMESPACED = "/apis/resource.k8s.io/v1/namespaces"
_names = itertools.count()


def numa_unknown(spec: NodeSpec) -> NodeSpec:
    """The same node with no NUMA node known for any root complex."""
    return dataclasses.replace(
        spec, roots=[dataclasses.replace(r, numa_node=None) for r in spec.roots]
    )


@pytest.fixture
def scheduler(dra_installed: ControlPlane) -> ControlPlane:
    dra_installed.start_scheduler(DEFAULT_SCHEDULER)
    return dra_installed


def _pod(template: str, node: str) -> dict[str, Any]:
    name = f"dra-pod-{next(_names)}"
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                     "containers": [{"name": "main", "image": "tier/none",
                                     "resources": {"claims": [{"name": "devices"}]}}],
                     "resourceClaims": [{"name": "devices",
                                         "resourceClaimTemplateName": template}]}}  # fmt: skip


def _claim_of(plane: ControlPlane, pod: dict[str, Any]) -> dict[str, Any]:
    (status,) = pod["status"]["resourceClaimStatuses"]
    claim: dict[str, Any] = plane.request(
        "GET",
        f"/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/{status['resourceClaimName']}",
    )
    return claim


def _items(plane: ControlPlane, path: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = plane.request("GET", path)["items"]
    return found


def _wait_for(plane: ControlPlane, name: str) -> tuple[str, dict[str, Any]]:
    state, pod = decision(plane, name)
    if state == "bound":
        # The binding comes after the claim's allocation is written.
        assert eventually(lambda: bool(_claim_of(plane, pod).get("status", {}).get("allocation")))
        pod = plane.request("GET", f"/api/v1/namespaces/default/pods/{name}")
    return state, pod


@pytest.mark.parametrize("layout", ["numa-known", "numa-unknown"])
def test_claims_from_the_chart_templates_land_at_the_best_free_level(
    scheduler: ControlPlane, layout: str
) -> None:
    plane = scheduler
    spec = hgx_node() if layout == "numa-known" else numa_unknown(hgx_node())
    node = f"dra-{layout}-{plane.bins.minor[1]}"
    add_node(plane, node, {})
    token = node_token(plane, DRA_NAMESPACE, f"{DRA_RELEASE}-devplugin", node)
    gpus, hcas = devices_from_spec(spec)
    topology = Topology.from_inventory(Inventory(gpus=gpus, hcas=hcas))
    pods: list[str] = []
    with DraSimNode(
        spec,
        None,
        node_name=node,
        settings={"kubernetes.lease_namespace": DRA_NAMESPACE},
        kubeconfig=kubeconfig(plane.server, plane.pki.ca, token=token),
    ):
        mine = f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName={node}"
        assert eventually(
            lambda: sum(len(s["spec"]["devices"]) for s in _items(plane, mine)) == 16, timeout=30
        )
        slices = _items(plane, mine)
        names = node_ids(slices)
        classes = {
            c["metadata"]["name"]: c
            for c in _items(plane, "/apis/resource.k8s.io/v1/deviceclasses")
        }
        templates = {
            t["metadata"]["name"]: t["spec"]["spec"]
            for t in _items(plane, f"{NAMESPACED}/default/resourceclaimtemplates")
        }
        try:
            for template in ("1-pair", "2-pairs", "4-pairs", "1-pair", "1-pair"):
                claims = _items(plane, "/apis/resource.k8s.io/v1/resourceclaims")
                taken = taken_devices(claims)
                imitation = Allocator(slices, classes, node, version=plane.bins.minor).allocate(
                    templates[template], taken
                )
                pod = _pod(template, node)
                pods.append(pod["metadata"]["name"])
                plane.request("POST", "/api/v1/namespaces/default/pods", pod)
                outcome, found = _wait_for(plane, pod["metadata"]["name"])
                if imitation is None:
                    assert outcome == "unschedulable", (template, found["spec"].get("nodeName"))
                    continue
                why = [c.get("message") for c in found["status"]["conditions"]]
                assert outcome == "bound", (template, why)
                assert found["spec"]["nodeName"] == node
                results = _claim_of(plane, found)["status"]["allocation"]["devices"]["results"]
                real = sorted((r["request"], r["device"]) for r in results)
                assert real == sorted((r["request"], r["device"]) for r in imitation), template
                # Each pair at the best level free when it was placed.
                free = [n for n in names if (DRIVER, node, n) not in taken]
                best = min(
                    topology.level(names[g], names[h])
                    for g in free
                    if g.startswith("gpu-")
                    for h in free
                    if h.startswith("hca-")
                )
                assert pair_levels(results, names, topology)[0] == best, template
            # The last pod found the node full: it never bound.
            assert outcome == "unschedulable"
        finally:
            for name in pods:
                with contextlib.suppress(ApiFailure):
                    delete_pod(plane, name)
    plane.request("DELETE", f"/api/v1/nodes/{node}")
