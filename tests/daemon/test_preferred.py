"""Joint GPU + HCA allocation through the kubelet simulator, over real gRPC."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Iterable

import grpc
import pytest

from devplugin.api import deviceplugin_v1beta1_pb2 as pb
from devplugin.model import DeviceKind
from devplugin.node.alignment import alignment
from devplugin.policy.topology import Level, Topology
from devplugin.testing.kubelet import ContainerRequest, KubeletSimulator
from devplugin.testing.layouts import LAYOUTS
from devplugin.testing.node import DOWN, hgx_node
from tests.conftest import GPU, HCA, Cluster

Start = Callable[..., Cluster]


def joint_optimum(
    topology: Topology, free_gpus: Iterable[str], free_hcas: Iterable[str], gpus: int, hcas: int
) -> Level:
    """The best worst GPU-to-nearest-HCA level over every choice of both sets."""
    free_g = list(free_gpus)
    best = Level.SYS
    for chosen in itertools.combinations(sorted(free_hcas), hcas):
        levels = sorted(min(topology.level(g, h) for h in chosen) for g in free_g)
        best = min(best, levels[gpus - 1])
    return best


def free_devices(kubelet: KubeletSimulator, resource: str) -> set[str]:
    held = kubelet.allocated().get(resource, set())
    return {d for d, rec in kubelet.devices(resource).items() if rec.health == "Healthy"} - held


def settle(cluster: Cluster) -> None:
    """Let the daemon see released devices: it learns of releases only from
    its PodResources poll, as it would on a real node."""
    coordinator = cluster.daemon.core.coordinator
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        # Allocations younger than the bookkeeping grace need a later poll.
        cluster.daemon.core.monitor.poke()
        if coordinator.free(DeviceKind.GPU) == free_devices(
            cluster.kubelet, GPU
        ) and coordinator.free(DeviceKind.HCA) == free_devices(cluster.kubelet, HCA):
            return
        time.sleep(0.02)
    raise AssertionError("the daemon did not observe the released devices")


def test_both_resources_offer_preferred_allocation(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node())
    for resource in (GPU, HCA):
        assert cluster.kubelet.options(resource).get_preferred_allocation_available


SHAPES = [(1, 1), (2, 2), (2, 1), (1, 2), (4, 4), (4, 2), (3, 1), (8, 8)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dgx-a100", "hgx-h100", "pcie-server", "asymmetric", "16-gpu"])
@pytest.mark.parametrize("order", [(GPU, HCA), (HCA, GPU)], ids=["gpu-first", "hca-first"])
def test_both_call_orders_reach_the_joint_optimum(
    start_cluster: Start, layout: str, order: tuple[str, str]
) -> None:
    """Streams of pods of one shape at a time, with churn, in one call order.

    The first resource's choice needs the other resource's count, which the
    kubelet does not send; the daemon assumes the count the last container
    of that shape had (one HCA per GPU with no history). Whenever that
    assumption is right, the achieved worst level must equal the optimum of
    an exhaustive search over both sets given what was free. Only the first
    pod of a new shape can meet a wrong assumption.
    """
    cluster = start_cluster(LAYOUTS[layout](), **{"pod_resources.min_interval_seconds": 0.02})
    kubelet = cluster.kubelet
    coordinator = cluster.daemon.core.coordinator
    topology = coordinator.topology
    first_kind = DeviceKind.GPU if order[0] == GPU else DeviceKind.HCA
    rng = random.Random(f"{layout}{order}")
    exact = unknown = 0
    for gpus, hcas in SHAPES:
        live: list[str] = []
        for round_ in range(3):
            for index in range(4):
                free_g, free_h = free_devices(kubelet, GPU), free_devices(kubelet, HCA)
                if gpus > len(free_g) or hcas > len(free_h):
                    break
                first_count = gpus if first_kind is DeviceKind.GPU else hcas
                assumed = coordinator.expected_partners(first_kind, first_count)
                actual = hcas if first_kind is DeviceKind.GPU else gpus
                expected = joint_optimum(topology, free_g, free_h, gpus, hcas)
                name = f"s{gpus}x{hcas}-{round_}-{index}"
                request = ContainerRequest("main", {GPU: gpus, HCA: hcas})
                container = kubelet.admit(name, [request], order=order).container("main")
                assert container.order == order
                achieved = alignment(topology, container.devices[GPU], container.devices[HCA])
                assert achieved is not None
                live.append(name)
                if assumed == actual:
                    assert achieved[0] == expected, (name, container.devices)
                    exact += 1
                else:
                    unknown += 1
            for name in rng.sample(live, len(live) // 2):
                kubelet.remove(name)
                live.remove(name)
            settle(cluster)
        for name in live:
            kubelet.remove(name)
        settle(cluster)
    assert unknown <= len(SHAPES)
    assert exact >= 10


def test_second_resource_follows_the_first_within_one_container(start_cluster: Start) -> None:
    cluster = start_cluster(LAYOUTS["dgx-a100"]())
    topology = cluster.daemon.core.coordinator.topology
    for order in [(HCA, GPU), (GPU, HCA)] * 2:
        pod = cluster.kubelet.admit(
            f"pod-{len(cluster.kubelet.registrations)}-{order[0]}-{time.monotonic_ns()}",
            [ContainerRequest("main", {GPU: 1, HCA: 1})],
            order=order,
        )
        container = pod.container("main")
        (gpu,), (hca,) = container.devices[GPU], container.devices[HCA]
        assert topology.level(gpu, hca) is Level.PIX


def preferred(
    cluster: Cluster, resource: str, available: list[str], size: int, must: list[str] | None = None
) -> list[str]:
    request = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=available,
                must_include_deviceIDs=must or [],
                allocation_size=size,
            )
        ]
    )
    response = cluster.kubelet.stub(resource).GetPreferredAllocation(request, timeout=5)
    return list(response.container_responses[0].deviceIDs)


def test_must_include_is_always_in_the_answer(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node())
    gpus = [g.uuid for g in cluster.node.gpus]
    for must in (gpus[7], gpus[0], gpus[3]):
        answer = preferred(cluster, GPU, gpus, 3, [must])
        assert must in answer
        assert len(set(answer)) == 3


@pytest.mark.parametrize(
    ("size", "must", "code", "text"),
    [
        (9, [], grpc.StatusCode.FAILED_PRECONDITION, "requested 9 devices, only 8 available"),
        (0, [], grpc.StatusCode.INVALID_ARGUMENT, "at least 1"),
        (2, ["GPU-unknown"], grpc.StatusCode.INVALID_ARGUMENT, "unknown must-include"),
    ],
)
def test_unanswerable_preferred_requests_get_a_clear_status(
    start_cluster: Start, size: int, must: list[str], code: grpc.StatusCode, text: str
) -> None:
    cluster = start_cluster(hgx_node())
    gpus = [g.uuid for g in cluster.node.gpus]
    with pytest.raises(grpc.RpcError) as info:
        preferred(cluster, GPU, gpus, size, must)
    assert info.value.code() is code
    assert text in info.value.details()
    assert preferred(cluster, GPU, gpus, 1)  # still serving


def test_unhealthy_devices_are_never_offered(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node())
    broken = cluster.node.hcas[0]
    state = broken.directory / "infiniband" / broken.name / "ports" / "1" / "state"
    state.write_text(f"{DOWN[0]}\n")
    assert cluster.kubelet.wait_for(
        lambda: cluster.kubelet.devices(HCA)[broken.device_id].health == "Unhealthy", timeout=5
    )
    everything = [h.device_id for h in cluster.node.hcas]
    answer = preferred(cluster, HCA, everything, 7)
    assert broken.device_id not in answer
    with pytest.raises(grpc.RpcError) as info:
        preferred(cluster, HCA, everything, 8)
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as info:
        preferred(cluster, HCA, everything, 2, [broken.device_id])
    assert "must-include device ids not available" in info.value.details()


def test_alignment_is_verified_through_pod_resources(start_cluster: Start) -> None:
    cluster = start_cluster(LAYOUTS["dgx-a100"]())
    kubelet = cluster.kubelet
    pod = kubelet.admit("train", [ContainerRequest("main", {GPU: 2, HCA: 2})])
    solo = kubelet.admit("infer", [ContainerRequest("srv", {GPU: 1})])
    monitor = cluster.daemon.core.monitor

    def reported() -> bool:
        report = monitor.report()
        return "default/train/main" in report and "default/infer/srv" in report

    deadline = time.monotonic() + 5
    while not reported() and time.monotonic() < deadline:
        time.sleep(0.05)
    report = monitor.report()
    train = report["default/train/main"]
    assert sorted(train.gpus) == sorted(pod.container("main").devices[GPU])
    assert train.worst is Level.PIX
    assert train.total == 2
    assert report["default/infer/srv"].worst is None
    assert report["default/infer/srv"].gpus == solo.container("srv").devices[GPU]
    # Released devices become free again for the other resource's choices.
    kubelet.remove("train")
    monitor.poke()
    deadline = time.monotonic() + 5
    while "default/train/main" in monitor.report() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "default/train/main" not in monitor.report()
    assert set(pod.container("main").devices[HCA]) <= cluster.daemon.core.coordinator.free(
        cluster.daemon.core.coordinator.topology.kind[pod.container("main").devices[HCA][0]]
    )


def test_pod_resources_polling_stays_far_below_the_kubelet_limit(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node())
    kubelet = cluster.kubelet
    started = time.monotonic()
    before = kubelet.pod_resources_calls
    for index in range(16):
        name = f"p{index}"
        kubelet.admit(name, [ContainerRequest("c", {GPU: 1, HCA: 1})])
        kubelet.remove(name)
    time.sleep(1.0)
    elapsed = time.monotonic() - started
    calls = kubelet.pod_resources_calls - before
    min_interval = cluster.daemon.config.pod_resources.min_interval_seconds
    assert calls >= 1
    assert calls <= elapsed / min_interval + 1
    assert calls / elapsed < 100


def test_attach_mode_gives_gpus_their_nearest_hcas(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node(), **{"allocation.attach_hcas": True})
    g = cluster.node.gpus
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=[g[1].uuid, g[6].uuid])]
    )
    response = cluster.kubelet.stub(GPU).Allocate(request, timeout=5)
    (container,) = response.container_responses
    assert container.envs["NVIDIA_VISIBLE_DEVICES"] == f"{g[1].uuid},{g[6].uuid}"
    assert container.envs["NCCL_IB_HCA"] == "=mlx5_1,mlx5_6"
    paths = [d.host_path for d in container.devices]
    assert paths == [
        "/dev/nvidia1",
        "/dev/nvidia6",
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        "/dev/infiniband/uverbs1",
        "/dev/infiniband/umad1",
        "/dev/infiniband/issm1",
        "/dev/infiniband/uverbs6",
        "/dev/infiniband/umad6",
        "/dev/infiniband/issm6",
        "/dev/infiniband/rdma_cm",
    ]


def test_attach_mode_works_without_serving_the_hca_resource(start_cluster: Start) -> None:
    cluster = start_cluster(
        hgx_node(), wait=False, **{"allocation.attach_hcas": True, "resources.hca.enabled": False}
    )
    assert cluster.kubelet.wait_for_devices(GPU, 8, timeout=10)
    assert not cluster.kubelet.registered(HCA)
    gpu = cluster.node.gpus[4]
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=[gpu.uuid])]
    )
    (container,) = cluster.kubelet.stub(GPU).Allocate(request, timeout=5).container_responses
    assert container.envs["NCCL_IB_HCA"] == "=mlx5_4"
    assert "/dev/infiniband/uverbs4" in [d.host_path for d in container.devices]
