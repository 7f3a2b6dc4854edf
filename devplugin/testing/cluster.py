"""A simulated node, its kubelet and a running daemon, as one context manager."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from devplugin.config import Config, override
from devplugin.runtime import Daemon, build
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.fake_nvml import FakeNvml
from devplugin.testing.kubelet import KubeletSimulator
from devplugin.testing.node import BuiltNode, NodeSpec, build_node

GPU = "nvidia.com/gpu"
HCA = "rdma/hca"


class RunningNode:
    """What a started simulated node holds: a base directory, a kubelet
    simulator and a daemon; closing stops both and removes the directory,
    whatever part started."""

    base: Path

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        daemon = getattr(self, "daemon", None)
        if daemon is not None:
            daemon.stop()
        kubelet = getattr(self, "kubelet", None)
        if kubelet is not None:
            kubelet.stop()
        shutil.rmtree(self.base, ignore_errors=True)


class SimCluster(RunningNode):
    """Builds `spec` under a short temporary directory (unix socket paths are
    limited to 107 bytes), starts the kubelet simulator and the daemon, and
    waits until both resources are registered with every device listed."""

    def __init__(
        self,
        spec: NodeSpec,
        *,
        settings: dict[str, Any] | None = None,
        seed: int = 1,
        workdir: Path | None = None,
        api: ApiServerImitation | None = None,
        node_name: str = "node-1",
        kubeconfig: dict[str, Any] | None = None,
    ) -> None:
        self.spec = spec
        self.api = api
        # A real API server's kubeconfig, where `api` is None.
        self.kubeconfig = kubeconfig
        self.node_name = node_name
        self.settings = settings or {}
        self.seed = seed
        self.workdir = workdir
        self.base = Path()
        self.node: BuiltNode
        self.kubelet: KubeletSimulator
        self.nvml: FakeNvml
        self.daemon: Daemon

    def __enter__(self) -> SimCluster:
        self.base = Path(tempfile.mkdtemp(prefix="dpsim-", dir=self.workdir or "/tmp"))
        try:
            self.node = build_node(self.spec, self.base / "node")
            plugin_dir = self.base / "dp"
            pod_resources = self.base / "pr" / "kubelet.sock"
            self.kubelet = KubeletSimulator(
                plugin_dir, pod_resources, seed=self.seed, api=self.api, node_name=self.node_name
            )
            self.kubelet.start()
            cluster_settings: dict[str, Any] = {}
            config_of = self.api.kubeconfig() if self.api is not None else self.kubeconfig
            if config_of is not None:
                kubeconfig = self.base / "kubeconfig"
                kubeconfig.write_text(yaml.safe_dump(config_of))
                cluster_settings = {
                    "kubernetes.enabled": True,
                    "kubernetes.kubeconfig": str(kubeconfig),
                    "kubernetes.node_name": self.node_name,
                }
            config = override(
                Config(),
                **{
                    "paths.sysfs_root": str(self.node.sysfs_root),
                    "paths.dev_root": str(self.node.dev_root),
                    "paths.device_plugin_dir": str(plugin_dir),
                    "paths.pod_resources_socket": str(pod_resources),
                    "nvml.fixture": str(self.node.fixture),
                    "lifecycle.checkpoint_file": str(self.base / "checkpoint.json"),
                    "metrics.addresses": ["127.0.0.1:0"],
                    **cluster_settings,
                    **self.settings,
                },
            )
            # Kept: a test injects NVML's events (an XID) into what the daemon reads.
            self.nvml = FakeNvml.from_file(self.node.fixture)
            self.daemon = build(config, self.nvml)
            self.daemon.start()
            ready = self.kubelet.wait_for_devices(
                GPU, len(self.node.gpus), timeout=10
            ) and self.kubelet.wait_for_devices(HCA, len(self.node.hcas), timeout=10)
            if not ready:
                raise RuntimeError("the daemon did not register both resources in time")
        except BaseException:
            self.close()
            raise
        return self
