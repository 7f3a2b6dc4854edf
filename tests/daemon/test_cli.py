"""The command line: the daemon as a process, discovery output, errors, the demo."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from devplugin.cli import build_parser, main, resolve_config
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.demo import run_demo
from devplugin.testing.kubelet import ContainerRequest, KubeletSimulator
from devplugin.testing.node import BuiltNode, build_node, hgx_node
from tests.conftest import GPU, HCA
from tests.waiting import wait_until


@pytest.fixture
def node(tmp_path: Path) -> BuiltNode:
    return build_node(hgx_node(), tmp_path / "node")


def source_flags(node: BuiltNode) -> list[str]:
    return [
        "--sysfs-root",
        str(node.sysfs_root),
        "--dev-root",
        str(node.dev_root),
        "--nvml-fixture",
        str(node.fixture),
    ]


def spawn(args: list[str]) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "devplugin", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_daemon_process_serves_then_exits_zero_on_signal_removing_sockets(
    node: BuiltNode, sock_dir: Path, signum: signal.Signals
) -> None:
    plugin_dir = sock_dir / "dp"
    kubelet = KubeletSimulator(plugin_dir)
    kubelet.start()
    process = spawn(
        [
            "run",
            *source_flags(node),
            "--device-plugin-dir",
            str(plugin_dir),
            "--log-format",
            "json",
            "--checkpoint-file",
            str(sock_dir / "checkpoint.json"),
            "--metrics-address",
            "127.0.0.1:0",
        ]
    )
    try:
        assert kubelet.wait_for_devices(GPU, 8, timeout=20)
        assert kubelet.wait_for_devices(HCA, 8, timeout=20)
        assert sorted(p.name for p in plugin_dir.glob("devplugin-*.sock")) == [
            "devplugin-nvidia.com-gpu.sock",
            "devplugin-rdma-hca.sock",
        ]
        process.send_signal(signum)
        output, _ = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
        kubelet.stop()
    assert process.returncode == 0, output
    assert not list(plugin_dir.glob("devplugin-*.sock"))
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert any(entry["msg"].startswith("received SIG") for entry in lines)
    assert any("registered with the kubelet" in entry["msg"] for entry in lines)


def test_bad_config_exits_two_with_one_line_naming_the_field(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("version: v1\nresources:\n  hca:\n    nmae: rdma/x\n")
    result = subprocess.run(
        [sys.executable, "-m", "devplugin", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "devplugin: config error: resources.hca.nmae: unknown key"
    ]


def test_bad_fixture_exits_two_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fixture = tmp_path / "f.json"
    fixture.write_text(json.dumps({"driver_version": "1", "cuda_driver_version": 1, "gpus": [{}]}))
    assert main(["discover", "--nvml-fixture", str(fixture)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("devplugin: config error: nvml.fixture: ")
    assert "gpus[0]." in err
    assert "\n" not in err


def test_flag_overrides_bad_value_exits_two(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["topo", "--sysfs-root", "relative/sys"]) == 2
    assert capsys.readouterr().err.strip() == (
        "devplugin: config error: paths.sysfs_root: must be an absolute path, got 'relative/sys'"
    )


def test_kubelet_directory_flags_set_the_dra_paths() -> None:
    args = build_parser().parse_args(
        ["run", "--kubelet-plugins-dir", "/k/plugins", "--kubelet-registry-dir", "/k/registry"]
    )
    config = resolve_config(args)
    assert config.paths.kubelet_plugins_dir == "/k/plugins"
    assert config.paths.kubelet_registry_dir == "/k/registry"


def test_relative_kubelet_plugins_dir_exits_two(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--kubelet-plugins-dir", "plugins"]) == 2
    assert capsys.readouterr().err.strip() == (
        "devplugin: config error: paths.kubelet_plugins_dir: must be an absolute path, "
        "got 'plugins'"
    )


def test_a_socket_directory_too_long_to_bind_in_exits_two_naming_the_field(
    node: BuiltNode, capsys: pytest.CaptureFixture[str]
) -> None:
    # 80 bytes of directory leave no room for "/devplugin-nvidia.com-gpu.sock"
    # plus the server's hidden name within the kernel's 107.
    deep = "/tmp/" + "d" * 75
    assert main(["run", "--device-plugin-dir", deep, *source_flags(node)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("devplugin: config error: paths.device_plugin_dir: unix socket path ")
    assert "\n" not in err
    assert not Path(deep).exists(), "refused before anything was created"


def test_a_registry_directory_too_long_to_bind_in_exits_two_naming_the_field(
    node: BuiltNode, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    config = tmp_path / "c.yaml"
    config.write_text(
        "version: v1\nresources:\n  hca:\n    api: dra\n"
        f"kubernetes:\n  enabled: true\n  kubeconfig: {kubeconfig}\n  node_name: n1\n"
    )
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:9"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "users": [{"name": "u", "user": {}}],
            }
        )
    )
    deep = "/tmp/" + "r" * 84
    flags = ["--config", str(config), "--kubelet-registry-dir", deep]
    assert main(["run", *flags, *source_flags(node)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("devplugin: config error: paths.kubelet_registry_dir: unix socket path ")
    assert "\n" not in err


def test_discover_json(node: BuiltNode, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["discover", "--json", *source_flags(node)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["nvml"]["ok"] is True
    assert [gpu["uuid"] for gpu in data["gpus"]] == [gpu.uuid for gpu in node.gpus]
    assert [hca["id"] for hca in data["hcas"]] == [hca.device_id for hca in node.hcas]
    first = data["hcas"][0]
    assert first["name"] == "mlx5_0"
    assert first["health"] == "Healthy"
    assert first["ports"][0]["state"] == "4: ACTIVE"
    assert first["pci"]["numa_node"] == 0
    assert [n["path"] for n in first["char_devices"]] == [
        "/dev/infiniband/uverbs0",
        "/dev/infiniband/umad0",
        "/dev/infiniband/issm0",
        "/dev/infiniband/rdma_cm",
    ]


def test_discover_text_and_topo(node: BuiltNode, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["discover", *source_flags(node)]) == 0
    text = capsys.readouterr().out
    assert "NVML: driver 550.54.15" in text
    assert "HCAs: 8" in text
    assert main(["topo", *source_flags(node)]) == 0
    topo = capsys.readouterr().out.splitlines()
    assert topo[0].split()[:3] == ["GPU0", "GPU1", "GPU2"]
    assert topo[1].split()[:3] == ["GPU0", "X", "NV18"]


def test_demo_runs_the_main_job_and_cleans_up(sock_dir: Path) -> None:
    lines: list[str] = []
    assert run_demo(lines.append, workdir=sock_dir) == 0
    text = "\n".join(lines)
    for pod in ("trainer-a", "notebook", "rdma-probe", "trainer-b"):
        assert f"pod default/{pod}" in text
    assert "kubelet sees nvidia.com/gpu: 8 devices, 8 healthy" in text
    assert "NCCL_IB_HCA==" in text
    assert "re-registered" in text
    # CDI names for both kinds, and what a runtime resolves them to.
    assert "cdi    nvidia.com/gpu=" in text
    assert "cdi    devplugin.io/hca=mlx5_" in text
    assert "a CDI runtime resolves trainer-b/main's 8 names to:" in text
    assert "device /dev/infiniband/rdma_cm 10:58" in text
    # The cluster's view: the node's record and an event per pod.
    assert "kubectl get nodedevices" in text
    assert "demo-node" in text
    assert "trainer-b: Aligned: 4 GPUs + 4 HCAs, worst GPU-HCA level PIX" in text
    assert "trainer-a: Aligned: 2 GPUs + 1 HCA, worst GPU-HCA level NODE" in text
    # trainer-b (4 GPUs + 4 HCAs, HCAs asked first) stays on one socket of the
    # NVSwitch node: GPUs 0-3 are NUMA 0, 4-7 NUMA 1.
    block = text.split("pod default/trainer-b", 1)[1]
    gpu_line = next(line for line in block.splitlines() if "nvidia.com/gpu:" in line)
    indexes = {int(uuid.split("-")[1]) for uuid in gpu_line.split(":", 1)[1].split(",")}
    assert len(indexes) == 4
    assert {i // 4 for i in indexes} in ({0}, {1})
    # The DRA flow: registered, slices published, the 2-pair template's
    # claim allocated at PIX, prepared, its CDI ids resolved, unprepared.
    dra = text.split("DRA: node dra-node", 1)[1]
    assert "services v1.DRAPlugin, v1beta1.DRAPlugin, v1alpha1.DRAResourceHealth" in dra
    assert "pool dra-node generation 1, 16 devices" in dra
    assert "from the chart's template 2-pairs" in dra
    assert dra.count("allocated gpu-") == 2
    assert "pair 0: " in dra
    assert dra.count(" at PIX") == 2
    assert dra.count(": k8s.devplugin.io/claim=") == 5  # 4 devices, then the whole claim's
    assert "for the whole claim: k8s.devplugin.io/claim=" in dra
    whole, one = dra.split("a container naming the whole claim gets", 1)[1].split(
        "a container naming request hca-0 gets", 1
    )
    assert whole.count(",mlx5_") == 1  # NCCL_IB_HCA names both HCAs
    assert "env NVIDIA_VISIBLE_DEVICES=GPU-" in whole
    assert "env NCCL_IB_HCA==mlx5_" in one
    assert "NVIDIA_VISIBLE_DEVICES" not in one.split("NodeUnprepareResources", 1)[0]
    assert "NodeUnprepareResources: done; the claim's CDI spec removed: True" in dra
    # The mixed cluster: labels by model, a pod kept to the model it chose,
    # and a MIG device paired with the HCA on its parent's switch.
    models = text.split("A cluster of mixed GPU models", 1)[1]
    assert "a100-node  NVIDIA-A100-SXM4-80GB  8  ampere" in models
    assert "mig-node   NVIDIA-H100-80GB-HBM3  8  hopper  mixed  8" in models
    assert "extender filter passes: a100-node\n" in models
    assert "mig-node: devplugin.io/gpu-product: the node's GPUs are NVIDIA-H100" in models
    assert "admitted on a100-node: 2 A100s, worst GPU-to-HCA PIX" in models
    assert "nvidia.com/mig-1g.10gb x8" in models
    assert "on the same switch: PIX" in models
    assert "env NVIDIA_VISIBLE_DEVICES=MIG-" in models
    assert list(sock_dir.iterdir()) == []


def test_kubeconfig_and_node_name_flags_alone_turn_api_access_on(
    node: BuiltNode, sock_dir: Path, tmp_path: Path, api: ApiServerImitation
) -> None:
    plugin_dir, pod_resources = sock_dir / "dp", sock_dir / "pr" / "kubelet.sock"
    kubelet = KubeletSimulator(plugin_dir, pod_resources, api=api, node_name="flag-node")
    kubelet.start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(api.kubeconfig()))
    process = spawn(
        [
            "run",
            *source_flags(node),
            "--device-plugin-dir",
            str(plugin_dir),
            "--pod-resources-socket",
            str(pod_resources),
            "--log-format",
            "json",
            "--checkpoint-file",
            str(sock_dir / "checkpoint.json"),
            "--metrics-address",
            "127.0.0.1:0",
            "--kubeconfig",
            str(kubeconfig),
            "--node-name",
            "flag-node",
        ]
    )
    try:
        assert kubelet.wait_for_devices(GPU, 8, timeout=20)
        assert kubelet.wait_for_devices(HCA, 8, timeout=20)
        kubelet.admit("job", [ContainerRequest("main", {GPU: 2, HCA: 2})])

        def published() -> bool:
            record = api.get("nodedevices", "flag-node") or {}
            holders = record.get("status", {}).get("allocations", [])
            return any(entry["pod"] == "job" and entry.get("podUID") for entry in holders)

        # The record names the pod with its uid: the pod watch knew it.
        assert wait_until(published, timeout=20)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
        kubelet.stop()
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    messages = [entry["msg"] for entry in lines]
    assert (
        "Kubernetes API access on: --kubeconfig and --node-name given on the command line"
        in messages
    )
    assert "pods cache started" in messages


def test_version_names_the_installed_release(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == "devplugin 0.1.0"
