"""Hostile or odd input gets a clear, bounded answer, and the daemon keeps serving."""

from __future__ import annotations

import logging
import os
import socket
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from devplugin.api import deviceplugin_v1beta1_pb2 as pb
from devplugin.cli import main
from devplugin.frontends.deviceplugin.server import MAX_DETAIL, socket_name
from devplugin.node.status import MAX_CONNECTIONS
from devplugin.testing.node import build_node, hgx_node
from tests.conftest import GPU, HCA, Cluster
from tests.support import probe
from tests.waiting import wait_until

Start = Callable[..., Cluster]
ROOT = Path(__file__).resolve().parents[2]


def refused(cluster: Cluster, ids: list[str]) -> grpc.RpcError:
    request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
    with pytest.raises(grpc.RpcError) as failure:
        cluster.kubelet.stub(GPU).Allocate(request, timeout=10)
    return failure.value


def still_serving(cluster: Cluster) -> None:
    uuid = cluster.node.gpus[0].uuid
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=[uuid])]
    )
    assert len(cluster.kubelet.stub(GPU).Allocate(request, timeout=5).container_responses) == 1


@pytest.mark.parametrize(
    "ids",
    [
        [f"GPU-unknown-{n}" for n in range(10_000)],
        ["G" * (1 << 20)],
        ["GPU-forged\n2026-01-01 00:00:00,000 INFO devplugin: all good"],
    ],
    ids=["10k-ids", "1MiB-id", "newline"],
)
def test_allocate_with_hostile_ids_gets_a_bounded_escaped_refusal(
    start_cluster: Start, ids: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    cluster = start_cluster(hgx_node())
    with caplog.at_level(logging.WARNING, logger="devplugin.frontends.deviceplugin.server"):
        failure = refused(cluster, ids)
    assert failure.code() is grpc.StatusCode.INVALID_ARGUMENT
    details = failure.details() or ""
    assert details.startswith("nvidia.com/gpu: unknown device ids: ")
    assert len(details) <= MAX_DETAIL + 100
    assert "\n" not in details
    if len(ids) > 5:
        assert f"and {len(ids) - 5} more" in details
    records = [r.getMessage() for r in caplog.records if "refused Allocate" in r.getMessage()]
    assert len(records) == 1
    assert len(records[0]) < 2 * MAX_DETAIL + 1000
    assert "\n" not in records[0]
    still_serving(cluster)


def refused_preference(cluster: Cluster, available: list[str], must: str) -> None:
    """GetPreferredAllocation naming a must-include id not in `available`."""
    request = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, must_include_deviceIDs=[must], allocation_size=2
            )
        ]
    )
    with pytest.raises(grpc.RpcError) as failure:
        cluster.kubelet.stub(GPU).GetPreferredAllocation(request, timeout=5)
    assert failure.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "not available" in (failure.value.details() or "")


def test_a_must_include_id_that_is_not_available_is_a_failed_precondition(
    start_cluster: Start,
) -> None:
    cluster = start_cluster(hgx_node())
    uuids = [gpu.uuid for gpu in cluster.node.gpus]
    refused_preference(cluster, uuids[:4], uuids[6])
    still_serving(cluster)


def test_a_must_include_replica_that_is_not_available_is_a_failed_precondition(
    start_cluster: Start,
) -> None:
    cluster = start_cluster(hgx_node(), **{"sharing.gpu.replicas": 2})
    replicas = sorted(cluster.kubelet.devices(GPU))
    refused_preference(cluster, replicas[:4], replicas[9])


def odd_sysfs(cluster: Cluster, index: int) -> Path:
    hca = cluster.node.hcas[index]
    return hca.directory / "infiniband" / hca.name


