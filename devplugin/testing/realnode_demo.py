"""`devplugin demo --real-node`: the daemon beside a real kubelet.

A real control plane (etcd, kube-apiserver, kube-controller-manager) and a
real node (containerd v2 with runc, the kubelet), built from the modules
pinned in upstream/ (`make demo-node` builds them once), on this machine;
the daemon serves the simulated 8-GPU / 8-HCA node of `devplugin demo`,
whose /dev nodes are real character devices. It shows the kubelet's view
of the daemon's resources, starts a pod asking for two GPUs and two HCAs,
and prints what the container saw; with `--stay` it then waits (Ctrl-C
ends it) with an admin kubeconfig to try more. Needs root, Go, util-linux,
Debian's runc and containernetworking-plugins.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from devplugin.config import Config, override
from devplugin.node.alignment import alignment
from devplugin.node.podresources import PodResourcesClient
from devplugin.policy.topology import Topology
from devplugin.runtime import Daemon, build
from devplugin.testing.cdi import nvidia_like_spec, realize, write_spec
from devplugin.testing.controlplane import ControlPlane, Unavailable, binaries
from devplugin.testing.fake_nvml import FakeNvml
from devplugin.testing.node import BuiltNode, build_node, hgx_node
from devplugin.testing.realnode import RealNode, missing, node_binaries
from devplugin.testing.realnode_pods import PODS, pod, wait_seen

MINOR = "v1.37"
GPU, HCA = "nvidia.com/gpu", "rdma/hca"


def simulated_hardware(node: RealNode, base: Path) -> BuiltNode:
    """The HGX-like simulated node, its /dev nodes made real, and the CDI
    spec NVIDIA's toolkit would have written for its GPUs (in the folder
    the node's containerd reads)."""
    hardware = build_node(hgx_node(), base / "hw")
    realize(hardware)
    spec = nvidia_like_spec(hardware, host_dev=hardware.dev_root, driver_files=False)
    write_spec(node.cdi_dir, "nvidia-gpu.json", spec)
    return hardware


def daemon_settings(node: RealNode, hardware: BuiltNode, base: Path) -> dict[str, Any]:
    """The daemon's settings on the real node: the kubelet's folders are the
    node's, and Allocate answers name CDI devices, which containerd resolves."""
    return {
        "paths.sysfs_root": str(hardware.sysfs_root),
        "paths.dev_root": str(hardware.dev_root),
        "paths.device_plugin_dir": str(node.device_plugin_dir),
        "paths.pod_resources_socket": str(node.pod_resources_socket),
        "nvml.fixture": str(hardware.fixture),
        "lifecycle.checkpoint_file": str(base / "checkpoint.json"),
        "metrics.addresses": ["127.0.0.1:0"],
        "cdi.spec_dirs": [str(node.cdi_dir)],
        "resources.gpu.device_list_strategy": ["cdi-cri"],
        "resources.hca.device_list_strategy": ["cdi-cri"],
    }


def start_daemon(settings: dict[str, Any], hardware: BuiltNode) -> tuple[Daemon, FakeNvml]:
    nvml = FakeNvml.from_file(hardware.fixture)
    daemon = build(override(Config(), **settings), nvml)
    daemon.start()
    return daemon, nvml


class _Clock:
    def __init__(self) -> None:
        self.began = time.monotonic()

    def step(self, what: str) -> None:
        now = time.monotonic()
        print(f"  {now - self.began:6.1f}s  {what}")
        self.began = now


def _wait(check: Any, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


def _show_pod(node: RealNode, hardware: BuiltNode, daemon: Daemon, clock: _Clock) -> bool:
    manifest = pod("demo", node.name, {"main": {GPU: 2, HCA: 2}})
    name = manifest["metadata"]["name"]
    node.plane.request("POST", PODS, manifest)
    seen = wait_seen(node, name, within=90)
    if seen is None:
        print(f"the pod did not start; the kubelet said:\n{node.tail('kubelet', 20)}")
        return False
    clock.step(f"pod {name} (2 GPUs, 2 HCAs) admitted, started by containerd and runc")
    held: dict[str, list[str]] = {}
    with PodResourcesClient(node.pod_resources_socket) as client:
        listed = client.list()
    for entry in listed:
        if entry.pod == name:
            held.setdefault(entry.resource, []).extend(entry.device_ids)
    for resource, ids in sorted(held.items()):
        print(f"    the kubelet's PodResources: {resource} = {', '.join(ids)}")
    ours = sorted(p for p in seen.nodes if p.startswith(("/dev/nvidia", "/dev/infiniband")))
    print(f"    the container's device nodes: {' '.join(ours)}")
    print(f"    the container's NCCL_IB_HCA: {seen.env.get('NCCL_IB_HCA', '(unset)')}")
    found = alignment(Topology.from_inventory(daemon.inventory), held[GPU], held[HCA])
    if found is not None:
        print(f"    worst GPU-to-nearest-HCA level: {found[0].name}")
    node.plane.request("DELETE", f"{PODS}/{name}")
    return True


def run_node_demo(stay: bool = False) -> int:
    why = missing()
    if why is not None:
        print(why)
        return 2
    clock = _Clock()
    try:
        bins = node_binaries(MINOR)
        plane_bins = binaries(MINOR)
    except Unavailable as exc:
        print(f"the real node cannot be built here: {exc}")
        return 2
    clock.step(f"kubelet {plane_bins.version} and containerd built (or found cached)")
    base = Path(tempfile.mkdtemp(prefix="rn-demo-", dir="/tmp"))
    plane = ControlPlane(plane_bins, base / "cp")
    node = RealNode(plane, bins, base / "n", "demo-node", cdi_dir=base / "cdi")
    daemon = None
    try:
        plane.start()
        clock.step("control plane up (etcd, kube-apiserver, kube-controller-manager)")
        node.start()
        clock.step("containerd up, images imported, the kubelet's Node Ready")
        hardware = simulated_hardware(node, base)
        daemon, _ = start_daemon(daemon_settings(node, hardware, base), hardware)
        if not _wait(lambda: all(daemon.registrar.registered().values()), 30):
            print("the daemon did not register with the kubelet")
            return 1
        clock.step("the daemon registered nvidia.com/gpu and rdma/hca with the kubelet")

        def allocatable() -> dict[str, str]:
            return dict(node.node().get("status", {}).get("allocatable", {}))

        if not _wait(lambda: allocatable().get(GPU) == "8" and allocatable().get(HCA) == "8", 60):
            print(f"the Node's allocatable never showed them: {allocatable()}")
            return 1
        shown = allocatable()
        clock.step(f"the Node's allocatable: {GPU}={shown[GPU]}, {HCA}={shown[HCA]}")
        if not _show_pod(node, hardware, daemon, clock):
            return 1
        if stay:
            _stay(plane, plane_bins.path("kubectl"), base)
        return 0
    finally:
        if daemon is not None:
            daemon.stop()
        node.stop()
        plane.stop()
        shutil.rmtree(base, ignore_errors=True)


def _stay(plane: ControlPlane, kubectl: str, base: Path) -> None:
    print(
        f"\nThe node stays up. Try:\n  {kubectl} --kubeconfig {plane.admin_file} "
        "get node demo-node -o jsonpath='{.status.allocatable}'\nCtrl-C ends the demo and removes "
        f"everything under {base}."
    )
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
