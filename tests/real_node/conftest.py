"""The real-node tier: a kubelet and containerd built from the modules pinned
in upstream/, joined to a real control plane, with the daemon on simulated
hardware whose /dev nodes are real character devices. Skipped with one line
where the machine cannot run it; `DEVPLUGIN_REQUIRE_NODE=1` (.ci/run) makes
that a failure."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from devplugin.runtime import Daemon
from devplugin.testing.controlplane import (
    ApiFailure,
    ControlPlane,
    Unavailable,
    binaries,
    env_flag,
    kubeconfig,
)
from devplugin.testing.fake_nvml import FakeNvml
from devplugin.testing.node import BuiltNode
from devplugin.testing.oci_image import WORK_IMAGE
from devplugin.testing.realnode import NodeBinaries, RealNode, missing, node_binaries
from devplugin.testing.realnode_demo import daemon_settings, simulated_hardware, start_daemon
from tests.real_cluster.conftest import DRA_NAMESPACE, DRA_RELEASE, DRA_VALUES, keep_installed
from tests.real_cluster.nodes import DEFAULT_SCHEDULER, pod_token, remove_node

# The newest pin; the node's own behaviour under v1.35 is for a later step.
# The kubelet and control plane of each pin: 1.35 (the stable DRA allocator,
# the last minor before 1.36's changes) and the newest.
VERSIONS = ("v1.35", "v1.37")


def unavailable(why: str) -> None:
    if env_flag("DEVPLUGIN_REQUIRE_NODE"):
        pytest.fail(f"real-node tier required here: {why}")
    pytest.skip(why)


@pytest.fixture(scope="session", params=VERSIONS)
def minor(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="session")
def node_bins(minor: str) -> NodeBinaries:
    why = missing()
    if why is not None:
        unavailable(why)
    try:
        return node_binaries(minor)
    except Unavailable as exc:
        unavailable(f"real-node tier: {exc}")
        raise


@pytest.fixture(scope="session")
def plane(minor: str, node_bins: NodeBinaries) -> Iterator[ControlPlane]:
    folder = Path(tempfile.mkdtemp(prefix="ntier-"))
    control = ControlPlane(binaries(minor), folder)
    try:
        control.start()
        yield control
    finally:
        control.stop()
        if not env_flag("DEVPLUGIN_KEEP_CLUSTER"):
            shutil.rmtree(folder, ignore_errors=True)


GPU, HCA = "nvidia.com/gpu", "rdma/hca"
NODE = "real-a"


@pytest.fixture(scope="session")
def charted(plane: ControlPlane) -> ControlPlane:
    """The chart installed with DRA (its DeviceClasses, claim templates in
    `default`, the daemon's account and node policy) and the scheduler on."""
    # Without the extender: its Deployment's pods would land on this node.
    values = {key: value for key, value in DRA_VALUES.items() if key != "extender"}
    keep_installed(plane, DRA_RELEASE, DRA_NAMESPACE, values)
    plane.start_scheduler(DEFAULT_SCHEDULER)
    return plane


def daemon_identity(
    plane: ControlPlane, node: str, release: str = DRA_RELEASE, namespace: str = DRA_NAMESPACE
) -> dict[str, Any]:
    """A kubeconfig for the daemon on `node`, as the chart's DaemonSet pod
    there has: its account's token bound to its pod on the node (the pod
    runs on the real kubelet, a container that only waits)."""
    account = f"{release}-devplugin"
    pods = f"/api/v1/namespaces/{namespace}/pods"
    waits = {"name": "daemon", "image": WORK_IMAGE, "imagePullPolicy": "Never",
             "command": ["/bin/sh", "-c", "exec sleep 36000"]}  # fmt: skip
    stand_in = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": f"daemon-{node}", "namespace": namespace},
                "spec": {"nodeName": node, "serviceAccountName": account,
                         "automountServiceAccountToken": False,
                         "terminationGracePeriodSeconds": 0, "containers": [waits]}}  # fmt: skip
    with contextlib.suppress(ApiFailure):
        plane.request("DELETE", f"{pods}/daemon-{node}?gracePeriodSeconds=0")
    created = plane.request("POST", pods, stand_in)
    token = pod_token(plane, namespace, account, created)
    return kubeconfig(plane.server, plane.pki.ca, token=token)


def with_api(node: RealNode, base: Path, **more: Any) -> dict[str, Any]:
    """Settings for a daemon that reads the cluster as the chart's does."""
    path = base / "kubeconfig"
    path.write_text(yaml.safe_dump(daemon_identity(node.plane, node.name)))
    return {
        "kubernetes.enabled": True,
        "kubernetes.kubeconfig": str(path),
        "kubernetes.node_name": node.name,
        "kubernetes.lease_namespace": DRA_NAMESPACE,
        **more,
    }


def dra(node: RealNode, base: Path) -> dict[str, Any]:
    """Both kinds served through DRA, to the real kubelet's DRA manager."""
    return with_api(
        node,
        base,
        **{
            "resources.gpu.api": "dra",
            "resources.hca.api": "dra",
            "paths.kubelet_plugins_dir": str(node.plugins_dir),
            "paths.kubelet_registry_dir": str(node.registry_dir),
        },
    )


class Running:
    """The real node with the daemon serving it; `settings` are the
    daemon's configuration overrides, kept for a restart."""

    def __init__(
        self, node: RealNode, hardware: BuiltNode, base: Path, settings: dict[str, Any]
    ) -> None:
        self.node, self.hardware, self.base, self.settings = node, hardware, base, settings
        self.daemon: Daemon | None = None
        self.nvml: FakeNvml | None = None
        # The devices a container asking for nothing sees (tests/real_node/pods.py).
        self.baseline: dict[str, tuple[int, int]] | None = None

    def start_daemon(self) -> Daemon:
        self.daemon, self.nvml = start_daemon(self.settings, self.hardware)
        return self.daemon

    def stop_daemon(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None

    @property
    def served(self) -> Daemon:
        assert self.daemon is not None, "the daemon is not running"
        return self.daemon

    def allocatable(self) -> dict[str, Any]:
        status = self.node.node().get("status", {})
        return dict(status.get("allocatable", {}))

    def capacity(self) -> dict[str, Any]:
        return dict(self.node.node().get("status", {}).get("capacity", {}))


@pytest.fixture
def running(
    request: pytest.FixtureRequest, plane: ControlPlane, node_bins: NodeBinaries
) -> Iterator[Running]:
    """The node and its daemon; a test's `indirect` parameter, a function of
    the node and the base folder, gives settings of its own (hooks, say)."""
    # Short: unix socket paths under it are limited to 107 bytes.
    base = Path(tempfile.mkdtemp(prefix="rn-", dir="/tmp"))
    node = RealNode(plane, node_bins, base / "n", NODE, cdi_dir=base / "cdi")
    served = None
    try:
        node.start()
        hardware = simulated_hardware(node, base)
        settings = daemon_settings(node, hardware, base)
        extra = getattr(request, "param", None)
        if extra is not None:
            settings.update(extra(node, base))
        served = Running(node, hardware, base, settings)
        served.start_daemon()
        yield served
    finally:
        if served is not None:
            served.stop_daemon()
        print(node.tail("kubelet", 15))  # shown by pytest when the test fails
        node.stop()
        remove_node(plane, NODE)
        shutil.rmtree(base, ignore_errors=True)
