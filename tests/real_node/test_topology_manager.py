"""The real kubelet's Topology Manager and static CPU manager judge the
daemon's devices, and the extender predicts them.

The node: the simulated HGX (four GPU+HCA pairs behind switches on each of
two NUMA nodes), its kubelet shown a machine of two NUMA nodes with one of
this machine's two CPUs each (its /sys/devices/system/node made so in the
node's mount namespace), CPU 0 reserved: a Guaranteed container asking one
whole CPU gets CPU 1, on NUMA node 1. The daemon reads the kubelet's
config file and its PodResources, and publishes both in its record.

* Pods bound to the node directly, a seeded stream with ends between: for
  each, the imitation (placement over the daemon's live record) says first
  whether the kubelet admits it or refuses it with TopologyAffinityError,
  and on which NUMA nodes its devices come; the real kubelet must agree on
  every one, and never start a split set where the policy forbids one.
* The same kind of stream through the chart's scheduler and the extender:
  no pod the extender placed is refused by the kubelet, and each pod it
  kept off the node is refused there when bound by hand."""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from devplugin.policy.allocator import Allocator
from devplugin.policy.node_record import node_from_record
from devplugin.policy.placement import place
from devplugin.policy.pod_request import shape_of
from devplugin.policy.podinfo import parse_pod
from devplugin.runtime import Daemon
from devplugin.testing.controlplane import ApiFailure, ControlPlane
from devplugin.testing.node import BuiltNode, write_numa_nodes
from devplugin.testing.oci_image import SEEN_SCRIPT, WORK_IMAGE
from devplugin.testing.realnode import NodeBinaries, RealNode
from devplugin.testing.realnode_demo import daemon_settings, simulated_hardware, start_daemon
from devplugin.testing.realnode_pods import PODS
from tests.real_cluster.cluster_support import (
    chart_extender,
    chart_scheduler_config,
    verb_calls,
)
from tests.real_cluster.conftest import keep_installed
from tests.real_cluster.nodes import DEFAULT_SCHEDULER, remove_node
from tests.real_node.conftest import GPU, HCA, NODE, daemon_identity
from tests.waiting import wait_until

pytestmark = pytest.mark.node

RELEASE, NAMESPACE = "tm", "devplugin-tm"
SCHEDULER = "devplugin-scheduler"
NUMA = {0: "0", 1: "1"}
# (policy, scope) per version: each scope and both aligning policies, split
# over the two versions to keep the tier's time.
CASES = {
    "v1.37": [("single-numa-node", "container"), ("restricted", "container")],
    "v1.35": [("single-numa-node", "pod")],
}
# GPUs, HCAs, whole CPUs of a Guaranteed pod (0: not Guaranteed).
SHAPES = [(1, 1, 0), (2, 2, 0), (3, 3, 0), (4, 4, 0), (5, 1, 0), (2, 0, 0), (1, 1, 1), (2, 2, 1)]
STREAM = 14


def work_pod(name: str, shape: tuple[int, int, int], *, node: str | None) -> dict[str, Any]:
    gpus, hcas, cpus = shape
    limits = {k: str(v) for k, v in ((GPU, gpus), (HCA, hcas)) if v}
    if cpus:
        limits.update({"cpu": str(cpus), "memory": "64Mi"})
    container = {"name": "main", "image": WORK_IMAGE, "imagePullPolicy": "Never",
                 "command": ["/bin/sh", "-c", SEEN_SCRIPT + "; exec sleep 3600"],
                 "resources": {"limits": limits}}  # fmt: skip
    spec: dict[str, Any] = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                            "automountServiceAccountToken": False,
                            "containers": [container]}  # fmt: skip
    if node is not None:
        spec["nodeName"] = node
    else:
        spec["schedulerName"] = SCHEDULER
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default"}, "spec": spec}  # fmt: skip