@pytest.mark.parametrize(
    "damage",
    ["numa-above-int64", "unicode-digit-state", "unicode-port-directory", "unicode-port-file"],
)
def test_odd_numbers_in_sysfs_are_unknown_for_that_device_only(
    start_cluster: Start, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = start_cluster(hgx_node())
    hca = cluster.node.hcas[3]
    ib = odd_sysfs(cluster, 3)
    with caplog.at_level(logging.WARNING):
        if damage == "numa-above-int64":
            (hca.directory / "numa_node").write_text("99999999999999999999999\n")
        elif damage == "unicode-digit-state":
            (ib / "ports" / "1" / "state").write_text("²: ACTIVE\n")
        elif damage == "unicode-port-directory":
            (ib / "ports" / "1").rename(ib / "ports" / "²")
        else:
            mad = cluster.node.sysfs_root / "class" / "infiniband_mad" / f"umad{hca.umads[0]}"
            (mad / "port").write_text("²\n")
        checks = cluster.daemon.checks
        cluster.daemon.core.checks.requests.rescan()
        assert wait_until(lambda: cluster.daemon.checks >= checks + 3)
    # The check loop keeps running and every other HCA is untouched.
    assert cluster.daemon.core.checks.thread is not None
    assert cluster.daemon.core.checks.thread.is_alive()
    others = {h.device_id for h in cluster.node.hcas} - {hca.device_id}
    devices = cluster.kubelet.devices(HCA)
    assert all(devices[d].health == "Healthy" for d in others)
    if damage == "numa-above-int64":
        # Served, without a NUMA hint (the kubelet would reject the int64).
        assert cluster.kubelet.wait_for(
            lambda: cluster.kubelet.devices(HCA)[hca.device_id].numa_nodes == (), 5
        )
        assert any("not a NUMA node" in r.getMessage() for r in caplog.records)
    elif damage in ("unicode-digit-state", "unicode-port-directory"):
        assert cluster.kubelet.wait_for(
            lambda: cluster.kubelet.devices(HCA)[hca.device_id].health == "Unhealthy", 5
        )
    else:
        assert any("is not a number" in r.getMessage() for r in caplog.records)
    still_serving(cluster)


def test_plugin_sockets_are_owner_only_whatever_the_umask(start_cluster: Start) -> None:
    old = os.umask(0)
    try:
        cluster = start_cluster(hgx_node())
    finally:
        os.umask(old)
    for resource in (GPU, HCA):
        mode = stat.S_IMODE(os.stat(cluster.plugin_dir / socket_name(resource)).st_mode)
        assert mode == 0o600, oct(mode)


def test_half_open_http_connections_cannot_exhaust_the_daemon(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node())
    assert cluster.daemon.status is not None
    host, port = cluster.daemon.status.bound[0]
    before = len(os.listdir("/proc/self/fd"))
    clients = []
    try:
        for _ in range(300):
            client = socket.create_connection((host, port), timeout=5)
            clients.append(client)
        # Ours hold 300 descriptors; the daemon's side holds at most the cap.
        assert wait_until(
            lambda: len(os.listdir("/proc/self/fd")) - before <= 300 + MAX_CONNECTIONS + 8
        )
        checks = cluster.daemon.checks
        assert wait_until(lambda: cluster.daemon.checks >= checks + 3)
        assert all(d.health == "Healthy" for d in cluster.kubelet.devices(HCA).values())
    finally:
        for client in clients:
            client.close()
    assert wait_until(lambda: probe(cluster, "/healthz")[0] == 200, timeout=10)
    still_serving(cluster)


def test_running_out_of_descriptors_does_not_make_devices_unhealthy(tmp_path: Path) -> None:
    node = build_node(hgx_node(), tmp_path / "node")
    script = textwrap.dedent(
        f"""
        import os, resource
        from pathlib import Path
        from devplugin.node.discovery import Discoverer, Roots
        from devplugin.node.hca.resource import hca_health
        roots = Roots(Path({str(node.sysfs_root)!r}), Path({str(node.dev_root)!r}))
        discoverer = Discoverer(roots, None)
        first = discoverer.scan()
        assert len(first.hcas) == 8 and not discoverer.incomplete
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
        held = []
        try:
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        second = discoverer.scan(full=True)
        for fd in held:
            os.close(fd)
        assert discoverer.incomplete, "the scan should know it could not read"
        assert len(second.hcas) == 8
        verdicts = [hca_health(h) for h in second.hcas]
        assert all(reason == "" for _, reason in verdicts), verdicts
        third = discoverer.scan()
        assert not discoverer.incomplete
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


# -- the command line ---------------------------------------------------------------------


def one_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_config_that_is_not_utf8_is_one_line_and_exit_two(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.yaml"
    config.write_bytes(b"version: v1\nlogging: {format: \xff\xfe}\n")
    assert main(["discover", "--config", str(config)]) == 2
    assert "not UTF-8" in one_line(capsys)


def test_a_fixture_that_is_not_utf8_is_one_line_and_exit_two(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    node = build_node(hgx_node(), tmp_path / "node")
    fixture = tmp_path / "nvml.json"
    fixture.write_bytes(b'{"driver_version": "\xff"}')
    argv = ["discover", "--sysfs-root", str(node.sysfs_root), "--dev-root", str(node.dev_root)]
    assert main([*argv, "--nvml-fixture", str(fixture)]) == 2
    line = one_line(capsys)
    assert line.startswith("devplugin: config error: nvml.fixture: ")
    assert "not UTF-8" in line


@pytest.mark.parametrize("flag", ["--sysfs-root", "--dev-root"])
def test_a_root_that_does_not_exist_is_one_line_and_exit_two(
    tmp_path: Path, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope"
    assert main(["discover", flag, str(missing)]) == 2
    line = one_line(capsys)
    assert f"paths.{flag[2:].replace('-', '_')}: {missing} is not a directory" in line


def test_a_busy_metrics_port_names_the_address(tmp_path: Path, sock_dir: Path) -> None:
    node = build_node(hgx_node(), tmp_path / "node")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "devplugin",
                "run",
                "--sysfs-root",
                str(node.sysfs_root),
                "--dev-root",
                str(node.dev_root),
                "--nvml-fixture",
                str(node.fixture),
                "--device-plugin-dir",
                str(sock_dir / "dp"),
                "--checkpoint-file",
                str(tmp_path / "c.json"),
                "--metrics-address",
                f"127.0.0.1:{port}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        busy.close()
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if "cannot start" in line]
    assert len(errors) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in errors[0]
    assert "Traceback" not in result.stderr


def test_discover_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    node = build_node(hgx_node(), tmp_path / "node")
    command = (
        f"{sys.executable} -m devplugin discover --json --sysfs-root {node.sysfs_root} "
        f"--dev-root {node.dev_root} --nvml-fixture {node.fixture} | true"
    )
    started = time.monotonic()
    result = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert time.monotonic() - started < 60
    assert "Traceback" not in result.stderr
    assert "BrokenPipeError" not in result.stderr
    assert result.returncode == 0
