"""CDI: devices named for any CDI runtime. The format's rules, the daemon's
reading of the node's GPU spec and writing of its HCA spec, and every name an
Allocate returns resolved the way a runtime resolves it."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from devplugin.api import deviceplugin_v1beta1_pb2 as pb
from devplugin.policy.cdi import (
    Node,
    SpecError,
    annotation_key,
    device_spec,
    minimum_version,
    sanitize_device_name,
    validate_spec,
)
from devplugin.testing.cdi import CdiRuntime, Unresolvable, nvidia_like_spec, write_spec
from devplugin.testing.kubelet import ContainerRequest
from devplugin.testing.layouts import LAYOUTS
from devplugin.testing.node import (
    BuiltHca,
    BuiltNode,
    Hca,
    NodeSpec,
    hgx_node,
    replug,
    unplug_hca,
)
from tests.conftest import GPU, HCA, Cluster
from tests.waiting import wait_until

Start = Callable[..., Cluster]
CDI_BOTH = ["cdi-cri"]


# -- the format ------------------------------------------------------------------------


def good_spec() -> dict[str, Any]:
    return {
        "cdiVersion": "0.3.0", "kind": "example.com/dev",
        "devices": [{"name": "d0", "containerEdits": {"deviceNodes": [{"path": "/dev/d0"}]}}],
    }  # fmt: skip


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda s: s.update(extra=1), "unknown field 'extra'"),
        (lambda s: s.update(kind="example.com"), "vendor/class"),
        (lambda s: s.update(kind="-bad.com/dev"), "vendor"),
        (lambda s: s.update(cdiVersion="0.2.0"), "not a known version"),
        (lambda s: s["devices"][0].update(name="-x"), "device name"),
        (lambda s: s["devices"].append(dict(s["devices"][0])), "defined twice"),
        (lambda s: s["devices"][0].update(containerEdits={}), "edits nothing"),
        (
            lambda s: s["devices"][0]["containerEdits"]["deviceNodes"][0].update(hostPath="/x"),
            "too old",
        ),
        (lambda s: s["devices"][0]["containerEdits"]["deviceNodes"][0].update(type="x"), "type"),
        (
            lambda s: s["devices"][0]["containerEdits"].update(
                hooks=[{"hookName": "x", "path": "/y"}]
            ),
            "known hook",
        ),
        (lambda s: s["devices"][0]["containerEdits"].update(env=["NOVALUE"]), "NAME=value"),
        (lambda s: s.update(devices=[]), "no devices"),
        # What the released library (v1.0.1) refuses and an older validator took.
        (
            lambda s: s["devices"][0]["containerEdits"]["deviceNodes"][0].update(
                permissions="none"
            ),
            "not made of r, w, m",
        ),
        (lambda s: s.update(cdiVersion="1.1.0"), "not a known version"),
        (
            lambda s: s["devices"][0]["containerEdits"].update(
                netDevices=[{"hostInterfaceName": "eth0", "name": "net0"}]
            ),
            "unknown field",
        ),
    ],
)
def test_a_spec_a_runtime_would_refuse_is_refused_with_the_reason(
    damage: Callable[[dict[str, Any]], None], why: str
) -> None:
    spec = good_spec()
    validate_spec(spec)
    damage(spec)
    with pytest.raises(SpecError, match=why):
        validate_spec(spec)


def test_the_version_declared_is_the_oldest_the_contents_allow() -> None:
    spec = good_spec()
    assert minimum_version(spec) == "0.3.0"
    spec["devices"][0]["name"] = "0"
    assert minimum_version(spec) == "0.5.0"  # a name starting with a digit
    spec["annotations"] = {"a": "b"}
    assert minimum_version(spec) == "0.6.0"
    spec["containerEdits"] = {"additionalGids": [44]}
    assert minimum_version(spec) == "0.7.0"
    written = device_spec(
        "devplugin.io/hca", {"mlx5_0": [Node("/dev/infiniband/uverbs0", 231, 192)]}
    )
    assert written["cdiVersion"] == "0.3.0"
    validate_spec(written)


def test_names_are_made_valid_and_annotation_keys_stay_short() -> None:
    assert sanitize_device_name("mlx5_0") == "mlx5_0"
    assert sanitize_device_name("ib dev/1") == "ib-dev-1"
    with pytest.raises(SpecError):
        sanitize_device_name("--")
    key = annotation_key("devplugin.gpu", ["GPU-" + "x" * 36] * 64)
    assert key.startswith("cdi.k8s.io/devplugin.gpu_")
    assert len(key.removeprefix("cdi.k8s.io/")) <= 63


@pytest.mark.parametrize(
    ("setting", "field"),
    [
        (
            "resources:\n  gpu:\n    device_list_strategy: [cdi]\n",
            "resources.gpu.device_list_strategy[0]: must be one of",
        ),
        (
            "resources:\n  hca:\n    device_list_strategy: []\n",
            "resources.hca.device_list_strategy: must name at least one strategy",
        ),
        ("cdi:\n  hca_kind: devplugin\n", "cdi.hca_kind: must be vendor/class"),
        ("cdi:\n  spec_dirs: [relative]\n", "cdi.spec_dirs: every directory must be"),
    ],
)
def test_a_bad_cdi_setting_exits_two_with_one_line_naming_the_field(
    tmp_path: Path, setting: str, field: str
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("version: v1\n" + setting)
    result = subprocess.run(
        [sys.executable, "-m", "devplugin", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"devplugin: config error: {field}"), line


# -- the daemon through the kubelet simulator --------------------------------------------


def dirs(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "etc-cdi", tmp_path / "run-cdi"


def cdi_cluster(
    start_cluster: Start,
    tmp_path: Path,
    layout: str,
    strategy: list[str],
    *,
    spec: NodeSpec | None = None,
    **extra: Any,
) -> tuple[Cluster, CdiRuntime]:
    static, dynamic = dirs(tmp_path)
    cluster = start_cluster(
        spec or LAYOUTS[layout](),
        wait=False,
        **{
            "resources.gpu.device_list_strategy": strategy,
            "resources.hca.device_list_strategy": strategy,
            "cdi.spec_dirs": [str(static), str(dynamic)],
            **extra,
        },
    )
    write_spec(static, "nvidia.yaml", nvidia_like_spec(cluster.node))
    node = cluster.node
    assert cluster.kubelet.wait_for(lambda: healthy(cluster, GPU) == len(node.gpus), 10)
    assert cluster.kubelet.wait_for(lambda: healthy(cluster, HCA) == len(node.hcas), 10)
    return cluster, CdiRuntime([static, dynamic])


def healthy(cluster: Cluster, resource: str) -> int:
    return sum(d.health == "Healthy" for d in cluster.kubelet.devices(resource).values())


def expected_nodes(node: BuiltNode, gpus: list[str], hcas: list[str]) -> dict[str, tuple[int, int]]:
    """The device nodes the chosen devices need, with the HCAs' numbers."""
    found: dict[str, tuple[int, int]] = {}
    if gpus:
        for gpu in node.gpus:
            if gpu.uuid in gpus:
                found[f"/dev/nvidia{gpu.minor}"] = (0, 0)
        for control in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
            found[f"/dev/{control}"] = (0, 0)
    for hca in node.hcas:
        if hca.device_id in hcas:
            found.update(hca_numbers(hca))
    if hcas:
        found["/dev/infiniband/rdma_cm"] = (10, 58)
    return found