@dataclass
class Aligned:
    plane: ControlPlane
    node: RealNode
    hardware: BuiltNode
    daemon: Daemon
    policy: str
    scope: str
    running: dict[str, tuple[int, int, int]] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        assert self.daemon.status is not None
        host, port = self.daemon.status.bound[0]
        with urllib.request.urlopen(f"http://{host}:{port}/record", timeout=5) as answer:
            found: dict[str, Any] = json.loads(answer.read())
        return found

    def settled(self) -> bool:
        """The record shows the running pods and the CPUs they hold."""
        status = self.record()["status"]
        shown = {a["pod"] for a in status.get("allocations", [])}
        with_devices = {n for n, (g, h, _) in self.running.items() if g or h}
        held_cpus = sum(c for _, _, c in self.running.values())
        free = sum(n.get("freeCpus", -99) for n in status.get("numaNodes", []))
        return shown == with_devices and free == 1 - held_cpus

    def shown(self) -> tuple[Any, ...]:
        status = self.record()["status"]
        return (status.get("allocations", []), status.get("numaNodes"),
                self.running)  # fmt: skip

    def pod(self, name: str) -> dict[str, Any]:
        found: dict[str, Any] = self.plane.request("GET", f"{PODS}/{name}")
        return found

    def kubelet_verdict(self, name: str) -> str:
        """'admitted' or the kubelet's reason for turning the pod away."""
        found: list[str] = []

        def decided() -> bool:
            status = self.pod(name).get("status") or {}
            if status.get("phase") == "Running":
                found.append("admitted")
            elif status.get("phase") == "Failed":
                found.append(str(status.get("reason") or status.get("message")))
            return bool(found)

        assert wait_until(decided, timeout=60), self.pod(name).get("status")
        return found[0]

    def numa_of(self, name: str) -> set[int | None]:
        topology = self.daemon.core.coordinator.topology
        status = self.record()["status"]
        devices = [d for a in status["allocations"] if a["pod"] == name for d in a["devices"]]
        return {topology.numa_node(d) for d in devices}

    def delete(self, name: str) -> None:
        with contextlib.suppress(ApiFailure):
            self.plane.request("DELETE", f"{PODS}/{name}?gracePeriodSeconds=0")
        self.running.pop(name, None)
        assert wait_until(lambda: self._gone(name), timeout=30)

    def _gone(self, name: str) -> bool:
        try:
            self.pod(name)
        except ApiFailure as exc:
            return exc.code == 404
        return False


def _fits_by_count(aligned: Aligned, shape: tuple[int, int, int]) -> bool:
    status = aligned.record()["status"]
    summary = status["summary"]
    free_cpus = sum(n.get("freeCpus", 0) for n in status.get("numaNodes", []))
    return (
        summary["gpusFree"] >= shape[0]
        and summary["hcasFree"] >= shape[1]
        and free_cpus >= shape[2]
    )


@pytest.fixture(scope="session")
def charted_tm(plane: ControlPlane) -> ControlPlane:
    """The chart with its extender and second scheduler, once per control
    plane: its accounts and RBAC for the daemon and the extender, its
    scheduler configuration. Its DaemonSet runs nowhere and its Deployments
    are scaled to none: the tier runs them as processes."""
    keep_installed(plane, RELEASE, NAMESPACE, {
        "extender": {"enabled": True, "scheduler": {"enabled": True}},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "tier.devplugin.test/none", "operator": "Exists"}]}]}}},
    })  # fmt: skip
    for deployment in ("extender", "scheduler"):
        plane.request(
            "PATCH",
            f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{RELEASE}-devplugin-{deployment}",
            {"spec": {"replicas": 0}},
            content_type="application/merge-patch+json",
        )
    return plane


