"""Health both ways, through the kubelet simulator: HCA ports and device nodes,
GPU XIDs and lost GPUs, recovery."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from devplugin.testing.fake_nvml import nvmlEventTypeDoubleBitEccError
from devplugin.testing.kubelet import ContainerRequest
from devplugin.testing.node import hgx_node
from tests.conftest import GPU, HCA, Cluster

Start = Callable[..., Cluster]


def health_of(cluster: Cluster, resource: str, device: str) -> str:
    return cluster.kubelet.devices(resource)[device].health


def becomes(cluster: Cluster, resource: str, device: str, health: str, within: float) -> bool:
    return cluster.kubelet.wait_for(
        lambda: (
            cluster.kubelet.devices(resource).get(device) is not None
            and cluster.kubelet.devices(resource)[device].health == health
        ),
        timeout=within,
    )


def port_file(cluster: Cluster, index: int, name: str) -> object:
    hca = cluster.node.hcas[index]
    return hca.directory / "infiniband" / hca.name / "ports" / "1" / name


def test_port_down_makes_the_hca_unhealthy_and_back_within_two_seconds(
    start_cluster: Start,
) -> None:
    cluster = start_cluster(hgx_node())
    hca = cluster.node.hcas[2]
    state = hca.directory / "infiniband" / hca.name / "ports" / "1" / "state"
    state.write_text("1: DOWN\n")
    assert becomes(cluster, HCA, hca.device_id, "Unhealthy", within=2.0)
    # The others are untouched.
    assert all(
        d.health == "Healthy" for i, d in cluster.kubelet.devices(HCA).items() if i != hca.device_id
    )
    state.write_text("4: ACTIVE\n")
    assert becomes(cluster, HCA, hca.device_id, "Healthy", within=2.0)


# Waits out the default 5 s check (7 s): with the slow tests, which CI runs.
@pytest.mark.slow
def test_with_the_default_five_second_check_a_port_going_down_is_seen_by_the_port_watch(
    start_cluster: Start,
) -> None:
    # The light check every 5 s (the default), the port watch every second:
    # only the watch can make the HCA Unhealthy within 3 s, every time.
    cluster = start_cluster(
        hgx_node(), **{"health.interval_seconds": 5.0, "discovery.rescan_interval_seconds": 30.0}
    )
    for index, new_state in ((1, "1: DOWN\n"), (3, "2: INIT\n")):
        hca = cluster.node.hcas[index]
        state = hca.directory / "infiniband" / hca.name / "ports" / "1" / "state"
        checks = cluster.daemon.checks
        state.write_text(new_state)
        assert becomes(cluster, HCA, hca.device_id, "Unhealthy", within=3.0)
        # One check started by the watch (the 5 s one may also have come due
        # meanwhile on a slow machine), not a check per watch tick.
        assert checks + 1 <= cluster.daemon.checks <= checks + 2
        state.write_text("4: ACTIVE\n")
        assert becomes(cluster, HCA, hca.device_id, "Healthy", within=3.0)
    # Nothing changed: the watch starts no check of its own.
    checks = cluster.daemon.checks
    time.sleep(2.5)
    assert cluster.daemon.checks <= checks + 1


def test_physical_state_counts_too(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node())
    hca = cluster.node.hcas[0]
    phys = hca.directory / "infiniband" / hca.name / "ports" / "1" / "phys_state"
    phys.write_text("3: Disabled\n")
    assert becomes(cluster, HCA, hca.device_id, "Unhealthy", within=2.0)
    phys.write_text("5: LinkUp\n")
    assert becomes(cluster, HCA, hca.device_id, "Healthy", within=2.0)


def test_missing_device_node_is_unhealthy_with_a_log_line_naming_it(
    start_cluster: Start, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = start_cluster(hgx_node())
    hca = cluster.node.hcas[4]
    with caplog.at_level(logging.WARNING, logger="devplugin.node.pipeline"):
        (cluster.node.dev_root / "infiniband" / "umad4").unlink()
        assert becomes(cluster, HCA, hca.device_id, "Unhealthy", within=2.0)
    assert any(
        hca.device_id in r.getMessage() and "/dev/infiniband/umad4" in r.getMessage()
        for r in caplog.records
    )
    (cluster.node.dev_root / "infiniband" / "umad4").touch()
    assert becomes(cluster, HCA, hca.device_id, "Healthy", within=2.0)


def wait_checks(cluster: Cluster, more: int) -> None:
    """Wait until the daemon has completed `more` further health checks."""
    target = cluster.daemon.checks + more
    deadline = time.monotonic() + 5
    while cluster.daemon.checks < target and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cluster.daemon.checks >= target


def wait_events(cluster: Cluster, count: int) -> None:
    xid = cluster.daemon.core.xid
    assert xid is not None
    deadline = time.monotonic() + 5
    while xid.events_seen < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert xid.events_seen >= count


def test_critical_xid_makes_the_gpu_unhealthy(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node())
    gpu = cluster.node.gpus[3]
    assert cluster.nvml.inject_xid(3, 79) == 1
    assert becomes(cluster, GPU, gpu.uuid, "Unhealthy", within=2.0)
    served = cluster.daemon.servicer(GPU).state.device(gpu.uuid)
    assert served is not None
    assert served.reason == "XID 79"
    # It stays out: one XID needs many good checks (health.xid_good_checks).
    wait_checks(cluster, 3)
    assert health_of(cluster, GPU, gpu.uuid) == "Unhealthy"


def test_double_bit_ecc_makes_the_gpu_unhealthy(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node())
    gpu = cluster.node.gpus[5]
    assert cluster.nvml.inject_event(5, nvmlEventTypeDoubleBitEccError) == 1
    assert becomes(cluster, GPU, gpu.uuid, "Unhealthy", within=2.0)


@pytest.mark.parametrize("xid", [13, 31, 43, 45, 68, 109])
def test_ignored_xids_change_nothing(start_cluster: Start, xid: int) -> None:
    cluster = start_cluster(hgx_node())
    before = cluster.kubelet.devices(GPU)
    updates = len(cluster.kubelet.history(GPU))
    assert cluster.nvml.inject_xid(1, xid) == 1
    wait_events(cluster, 1)
    cluster.daemon.judge()
    assert cluster.kubelet.devices(GPU) == before
    assert len(cluster.kubelet.history(GPU)) == updates
    assert all(d.health == "Healthy" for d in before.values())


def test_xid_fault_recovers_after_enough_good_checks(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node(), **{"health.xid_good_checks": 3})
    gpu = cluster.node.gpus[0]
    cluster.nvml.inject_xid(0, 48)
    assert becomes(cluster, GPU, gpu.uuid, "Unhealthy", within=2.0)
    # 3 good checks at 0.2 s: back within about a second, not forever.
    assert becomes(cluster, GPU, gpu.uuid, "Healthy", within=3.0)


def test_a_lost_gpu_leaves_the_others_allocatable(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node())
    lost = cluster.node.gpus[2]
    cluster.nvml.lost.add(2)
    assert becomes(cluster, GPU, lost.uuid, "Unhealthy", within=2.0)
    served = cluster.daemon.servicer(GPU).state.device(lost.uuid)
    assert served is not None
    assert "GPU is lost" in served.reason
    pod = cluster.kubelet.admit("rest", [ContainerRequest("c", {GPU: 7})])
    assert lost.uuid not in pod.container("c").devices[GPU]
    assert len(pod.container("c").devices[GPU]) == 7
    # The GPU comes back: usable again, so Healthy again.
    cluster.nvml.lost.discard(2)
    assert becomes(cluster, GPU, lost.uuid, "Healthy", within=2.0)


def test_after_cleanup_recovery_waits_for_a_successful_cleanup(
    start_cluster: Start, tmp_path: Path
) -> None:
    from tests.support import hook, runs

    log = tmp_path / "cleanup.log"
    cluster = start_cluster(
        hgx_node(),
        **{
            "health.recovery": "after_cleanup",
            "resources.gpu.hooks.cleanup": hook(tmp_path / "gpu.log", "ok"),
            "resources.hca.hooks.cleanup": hook(log, "ok"),
        },
    )
    hca = cluster.node.hcas[1]
    state = hca.directory / "infiniband" / hca.name / "ports" / "1" / "state"
    state.write_text("1: DOWN\n")
    assert becomes(cluster, HCA, hca.device_id, "Unhealthy", within=2.0)
    # While the port is down no cleanup is attempted; good checks alone do
    # not bring it back in this mode.
    wait_checks(cluster, 3)
    assert runs(log) == []
    state.write_text("4: ACTIVE\n")
    assert becomes(cluster, HCA, hca.device_id, "Healthy", within=5.0)
    (run,) = runs(log)
    assert run["env"]["DEVPLUGIN_DEVICE_IDS"] == hca.device_id