def hca_numbers(hca: BuiltHca) -> dict[str, tuple[int, int]]:
    # What the simulated sysfs says (class/infiniband_*/<entry>/dev).
    numbers = {f"/dev/infiniband/uverbs{hca.uverbs}": (231, 192 + hca.uverbs)}
    numbers.update({f"/dev/infiniband/umad{i}": (231, i) for i in hca.umads})
    numbers.update({f"/dev/infiniband/issm{i}": (231, 64 + i) for i in hca.issms})
    return numbers


def resolved(runtime: CdiRuntime, names: list[str]) -> dict[str, tuple[int, int]]:
    runtime.refresh()
    edits = runtime.resolve(names)
    return {n["path"]: (n.get("major", 0), n.get("minor", 0)) for n in edits.device_nodes}


SHAPES = [(2, 2), (1, 1), (4, 2), (1, 0), (0, 1)]


@pytest.mark.parametrize("layout", ["hgx-h100", "pcie-server", "asymmetric"])
def test_every_cdi_name_allocate_returns_resolves_to_exactly_the_devices_nodes(
    start_cluster: Start, tmp_path: Path, layout: str
) -> None:
    cluster, runtime = cdi_cluster(start_cluster, tmp_path, layout, CDI_BOTH)
    for index, (gpus, hcas) in enumerate(SHAPES):
        requests = {k: v for k, v in ((GPU, gpus), (HCA, hcas)) if v}
        pod = cluster.kubelet.admit(f"p{index}", [ContainerRequest("main", requests)])
        got = pod.container("main")
        names: list[str] = []
        for resource, response in got.responses.items():
            assert list(response.devices) == []  # no device specs: CDI only
            assert not response.annotations
            names.extend(device.name for device in response.cdi_devices)
            if resource == GPU:
                assert "NVIDIA_VISIBLE_DEVICES" not in response.envs
            else:
                # The chosen HCAs' names, whatever the strategy.
                hca_names = [cluster.node.hca_by_id(d).name for d in got.devices[HCA]]
                assert response.envs["NCCL_IB_HCA"] == "=" + ",".join(hca_names)
        expected = expected_nodes(
            cluster.node, list(got.devices.get(GPU, ())), list(got.devices.get(HCA, ()))
        )
        assert resolved(runtime, names) == expected, (names, expected)
        cluster.kubelet.remove(f"p{index}")


