"""What the cluster tier's extender tests share: the extender run as the
chart's Deployment runs it, and the chart's second-scheduler configuration
pointed at it."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from devplugin.testing.cluster import SimCluster
from devplugin.testing.controlplane import ControlPlane, kubeconfig
from devplugin.testing.extender_proc import free_port, ready
from devplugin.testing.layouts import LAYOUTS
from devplugin.testing.node import devices_from_spec
from devplugin.testing.promtext import total
from devplugin.testing.proxy import SilentProxy
from tests.real_cluster.conftest import NAMESPACE, RELEASE
from tests.real_cluster.nodes import GPU, HCA, add_node, eventually, node_token
from tests.real_cluster.stand_ins import Kubelets

SCHEDULER_NAME = "devplugin-scheduler"


def account_token(plane: ControlPlane, namespace: str, account: str) -> str:
    request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
               "spec": {"audiences": ["https://kubernetes.default.svc"],
                        "expirationSeconds": 7200}}  # fmt: skip
    answer = plane.request(
        "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token", request
    )
    return str(answer["status"]["token"])


@contextlib.contextmanager
def chart_extender(
    plane: ControlPlane,
    base: Path,
    namespace: str = NAMESPACE,
    release: str = RELEASE,
    *,
    server: str | None = None,
) -> Iterator[str]:
    """The extender as the chart's Deployment runs it (its arguments), on a
    local port, with its service account's token; its URL once ready.
    `server`: the API server's address as the extender reaches it (a proxy)."""
    deployment = plane.request(
        "GET", f"/apis/apps/v1/namespaces/{namespace}/deployments/{release}-devplugin-extender"
    )
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    port = free_port()
    args = [a for a in container["args"] if not a.startswith("--listen=")]
    token = account_token(plane, namespace, f"{release}-devplugin-extender")
    config = base / "extender.kubeconfig"
    reach = server or plane.server
    config.write_text(yaml.safe_dump(kubeconfig(reach, plane.pki.ca, token=token)))
    command = [sys.executable, "-m", "devplugin", *args, f"--listen=127.0.0.1:{port}",
               "--kubeconfig", str(config)]  # fmt: skip
    with (base / "extender.log").open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            if not eventually(lambda: ready(url) or process.poll() is not None, timeout=30):
                raise RuntimeError("the extender did not become ready")
            if process.poll() is not None:
                raise RuntimeError((base / "extender.log").read_text()[-2000:])
            yield url
        finally:
            process.terminate()
            process.wait(10)


def chart_scheduler_config(
    plane: ControlPlane, extender_url: str, namespace: str = NAMESPACE, release: str = RELEASE
) -> dict[str, Any]:
    """The second scheduler's configuration as the chart installed it, its
    extender entries pointed at the extender process here."""
    found = plane.request(
        "GET", f"/api/v1/namespaces/{namespace}/configmaps/{release}-devplugin-scheduler"
    )
    config: dict[str, Any] = yaml.safe_load(found["data"]["scheduler-config.yaml"])
    for entry in config["extenders"]:
        suffix = entry["urlPrefix"].split("/scheduler", 1)[1]
        entry["urlPrefix"] = f"{extender_url}/scheduler{suffix}"
    return config


def extender_metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
        return str(answer.read().decode())


def verb_calls(url: str, verb: str, result: str | None = None) -> int:
    """How many times the extender at `url` answered `verb` (every result,
    or only `result`), from its own request counter."""
    labels = {"verb": verb} if result is None else {"verb": verb, "result": result}
    return int(total(extender_metrics(url), "devplugin_extender_requests_total", labels))


def preempt_answers(url: str, outcome: str) -> int:
    """The extender's preempt answers of one outcome (victims, untold, none, waiting)."""
    text = extender_metrics(url)
    return int(total(text, "devplugin_extender_preempt_answers_total", {"outcome": outcome}))


@dataclass
class ChartNodes:
    """HGX nodes with their daemons and kubelet stand-ins, the extender as the
    chart runs it, and the real scheduler with the chart's profile."""

    nodes: dict[str, SimCluster]
    kubelets: Kubelets
    url: str
    config: dict[str, Any]


def chart_nodes(
    plane: ControlPlane, stack: ExitStack, prefix: str, count: int, lag: float = 0.0
) -> ChartNodes:
    """`count` nodes named `prefix`-N, everything stopped by `stack`. With
    `lag`, the extender hears the API server that late; the scheduler does
    not (the window where its watches trail the scheduler's decisions)."""
    gpus, hcas = devices_from_spec(LAYOUTS["hgx-h100"]())
    nodes: dict[str, SimCluster] = {}
    for index in range(count):
        name = f"{prefix}-{index}"
        add_node(plane, name, {GPU: len(gpus), HCA: len(hcas)})
        token = node_token(plane, NAMESPACE, f"{RELEASE}-devplugin", name)
        sim = SimCluster(
            LAYOUTS["hgx-h100"](),
            node_name=name,
            settings={"kubernetes.lease_namespace": NAMESPACE},
            kubeconfig=kubeconfig(plane.server, plane.pki.ca, token=token),
        )
        nodes[name] = stack.enter_context(sim)
    kubelets = stack.enter_context(Kubelets(plane, nodes))
    base = Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir=plane.folder))
    server = None
    if lag:
        proxy = SilentProxy(("127.0.0.1", plane.port), lag=lag)
        proxy.start()
        stack.callback(proxy.stop)
        server = "https://{}:{}".format(*proxy.address)
    url = stack.enter_context(chart_extender(plane, base, server=server))
    config = chart_scheduler_config(plane, url)
    plane.start_scheduler(config)
    stack.callback(plane.stop_scheduler)
    return ChartNodes(nodes, kubelets, url, config)
