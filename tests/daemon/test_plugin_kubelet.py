"""The daemon against the kubelet simulator, over real gRPC on real unix sockets."""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
import pytest

from devplugin.api import deviceplugin_v1beta1_pb2 as pb
from devplugin.node.podresources import PodResourcesClient
from devplugin.testing.fake_nvml import NVML_ERROR_DRIVER_NOT_LOADED
from devplugin.testing.kubelet import AdmissionError, ContainerRequest
from devplugin.testing.node import DOWN, Gpu, Hca, NodeSpec, Port, RootComplex, Switch, hgx_node
from tests.conftest import GPU, HCA, Cluster
from tests.waiting import wait_until

Start = Callable[..., Cluster]


def allocate(cluster: Cluster, resource: str, *requests: list[str]) -> pb.AllocateResponse:
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=ids) for ids in requests]
    )
    response: pb.AllocateResponse = cluster.kubelet.stub(resource).Allocate(request, timeout=5)
    return response


def devices_of(response: pb.ContainerAllocateResponse) -> list[tuple[str, str, str]]:
    return [(d.container_path, d.host_path, d.permissions) for d in response.devices]


def rw(*paths: str) -> list[tuple[str, str, str]]:
    return [(path, path, "rw") for path in paths]


def test_both_resources_register_with_correct_fields(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node())
    records = {record.resource: record for record in cluster.kubelet.registrations}
    assert set(records) == {GPU, HCA}
    assert records[GPU].version == "v1beta1"
    assert records[GPU].endpoint == "devplugin-nvidia.com-gpu.sock"
    assert records[HCA].endpoint == "devplugin-rdma-hca.sock"
    for resource in (GPU, HCA):
        assert (cluster.plugin_dir / records[resource].endpoint).exists()
        # Options are derived from what the resource implements.
        servicer = cluster.daemon.servicer(resource)
        caps = servicer.resource.capabilities
        assert records[resource].options == pb.DevicePluginOptions(
            pre_start_required=caps.pre_start,
            get_preferred_allocation_available=caps.preferred_allocation,
        )
        assert records[resource].options.get_preferred_allocation_available


def test_list_and_watch_lists_every_device_with_its_numa_node(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node())
    gpus = cluster.kubelet.devices(GPU)
    assert set(gpus) == {gpu.uuid for gpu in cluster.node.gpus}
    for index, gpu in enumerate(cluster.node.gpus):
        assert gpus[gpu.uuid].health == "Healthy"
        assert gpus[gpu.uuid].numa_nodes == (0 if index < 4 else 1,)
    hcas = cluster.kubelet.devices(HCA)
    assert set(hcas) == {hca.device_id for hca in cluster.node.hcas}
    for index, hca in enumerate(cluster.node.hcas):
        assert hcas[hca.device_id].health == "Healthy"
        assert hcas[hca.device_id].numa_nodes == (0 if index < 4 else 1,)


def test_unknown_numa_node_is_omitted(start_cluster: Start) -> None:
    cluster = start_cluster(NodeSpec(roots=[RootComplex(None, "0-7", [Switch([Gpu(), Hca()])])]))
    assert [d.numa_nodes for d in cluster.kubelet.devices(GPU).values()] == [()]
    assert [d.numa_nodes for d in cluster.kubelet.devices(HCA).values()] == [()]


def test_gpu_allocate_returns_exactly_the_gpu_nodes_and_env(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node())
    g = cluster.node.gpus
    response = allocate(cluster, GPU, [g[3].uuid, g[1].uuid])
    (container,) = response.container_responses
    assert dict(container.envs) == {"NVIDIA_VISIBLE_DEVICES": f"{g[3].uuid},{g[1].uuid}"}
    assert devices_of(container) == rw(
        "/dev/nvidia3", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"
    )
    assert list(container.mounts) == []


def test_gpu_allocate_leaves_out_control_nodes_that_do_not_exist(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node())
    (cluster.node.dev_root / "nvidia-uvm-tools").unlink()
    cluster.daemon.rescan()
    response = allocate(cluster, GPU, [cluster.node.gpus[0].uuid])
    assert devices_of(response.container_responses[0]) == rw(
        "/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"
    )


def test_hca_allocate_returns_every_node_of_every_port_and_nccl_env(start_cluster: Start) -> None:
    spec = NodeSpec(
        roots=[RootComplex(0, "0-7", [Switch([Gpu(), Hca(), Hca(ports=[Port(), Port()])])])]
    )
    cluster = start_cluster(spec)
    single, dual = cluster.node.hcas
    response = allocate(cluster, HCA, [single.device_id, dual.device_id])
    (container,) = response.container_responses
    assert dict(container.envs) == {"NCCL_IB_HCA": "=mlx5_0,mlx5_1"}
    assert devices_of(container) == rw(
        "/dev/infiniband/uverbs0",
        "/dev/infiniband/umad0",
        "/dev/infiniband/issm0",
        "/dev/infiniband/uverbs1",
        "/dev/infiniband/umad1",
        "/dev/infiniband/umad2",
        "/dev/infiniband/issm1",
        "/dev/infiniband/issm2",
        "/dev/infiniband/rdma_cm",
    )


