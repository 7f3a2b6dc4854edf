"""Draw docs/node-hgx-h100.svg and .png: the picture `devplugin topo --node`
gives of a simulated hgx-h100 node whose daemon holds two pods (4 GPUs +
4 HCAs, and 1 + 1) and has one HCA port down, read from the record the
daemon published to the API server imitation.

    .venv/bin/python scripts/node_picture.py   # needs Graphviz's dot
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from devplugin.config import Config, KubernetesConfig, override
from devplugin.drawing import from_api, render
from devplugin.picture import dot, picture
from devplugin.runtime import build
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.fake_nvml import FakeNvml
from devplugin.testing.kubelet import ContainerRequest, KubeletSimulator
from devplugin.testing.node import build_node, hgx_node

GPU, HCA = "nvidia.com/gpu", "rdma/hca"
NODE = "hgx-h100-0"
DOCS = Path(__file__).resolve().parent.parent / "docs"


def _published(api: ApiServerImitation, allocations: int) -> bool:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        status = (api.get("nodedevices", NODE) or {}).get("status") or {}
        summary = status.get("summary") or {}
        if len(status.get("allocations", [])) == allocations and summary.get("unhealthy") == 1:
            return True
        time.sleep(0.05)
    return False


def main() -> int:
    base = Path(tempfile.mkdtemp(prefix="dppic-"))
    node = build_node(hgx_node(), base / "node")
    api = ApiServerImitation()
    api.start()
    kubeconfig = base / "kubeconfig"
    kubeconfig.write_text(json.dumps(api.kubeconfig()))
    api.put("nodes", {"metadata": {"name": NODE}})
    kubelet = KubeletSimulator(base / "dp", base / "pr" / "kubelet.sock", api=api, node_name=NODE)
    kubelet.start()
    config = override(
        Config(),
        **node.settings(base),
        **{
            "metrics.addresses": [],
            "kubernetes.enabled": True,
            "kubernetes.kubeconfig": str(kubeconfig),
            "kubernetes.node_name": NODE,
            "kubernetes.record_min_interval_seconds": 0.2,
        },
    )
    daemon = build(config, FakeNvml.from_file(node.fixture))
    daemon.start()
    try:
        kubelet.wait_for_devices(GPU, 8, timeout=10)
        kubelet.wait_for_devices(HCA, 8, timeout=10)
        kubelet.admit("llm-0", [ContainerRequest("main", {GPU: 4, HCA: 4})], namespace="training")
        kubelet.admit("chat-7", [ContainerRequest("server", {GPU: 1, HCA: 1})],
                      namespace="inference")  # fmt: skip
        hca = node.hcas[7]
        (hca.directory / "infiniband" / hca.name / "ports" / "1" / "state").write_text("1: DOWN\n")
        if not _published(api, 2):
            print("the record did not show both pods and the port in time", file=sys.stderr)
            return 1
        name, status = from_api(KubernetesConfig(enabled=True, kubeconfig=str(kubeconfig)), NODE)
        source = dot(picture(name, status))
        for fmt in ("svg", "png"):
            (DOCS / f"node-hgx-h100.{fmt}").write_bytes(render(source, fmt))
    finally:
        daemon.stop()
        kubelet.stop()
        api.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
