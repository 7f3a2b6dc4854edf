"""Claim-only pods and the chart's second scheduler on the real
kube-scheduler, with the chart installed for DRA and the extender on: the
scheduler asks the extender's claims verbs about them (the chart's /claims
entry has no managed resources, so it is asked about every pod of the
profile), the pod lands where the allocator gives the best pair and the
extender scores highest, and a template a node cannot hold is refused there well within
the scheduler's DRA filter timeout, by the scheduler's own metrics."""

from __future__ import annotations

import contextlib
import itertools
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from devplugin.model import Inventory
from devplugin.policy.topology import Topology
from devplugin.testing.controlplane import ApiFailure, ControlPlane, kubeconfig
from devplugin.testing.dra_cluster import DraSimNode
from devplugin.testing.dra_scheduler import Allocator, node_ids, pair_levels, taken_devices
from devplugin.testing.layouts import LAYOUTS
from devplugin.testing.node import devices_from_spec
from devplugin.testing.promtext import histogram, total
from devplugin.testing.scheduler import call_extender
from tests.real_cluster.cluster_support import (
    SCHEDULER_NAME,
    chart_extender,
    chart_scheduler_config,
    extender_metrics,
)
from tests.real_cluster.conftest import DRA_NAMESPACE, DRA_RELEASE
from tests.real_cluster.nodes import add_node, decision, delete_pod, eventually, node_token

pytestmark = pytest.mark.cluster

RESOURCE = "/apis/resource.k8s.io/v1"
# The scheduler's default for one node's DRA Filter (DRASchedulerFilterTimeout).
FILTER_TIMEOUT_S = 10.0
_names = itertools.count()


class Nodes:
    """A PCIe server (two HCAs, one per NUMA node: no GPU shares a switch
    with one) and an HGX H100 (a GPU and an HCA under every switch), each
    with its DRA daemon; the extender and the real scheduler as the chart
    configures them."""

    def __init__(self, plane: ControlPlane, stack: ExitStack) -> None:
        self.plane = plane
        minor = plane.bins.minor[1]
        self.names = {"pcie": f"drx{minor}-pcie", "hgx": f"drx{minor}-hgx"}
        self.topologies: dict[str, Topology] = {}
        for layout, key in (("pcie-server", "pcie"), ("hgx-h100", "hgx")):
            name = self.names[key]
            spec = LAYOUTS[layout]()
            gpus, hcas = devices_from_spec(spec)
            self.topologies[name] = Topology.from_inventory(Inventory(gpus=gpus, hcas=hcas))
            add_node(plane, name, {})
            token = node_token(plane, DRA_NAMESPACE, f"{DRA_RELEASE}-devplugin", name)
            stack.enter_context(
                DraSimNode(
                    spec,
                    None,
                    node_name=name,
                    settings={"kubernetes.lease_namespace": DRA_NAMESPACE},
                    kubeconfig=kubeconfig(plane.server, plane.pki.ca, token=token),
                )
            )
        base = Path(tempfile.mkdtemp(prefix="drx-", dir=plane.folder))
        self.url = stack.enter_context(chart_extender(plane, base, DRA_NAMESPACE, DRA_RELEASE))
        config = chart_scheduler_config(plane, self.url, DRA_NAMESPACE, DRA_RELEASE)
        assert any(e["urlPrefix"].endswith("/claims") for e in config["extenders"])
        plane.start_scheduler(config)
        self.pods: list[str] = []

    def slices(self, node: str) -> list[dict[str, Any]]:
        path = f"{RESOURCE}/resourceslices?fieldSelector=spec.nodeName={node}"
        found: list[dict[str, Any]] = self.plane.request("GET", path)["items"]
        return found

    def pod(self, template: str, node: str | None = None) -> dict[str, Any]:
        name = f"drx-pod-{next(_names)}"
        self.pods.append(name)
        spec: dict[str, Any] = {
            "schedulerName": SCHEDULER_NAME,
            "containers": [{"name": "main", "image": "tier/none",
                            "resources": {"claims": [{"name": "devices"}]}}],
            "resourceClaims": [{"name": "devices", "resourceClaimTemplateName": template}],
        }  # fmt: skip
        if node is not None:
            spec["nodeSelector"] = {"kubernetes.io/hostname": node}
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": "default"}, "spec": spec}  # fmt: skip
        created: dict[str, Any] = self.plane.request(
            "POST", "/api/v1/namespaces/default/pods", body
        )
        return created

    def decided(self, name: str) -> dict[str, Any]:
        """The pod once bound (its claim allocated) or unschedulable."""
        return decision(self.plane, name)[1]

    def claim(self, pod: dict[str, Any]) -> dict[str, Any]:
        (status,) = pod["status"]["resourceClaimStatuses"]
        path = f"{RESOURCE}/namespaces/default/resourceclaims/{status['resourceClaimName']}"
        claim: dict[str, Any] = self.plane.request("GET", path)
        return claim

    def close(self) -> None:
        for name in self.pods:
            with contextlib.suppress(ApiFailure):
                delete_pod(self.plane, name)


