"""DRA on the real node: a pod with a claim from one of the chart's
templates is scheduled by the real kube-scheduler (which allocates the
claim), prepared through the real kubelet's DRA manager (which calls the
daemon's NodePrepareResources and hands containerd the CDI names it
answers), its container sees exactly the claim's devices, and the claim is
unprepared when the pod goes."""

from __future__ import annotations

from typing import Any

import pytest

from devplugin.policy.topology import Topology
from devplugin.testing.controlplane import ControlPlane
from devplugin.testing.dra_scheduler import node_ids, pair_levels
from tests.real_node.conftest import NODE, Running, dra
from tests.real_node.pods import PODS, added, container, delete, gone, metric, seen, status
from tests.real_runtime import expected_nodes
from tests.waiting import wait_until

pytestmark = pytest.mark.node
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"
SLICES = f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName={NODE}"


def claim_pod(name: str, template: str) -> dict[str, Any]:
    main = container("main", {})
    main["resources"] = {"claims": [{"name": "devices"}]}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": NODE},
                     "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "automountServiceAccountToken": False, "containers": [main],
                     "resourceClaims": [{"name": "devices",
                                         "resourceClaimTemplateName": template}]}}  # fmt: skip


def spec_files(running: Running) -> set[str]:
    return {path.name for path in (running.base / "cdi").glob("*") if path.is_file()}


@pytest.mark.parametrize("running", [dra], indirect=True)
@pytest.mark.parametrize("template", ["2-pairs"])
def test_a_claim_pod_is_scheduled_prepared_and_unprepared_by_the_real_components(
    charted: ControlPlane, running: Running, template: str
) -> None:
    plane = running.node.plane
    every = len(running.hardware.gpus) + len(running.hardware.hcas)
    assert wait_until(
        lambda: (
            sum(len(s["spec"]["devices"]) for s in plane.request("GET", SLICES)["items"]) == every
        ),
        timeout=30,
    )
    before = spec_files(running)
    prepared = metric(running, "devplugin_dra_claims_total", call="prepare", result="ok")
    name = f"claimed-{template}"
    plane.request("POST", PODS, claim_pod(name, template))
    saw = seen(running, name, within=90)
    found = plane.request("GET", f"{PODS}/{name}")
    assert found["spec"]["nodeName"] == NODE
    (claim_status,) = found["status"]["resourceClaimStatuses"]
    claim = plane.request("GET", f"{CLAIMS}/{claim_status['resourceClaimName']}")
    results = claim["status"]["allocation"]["devices"]["results"]
    names = node_ids(plane.request("GET", SLICES)["items"])
    gpus = [names[r["device"]] for r in results if r["device"].startswith("gpu-")]
    hcas = [names[r["device"]] for r in results if r["device"].startswith("hca-")]
    assert (len(gpus), len(hcas)) == (2, 2)
    # The kubelet's DRA manager had it prepared, and containerd gave the
    # container exactly the claim's devices.
    assert metric(running, "devplugin_dra_claims_total", call="prepare", result="ok") > prepared
    assert added(running, saw) == expected_nodes(running.hardware, gpus, hcas)
    assert spec_files(running) - before, "no CDI spec was written for the claim"
    # On a free node both pairs are at the best level (each GPU and its HCA
    # behind one switch).
    topology = Topology.from_inventory(running.served.inventory)
    hardware = running.hardware
    best = min(topology.level(g.uuid, h.device_id) for g in hardware.gpus for h in hardware.hcas)
    levels = pair_levels(results, names, topology)
    assert levels == [best, best], (levels, status(running, name))
    delete(running, name)
    assert wait_until(lambda: gone(running, name), timeout=60)
    assert wait_until(
        lambda: metric(running, "devplugin_dra_claims_total", call="unprepare", result="ok") > 0,
        timeout=30,
    )
    assert wait_until(lambda: spec_files(running) == before, timeout=30)