@pytest.fixture(params=[0, 1], ids=["first", "second"])
def aligned(
    request: pytest.FixtureRequest, minor: str, charted_tm: ControlPlane, node_bins: NodeBinaries
) -> Iterator[Aligned]:
    plane = charted_tm
    cases = CASES[minor]
    if request.param >= len(cases):
        pytest.skip(f"{minor}: one case only")
    policy, scope = cases[request.param]
    plane.start_scheduler(DEFAULT_SCHEDULER)
    base = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    managers = {"topologyManagerPolicy": policy, "topologyManagerScope": scope,
                "cpuManagerPolicy": "static", "reservedSystemCPUs": "0"}  # fmt: skip
    folder, cdi = base / "n", base / "cdi"
    node = RealNode(plane, node_bins, folder, NODE, cdi, kubelet_settings=managers, numa=NUMA)
    daemon: Daemon | None = None
    found: Aligned | None = None
    try:
        node.start()
        hardware = simulated_hardware(node, base)
        write_numa_nodes(hardware.sysfs_root, NUMA)  # the machine the kubelet sees
        identity = base / "kubeconfig"
        identity.write_text(yaml.safe_dump(daemon_identity(plane, NODE, RELEASE, NAMESPACE)))
        settings = {
            **daemon_settings(node, hardware, base),
            "kubernetes.enabled": True, "kubernetes.kubeconfig": str(identity),
            "kubernetes.node_name": NODE, "kubernetes.lease_namespace": NAMESPACE,
            "kubernetes.record_min_interval_seconds": 0.5,
            "kubelet.config_file": str(node.folder / "kubelet.yaml"),
        }  # fmt: skip
        daemon, _ = start_daemon(settings, hardware)
        found = Aligned(plane, node, hardware, daemon, policy, scope)
        assert wait_until(found.settled, timeout=60), found.record()["status"].get("numaNodes")
        yield found
    finally:
        for name in list(found.running) if found is not None else []:
            with contextlib.suppress(ApiFailure):
                plane.request("DELETE", f"{PODS}/{name}?gracePeriodSeconds=0")
        if daemon is not None:
            daemon.stop()
        print(node.tail("kubelet", 15))
        node.stop()
        remove_node(plane, NODE)
        shutil.rmtree(base, ignore_errors=True)


def predicted(aligned: Aligned, pod: dict[str, Any]) -> tuple[str, set[int | None]]:
    """('admitted', the NUMA nodes its devices come from) or ('refused',
    set()), as placement over the daemon's live record says."""
    state = node_from_record(aligned.record())
    body = {**pod, "metadata": {**pod["metadata"], "uid": "predicted"}}
    outcome = place(state, shape_of(parse_pod(body), GPU, HCA), Allocator(state.topology))
    if not outcome.fits:
        assert "TopologyAffinityError" in outcome.reason, outcome.reason
        return "refused", set()
    return "admitted", {state.topology.numa_node(d) for d in outcome.taken(state.free)}


@pytest.mark.timeout(900)
def test_the_kubelet_admits_and_refuses_exactly_as_placement_predicts(aligned: Aligned) -> None:
    rng = random.Random(f"{aligned.policy}/{aligned.scope}/3")
    # The record says what the kubelet was configured with.
    kubelet = aligned.record()["status"]["kubelet"]
    said = kubelet["topologyManagerPolicy"], kubelet["topologyManagerScope"]
    assert said == (aligned.policy, aligned.scope)
    admitted = refused = 0
    for index in range(STREAM):
        if aligned.running and rng.random() < 0.35:
            aligned.delete(rng.choice(sorted(aligned.running)))
            assert wait_until(aligned.settled, timeout=30)
        shape = rng.choice([s for s in SHAPES if _fits_by_count(aligned, s)] or [(0, 0, 0)])
        if shape == (0, 0, 0):
            aligned.delete(sorted(aligned.running)[0])
            assert wait_until(aligned.settled, timeout=30)
            continue
        name = f"tm-{index}"
        pod = work_pod(name, shape, node=NODE)
        said, where = predicted(aligned, pod)
        aligned.plane.request("POST", PODS, pod)
        verdict = aligned.kubelet_verdict(name)
        if said == "admitted":
            assert verdict == "admitted", (name, shape, verdict)
            aligned.running[name] = shape
            assert wait_until(aligned.settled, timeout=30), aligned.shown()
            got = aligned.numa_of(name)
            assert got == where, (name, shape, got, where)
            if aligned.policy == "single-numa-node":
                assert len(got) == 1  # never a split set
            admitted += 1
        else:
            assert verdict == "TopologyAffinityError", (name, shape, verdict)
            aligned.delete(name)
            refused += 1
    print(f"{aligned.policy}/{aligned.scope}: {admitted} admitted, {refused} refused, as predicted")
    assert admitted  # the stream met both verdicts
    assert refused


