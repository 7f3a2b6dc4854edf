"""Sharing through the kubelet simulator: GPU replicas and shared HCA units."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from devplugin.api import deviceplugin_v1beta1_pb2 as pb
from devplugin.model import Refused
from devplugin.node.gpu.resource import GpuResource
from devplugin.node.sharing import SharedResource, physical_of
from devplugin.policy.topology import Level
from devplugin.testing.kubelet import AdmissionError, ContainerRequest
from devplugin.testing.node import hgx_node
from tests.conftest import GPU, HCA, Cluster
from tests.support import hook, runs
from tests.waiting import wait_until

Start = Callable[..., Cluster]
SHARED = "nvidia.com/gpu.shared"


def start_shared(start_cluster: Start, **settings: object) -> Cluster:
    cluster = start_cluster(hgx_node(), wait=False, **settings)
    name = str(settings.get("sharing.gpu.resource_name") or GPU)
    assert cluster.kubelet.wait_for_devices(
        name, 8 * int(str(settings.get("sharing.gpu.replicas", 1))), timeout=10
    )
    assert cluster.kubelet.wait_for_devices(
        HCA, 8 * int(str(settings.get("sharing.hca.units", 1))), timeout=10
    )
    return cluster


def test_gpus_are_advertised_as_replicas_under_a_renamed_resource(start_cluster: Start) -> None:
    cluster = start_shared(
        start_cluster, **{"sharing.gpu.replicas": 4, "sharing.gpu.resource_name": SHARED}
    )
    assert {r.resource for r in cluster.kubelet.registrations} == {SHARED, HCA}
    devices = cluster.kubelet.devices(SHARED)
    assert len(devices) == 32
    for index, gpu in enumerate(cluster.node.gpus):
        for n in range(4):
            record = devices[f"{gpu.uuid}::{n}"]
            assert record.health == "Healthy"
            assert record.numa_nodes == (0 if index < 4 else 1,)


def test_distributed_replicas_spread_over_gpus_next_to_the_hcas(start_cluster: Start) -> None:
    cluster = start_shared(start_cluster, **{"sharing.gpu.replicas": 4})
    topology = cluster.daemon.core.coordinator.topology
    pod = cluster.kubelet.admit("p", [ContainerRequest("c", {GPU: 2, HCA: 2})], order=[GPU, HCA])
    container = pod.container("c")
    gpus = [physical_of(r) for r in container.devices[GPU]]
    assert len(set(gpus)) == 2  # one replica on each of two GPUs
    assert container.responses[GPU].envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(gpus)
    assert {d.host_path for d in container.responses[GPU].devices} >= {
        f"/dev/nvidia{topology.gpus[[g.uuid for g in topology.gpus].index(u)].minor_number}"
        for u in gpus
    }
    # The topology objective still holds for the physical GPUs behind them.
    hcas = container.devices[HCA]
    assert max(min(topology.level(g, h) for h in hcas) for g in gpus) is Level.PIX
    # More replicas than GPUs: every GPU gets one before any gets two.
    big = cluster.kubelet.admit("q", [ContainerRequest("c", {GPU: 10})]).container("c")
    per_gpu = Counter(physical_of(r) for r in big.devices[GPU])
    assert len(per_gpu) == 8
    assert sorted(per_gpu.values()) == [1, 1, 1, 1, 1, 1, 2, 2]


def test_packed_replicas_fill_few_gpus_partly_used_first(start_cluster: Start) -> None:
    cluster = start_shared(
        start_cluster, **{"sharing.gpu.replicas": 4, "sharing.gpu.policy": "packed"}
    )
    first = cluster.kubelet.admit("a", [ContainerRequest("c", {GPU: 3})]).container("c")
    assert len({physical_of(r) for r in first.devices[GPU]}) == 1
    (used,) = {physical_of(r) for r in first.devices[GPU]}
    # One replica left on that GPU: the next single replica takes it.
    second = cluster.kubelet.admit("b", [ContainerRequest("c", {GPU: 1})]).container("c")
    assert physical_of(second.devices[GPU][0]) == used
    six = cluster.kubelet.admit("d", [ContainerRequest("c", {GPU: 6})]).container("c")
    assert len({physical_of(r) for r in six.devices[GPU]}) == 2
    assert six.responses[GPU].envs["NVIDIA_VISIBLE_DEVICES"].count("GPU-") == 2


def test_several_replicas_of_one_gpu_can_be_refused(start_cluster: Start) -> None:
    cluster = start_shared(
        start_cluster, **{"sharing.gpu.replicas": 2, "sharing.gpu.refuse_multiple_per_gpu": True}
    )
    uuid = cluster.node.gpus[0].uuid
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=[f"{uuid}::0", f"{uuid}::1"])]
    )
    with pytest.raises(grpc.RpcError) as info:
        cluster.kubelet.stub(GPU).Allocate(request, timeout=5)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "several replicas of one device requested" in info.value.details()
    pod = cluster.kubelet.admit("p", [ContainerRequest("c", {GPU: 8})]).container("c")
    assert len({physical_of(r) for r in pod.devices[GPU]}) == 8
    with pytest.raises(AdmissionError):
        cluster.kubelet.admit("q", [ContainerRequest("c", {GPU: 9})])


def test_shared_hca_units_carry_the_hcas_nodes_and_follow_the_gpus(start_cluster: Start) -> None:
    cluster = start_shared(start_cluster, **{"sharing.hca.units": 4})
    topology = cluster.daemon.core.coordinator.topology
    assert len(cluster.kubelet.devices(HCA)) == 32
    pod = cluster.kubelet.admit("p", [ContainerRequest("c", {GPU: 1, HCA: 1})], order=[GPU, HCA])
    container = pod.container("c")
    (gpu,) = container.devices[GPU]
    (unit,) = container.devices[HCA]
    hca = physical_of(unit)
    assert topology.level(gpu, hca) is Level.PIX
    built = next(h for h in cluster.node.hcas if h.device_id == hca)
    response = container.responses[HCA]
    assert [d.host_path for d in response.devices] == [
        f"/dev/infiniband/uverbs{built.uverbs}",
        f"/dev/infiniband/umad{built.umads[0]}",
        f"/dev/infiniband/issm{built.issms[0]}",
        "/dev/infiniband/rdma_cm",
    ]
    assert response.envs["NCCL_IB_HCA"] == f"={built.name}"
    # Another unit of the same HCA gives the same nodes.
    other = f"{hca}::3" if unit != f"{hca}::3" else f"{hca}::2"
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=[other])]
    )
    again = cluster.kubelet.stub(HCA).Allocate(request, timeout=5).container_responses[0]
    assert [d.host_path for d in again.devices] == [d.host_path for d in response.devices]


def test_a_shared_gpu_is_cleaned_once_its_last_replica_is_released(
    start_cluster: Start, tmp_path: Path
) -> None:
    log = tmp_path / "cleanup.log"
    cluster = start_shared(
        start_cluster,
        **{
            "sharing.gpu.replicas": 2,
            "sharing.gpu.policy": "packed",
            "resources.gpu.hooks.cleanup": hook(log, "ok"),
        },
    )
    kubelet = cluster.kubelet
    a = kubelet.admit("a", [ContainerRequest("c", {GPU: 1})]).container("c")
    b = kubelet.admit("b", [ContainerRequest("c", {GPU: 1})]).container("c")
    gpu = physical_of(a.devices[GPU][0])
    assert physical_of(b.devices[GPU][0]) == gpu  # packed onto one GPU
    kubelet.remove("a")
    polls = cluster.daemon.core.monitor.polls
    assert wait_until(lambda: cluster.daemon.core.monitor.polls >= polls + 4)
    assert runs(log) == []  # b still holds a replica of it
    kubelet.remove("b")
    assert wait_until(lambda: len(runs(log)) == 1)
    assert runs(log)[0]["env"]["DEVPLUGIN_DEVICE_IDS"] == gpu
    assert kubelet.wait_for(
        lambda: all(kubelet.devices(GPU)[f"{gpu}::{n}"].health == "Healthy" for n in range(2)),
        timeout=5,
    )


# -- the replica choice on its own -----------------------------------------------


def shared(policy: str, replicas: int = 3, refuse: bool = False) -> SharedResource:
    return SharedResource(GpuResource(), replicas, policy=policy, refuse_multiple=refuse)


def pick_sorted(physical: frozenset[str], required: frozenset[str], count: int) -> list[str]:
    """A stand-in allocator: must-include first, then by id."""
    return (sorted(required) + sorted(physical - required))[:count]


ALL = [f"{g}::{n}" for g in ("A", "B", "C") for n in range(3)]


def test_distributed_gives_one_replica_per_device_first() -> None:
    assert shared("distributed").choose(ALL, [], 2, pick_sorted) == ["A::0", "B::0"]
    four = shared("distributed").choose(ALL, [], 4, pick_sorted)
    assert Counter(physical_of(r) for r in four) == {"A": 2, "B": 1, "C": 1}
    with_must = shared("distributed").choose(ALL, ["B::2"], 2, pick_sorted)
    assert with_must == ["B::2", "A::0"]


def test_packed_fills_the_fullest_used_device_first() -> None:
    # A has one free replica left, B and C all three.
    available = ["A::2", *ALL[3:]]
    assert shared("packed").choose(available, [], 1, pick_sorted) == ["A::2"]
    four = shared("packed").choose(available, [], 4, pick_sorted)
    assert Counter(physical_of(r) for r in four) == {"A": 1, "B": 3}


def test_refusing_several_replicas_per_device() -> None:
    resource = shared("distributed", refuse=True)
    with pytest.raises(Refused, match="at most one replica per device"):
        resource.choose(ALL, [], 4, pick_sorted)
    with pytest.raises(Refused, match="several replicas of one device"):
        resource.choose(ALL, ["A::0", "A::1"], 2, pick_sorted)
    with pytest.raises(Refused, match="only 9 available"):
        shared("packed").choose(ALL, [], 10, pick_sorted)