def test_cdi_annotations_carry_the_same_names(start_cluster: Start, tmp_path: Path) -> None:
    cluster, runtime = cdi_cluster(start_cluster, tmp_path, "hgx-h100", ["cdi-annotations"])
    pod = cluster.kubelet.admit("p", [ContainerRequest("main", {GPU: 2, HCA: 2})])
    got = pod.container("main")
    for resource, response in got.responses.items():
        assert list(response.cdi_devices) == []
        ((key, value),) = response.annotations.items()
        plugin = "devplugin.gpu" if resource == GPU else "devplugin.hca"
        assert key == annotation_key(plugin, list(got.devices[resource]))
        names = value.split(",")
        assert len(names) == 2
        assert all(
            name.startswith("nvidia.com/gpu=" if resource == GPU else "devplugin.io/hca=")
            for name in names
        )
        runtime.resolve(names)


def test_the_default_strategy_answers_as_before(start_cluster: Start, tmp_path: Path) -> None:
    # The default is [envvar, device-nodes]: spelled out, the answers are the same.
    default = start_cluster(hgx_node())
    spelled = start_cluster(
        hgx_node(),
        **{
            "resources.gpu.device_list_strategy": ["envvar", "device-nodes"],
            "resources.hca.device_list_strategy": ["device-nodes", "envvar"],
        },
    )
    request = [ContainerRequest("main", {GPU: 2, HCA: 2})]
    first = default.kubelet.admit("p", request, order=[GPU, HCA]).container("main")
    second = spelled.kubelet.admit("p", request, order=[GPU, HCA]).container("main")
    for resource in (GPU, HCA):
        one, two = first.responses[resource], second.responses[resource]
        assert one == two
        assert not one.cdi_devices
        assert not one.annotations
    gpus = first.responses[GPU]
    assert gpus.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(first.devices[GPU])
    assert {d.host_path for d in gpus.devices} >= {"/dev/nvidiactl", "/dev/nvidia-uvm"}


