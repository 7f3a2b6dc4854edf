"""The kubelet's Topology Manager as placement follows it: hints, the
merge of each policy, the scopes, and the devices a container may then get.
What the real kubelet does with the same pods is the node tier's
(tests/real_node/test_topology_manager.py); these are the rules one by one."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from devplugin.model import DeviceKind
from devplugin.policy.allocator import Allocator
from devplugin.policy.node_record import node_from_record
from devplugin.policy.node_state import NodeState
from devplugin.policy.placement import place
from devplugin.policy.pod_request import Shape, shape_of
from devplugin.policy.podinfo import parse_pod
from devplugin.policy.topology_manager import (
    BEST_EFFORT,
    NONE,
    POD,
    RESTRICTED,
    SINGLE,
    Hint,
    KubeletPolicy,
    Pool,
    hints,
    merge,
)
from tests.extender_support import inventory, record

MACHINE = (0, 1)


def pool(every: dict[int, int], free: dict[int, int]) -> Pool:
    return Pool(every, free)


def test_device_hints_prefer_the_fewest_nodes_any_empty_node_could_use() -> None:
    four_each = {0: 4, 1: 4}
    found = hints(pool(four_each, four_each), 2, MACHINE)
    assert found == [Hint(0b01, True), Hint(0b10, True), Hint(0b11, False)]
    # Five never fit one node: both together is the narrowest, so preferred.
    assert hints(pool(four_each, four_each), 5, MACHINE) == [Hint(0b11, True)]
    # Two free on each: four fit only across both, which is not the fewest.
    assert hints(pool(four_each, {0: 2, 1: 2}), 4, MACHINE) == [Hint(0b11, False)]
    # Too few free anywhere: nothing fits; no device with a node: no preference.
    assert hints(pool(four_each, {0: 1}), 2, MACHINE) == []
    assert hints(pool({}, {}), 2, MACHINE) is None


def test_device_masks_span_the_nodes_with_devices_from_1_37_and_every_node_before() -> None:
    only_first = pool({0: 4}, {0: 4})
    assert hints(only_first, 2, MACHINE) == [Hint(0b01, True)]
    older = hints(only_first, 2, MACHINE, device_nodes_only=False)
    assert older == [Hint(0b01, True), Hint(0b11, False)]


def test_cpu_hints_count_every_cpu_for_the_fewest_and_the_free_ones_for_a_fit() -> None:
    # cpu0 on node 0 reserved for the system, cpu1 on node 1 free.
    cpus = pool({0: 1, 1: 1}, {0: 0, 1: 1})
    assert hints(cpus, 1, MACHINE, devices=False) == [Hint(0b10, True), Hint(0b11, False)]


def test_single_numa_node_admits_only_one_node_every_resource_shares() -> None:
    gpus = [Hint(0b10, True), Hint(0b11, False)]
    hcas = [Hint(0b01, True), Hint(0b11, False)]
    best, admit = merge(SINGLE, [gpus, hcas], MACHINE)
    assert not admit
    best, admit = merge(SINGLE, [gpus, [Hint(0b10, True), Hint(0b11, False)]], MACHINE)
    assert (best, admit) == (Hint(0b10, True), True)
    # No resource with a preference: the whole machine, said as "any".
    assert merge(SINGLE, [None], MACHINE) == (Hint(None, True), True)


def test_restricted_admits_a_preferred_merge_and_best_effort_anything() -> None:
    across = [[Hint(0b11, False)]]
    assert merge(RESTRICTED, across, MACHINE)[1] is False
    best, admit = merge(BEST_EFFORT, across, MACHINE)
    assert (best, admit) == (Hint(0b11, False), True)
    assert merge(RESTRICTED, [[Hint(0b11, True)]], MACHINE) == (Hint(0b11, True), True)
    assert merge(NONE, across, MACHINE) == (Hint(None, True), True)


def test_the_merge_prefers_preferred_then_narrower_then_the_lower_node() -> None:
    both = [Hint(0b01, True), Hint(0b10, True), Hint(0b11, False)]
    assert merge(RESTRICTED, [both, both], MACHINE) == (Hint(0b01, True), True)
    # Masks that disagree merge to their AND, not preferred.
    best, admit = merge(RESTRICTED, [[Hint(0b11, True)], [Hint(0b01, True)]], MACHINE)
    assert (best, admit) == (Hint(0b01, False), False)
    # A merge that leaves no node never wins.
    best, _ = merge(BEST_EFFORT, [[Hint(0b01, True)], [Hint(0b10, True)]], MACHINE)
    assert best == Hint(0b11, False)


# -- placement on a node whose kubelet aligns ------------------------------------


@pytest.fixture(scope="module")
def hgx(tmp_path_factory: pytest.TempPathFactory) -> NodeState:
    """hgx-h100: NUMA 0 and 1, four GPU+HCA pairs behind a switch each."""
    found = record(inventory("hgx-h100", tmp_path_factory.mktemp("hgx")))
    found["status"]["numaNodes"] = [{"id": 0, "cpus": 1, "freeCpus": 0},
                                    {"id": 1, "cpus": 1, "freeCpus": 1}]  # fmt: skip
    return node_from_record(found)


def on(node: NodeState, topology: str, scope: str = "container", cpu: str = "none") -> NodeState:
    return replace(node, kubelet=KubeletPolicy(topology, scope, cpu))


def numa_of(node: NodeState, devices: frozenset[str]) -> set[int | None]:
    return {node.topology.numa_node(d) for d in devices}


def keep(node: NodeState, per_numa: dict[int, tuple[int, int]]) -> NodeState:
    """The node with only this many GPUs and HCAs free on each NUMA node."""
    free: dict[DeviceKind, set[str]] = {DeviceKind.GPU: set(), DeviceKind.HCA: set()}
    for kind, index in ((DeviceKind.GPU, 0), (DeviceKind.HCA, 1)):
        for numa, counts in per_numa.items():
            there = sorted(d for d in node.free[kind] if node.topology.numa_node(d) == numa)
            free[kind].update(there[: counts[index]])
    return replace(node, free={k: frozenset(v) for k, v in free.items()})


def test_single_numa_node_refuses_what_no_node_holds_and_keeps_a_pod_on_one(
    hgx: NodeState,
) -> None:
    allocator = Allocator(hgx.topology)
    node = on(hgx, SINGLE)
    assert "TopologyAffinityError" in place(node, Shape(((5, 0),), 5, 0), allocator).reason
    fits = place(node, Shape(((2, 2),), 2, 2), allocator)
    assert fits.fits
    assert len(numa_of(node, fits.taken(node.free))) == 1
    # Without the Topology Manager five GPUs fit, across both nodes.
    assert place(hgx, Shape(((5, 0),), 5, 0), allocator).fits


def test_the_scopes_differ_when_two_containers_fit_only_apart(hgx: NodeState) -> None:
    allocator = Allocator(hgx.topology)
    split = keep(hgx, {0: (2, 2), 1: (2, 2)})
    two = Shape(((2, 2), (2, 2)), 4, 4)
    by_container = place(on(split, SINGLE), two, allocator)
    assert by_container.fits  # each container on a node of its own
    assert numa_of(split, by_container.taken(split.free)) == {0, 1}
    by_pod = place(on(split, SINGLE, POD), two, allocator)
    assert "TopologyAffinityError" in by_pod.reason  # the pod's 4 + 4 on one node
    assert place(on(keep(hgx, {0: (4, 4), 1: (0, 0)}), SINGLE, POD), two, allocator).fits


def test_restricted_refuses_a_split_the_empty_node_would_not_need(hgx: NodeState) -> None:
    allocator = Allocator(hgx.topology)
    split = keep(hgx, {0: (2, 2), 1: (2, 2)})
    four = Shape(((4, 0),), 4, 0)
    assert "TopologyAffinityError" in place(on(split, RESTRICTED), four, allocator).reason
    assert place(on(split, BEST_EFFORT), four, allocator).fits
    # Five never fit one node: across both is what restricted prefers.
    assert place(on(hgx, RESTRICTED), Shape(((5, 0),), 5, 0), allocator).fits


def guaranteed(cpus: str, gpus: int, hcas: int) -> dict[str, Any]:
    limits = {"cpu": cpus, "memory": "1Gi", "nvidia.com/gpu": str(gpus), "rdma/hca": str(hcas)}
    container = {"name": "main", "resources": {"limits": limits}}
    meta = {"uid": "u", "namespace": "default", "name": "g"}
    return {"metadata": meta, "spec": {"containers": [container]}}


def test_a_guaranteed_pods_whole_cpus_pull_its_devices_to_their_node(hgx: NodeState) -> None:
    allocator = Allocator(hgx.topology)
    shape = shape_of(parse_pod(guaranteed("1", 2, 2)), "nvidia.com/gpu", "rdma/hca")
    assert shape.cpus == (1,)
    node = on(hgx, SINGLE, cpu="static")
    got = place(node, shape, allocator)
    assert got.fits
    assert numa_of(node, got.taken(node.free)) == {1}  # the free CPU is on node 1
    assert got.cpus_after is not None
    assert got.cpus_after.free == {0: 0, 1: 0}
    # With node 1's GPUs taken no node has both: refused.
    no_gpus_there = keep(hgx, {0: (4, 4), 1: (0, 4)})
    refused = place(on(no_gpus_there, SINGLE, cpu="static"), shape, allocator)
    assert "TopologyAffinityError" in refused.reason
    # Fractional CPUs, or a pod that is not Guaranteed, ask for no exclusive CPU.
    assert shape_of(parse_pod(guaranteed("1500m", 2, 2)), "nvidia.com/gpu", "rdma/hca").cpus == ()
    burstable = guaranteed("1", 2, 2)
    del burstable["spec"]["containers"][0]["resources"]["limits"]["memory"]
    assert shape_of(parse_pod(burstable), "nvidia.com/gpu", "rdma/hca").cpus == ()


def test_a_record_says_the_policy_strictly(tmp_path: Path) -> None:
    found = record(inventory("hgx-h100", tmp_path))
    found["status"]["kubelet"] = {"topologyManagerPolicy": "single-numa-node",
                                  "topologyManagerScope": "pod", "cpuManagerPolicy": "static",
                                  "version": "v1.35.4"}  # fmt: skip
    found["status"]["numaNodes"] = [{"id": 0, "cpus": 4}, {"id": 1, "cpus": 4}]
    node = node_from_record(found)
    assert node.kubelet == KubeletPolicy(SINGLE, POD, "static")
    assert node.machine == (0, 1)
    assert node.cpus is None  # free CPUs not said: not counted
    assert node.device_nodes_only is False  # a 1.35 kubelet
    for key, bad in (("topologyManagerPolicy", "strict"), ("topologyManagerScope", "node")):
        wrong = {**found["status"]["kubelet"], key: bad}
        with pytest.raises(ValueError, match=key):
            node_from_record({**found, "status": {**found["status"], "kubelet": wrong}})
    twice = [{"id": 0, "cpus": 1}, {"id": 0, "cpus": 1}]
    with pytest.raises(ValueError, match="listed twice"):
        node_from_record({**found, "status": {**found["status"], "numaNodes": twice}})
