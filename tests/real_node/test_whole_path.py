"""The whole path through real components, nothing imitated but the GPUs:
the chart installed into the real control plane; its DaemonSet pod running
the daemon from the image the build produces (imported into the node's
containerd, no registry) on the real kubelet; its extender Deployment pod
beside it; and pods sent by the chart's second scheduler (the real
kube-scheduler with the chart's profile) through that extender to the
node, started on containerd with an aligned set, checked from inside, and
cleaned by the chart's cleanup hook when they end.

The node's hardware is the simulated HGX (its sysfs tree and real /dev
nodes given to the DaemonSet through the chart's hostPaths); NVML is the
fake one, named by the one argument added to the installed DaemonSet (the
chart does not let a fake NVML be configured, nor should it)."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from devplugin.node.podresources import PodResourcesClient
from devplugin.testing.controlplane import ApiFailure, ControlPlane, Unavailable, free_port
from devplugin.testing.daemon_image import image_archive
from devplugin.testing.node import BuiltNode
from devplugin.testing.realnode import NodeBinaries, RealNode
from devplugin.testing.realnode_demo import simulated_hardware
from devplugin.testing.realnode_pods import PODS, pod, wait_seen
from tests.real_cluster.cluster_support import chart_scheduler_config, verb_calls
from tests.real_cluster.conftest import keep_installed
from tests.real_cluster.nodes import DEFAULT_SCHEDULER, remove_node
from tests.real_node.conftest import GPU, HCA, NODE, unavailable
from tests.real_node.pods import switch
from tests.real_runtime import expected_nodes, ib_names
from tests.waiting import wait_until

pytestmark = pytest.mark.node

RELEASE, NAMESPACE = "whole", "devplugin-whole"
SCHEDULER = "devplugin-scheduler"
# Only the node this test labels runs this release's DaemonSet (not a devplugin.io/
# label: the daemon owns those on its node).
LABEL = "tier.devplugin.test/whole"
HOOK_LOG = "/var/lib/devplugin/hooks.log"
CLEANUP = ["/bin/sh", "-c", f'cat >/dev/null; echo "$DEVPLUGIN_DEVICE_IDS" >> {HOOK_LOG}']


def values(
    plane: ControlPlane, node: RealNode, hardware: BuiltNode, state: Path, reference: str
) -> dict[str, Any]:
    """The chart's values for this node: the image built here, the node's
    network (the API server listens on loopback; no kube-proxy runs), the
    simulated hardware's folders, CDI names in Allocate answers."""
    repository, tag = reference.rsplit(":", 1)
    hosts = {"sys": str(hardware.sysfs_root), "dev": str(hardware.dev_root), "state": str(state),
             "cdiStatic": str(node.cdi_dir), "cdiDynamic": str(node.cdi_dynamic)}  # fmt: skip
    cdi = ["cdi-cri"]
    return {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "hostNetwork": True,
        "kubernetesService": {"host": "127.0.0.1", "port": plane.port},
        "hostPaths": hosts,
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": LABEL, "operator": "In", "values": ["true"]}]}]}}},
        "metrics": {"port": free_port()},
        "config": {"resources": {
            "gpu": {"device_list_strategy": cdi, "hooks": {"cleanup": CLEANUP}},
            "hca": {"device_list_strategy": cdi}}},
        "extender": {"enabled": True, "hostNetwork": True, "port": free_port(),
                     "scheduler": {"enabled": True}},
    }  # fmt: skip


