"""Init and cleanup hooks, through the kubelet simulator."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from devplugin.testing.kubelet import AdmissionError, ContainerRequest
from devplugin.testing.node import hgx_node
from tests.conftest import GPU, HCA, Cluster
from tests.support import hook, runs
from tests.waiting import wait_until

Start = Callable[..., Cluster]


def test_init_receives_exactly_the_allocated_devices(start_cluster: Start, tmp_path: Path) -> None:
    log = tmp_path / "init.log"
    cluster = start_cluster(
        hgx_node(),
        **{
            "resources.gpu.hooks.init": hook(log, "ok"),
            "resources.hca.hooks.init": hook(log, "ok"),
        },
    )
    pod = cluster.kubelet.admit("p", [ContainerRequest("c", {GPU: 2, HCA: 1})], order=[GPU, HCA])
    gpus, hcas = pod.container("c").devices[GPU], pod.container("c").devices[HCA]
    gpu_run, hca_run = runs(log)
    assert gpu_run["env"]["DEVPLUGIN_HOOK"] == "init"
    assert gpu_run["env"]["DEVPLUGIN_RESOURCE"] == GPU
    assert gpu_run["env"]["DEVPLUGIN_DEVICE_IDS"] == ",".join(gpus)
    assert gpu_run["env"]["DEVPLUGIN_DEVICE_COUNT"] == "2"
    by_uuid = {g.uuid: g for g in cluster.node.gpus}
    for index, uuid in enumerate(gpus):
        gpu = by_uuid[uuid]
        assert gpu_run["env"][f"DEVPLUGIN_DEVICE_{index}_UUID"] == uuid
        assert gpu_run["env"][f"DEVPLUGIN_DEVICE_{index}_PCI"] == str(gpu.address)
        assert gpu_run["env"][f"DEVPLUGIN_DEVICE_{index}_NODES"] == f"/dev/nvidia{gpu.minor}"
    assert gpu_run["stdin"]["resource"] == GPU
    assert [d["id"] for d in gpu_run["stdin"]["devices"]] == list(gpus)
    assert [d["gpu_uuid"] for d in gpu_run["stdin"]["devices"]] == list(gpus)
    assert all(d["numa_node"] in (0, 1) for d in gpu_run["stdin"]["devices"])
    (hca_id,) = hcas
    hca = next(h for h in cluster.node.hcas if h.device_id == hca_id)
    assert hca_run["env"]["DEVPLUGIN_RESOURCE"] == HCA
    assert hca_run["env"]["DEVPLUGIN_DEVICE_0_NAME"] == hca.name
    assert hca_run["stdin"]["devices"] == [
        {
            "id": hca_id,
            "pci_address": hca_id,
            "device_nodes": [
                f"/dev/infiniband/uverbs{hca.uverbs}",
                f"/dev/infiniband/umad{hca.umads[0]}",
                f"/dev/infiniband/issm{hca.issms[0]}",
                "/dev/infiniband/rdma_cm",
            ],
            "numa_node": hca_run["stdin"]["devices"][0]["numa_node"],
            "hca_name": hca.name,
        }
    ]


def test_failing_init_fails_allocate_with_its_stderr(start_cluster: Start, tmp_path: Path) -> None:
    cluster = start_cluster(
        hgx_node(), **{"resources.hca.hooks.init": hook(tmp_path / "l", "fail")}
    )
    with pytest.raises(AdmissionError) as info:
        cluster.kubelet.admit("p", [ContainerRequest("c", {HCA: 1})])
    assert info.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "init hook failed with exit status 3" in str(info.value)
    assert "boom: device not ready" in str(info.value)
    assert cluster.kubelet.registered(HCA)  # still serving


def test_hanging_init_is_killed_at_its_timeout(start_cluster: Start, tmp_path: Path) -> None:
    log = tmp_path / "hang.log"
    cluster = start_cluster(
        hgx_node(),
        **{
            "resources.gpu.hooks.init": hook(log, "hang"),
            "resources.gpu.hooks.timeout_seconds": 0.5,
        },
    )
    started = time.monotonic()
    with pytest.raises(AdmissionError) as info:
        cluster.kubelet.admit("p", [ContainerRequest("c", {GPU: 1})])
    assert time.monotonic() - started < 10
    assert "init hook timed out after 0.5s and was killed" in str(info.value)
    (run,) = runs(log)
    with pytest.raises(ProcessLookupError):
        os.kill(run["pid"], 0)


def test_init_in_pre_start_container(start_cluster: Start, tmp_path: Path) -> None:
    log = tmp_path / "pre.log"
    cluster = start_cluster(
        hgx_node(),
        **{
            "resources.gpu.hooks.init": hook(log, "ok"),
            "resources.gpu.hooks.init_phase": "pre_start",
        },
    )
    assert cluster.kubelet.options(GPU).pre_start_required
    assert not cluster.kubelet.options(HCA).pre_start_required
    pod = cluster.kubelet.admit("p", [ContainerRequest("c", {GPU: 1})])
    (run,) = runs(log)
    assert run["env"]["DEVPLUGIN_DEVICE_IDS"] == pod.container("c").devices[GPU][0]


def test_deleting_a_pod_runs_cleanup_once_unhealthy_during_and_healthy_after(
    start_cluster: Start, tmp_path: Path
) -> None:
    log, go = tmp_path / "cleanup.log", tmp_path / "go"
    cluster = start_cluster(hgx_node(), **{"resources.hca.hooks.cleanup": hook(log, f"wait:{go}")})
    kubelet = cluster.kubelet
    pod = kubelet.admit("p", [ContainerRequest("c", {HCA: 1})])
    (hca,) = pod.container("c").devices[HCA]
    assert runs(log) == []
    kubelet.remove("p")
    # Released: the cleanup runs, and meanwhile the kubelet sees the HCA Unhealthy.
    assert wait_until(lambda: len(runs(log)) == 1)
    assert kubelet.wait_for(lambda: kubelet.devices(HCA)[hca].health == "Unhealthy", timeout=2)
    served = cluster.daemon.servicer(HCA).state.device(hca)
    assert served is not None
    assert served.reason == "cleanup running"
    go.touch()
    assert kubelet.wait_for(lambda: kubelet.devices(HCA)[hca].health == "Healthy", timeout=5)
    (run,) = runs(log)
    assert run["env"]["DEVPLUGIN_HOOK"] == "cleanup"
    assert run["env"]["DEVPLUGIN_DEVICE_IDS"] == hca
    # Several more polls later, still exactly one run.
    polls = cluster.daemon.core.monitor.polls
    assert wait_until(lambda: cluster.daemon.core.monitor.polls >= polls + 3)
    assert len(runs(log)) == 1


def test_failing_cleanup_quarantines_and_retries(start_cluster: Start, tmp_path: Path) -> None:
    log = tmp_path / "cleanup.log"
    cluster = start_cluster(
        hgx_node(),
        **{
            "resources.gpu.hooks.cleanup": hook(log, "fail-times:2"),
            "lifecycle.cleanup_retry_initial_seconds": 0.2,
        },
    )
    kubelet = cluster.kubelet
    pod = kubelet.admit("p", [ContainerRequest("c", {GPU: 1})])
    (gpu,) = pod.container("c").devices[GPU]
    kubelet.remove("p")
    servicer = cluster.daemon.servicer(GPU)

    def quarantined() -> bool:
        device = servicer.state.device(gpu)
        return device is not None and device.reason.startswith("quarantined")

    assert wait_until(quarantined)
    assert kubelet.wait_for(lambda: kubelet.devices(GPU)[gpu].health == "Unhealthy", timeout=2)
    device = servicer.state.device(gpu)
    assert device is not None
    assert "attempt 1 failed" in device.reason
    assert kubelet.wait_for(lambda: kubelet.devices(GPU)[gpu].health == "Healthy", timeout=10)
    assert len(runs(log)) == 3


def test_a_device_reused_before_its_release_was_seen_is_cleaned_inline(
    start_cluster: Start, tmp_path: Path
) -> None:
    log = tmp_path / "cleanup.log"
    cluster = start_cluster(
        hgx_node(),
        **{
            "resources.hca.hooks.cleanup": hook(log, "ok"),
            "resources.hca.hooks.init": hook(tmp_path / "init.log", "ok"),
            # Polls alone would take a long time to call it released.
            "lifecycle.release_confirmations": 50,
        },
    )
    kubelet = cluster.kubelet
    first = kubelet.admit("a", [ContainerRequest("c", {HCA: 8})])
    kubelet.remove("a")
    second = kubelet.admit("b", [ContainerRequest("c", {HCA: 1})])
    (hca,) = second.container("c").devices[HCA]
    assert hca in first.container("c").devices[HCA]
    (cleanup,) = runs(log)
    (init_a, init_b) = runs(tmp_path / "init.log")
    assert cleanup["env"]["DEVPLUGIN_DEVICE_IDS"] == hca
    assert init_a["start"] < cleanup["start"] < init_b["start"]