@pytest.mark.timeout(900)
def test_the_extender_never_sends_a_pod_the_kubelet_would_refuse(aligned: Aligned) -> None:
    plane = aligned.plane
    base = Path(tempfile.mkdtemp(prefix="rx-", dir="/tmp"))
    with chart_extender(plane, base, NAMESPACE, RELEASE) as url:
        plane.start_scheduler(chart_scheduler_config(plane, url, NAMESPACE, RELEASE), SCHEDULER)
        try:
            placed, kept_off, errors = _stream(aligned, url)
        finally:
            plane.stop_scheduler(SCHEDULER)
    shutil.rmtree(base, ignore_errors=True)
    print(
        f"{aligned.policy}/{aligned.scope}: through the extender {placed} placed, "
        f"{kept_off} kept off (each refused by the kubelet when bound by hand), "
        f"{errors} TopologyAffinityError"
    )
    assert errors == 0
    assert placed
    assert kept_off


def _stream(aligned: Aligned, url: str) -> tuple[int, int, int]:
    plane = aligned.plane
    rng = random.Random(f"extender {aligned.policy}/{aligned.scope}")
    placed = kept_off = errors = 0
    for index in range(STREAM):
        if aligned.running and rng.random() < 0.35:
            aligned.delete(rng.choice(sorted(aligned.running)))
        assert wait_until(aligned.settled, timeout=30)
        shape = rng.choice([s for s in SHAPES if _fits_by_count(aligned, s)] or [(0, 0, 0)])
        if shape == (0, 0, 0):
            aligned.delete(sorted(aligned.running)[0])
            continue
        name = f"tx-{index}"
        asked = verb_calls(url, "filter", "ok")
        plane.request("POST", PODS, work_pod(name, shape, node=None))
        outcome = _scheduled(aligned, name)
        assert verb_calls(url, "filter", "ok") > asked  # the extender was asked
        if outcome == "bound":
            verdict = aligned.kubelet_verdict(name)
            if verdict == "TopologyAffinityError":
                errors += 1
                aligned.delete(name)
                continue
            assert verdict == "admitted", (name, shape, verdict)
            aligned.running[name] = shape
            placed += 1
            continue
        # Kept off by the extender: bound by hand, the kubelet refuses it too.
        aligned.delete(name)
        by_hand = f"{name}-hand"
        plane.request("POST", PODS, work_pod(by_hand, shape, node=NODE))
        assert aligned.kubelet_verdict(by_hand) == "TopologyAffinityError", (name, shape)
        aligned.delete(by_hand)
        kept_off += 1
    return placed, kept_off, errors


def _scheduled(aligned: Aligned, name: str) -> str:
    """'bound', or 'kept off' once the scheduler found the pod unschedulable
    with the extender's Topology Manager reason."""
    found: list[str] = []

    def decided() -> bool:
        pod = aligned.pod(name)
        if pod["spec"].get("nodeName"):
            found.append("bound")
        for condition in (pod.get("status") or {}).get("conditions") or []:
            if condition.get("reason") == "Unschedulable" and "TopologyAffinityError" in str(
                condition.get("message")
            ):
                found.append("kept off")
        return bool(found)

    assert wait_until(decided, timeout=60), aligned.pod(name).get("status")
    return found[0]