def test_one_response_per_container_request(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node())
    hcas = cluster.node.hcas
    response = allocate(cluster, HCA, [hcas[0].device_id], [hcas[5].device_id])
    first, second = response.container_responses
    assert first.envs["NCCL_IB_HCA"] == "=mlx5_0"
    assert second.envs["NCCL_IB_HCA"] == "=mlx5_5"
    assert devices_of(second)[0] == ("/dev/infiniband/uverbs5",) * 2 + ("rw",)


@pytest.mark.parametrize(
    ("ids", "expected"),
    [
        (["GPU-nope", "GPU-other"], "unknown device ids: GPU-nope, GPU-other"),
        (["{g0}", "{g0}"], "duplicate device ids: {g0}"),
        ([], "no device ids"),
    ],
)
def test_bad_allocate_is_invalid_argument_and_daemon_keeps_serving(
    start_cluster: Start, ids: list[str], expected: str
) -> None:
    cluster = start_cluster(hgx_node())
    g0 = cluster.node.gpus[0].uuid
    ids = [device_id.format(g0=g0) for device_id in ids]
    with pytest.raises(grpc.RpcError) as info:
        allocate(cluster, GPU, ids)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert expected.format(g0=g0) in info.value.details()
    # Still serving: the stream is up and a good request succeeds.
    assert cluster.kubelet.registered(GPU)
    good = allocate(cluster, GPU, [g0])
    assert good.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == g0


def test_unhealthy_device_is_refused_with_its_reason(start_cluster: Start) -> None:
    spec = NodeSpec(roots=[RootComplex(0, "0-7", [Switch([Hca(ports=[Port(*DOWN)])])])])
    cluster = start_cluster(spec)
    hca = cluster.node.hcas[0]
    assert cluster.kubelet.devices(HCA)[hca.device_id].health == "Unhealthy"
    with pytest.raises(grpc.RpcError) as info:
        allocate(cluster, HCA, [hca.device_id])
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "port 1 is 1: DOWN" in info.value.details()


def test_preferred_allocation_can_be_switched_off(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node(), **{"allocation.preferred": False})
    for record in cluster.kubelet.registrations:
        assert record.options == pb.DevicePluginOptions()
    with pytest.raises(grpc.RpcError) as info:
        cluster.kubelet.stub(GPU).GetPreferredAllocation(pb.PreferredAllocationRequest(), timeout=5)
    assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED


def test_pods_admitted_through_the_kubelet_get_their_devices(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node())
    pod = cluster.kubelet.admit("train", [ContainerRequest("main", {GPU: 2, HCA: 2})])
    main = pod.container("main")
    assert len(main.devices[GPU]) == 2
    assert len(main.devices[HCA]) == 2
    assert main.responses[GPU].envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(main.devices[GPU])
    with pytest.raises(AdmissionError, match="only 6 available"):
        cluster.kubelet.admit("greedy", [ContainerRequest("main", {GPU: 7})])
    with PodResourcesClient(cluster.kubelet.pod_resources_socket) as client:  # type: ignore[arg-type]
        listed = client.list()
    assert {(c.pod, c.container, c.resource, c.device_ids) for c in listed} == {
        ("train", "main", GPU, main.devices[GPU]),
        ("train", "main", HCA, main.devices[HCA]),
    }


def test_kubelet_restart_is_followed_by_reregistration_within_two_seconds(
    start_cluster: Start,
) -> None:
    cluster = start_cluster(hgx_node())
    kubelet = cluster.kubelet
    before = len(kubelet.registrations)
    sockets = sorted(cluster.plugin_dir.glob("devplugin-*.sock"))
    made = {path: (path.stat().st_ino, path.stat().st_ctime_ns) for path in sockets}
    restarted_at = kubelet.restart()

    def reregistered() -> bool:
        fresh = {r.resource for r in kubelet.registrations[before:] if r.at >= restarted_at}
        return fresh == {GPU, HCA}

    assert kubelet.wait_for(reregistered, timeout=2.0)
    latest = max(r.at for r in kubelet.registrations[before:])
    assert latest - restarted_at < 2.0
    assert kubelet.wait_for_devices(GPU, 8, timeout=2.0)
    assert kubelet.wait_for_devices(HCA, 8, timeout=2.0)
    assert all(d.health == "Healthy" for d in kubelet.devices(GPU).values())
    assert (cluster.plugin_dir / "devplugin-nvidia.com-gpu.sock").exists()
    # Our sockets were wiped with the directory and made anew (the daemon
    # may hear of it before this test looks: compare the files, not a gap).
    assert len(sockets) == 2
    assert all((p.stat().st_ino, p.stat().st_ctime_ns) != was for p, was in made.items())
    response = allocate(cluster, GPU, [cluster.node.gpus[0].uuid])
    assert len(response.container_responses) == 1


