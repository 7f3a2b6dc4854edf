"""Kubernetes access settings and the client, against the API server imitation."""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from devplugin.cli import main
from devplugin.cluster.client import make_client
from devplugin.cluster.pods import RawPod
from devplugin.config import ConfigError, KubernetesConfig, node_name, parse_config
from devplugin.logs import setup_logging
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.node import build_node, hgx_node
from tests.conftest import Cluster

Start = Callable[..., Cluster]


def test_the_kubernetes_section_parses_and_rejects_unknown_keys() -> None:
    config = parse_config(
        {
            "version": "v1",
            "kubernetes": {"enabled": True, "node_name": "n1", "pod_wait_seconds": 0.05},
        }
    )
    assert config.kubernetes.enabled
    assert node_name(config) == "n1"
    with pytest.raises(ConfigError, match=r"kubernetes\.watch: unknown key"):
        parse_config({"version": "v1", "kubernetes": {"watch": True}})


def test_the_node_name_comes_from_the_environment_when_not_configured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NODE_NAME", "from-downward-api")
    assert node_name(parse_config({"version": "v1"})) == "from-downward-api"


def run_config(tmp_path: Path, **kubernetes: object) -> Path:
    node = build_node(hgx_node(), tmp_path / "node")
    path = tmp_path / "devplugin.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "version": "v1",
                "paths": {"sysfs_root": str(node.sysfs_root), "dev_root": str(node.dev_root)},
                "nvml": {"fixture": str(node.fixture)},
                "kubernetes": {"enabled": True, **kubernetes},
            }
        )
    )
    return path


def test_api_access_without_a_node_name_is_a_configuration_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    assert main(["run", "--config", str(run_config(tmp_path))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "devplugin: config error: kubernetes.node_name: required when kubernetes.enabled "
        "(or set NODE_NAME)"
    ]


def test_a_missing_kubeconfig_is_a_configuration_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = run_config(tmp_path)
    missing = tmp_path / "nope.yaml"
    argv = ["run", "--config", str(config), "--node-name", "n1", "--kubeconfig", str(missing)]
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == f"devplugin: config error: kubernetes.kubeconfig: {missing} is not a file"


def test_a_client_from_a_kubeconfig_reaches_the_cluster(
    api: ApiServerImitation, tmp_path: Path
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(api.kubeconfig()))
    api.put("pods", {"metadata": {"name": "a", "namespace": "default"},
                     "spec": {"nodeName": "n1", "containers": []}})  # fmt: skip
    client = make_client(KubernetesConfig(enabled=True, kubeconfig=str(kubeconfig)))
    assert client is not None
    assert [pod.metadata.name for pod in client.list(RawPod, namespace="*")] == ["a"]
    client.close()


@pytest.mark.parametrize(
    ("server", "unverified"), [("http://127.0.0.1:1", True), ("https://127.0.0.1:1", False)]
)
def test_only_a_plain_http_server_goes_without_certificate_checks(
    tmp_path: Path, server: str, unverified: bool
) -> None:
    # Over http no certificate exists to check; over https nothing is relaxed.
    kubeconfig = tmp_path / "kubeconfig"
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
    }
    kubeconfig.write_text(yaml.safe_dump(config))
    client = make_client(KubernetesConfig(enabled=True, kubeconfig=str(kubeconfig)))
    assert client is not None
    assert client.config.cluster.server == server
    assert client.config.cluster.insecure is unverified
    client.close()


def test_outside_a_pod_without_a_kubeconfig_there_is_no_client_and_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="devplugin.cluster.client"):
        assert make_client(KubernetesConfig(enabled=True)) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert lines[0].startswith("no Kubernetes API access (the pod's service account")


def test_the_daemon_keeps_a_cache_of_its_nodes_pods(
    start_cluster: Start, api: ApiServerImitation, tmp_path: Path
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(api.kubeconfig()))
    api.put("pods", {"metadata": {"name": "early", "namespace": "default"},
                     "spec": {"nodeName": "n1", "containers": []}})  # fmt: skip
    cluster = start_cluster(
        hgx_node(),
        **{
            "kubernetes.enabled": True,
            "kubernetes.kubeconfig": str(kubeconfig),
            "kubernetes.node_name": "n1",
        },
    )
    pods = cluster.daemon.pods
    assert pods is not None
    assert pods.synced.wait(5)
    api.put("pods", {"metadata": {"name": "late", "namespace": "default"},
                     "spec": {"nodeName": "n1", "containers": []}})  # fmt: skip
    assert pods.wait_for(lambda found: {p.name for p in found.values()} == {"early", "late"}, 5)


def test_without_api_access_the_daemon_serves_as_before(start_cluster: Start) -> None:
    cluster = start_cluster(
        hgx_node(), **{"kubernetes.enabled": True, "kubernetes.node_name": "n1"}
    )
    assert cluster.daemon.pods is None
    assert len(cluster.kubelet.devices("nvidia.com/gpu")) == 8


@pytest.mark.parametrize(("level", "shown"), [("info", False), ("debug", True)])
def test_the_http_clients_request_lines_show_only_when_debugging(
    api: ApiServerImitation, tmp_path: Path, level: str, shown: bool
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(api.kubeconfig()))
    stream = io.StringIO()
    root = logging.getLogger()
    handlers, root_level = list(root.handlers), root.level
    setup_logging("text", level, stream)
    try:
        client = make_client(KubernetesConfig(enabled=True, kubeconfig=str(kubeconfig)))
        assert client is not None
        list(client.list(RawPod, namespace="*"))
        client.close()
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(root_level)
    assert ("HTTP Request: GET" in stream.getvalue()) is shown