@pytest.fixture
def nodes(dra_installed: ControlPlane) -> Iterator[Nodes]:
    with ExitStack() as stack:
        found = Nodes(dra_installed, stack)
        stack.callback(found.close)
        yield found


def _claims_calls(url: str) -> dict[str, float]:
    text = extender_metrics(url)
    return {
        verb: total(text, "devplugin_extender_requests_total", {"verb": verb, "result": "ok"})
        for verb in ("claims_filter", "claims_prioritize")
    }


def test_claim_only_pods_reach_the_extenders_claims_verbs_and_land_where_the_pair_is_best(
    nodes: Nodes,
) -> None:
    plane = nodes.plane
    templates = {
        t["metadata"]["name"]: t["spec"]["spec"]
        for t in plane.request("GET", f"{RESOURCE}/namespaces/default/resourceclaimtemplates")[
            "items"
        ]
    }
    classes = {
        c["metadata"]["name"]: c for c in plane.request("GET", f"{RESOURCE}/deviceclasses")["items"]
    }
    # The best pair the allocator imitation gives on each node.
    claims = plane.request("GET", f"{RESOURCE}/resourceclaims")["items"]
    levels = {}
    for name in nodes.names.values():
        assert eventually(lambda n=name: len(node_ids(nodes.slices(n))) > 0, timeout=30)
        slices = nodes.slices(name)
        picked = Allocator(slices, classes, name, version=plane.bins.minor).allocate(
            templates["1-pair"], taken_devices(claims)
        )
        assert picked is not None
        levels[name] = pair_levels(picked, node_ids(slices), nodes.topologies[name])[0]

    before = _claims_calls(nodes.url)
    pod = nodes.pod("1-pair")
    decided = nodes.decided(pod["metadata"]["name"])
    why = [c.get("message") for c in decided["status"].get("conditions") or []]
    bound = decided["spec"].get("nodeName")
    assert bound in nodes.names.values(), why
    after = _claims_calls(nodes.url)
    # The scheduler asked the claims verbs about this pod: both nodes
    # passed its own filters, so it filtered and scored them through the
    # extender too.
    assert after["claims_filter"] > before["claims_filter"], (before, after)
    assert after["claims_prioritize"] > before["claims_prioritize"], (before, after)
    assert eventually(lambda: bool(nodes.claim(decided).get("status", {}).get("allocation")))
    results = nodes.claim(decided)["status"]["allocation"]["devices"]["results"]
    got = pair_levels(results, node_ids(nodes.slices(bound)), nodes.topologies[bound])[0]
    assert got == min(levels.values()), (got, levels)
    # The extender's own answer for a pod of that template scores the node
    # the scheduler chose at least as high as the other.
    probe = nodes.pod("1-pair", node="nowhere")  # its claim made, never allocated
    assert eventually(lambda: bool(nodes.decided(probe["metadata"]["name"])))
    probe = plane.request("GET", f"/api/v1/namespaces/default/pods/{probe['metadata']['name']}")
    args = {"Pod": probe, "NodeNames": sorted(nodes.names.values())}
    scores = {s["Host"]: s["Score"] for s in call_extender(nodes.url, "claims/prioritize", args)}
    assert scores[bound] == max(scores.values()), (bound, scores)
    assert scores[bound] > 0, scores  # it knew the claim and ranked the nodes


def test_a_template_a_node_cannot_hold_is_refused_there_within_the_filter_timeout(
    nodes: Nodes,
) -> None:
    plane = nodes.plane
    pcie = nodes.names["pcie"]
    metric = "scheduler_scheduling_attempt_duration_seconds"
    before = histogram(plane.scheduler_metrics(), metric, {"result": "unschedulable"})
    # Four GPU+HCA pairs on a node with two HCAs.
    pod = nodes.pod("4-pairs", node=pcie)
    decided = nodes.decided(pod["metadata"]["name"])
    assert not decided["spec"].get("nodeName")
    message = " ".join(str(c.get("message")) for c in decided["status"]["conditions"])
    assert "cannot allocate all claims" in message, message
    assert "timed out" not in message, message
    after = histogram(plane.scheduler_metrics(), metric, {"result": "unschedulable"})
    attempts = after.minus(before)
    assert attempts.count >= 1
    # Every unschedulable attempt ended under a bucket bound well inside
    # the filter's 10 s (the buckets double from 1 ms).
    assert attempts.at_most() < FILTER_TIMEOUT_S / 4, attempts
    print(
        f"{plane.bins.version}: 4 pairs on {pcie} refused in {attempts.count:.0f} attempts, "
        f"each under {attempts.at_most() * 1e3:.0f} ms (mean {attempts.mean * 1e3:.1f} ms)"
    )
