"""The daemon registered with a real kubelet: both resources in the Node's
capacity and allocatable, and registered again after a kubelet restart."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devplugin.config import Config, override
from devplugin.runtime import Daemon, build
from devplugin.testing.controlplane import ApiFailure, ControlPlane
from devplugin.testing.fake_nvml import FakeNvml
from devplugin.testing.node import BuiltNode, build_node, hgx_node
from devplugin.testing.realnode import NodeBinaries, RealNode
from tests.real_runtime import realize
from tests.waiting import wait_until

pytestmark = pytest.mark.node

GPU, HCA = "nvidia.com/gpu", "rdma/hca"


class Running:
    def __init__(self, node: RealNode, hardware: BuiltNode, daemon: Daemon) -> None:
        self.node, self.hardware, self.daemon = node, hardware, daemon

    def allocatable(self) -> dict[str, Any]:
        status = self.node.node().get("status", {})
        return dict(status.get("allocatable", {}))

    def capacity(self) -> dict[str, Any]:
        return dict(self.node.node().get("status", {}).get("capacity", {}))


@pytest.fixture
def running(plane: ControlPlane, node_bins: NodeBinaries) -> Iterator[Running]:
    # Short: unix socket paths under it are limited to 107 bytes.
    base = Path(tempfile.mkdtemp(prefix="rn-", dir="/tmp"))
    node = RealNode(plane, node_bins, base / "n", "real-a", cdi_dir=base / "cdi")
    daemon = None
    try:
        node.start()
        hardware = build_node(hgx_node(), base / "hw")
        realize(hardware)
        config = override(
            Config(),
            **{
                "paths.sysfs_root": str(hardware.sysfs_root),
                "paths.dev_root": str(hardware.dev_root),
                "paths.device_plugin_dir": str(node.device_plugin_dir),
                "paths.pod_resources_socket": str(node.pod_resources_socket),
                "nvml.fixture": str(hardware.fixture),
                "lifecycle.checkpoint_file": str(base / "checkpoint.json"),
                "metrics.addresses": ["127.0.0.1:0"],
                "cdi.spec_dirs": [str(base / "cdi")],
            },
        )
        daemon = build(config, FakeNvml.from_file(hardware.fixture))
        daemon.start()
        yield Running(node, hardware, daemon)
    finally:
        if daemon is not None:
            daemon.stop()
        print(node.tail("kubelet", 15))  # shown by pytest when the test fails
        node.stop()
        with contextlib.suppress(ApiFailure):
            plane.request("DELETE", "/api/v1/nodes/real-a")
        shutil.rmtree(base, ignore_errors=True)


def _counts(found: dict[str, Any]) -> tuple[str | None, str | None]:
    return found.get(GPU), found.get(HCA)


def test_both_resources_reach_the_nodes_capacity_and_allocatable(running: Running) -> None:
    assert wait_until(lambda: _counts(running.capacity()) == ("8", "8"), timeout=30)
    assert wait_until(lambda: _counts(running.allocatable()) == ("8", "8"), timeout=30)


def test_a_kubelet_restart_is_followed_by_registration_within_two_seconds(
    running: Running,
) -> None:
    assert wait_until(lambda: _counts(running.allocatable()) == ("8", "8"), timeout=30)
    registrar = running.daemon.registrar
    running.node.stop_kubelet()
    running.node.start_kubelet()
    # The new kubelet's socket appears when its device manager starts; from
    # then the daemon has two seconds to register both resources again.
    socket = running.node.device_plugin_dir / "kubelet.sock"
    assert wait_until(socket.exists, timeout=30)
    seen = time.monotonic()
    assert wait_until(lambda: all(registrar.registered().values()), timeout=10)
    assert time.monotonic() - seen <= 2.0
    assert running.node.wait_ready(30)
    assert wait_until(lambda: _counts(running.allocatable()) == ("8", "8"), timeout=30)