@dataclass
class Whole:
    plane: ControlPlane
    node: RealNode
    hardware: BuiltNode
    state: Path
    extender: str  # the extender pod's URL
    last_log: str = ""

    def daemon_pods(self) -> list[dict[str, Any]]:
        """The DaemonSet's pods (its owner says so)."""
        listed = _get(self.plane, f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]
        return [
            p for p in listed
            if any(o.get("kind") == "DaemonSet" for o in p["metadata"].get("ownerReferences", []))
        ]  # fmt: skip

    def daemon_ready(self) -> bool:
        for folder in self.node.logs.glob(f"{NAMESPACE}_{RELEASE}-devplugin-*"):
            for log in folder.glob("devplugin/*.log"):
                text = log.read_text(errors="replace").splitlines()
                self.last_log = "\n".join(
                    line for line in text if '"warning"' in line or '"error"' in line
                )[-4000:]
        return any(
            c["type"] == "Ready" and c["status"] == "True"
            for p in self.daemon_pods()
            for c in (p.get("status") or {}).get("conditions") or []
        )

    def daemon_log(self) -> str:
        """What the release's pods show: their phases, and the last lines
        their containers wrote."""
        lines = [self.last_log]
        for entry in _get(self.plane, f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]:
            name = entry["metadata"]["name"]
            lines.append(f"{name}: {(entry.get('status') or {}).get('phase')}")
            for container in entry["spec"]["containers"]:
                text = self.node.container_log(NAMESPACE, name, container["name"])
                lines.extend(text.splitlines()[-25:])
        for folder in sorted(self.node.logs.glob(f"{NAMESPACE}_{RELEASE}-devplugin-*")):
            for log in sorted(folder.glob("devplugin/*.log")):
                lines.append(f"-- {folder.name}/{log.name}")
                lines.extend(log.read_text(errors="replace").splitlines()[-25:])
        for event in _get(self.plane, f"/api/v1/namespaces/{NAMESPACE}/events")["items"]:
            lines.append(f"event {event['involvedObject']['name']}: {event.get('message')}")
        return "\n".join(lines)

    def hooks(self) -> list[str]:
        log = self.state / "hooks.log"
        return log.read_text().splitlines() if log.exists() else []


def _get(plane: ControlPlane, path: str) -> dict[str, Any]:
    found: dict[str, Any] = plane.request("GET", path)
    return found


def _add_fake_nvml(plane: ControlPlane, fixture: str) -> None:
    """The installed DaemonSet, its container given the fake NVML's fixture."""
    path = f"/apis/apps/v1/namespaces/{NAMESPACE}/daemonsets/{RELEASE}-devplugin"
    (container,) = _get(plane, path)["spec"]["template"]["spec"]["containers"]
    assert container["args"], container
    # A patch, not a read-modify-write: the DaemonSet controller writes the
    # object's status meanwhile (a PUT then meets 409 Conflict).
    patch = [
        {
            "op": "add",
            "path": "/spec/template/spec/containers/0/args/-",
            "value": f"--nvml-fixture={fixture}",
        }
    ]
    plane.request("PATCH", path, patch, content_type="application/json-patch+json")


def _extender_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


@pytest.fixture
def whole(plane: ControlPlane, node_bins: NodeBinaries) -> Iterator[Whole]:
    try:
        archive, reference = image_archive()
    except Unavailable as exc:
        unavailable(f"real-node tier: {exc}")
        raise
    base = Path(tempfile.mkdtemp(prefix="rw-", dir="/tmp"))
    node = RealNode(plane, node_bins, base / "n", NODE, cdi_dir=base / "cdi")
    try:
        node.start()
        node.import_image(archive)
        assert any(ref.endswith(reference) for ref in node.images()), node.images()
        hardware = simulated_hardware(node, base)
        state = base / "state"
        state.mkdir()
        shutil.copy(hardware.fixture, state / "fixture.json")
        plane.request(
            "PATCH",
            f"/api/v1/nodes/{NODE}",
            {"metadata": {"labels": {LABEL: "true"}}},
            content_type="application/merge-patch+json",
        )
        settings = values(plane, node, hardware, state, reference)
        keep_installed(plane, RELEASE, NAMESPACE, settings)
        _add_fake_nvml(plane, "/var/lib/devplugin/fixture.json")
        # The chart's second scheduler is upstream's image, out of reach here:
        # the same binary runs beside the node with the chart's ConfigMap.
        plane.request(
            "PATCH",
            f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{RELEASE}-devplugin-scheduler",
            {"spec": {"replicas": 0}},
            content_type="application/merge-patch+json",
        )
        plane.start_scheduler(DEFAULT_SCHEDULER)  # places the extender's Deployment
        url = f"http://127.0.0.1:{settings['extender']['port']}"
        found = Whole(plane, node, hardware, state, url)
        assert wait_until(found.daemon_ready, timeout=120), found.daemon_log()
        assert wait_until(lambda: _extender_ready(url), timeout=120), found.daemon_log()
        plane.start_scheduler(
            chart_scheduler_config(plane, url, NAMESPACE, RELEASE), name=SCHEDULER
        )
        yield found
    finally:
        plane.stop_scheduler(SCHEDULER)
        with contextlib.suppress(ApiFailure):
            plane.request(
                "DELETE", f"/apis/apps/v1/namespaces/{NAMESPACE}/daemonsets/{RELEASE}-devplugin"
            )
        print(node.tail("kubelet", 15))
        node.stop()
        remove_node(plane, NODE)
        shutil.rmtree(base, ignore_errors=True)