def test_new_kubelet_socket_alone_triggers_reregistration(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node())
    kubelet = cluster.kubelet
    kubelet.stop()
    assert kubelet.wait_for(lambda: not kubelet.registered(GPU), timeout=2.0)
    before = len(kubelet.registrations)
    kubelet.start()
    assert kubelet.wait_for(
        lambda: {r.resource for r in kubelet.registrations[before:]} == {GPU, HCA}, timeout=2.0
    )
    assert kubelet.wait_for_devices(HCA, 8, timeout=2.0)


def test_daemon_waits_for_an_absent_kubelet(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node(), start_kubelet=False)
    kubelet = cluster.kubelet
    assert (cluster.plugin_dir / "devplugin-rdma-hca.sock").exists()
    registrar = cluster.daemon.registrar
    assert registrar is not None
    assert registrar.registered() == {GPU: False, HCA: False}
    kubelet.start()
    assert kubelet.wait_for_devices(GPU, 8, timeout=2.0)
    assert kubelet.wait_for_devices(HCA, 8, timeout=2.0)
    # The kubelet may list the devices a moment before Register returns.
    assert wait_until(lambda: registrar.registered() == {GPU: True, HCA: True}, timeout=2.0)


def test_without_nvml_the_hca_resource_still_works(
    start_cluster: Start, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR):
        cluster = start_cluster(
            hgx_node(), nvml_init_error=NVML_ERROR_DRIVER_NOT_LOADED, wait=False
        )
    assert cluster.kubelet.wait_for_devices(HCA, 8, timeout=5)
    assert cluster.kubelet.wait_for(lambda: cluster.kubelet.registered(GPU), timeout=5)
    assert cluster.kubelet.devices(GPU) == {}
    assert any(
        "NVML unavailable: Driver Not Loaded" in record.getMessage() for record in caplog.records
    )
    response = allocate(cluster, HCA, [cluster.node.hcas[2].device_id])
    assert response.container_responses[0].envs["NCCL_IB_HCA"] == "=mlx5_2"
    # When the driver arrives, the GPUs appear without a restart.
    cluster.nvml.init_error = None
    assert cluster.kubelet.wait_for(lambda: len(cluster.kubelet.devices(GPU)) == 8, timeout=5)


def test_changes_on_the_node_reach_list_and_watch(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node())
    hca = cluster.node.hcas[1]
    (hca.directory / "infiniband" / hca.name / "ports" / "1" / "state").write_text("1: DOWN\n")

    def unhealthy() -> bool:
        return cluster.kubelet.devices(HCA)[hca.device_id].health == "Unhealthy"

    assert cluster.kubelet.wait_for(unhealthy, timeout=5)
    (hca.directory / "infiniband" / hca.name / "ports" / "1" / "state").write_text("4: ACTIVE\n")
    assert cluster.kubelet.wait_for(lambda: not unhealthy(), timeout=5)


def test_a_kubelet_restart_is_heard_at_once_not_at_the_next_poll(start_cluster: Start) -> None:
    # The registrar's poll an hour apart: only the directory's events can
    # make it register again within a second.
    cluster = start_cluster(hgx_node(), **{"kubelet.watch_interval_seconds": 3600.0})
    kubelet = cluster.kubelet
    assert cluster.daemon.plugins.dirwatch is not None
    assert cluster.daemon.plugins.dirwatch.watching
    before = len(kubelet.registrations)
    restarted_at = kubelet.restart()

    def reregistered() -> bool:
        fresh = {r.resource for r in kubelet.registrations[before:] if r.at >= restarted_at}
        return fresh == {GPU, HCA}

    assert kubelet.wait_for(reregistered, timeout=2.0)
    assert kubelet.wait_for_devices(GPU, 8, timeout=2.0)


def test_the_registered_poll_relaxes_only_while_the_directory_is_heard(
    start_cluster: Start,
) -> None:
    cluster = start_cluster(hgx_node())
    plugins = cluster.daemon.plugins
    assert plugins.dirwatch is not None
    assert plugins.dirwatch.watching
    assert plugins.registrar.pace() == 10.0  # the 1 s net, ten times slower
    plugins.dirwatch.signal_stop()
    plugins.dirwatch.join(5.0)
    assert not plugins.dirwatch.watching
    assert plugins.registrar.pace() == 1.0
