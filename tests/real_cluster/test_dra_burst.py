"""A burst of DRA pods on the real kube-scheduler (the stable allocator on
1.35, the incubating one on 1.37), on nodes one device short of the largest
template: the daemons' free counts follow the scheduler's allocations
(their pod watches read the bound pods' claims; no kubelet prepares
anything here, so every claim stays allocated and unprepared), the pods
that cannot fit anywhere are refused without a Filter timeout, and every
pod that fits lands at the best free level (PIX on these nodes)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from contextlib import ExitStack
from functools import partial
from typing import Any

import pytest

from devplugin.model import Inventory
from devplugin.policy.topology import Level, Topology
from devplugin.testing.controlplane import ApiFailure, ControlPlane, kubeconfig
from devplugin.testing.dra_cluster import DraSimNode
from devplugin.testing.dra_scheduler import node_ids, pair_levels
from devplugin.testing.node import devices_from_spec, hgx_node
from devplugin.testing.promtext import histogram
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

RESOURCE = "/apis/resource.k8s.io/v1"
# The scheduler's default for one node's DRA Filter (DRASchedulerFilterTimeout).
FILTER_TIMEOUT_S = 10.0
NODES = 3
_names = itertools.count()


def free_gpus(plane: ControlPlane, node: str) -> set[int]:
    path = f"{RESOURCE}/resourceslices?fieldSelector=spec.nodeName={node}"
    return {
        d["attributes"]["freeGpus"]["int"]
        for s in plane.request("GET", path)["items"]
        for d in s["spec"]["devices"]
    }


def allocated(plane: ControlPlane, path: str) -> bool:
    return bool(plane.request("GET", path).get("status", {}).get("allocation"))


def claim_pod(template: str, nodes: list[str]) -> dict[str, Any]:
    name = f"burst-{next(_names)}"
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}]}]}}}  # fmt: skip
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"affinity": affinity,
                     "containers": [{"name": "main", "image": "tier/none",
                                     "resources": {"claims": [{"name": "devices"}]}}],
                     "resourceClaims": [{"name": "devices",
                                         "resourceClaimTemplateName": template}]}}  # fmt: skip


@pytest.fixture
def burst_nodes(dra_installed: ControlPlane) -> Iterator[tuple[ControlPlane, list[str]]]:
    plane = dra_installed
    plane.start_scheduler(DEFAULT_SCHEDULER)
    names = [f"burst-{plane.bins.minor[1]}-{i}" for i in range(NODES)]
    with ExitStack() as stack:
        for name in names:
            add_node(plane, name, {})
            token = node_token(plane, DRA_NAMESPACE, f"{DRA_RELEASE}-devplugin", name)
            stack.enter_context(
                DraSimNode(
                    hgx_node(),
                    None,
                    node_name=name,
                    settings={"kubernetes.lease_namespace": DRA_NAMESPACE},
                    kubeconfig=kubeconfig(plane.server, plane.pki.ca, token=token),
                )
            )
        yield plane, names


def test_a_burst_on_nodes_one_pair_short_has_no_filter_timeout_and_lands_at_pix(
    burst_nodes: tuple[ControlPlane, list[str]],
) -> None:
    plane, names = burst_nodes
    pods: list[str] = []
    gpus, hcas = devices_from_spec(hgx_node())
    topology = Topology.from_inventory(Inventory(gpus=gpus, hcas=hcas))
    try:
        # One pair taken on each node: 7 of 8 left, one short of 8-pairs.
        for name in names:
            first = claim_pod("1-pair", [name])
            plane.request("POST", "/api/v1/namespaces/default/pods", first)
            pods.append(first["metadata"]["name"])
            assert decision(plane, first["metadata"]["name"])[0] == "bound"
        # The counts follow the allocation (nothing was prepared).
        assert eventually(lambda: all(free_gpus(plane, n) == {7} for n in names), timeout=15)
        metric = "scheduler_scheduling_attempt_duration_seconds"
        before = histogram(plane.scheduler_metrics(), metric)
        burst = [claim_pod("8-pairs", names) for _ in range(NODES)]
        burst += [claim_pod("2-pairs", names) for _ in range(2 * NODES)]
        burst += [claim_pod("8-pairs", names) for _ in range(NODES)]
        for pod in burst:
            plane.request("POST", "/api/v1/namespaces/default/pods", pod)
            pods.append(pod["metadata"]["name"])
        outcomes = {
            p["metadata"]["name"]: decision(plane, p["metadata"]["name"], timeout=120)
            for p in burst
        }
        for pod in burst:
            name = pod["metadata"]["name"]
            state, found = outcomes[name]
            template = pod["spec"]["resourceClaims"][0]["resourceClaimTemplateName"]
            message = " ".join(str(c.get("message")) for c in found["status"].get("conditions", []))
            assert "timed out" not in message, message
            if template == "8-pairs":
                assert state == "unschedulable", (name, found["spec"].get("nodeName"))
                continue
            assert state == "bound", (name, message)
            (status,) = found["status"]["resourceClaimStatuses"]
            claim_path = (
                f"{RESOURCE}/namespaces/default/resourceclaims/{status['resourceClaimName']}"
            )
            assert eventually(partial(allocated, plane, claim_path))
            claim = plane.request("GET", claim_path)
            node = found["spec"]["nodeName"]
            path = f"{RESOURCE}/resourceslices?fieldSelector=spec.nodeName={node}"
            ids = node_ids(plane.request("GET", path)["items"])
            results = claim["status"]["allocation"]["devices"]["results"]
            assert pair_levels(results, ids, topology) == [Level.PIX, Level.PIX], name
        after = histogram(plane.scheduler_metrics(), metric)
        attempts = after.minus(before)
        assert attempts.count >= len(burst)
        assert attempts.at_most() < FILTER_TIMEOUT_S / 4, attempts
        print(
            f"{plane.bins.version}: {len(burst)} pods in a burst on {NODES} nodes one pair short: "
            f"{attempts.count:.0f} attempts, each under {attempts.at_most() * 1e3:.0f} ms "
            f"(mean {attempts.mean * 1e3:.1f} ms)"
        )
    finally:
        for name in pods:
            with contextlib.suppress(ApiFailure):
                delete_pod(plane, name)
