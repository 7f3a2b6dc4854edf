"""A simulated node serving both kinds through DRA: its DRA kubelet
simulator and a running daemon, as one context manager."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import yaml

from devplugin.config import Config, override
from devplugin.node.lifecycle.checkpoint import Checkpoint, LifecycleState
from devplugin.runtime import Daemon, build
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.cluster import RunningNode
from devplugin.testing.dra_kubelet import DraKubeletSimulator
from devplugin.testing.fake_nvml import FakeNvml
from devplugin.testing.node import BuiltNode, NodeSpec, build_node


class DraSimNode(RunningNode):
    """Builds `spec` under a short temporary directory, registers a Node
    object, starts the DRA kubelet simulator and the daemon (both resources
    on `api: dra`, driver `driver`, pool = the node's name) and waits until
    the driver is registered and its slices list every device."""

    def __init__(
        self,
        spec: NodeSpec,
        api: ApiServerImitation | None,
        *,
        kubeconfig: dict[str, Any] | None = None,
        node_name: str,
        driver: str = "devplugin.io",
        settings: dict[str, Any] | None = None,
        workdir: Path | None = None,
    ) -> None:
        self.spec = spec
        self.api = api
        # A real API server's kubeconfig, where `api` is None: the Node is
        # then the caller's to make, and slices are read back through it.
        self.kubeconfig = kubeconfig
        self.node_name = node_name
        self.driver = driver
        self.settings = settings or {}
        self.workdir = workdir
        self.base = Path()
        self.node: BuiltNode
        self.kubelet: DraKubeletSimulator
        self.daemon: Daemon

    def __enter__(self) -> DraSimNode:
        self.base = Path(tempfile.mkdtemp(prefix="dpdra-", dir=self.workdir or "/tmp"))
        try:
            self.node = build_node(self.spec, self.base / "node")
            if self.api is not None:
                node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.node_name}}
                self.api.put("nodes", node)
            kubeconfig = self.base / "kubeconfig"
            config_of = self.api.kubeconfig() if self.api is not None else self.kubeconfig
            kubeconfig.write_text(yaml.safe_dump(config_of))
            checkpoint = self.base / "state" / "checkpoint.json"
            # A node known to be clean: no cleanup owed before its devices are offered.
            Checkpoint(checkpoint).save(LifecycleState())
            sockets = self.base / "s"
            self.kubelet = DraKubeletSimulator(
                sockets / "registry", node=self.node_name, api=self.api
            )
            self.kubelet.start()
            config = override(
                Config(),
                **{
                    "paths.sysfs_root": str(self.node.sysfs_root),
                    "paths.dev_root": str(self.node.dev_root),
                    "paths.device_plugin_dir": str(sockets / "dp"),
                    "paths.pod_resources_socket": str(sockets / "pr" / "kubelet.sock"),
                    "paths.kubelet_plugins_dir": str(sockets / "plugins"),
                    "paths.kubelet_registry_dir": str(sockets / "registry"),
                    "nvml.fixture": str(self.node.fixture),
                    "lifecycle.checkpoint_file": str(checkpoint),
                    "metrics.addresses": ["127.0.0.1:0"],
                    "kubernetes.enabled": True,
                    "kubernetes.kubeconfig": str(kubeconfig),
                    "kubernetes.node_name": self.node_name,
                    "resources.gpu.api": "dra",
                    "resources.hca.api": "dra",
                    "dra.driver": self.driver,
                    "cdi.spec_dirs": [str(self.base / "etc-cdi"), str(self.base / "run-cdi")],
                    **self.settings,
                },
            )
            self.daemon = build(config, FakeNvml.from_file(self.node.fixture))
            self.daemon.start()
            every = len(self.node.gpus) + len(self.node.hcas)
            ready = self.kubelet.wait_for(lambda: self.kubelet.registered(self.driver), timeout=10)
            if self.api is not None:
                ready = ready and self.kubelet.wait_for(
                    lambda: len(self.devices()) == every, timeout=20
                )
            if not ready:
                raise RuntimeError("the DRA driver did not register and publish in time")
        except BaseException:
            self.close()
            raise
        return self

    def slices(self) -> list[dict[str, Any]]:
        if self.api is None:
            raise RuntimeError("read a real API server's slices through it")
        return [
            item
            for item in self.api.items("resourceslices")
            if item["spec"].get("nodeName") == self.node_name
            and item["spec"].get("driver") == self.driver
        ]

    def devices(self) -> dict[str, dict[str, Any]]:
        """Slice device name -> entry, untainted ones only."""
        return {
            d["name"]: d
            for item in self.slices()
            for d in item["spec"]["devices"]
            if not d.get("taints")
        }
