"""The demo's last part: a cluster of mixed GPU models, one node cut by MIG.

Beside the demo's H100 node, two more nodes join the same API server
imitation, each with its own daemon behind its own kubelet simulator: an
A100 node and an H100 node under the mixed MIG strategy (half its GPUs cut
into 3g.40gb, 2g.20gb and two 1g.10gb devices). Each daemon labels its own
Node; the extender (over HTTP) filters a pod that chose A100s by
annotation, which is then admitted where the extender sent it; a pod asks
for a 1g.10gb MIG device and an HCA on the MIG node and gets the HCA on its
parent GPU's switch.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devplugin.config import Config, KubernetesConfig, override
from devplugin.extender.app import serve
from devplugin.node.alignment import alignment
from devplugin.node.lifecycle.checkpoint import Checkpoint, LifecycleState
from devplugin.runtime import Daemon, build
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.fake_nvml import FakeNvml
from devplugin.testing.kubelet import ContainerRequest, KubeletSimulator
from devplugin.testing.layouts import dgx_a100, hgx_h100_mig
from devplugin.testing.node import BuiltNode, NodeSpec, build_node
from devplugin.testing.scheduler import call_extender, pending_pod, selector_fits

GPU, HCA = "nvidia.com/gpu", "rdma/hca"
ONE_G = "nvidia.com/mig-1g.10gb"
SHOWN = ("gpu.product", "gpu.count", "gpu.family", "mig.strategy", "mig-1g.10gb.count")


def _node_config(node: BuiltNode, base: Path, kubeconfig: Path, name: str, mig: str) -> Config:
    return override(
        Config(),
        **{
            **node.settings(base),
            "metrics.enabled": False,
            "kubernetes.enabled": True,
            "kubernetes.kubeconfig": str(kubeconfig),
            "kubernetes.node_name": name,
            "kubernetes.record_min_interval_seconds": 0.2,
            "resources.gpu.mig.strategy": mig,
        },
    )


class _Node:
    """One more simulated node: its kubelet simulator and its daemon."""

    def __init__(
        self, base: Path, api: ApiServerImitation, name: str, spec: NodeSpec, mig: str
    ) -> None:
        built = build_node(spec, base / "node")
        kubeconfig = base / "kubeconfig"
        kubeconfig.write_text(json.dumps(api.kubeconfig()))
        api.put("nodes", {"metadata": {"name": name}})
        Checkpoint(base / "checkpoint.json").save(LifecycleState())
        self.name = name
        self.kubelet = KubeletSimulator(
            base / "dp", base / "pr" / "kubelet.sock", seed=3, api=api, node_name=name
        )
        self.kubelet.start()
        config = _node_config(built, base, kubeconfig, name, mig)
        self.daemon: Daemon = build(config, FakeNvml.from_file(built.fixture))
        self.daemon.start()

    def stop(self) -> None:
        self.daemon.stop()
        self.kubelet.stop()


def _labels(api: ApiServerImitation, name: str) -> dict[str, str]:
    found = api.get("nodes", name) or {}
    return dict(found.get("metadata", {}).get("labels") or {})


def _wait(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def models_demo(base: Path, api: ApiServerImitation, out: Callable[[str], None]) -> int:
    """The mixed cluster (the demo's H100 node, named demo-node, is running)."""
    nodes = [
        _Node(base / "a100", api, "a100-node", dgx_a100(), "none"),
        _Node(base / "mig", api, "mig-node", hgx_h100_mig(), "mixed"),
    ]
    kubeconfig = base / "extender-kubeconfig"
    kubeconfig.write_text(json.dumps(api.kubeconfig()))
    kube = KubernetesConfig(enabled=True, kubeconfig=str(kubeconfig))
    extender = serve(kube, ("127.0.0.1", 0), stale_after=60.0)
    names = ["demo-node", "a100-node", "mig-node"]
    try:
        out(
            "A cluster of mixed GPU models: demo-node (H100), a100-node, mig-node (H100, mixed MIG)"
        )
        if not _wait(lambda: all("devplugin.io/gpu.product" in _labels(api, n) for n in names)):
            out("demo failed: the daemons did not label their Nodes")
            return 1
        if not _wait(lambda: set(names) <= set(extender[0].records.items())):
            out("demo failed: the extender did not see every node's record")
            return 1
        out("kubectl get nodes -L " + ",".join(f"devplugin.io/{k}" for k in SHOWN))
        for name in names:
            labels = _labels(api, name)
            shown = "  ".join(labels.get(f"devplugin.io/{k}", "-") for k in SHOWN)
            out(f"  {name:10} {shown}")
        host, port = extender[1].address
        url = f"http://{host}:{port}"
        return _choose_a_model(url, api, nodes[0], names, out) or _mig_pod(nodes[1], out)
    finally:
        extender[1].stop()
        for cache in extender[2]:
            cache.signal_stop()
        for node in nodes:
            node.stop()


def _choose_a_model(
    url: str,
    api: ApiServerImitation,
    a100: _Node,
    names: list[str],
    out: Callable[[str], None],
) -> int:
    pod: dict[str, Any] = pending_pod("a100-trainer", {GPU: 2, HCA: 2})
    pod["metadata"]["annotations"] = {"devplugin.io/gpu-product": "A100"}
    result = call_extender(url, "filter", {"Pod": pod, "NodeNames": names})
    out("pod a100-trainer (2 GPUs + 2 HCAs) annotated devplugin.io/gpu-product: A100")
    out(f"  extender filter passes: {', '.join(result['NodeNames']) or 'none'}")
    for name, why in sorted((result.get("FailedAndUnresolvableNodes") or {}).items()):
        out(f"  {name}: {why}")
    if result["NodeNames"] != [a100.name]:
        out("demo failed: the extender did not keep the pod to the A100 node")
        return 1
    admitted = a100.kubelet.admit("a100-trainer", [ContainerRequest("main", {GPU: 2, HCA: 2})])
    got = admitted.container("main")
    topology = a100.daemon.core.coordinator.topology
    measured = alignment(topology, got.devices[GPU], got.devices[HCA])
    level = measured[0].name if measured is not None else "-"
    out(f"  admitted on {a100.name}: {len(got.devices[GPU])} A100s, worst GPU-to-HCA {level}")
    hopper = {"spec": {"nodeSelector": {"devplugin.io/gpu.family": "hopper"}}}
    fits = [n for n in names if selector_fits(hopper, _labels(api, n), n)]
    out(f"a pod with nodeSelector devplugin.io/gpu.family=hopper fits: {', '.join(fits)}")
    return 0


def _mig_pod(mig: _Node, out: Callable[[str], None]) -> int:
    kubelet = mig.kubelet
    if not kubelet.wait_for_devices(ONE_G, 8) or not kubelet.wait_for_devices(HCA, 8):
        out("demo failed: the MIG node did not register its resources")
        return 1
    served = ", ".join(
        f"{resource} x{len(kubelet.devices(resource))}"
        for resource in (GPU, "nvidia.com/mig-3g.40gb", "nvidia.com/mig-2g.20gb", ONE_G)
    )
    out(f"mig-node serves {served}")
    admitted = kubelet.admit("inference", [ContainerRequest("main", {ONE_G: 1, HCA: 1})])
    got = admitted.container("main")
    (device,) = got.devices[ONE_G]
    (hca,) = got.devices[HCA]
    topology = mig.daemon.core.coordinator.topology
    gpu = next(g for g in mig.daemon.inventory.gpus if g.uuid == device)
    parent = gpu.slice.parent_uuid if gpu.slice is not None else "-"
    out(f"pod inference (1 x mig-1g.10gb + 1 HCA), kubelet order {', '.join(got.order)}")
    out(f"  MIG device {device} of GPU {parent}")
    out(f"  HCA {hca}, on the same switch: {topology.level(device, hca).name}")
    env = got.responses[ONE_G].envs
    out(f"  env NVIDIA_VISIBLE_DEVICES={env.get('NVIDIA_VISIBLE_DEVICES', '')}")
    return 0