def test_a_gpu_no_spec_names_is_not_offered_until_one_does(
    start_cluster: Start, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    static, dynamic = dirs(tmp_path)
    cluster = start_cluster(
        hgx_node(),
        wait=False,
        **{
            "resources.gpu.device_list_strategy": ["cdi-cri"],
            "cdi.spec_dirs": [str(static), str(dynamic)],
        },
    )
    node, kubelet = cluster.node, cluster.kubelet
    # The toolkit's spec without GPU 5: only GPU 5 stays out.
    write_spec(static, "nvidia.yaml", nvidia_like_spec(node, skip=[5]))
    left_out = node.gpus[5].uuid
    assert kubelet.wait_for(lambda: healthy(cluster, GPU) == len(node.gpus) - 1, 10)
    assert kubelet.devices(GPU)[left_out].health == "Unhealthy"
    reason = cluster.daemon.servicer(GPU).state.device(left_out)
    assert reason is not None
    assert reason.reason.startswith("no CDI spec declares nvidia.com/gpu=5")
    metrics = cluster.daemon.core.metrics
    assert metrics.cdi_undeclared.labels(GPU)._value.get() == 1
    # A malformed spec next to it names nothing and breaks nothing.
    with caplog.at_level(logging.WARNING):
        (static / "broken.json").write_text("{not json")
        (dynamic / "odd.yaml").parent.mkdir(parents=True, exist_ok=True)
        (dynamic / "odd.yaml").write_text(
            yaml_text({"cdiVersion": "0.3.0", "kind": "nvidia.com/gpu", "surprise": 1})
        )
        assert wait_until(lambda: metrics.cdi_refused_specs._value.get() == 2, timeout=10)
        pod = kubelet.admit("p", [ContainerRequest("main", {GPU: 2})])
        assert left_out not in pod.container("main").devices[GPU]
        polls = cluster.daemon.checks
        assert wait_until(lambda: cluster.daemon.checks >= polls + 3, timeout=10)
    refusals = [r for r in caplog.records if "is not usable" in r.getMessage()]
    assert len(refusals) == 2  # one line per file, not one per scan
    # The toolkit runs again (a new GPU, a driver update): within one scan.
    write_spec(static, "nvidia.yaml", nvidia_like_spec(node))
    assert kubelet.wait_for(lambda: kubelet.devices(GPU)[left_out].health == "Healthy", 5)
    assert metrics.cdi_undeclared.labels(GPU)._value.get() == 0


def yaml_text(data: Any) -> str:
    return json.dumps(data)  # JSON is YAML


def hca_spec(tmp_path: Path) -> dict[str, Any]:
    # What a runtime reads: one file, no leftovers (a write in progress is a
    # hidden temporary file, which no runtime reads).
    files = sorted(f for f in dirs(tmp_path)[1].iterdir() if not f.name.startswith("."))
    assert [f.name for f in files] == ["devplugin.io-hca.json"]
    loaded: dict[str, Any] = json.loads(files[0].read_text())
    return loaded


def spec_names(tmp_path: Path) -> set[str]:
    return {device["name"] for device in hca_spec(tmp_path)["devices"]}


def test_the_hca_spec_follows_hotplug_and_restarts_and_outlives_a_clean_stop(
    start_cluster: Start, tmp_path: Path
) -> None:
    settings = {"hotplug.udev": False, "discovery.rescan_interval_seconds": 0.3}
    cluster, runtime = cdi_cluster(start_cluster, tmp_path, "hgx-h100", CDI_BOTH, **settings)
    node = cluster.node
    every = {hca.name for hca in node.hcas}
    assert spec_names(tmp_path) == every
    assert hca_spec(tmp_path)["cdiVersion"] == "0.3.0"
    runtime.refresh()
    assert not runtime.refused
    for hca in node.hcas:
        assert resolved(runtime, [f"devplugin.io/hca={hca.name}"]) == {
            **hca_numbers(hca),
            "/dev/infiniband/rdma_cm": (10, 58),
        }
    written = (dirs(tmp_path)[1] / "devplugin.io-hca.json").stat().st_mtime_ns
    checks = cluster.daemon.checks
    assert wait_until(lambda: cluster.daemon.checks >= checks + 3, timeout=10)
    # Nothing changed: not rewritten.
    assert (dirs(tmp_path)[1] / "devplugin.io-hca.json").stat().st_mtime_ns == written
    unplugged = unplug_hca(node, "mlx5_2", tmp_path / "stash")
    assert wait_until(lambda: spec_names(tmp_path) == every - {"mlx5_2"}, timeout=5)
    replug(unplugged)
    assert wait_until(lambda: spec_names(tmp_path) == every, timeout=5)
    spec_file = dirs(tmp_path)[1] / "devplugin.io-hca.json"
    assert spec_file.stat().st_mode & 0o777 == 0o644
    for device in hca_spec(tmp_path)["devices"]:
        assert {n["permissions"] for n in device["containerEdits"]["deviceNodes"]} == {"rw"}
    # A clean stop leaves the spec: containers that hold an HCA may restart
    # while no daemon runs, and must still resolve their names.
    cluster.daemon.stop()
    assert spec_names(tmp_path) == every
    runtime.refresh()
    assert resolved(runtime, [f"devplugin.io/hca={name}" for name in sorted(every)])
    # A restart (a new daemon on the same node): the same one file, written again.
    # A daemon that was killed left one naming an HCA that is gone since.
    stale = device_spec("devplugin.io/hca", {"mlx5_99": [Node("/dev/infiniband/uverbs99", 1, 2)]})
    write_spec(dirs(tmp_path)[1], "devplugin.io-hca.json", stale)
    again, _ = cdi_cluster(start_cluster, tmp_path, "hgx-h100", CDI_BOTH, **settings)
    assert spec_names(tmp_path) == {hca.name for hca in again.node.hcas}


def test_cdi_on_for_hcas_only_needs_no_gpu_spec(start_cluster: Start, tmp_path: Path) -> None:
    static, dynamic = dirs(tmp_path)
    cluster = start_cluster(
        hgx_node(),
        **{
            "resources.hca.device_list_strategy": ["cdi-cri", "device-nodes"],
            "cdi.spec_dirs": [str(static), str(dynamic)],
        },
    )
    pod = cluster.kubelet.admit("p", [ContainerRequest("main", {GPU: 1, HCA: 1})])
    got = pod.container("main")
    assert got.responses[GPU].envs["NVIDIA_VISIBLE_DEVICES"] == got.devices[GPU][0]
    hcas = got.responses[HCA]
    (name,) = [d.name for d in hcas.cdi_devices]
    assert {d.host_path for d in hcas.devices} == set(
        resolved(CdiRuntime([static, dynamic]), [name])
    )
    assert isinstance(hcas, pb.ContainerAllocateResponse)


def test_a_name_no_spec_declares_does_not_resolve(tmp_path: Path) -> None:
    static = tmp_path / "cdi"
    write_spec(static, "a.json", good_spec())
    write_spec(static, "b.json", good_spec())  # the same device twice, one directory
    runtime = CdiRuntime([static])
    assert runtime.conflicts == {"example.com/dev=d0"}
    with pytest.raises(Unresolvable, match=r"example\.com/dev=d0"):
        runtime.resolve(["example.com/dev=d0"])
    later = tmp_path / "run"
    write_spec(later, "c.json", good_spec())  # a later directory wins
    runtime = CdiRuntime([static, later])
    assert runtime.resolve(["example.com/dev=d0"]).node_paths() == {"/dev/d0"}
    with pytest.raises(Unresolvable):
        runtime.resolve(["example.com/dev=missing", "not-qualified"])


@pytest.mark.parametrize("strategy", [CDI_BOTH, ["device-nodes"]], ids=["cdi", "device-nodes"])
def test_hcas_are_served_without_rdma_cm_in_every_strategy_with_one_log_line(
    start_cluster: Start, tmp_path: Path, strategy: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    # rdma_ucm not loaded: no /dev/infiniband/rdma_cm. Verbs work without it.
    built = hgx_node()
    for root in built.roots:
        _leave_out_rdma_cm(root.children)
    with caplog.at_level(logging.INFO):
        cluster, _ = cdi_cluster(start_cluster, tmp_path, "hgx-h100", strategy, spec=built)
        checks = cluster.daemon.checks
        assert wait_until(lambda: cluster.daemon.checks >= checks + 3, timeout=10)
    pod = cluster.kubelet.admit("p", [ContainerRequest("main", {HCA: 2})])
    got = pod.container("main").responses[HCA]
    if "cdi-cri" in strategy:
        names = [device.name for device in got.cdi_devices]
        nodes = resolved(CdiRuntime(dirs(tmp_path)), names)
        assert len(nodes) >= 2
    else:
        nodes = {device.container_path: (0, 0) for device in got.devices}
    assert "/dev/infiniband/rdma_cm" not in nodes
    lines = [r for r in caplog.records if "rdma_cm is missing" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]


def _leave_out_rdma_cm(children: list[Any]) -> None:
    for child in children:
        if isinstance(child, Hca):
            child.missing_nodes = (*child.missing_nodes, "rdma_cm")
        elif hasattr(child, "children"):
            _leave_out_rdma_cm(child.children)