# The image is built first where the cache lacks this tree's (minutes).
@pytest.mark.timeout(1200)
def test_a_pod_goes_through_the_charts_scheduler_and_extender_to_the_charts_daemon(
    whole: Whole,
) -> None:
    plane, node, hardware = whole.plane, whole.node, whole.hardware
    node_path = f"/api/v1/nodes/{NODE}"
    assert wait_until(
        lambda: _get(plane, node_path)["status"]["allocatable"].get(GPU) == "8", 60
    ), whole.daemon_log()
    assert wait_until(lambda: _get(plane, node_path)["status"]["allocatable"].get(HCA) == "8", 60)
    # The daemon in its pod published its record; the extender pod reads it.
    record = f"/apis/devplugin.io/v1alpha1/nodedevices/{NODE}"
    assert wait_until(lambda: bool(_get(plane, record).get("status")), timeout=60)
    filtered = verb_calls(whole.extender, "filter", "ok")
    asked = pod("whole", None, {"main": {GPU: 2, HCA: 2}})
    asked["spec"]["schedulerName"] = SCHEDULER
    plane.request("POST", PODS, asked)
    name = asked["metadata"]["name"]
    saw = wait_seen(node, name, within=120)
    conditions = (_get(plane, f"{PODS}/{name}").get("status") or {}).get("conditions") or []
    assert saw is not None, [c.get("message") for c in conditions]
    # The chart's scheduler asked the chart's extender.
    assert verb_calls(whole.extender, "filter", "ok") > filtered
    assert _get(plane, f"{PODS}/{name}")["spec"]["nodeName"] == NODE
    # What the container holds, by the kubelet's own record of it.
    held: dict[str, list[str]] = {}
    with PodResourcesClient(node.pod_resources_socket) as client:
        for entry in client.list():
            if entry.pod == name and entry.container == "main":
                held.setdefault(entry.resource, []).extend(entry.device_ids)
    gpus, hcas = held.get(GPU, []), held.get(HCA, [])
    assert (len(gpus), len(hcas)) == (2, 2)
    # Inside the container: exactly those devices' nodes, NCCL told its HCAs.
    baseline = {path for path in saw.nodes if not path.startswith(("/dev/nvidia", "/dev/infini"))}
    seen_nodes = {p: n for p, n in saw.nodes.items() if p not in baseline}
    assert seen_nodes == expected_nodes(hardware, gpus, hcas)
    value = saw.env.get("NCCL_IB_HCA", "")
    assert sorted(value[1:].split(",")) == sorted(ib_names(hardware, hcas)[1:].split(","))
    # Aligned on the node's layout: every GPU behind the same switch as an HCA.
    by_uuid = {gpu.uuid: gpu for gpu in hardware.gpus}
    assert {switch(by_uuid[g].directory) for g in gpus} == {
        switch(hardware.hca_by_id(h).directory) for h in hcas
    }
    # The pod ends: the chart's cleanup hook runs on its GPUs (one run per
    # device; the runs before are the daemon's first cleanup of every GPU).
    before = len(whole.hooks())
    plane.request("DELETE", f"{PODS}/{name}")

    def cleaned() -> bool:
        return set(gpus) <= {i for line in whole.hooks()[before:] for i in line.split(",")}

    assert wait_until(cleaned, timeout=60), whole.hooks()
    print(json.dumps({"gpus": gpus, "hcas": hcas}))
