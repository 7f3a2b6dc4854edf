"""A node served through DRA for the tests: the API imitation, the kubelet's
DRA side and a daemon with both resources on `api: dra`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from devplugin.node.lifecycle.checkpoint import Checkpoint, LifecycleState
from devplugin.runtime import Daemon, build
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.dra_kubelet import ClaimCall, DraKubeletSimulator
from devplugin.testing.dra_scheduler import put_claim
from devplugin.testing.fake_nvml import FakeNvml
from devplugin.testing.node import BuiltNode, NodeSpec, build_node
from tests.conftest import fast_config

DRIVER = "devplugin.io"
NODE = "node-1"


@dataclass
class DraCluster:
    node: BuiltNode
    api: ApiServerImitation
    kubelet: DraKubeletSimulator
    daemon: Daemon
    nvml: FakeNvml
    cdi_dir: Path
    plugins_dir: Path
    registry_dir: Path
    checkpoint: Path
    driver: str = DRIVER

    def slices(self) -> list[dict[str, Any]]:
        return [
            item
            for item in self.api.items("resourceslices")
            if item["spec"].get("nodeName") == NODE and item["spec"].get("driver") == self.driver
        ]

    def devices(self) -> dict[str, dict[str, Any]]:
        """Slice device name -> entry, over every slice of the pool."""
        return {d["name"]: d for item in self.slices() for d in item["spec"]["devices"]}

    def attribute(self, device: str, name: str) -> Any:
        value = self.devices()[device]["attributes"].get(name)
        return next(iter(value.values())) if value else None

    def claim(
        self, name: str, results: list[tuple[str, str]], namespace: str = "default"
    ) -> ClaimCall:
        """An allocated ResourceClaim: (request, device) results in this pool."""
        requests = [
            {"name": r.split("/")[0], "exactly": {"deviceClassName": "x"}}
            for r in dict.fromkeys(request for request, _ in results)
        ]
        chosen = [
            {"request": request, "driver": self.driver, "pool": NODE, "device": device}
            for request, device in results
        ]
        created = put_claim(
            self.api, name, {"devices": {"requests": requests}}, namespace=namespace, results=chosen
        )
        return ClaimCall(namespace, created["metadata"]["uid"], name)

    def prepare(self, *claims: ClaimCall) -> dict[str, Any]:
        return dict(self.kubelet.prepare(self.driver, claims))

    def unprepare(self, *claims: ClaimCall) -> dict[str, str]:
        return dict(self.kubelet.unprepare(self.driver, claims))


def dra_settings(sock_dir: Path, tmp: Path, kubeconfig: Path, checkpoint: Path) -> dict[str, Any]:
    return {
        "kubernetes.enabled": True,
        "kubernetes.kubeconfig": str(kubeconfig),
        "kubernetes.node_name": NODE,
        "resources.gpu.api": "dra",
        "resources.hca.api": "dra",
        "paths.kubelet_plugins_dir": str(sock_dir / "plugins"),
        "paths.kubelet_registry_dir": str(sock_dir / "registry"),
        "cdi.spec_dirs": [str(tmp / "etc-cdi"), str(tmp / "run-cdi")],
        "lifecycle.checkpoint_file": str(checkpoint),
        "kubelet.watch_interval_seconds": 0.05,
    }


@pytest.fixture
def start_dra(
    tmp_path: Path, sock_dir: Path, api: ApiServerImitation
) -> Iterator[Callable[..., DraCluster]]:
    started: list[tuple[Daemon, DraKubeletSimulator]] = []

    def start(
        spec: NodeSpec,
        *,
        known_clean: bool = True,
        on_built: Callable[[BuiltNode], None] | None = None,
        **config: Any,
    ) -> DraCluster:
        tag = str(len(started))
        node = build_node(spec, tmp_path / f"node{tag}")
        if on_built is not None:
            on_built(node)
        api.put("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        kubeconfig = tmp_path / f"kubeconfig{tag}"
        kubeconfig.write_text(yaml.safe_dump(api.kubeconfig()))
        checkpoint = tmp_path / f"state{tag}" / "checkpoint.json"
        settings = {
            **dra_settings(sock_dir, tmp_path, kubeconfig, checkpoint), **config,
        }  # fmt: skip
        if known_clean:
            Checkpoint(checkpoint).save(LifecycleState())
        kubelet = DraKubeletSimulator(sock_dir / "registry", node=NODE, api=api)
        kubelet.start()
        lib = FakeNvml.from_file(node.fixture)
        daemon = build(
            fast_config(node, sock_dir / "dp", sock_dir / "pr" / "kubelet.sock", **settings), lib
        )
        daemon.start()
        started.append((daemon, kubelet))
        driver = str(settings.get("dra.driver", DRIVER))
        cdi_dir = Path(settings["cdi.spec_dirs"][-1])
        cluster = DraCluster(
            node,
            api,
            kubelet,
            daemon,
            lib,
            cdi_dir,
            sock_dir / "plugins",
            sock_dir / "registry",
            checkpoint,
            driver,
        )
        assert kubelet.wait_for(lambda: kubelet.registered(driver), timeout=10)
        return cluster

    yield start
    for daemon, kubelet in started:
        daemon.stop()
        kubelet.stop()


def published(cluster: DraCluster, count: int) -> bool:
    return len(cluster.devices()) == count and all(
        "taints" not in d for d in cluster.devices().values()
    )


def pix_pair(cluster: DraCluster) -> tuple[str, str]:
    """A GPU and an HCA under one switch, by their slice attributes."""
    devices = cluster.devices()
    for gpu in sorted(n for n in devices if n.startswith("gpu-")):
        for hca in sorted(n for n in devices if n.startswith("hca-")):
            if cluster.attribute(gpu, "pcieSwitch") == cluster.attribute(hca, "pcieSwitch"):
                return gpu, hca
    raise AssertionError("no PIX pair published")
