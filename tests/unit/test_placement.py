"""Placing a pod on a node from its NodeDevices record (pure): the record's
topology round-trips exactly, and the simulated choices are the daemon's."""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from devplugin.model import DeviceKind
from devplugin.node.alignment import best_worst_level
from devplugin.policy.allocator import Allocator
from devplugin.policy.node_record import node_from_record
from devplugin.policy.placement import check, place, scores
from devplugin.policy.pod_request import Requirement, Shape, requirement_of, shape_of
from devplugin.policy.podinfo import ContainerInfo, PodInfo
from devplugin.policy.topology import Level, Topology
from tests.extender_support import GPU, HCA, inventory, record


@pytest.mark.parametrize(
    "layout",
    ["hgx-h100", "dgx-a100", "pcie-server", "asymmetric", "16-gpu", "dgx-1", "16-gpu-bridged"],
)
def test_the_records_topology_gives_every_level_and_nvlink_of_the_node(
    layout: str, tmp_path: Path
) -> None:
    inv = inventory(layout, tmp_path)
    real = Topology.from_inventory(inv)
    rebuilt = node_from_record(record(inv)).topology
    ids = list(real.kind)
    assert set(rebuilt.kind) == set(ids)
    for a in ids:
        for b in ids:
            if a != b:
                assert rebuilt.level(a, b) == real.level(a, b), (a, b)
                assert rebuilt.nvlinks(a, b) == real.nvlinks(a, b), (a, b)
    # The extender searches such a node the way its daemon does.
    assert Allocator(rebuilt).method == Allocator(real).method


@pytest.mark.parametrize("layout", ["hgx-h100", "dgx-a100", "pcie-server"])
@pytest.mark.parametrize(("gpus", "hcas"), [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4), (3, 1)])
def test_a_single_container_gets_the_best_level_an_empty_node_allows(
    layout: str, gpus: int, hcas: int, tmp_path: Path
) -> None:
    inv = inventory(layout, tmp_path)
    node = node_from_record(record(inv))
    real = Topology.from_inventory(inv)
    outcome = place(node, Shape(((gpus, hcas),), gpus, hcas))
    if gpus > len(inv.gpus) or hcas > len(inv.hcas):
        assert not outcome.fits  # larger than the node
        return
    assert outcome.fits
    best = best_worst_level(real, real.ids(DeviceKind.GPU), real.ids(DeviceKind.HCA), gpus, hcas)
    assert outcome.worst == best


def test_held_and_unhealthy_devices_are_not_free_and_counts_filter(tmp_path: Path) -> None:
    inv = inventory("hgx-h100", tmp_path)
    gpus = [g.uuid for g in inv.gpus]
    hcas = [h.device_id for h in inv.hcas]
    from devplugin.node.alignment import ContainerAlignment

    held = [ContainerAlignment("ns", "p", "c", tuple(gpus[:6]), tuple(hcas[:2]), Level.PIX, 6)]
    node = node_from_record(record(inv, unhealthy=frozenset({gpus[7]}), allocations=held))
    assert node.free[DeviceKind.GPU] == {gpus[6]}
    assert node.holders == {("ns", "p")}
    outcome = place(node, Shape(((2, 1),), 2, 1))
    assert not outcome.fits
    assert "1 GPUs and 6 HCAs free" in outcome.reason


def test_a_required_alignment_filters_and_a_preferred_one_never_does(tmp_path: Path) -> None:
    inv = inventory("hgx-h100", tmp_path)
    node = node_from_record(record(inv))
    outcome = place(node, Shape(((2, 1),), 2, 1))  # NODE at best on this node
    assert outcome.worst is Level.NODE
    reason = check(outcome, Requirement(Level.PIX, required=True))
    assert reason is not None
    assert "NODE" in reason
    assert "PIX" in reason
    assert check(outcome, Requirement(Level.PIX, required=False)) is None
    assert check(outcome, Requirement(Level.NODE, required=True)) is None


def test_scores_rank_alignment_then_fragmentation(tmp_path: Path) -> None:
    inv = inventory("hgx-h100", tmp_path)
    gpus = [g.uuid for g in inv.gpus]
    hcas = [h.device_id for h in inv.hcas]
    from devplugin.node.alignment import ContainerAlignment

    empty = node_from_record(record(inv, "empty"))
    # Half used: the pod fits as well, and an empty node stays whole.
    held = [ContainerAlignment("ns", "p", "c", tuple(gpus[4:]), tuple(hcas[4:]), Level.PIX, 4)]
    half = node_from_record(record(inv, "half", allocations=held))
    shape = Shape(((2, 2),), 2, 2)
    outcomes = {"empty": place(empty, shape), "half": place(half, shape), "none": None}
    assert outcomes["empty"].worst == outcomes["half"].worst == Level.PIX  # type: ignore[union-attr]
    ranked = scores(outcomes)
    assert ranked["half"] == 10
    assert ranked["empty"] < 10
    assert ranked["none"] == 0


def test_shape_and_requirement_are_read_from_the_pod() -> None:
    def c(name: str, g: int, h: int, sidecar: bool = False) -> ContainerInfo:
        return ContainerInfo(name, MappingProxyType({GPU: g, HCA: h}), sidecar)

    pod = PodInfo(
        "u",
        "ns",
        "p",
        "",
        "Pending",
        "",
        False,
        (c("prep", 4, 0), c("side", 1, 1, sidecar=True)),
        (c("a", 2, 1), c("b", 0, 0)),
    )
    shape = shape_of(pod, GPU, HCA)
    assert shape.containers == ((1, 1), (2, 1))
    assert (shape.gpus, shape.hcas) == (4, 2)  # the init container's 4 GPUs
    assert requirement_of({}) == Requirement(None, False)
    assert requirement_of({"devplugin.io/alignment": "PXB"}) == Requirement(Level.PXB, False)
    assert requirement_of(
        {"devplugin.io/alignment": "PIX", "devplugin.io/alignment-policy": "required"}
    ) == Requirement(Level.PIX, True)
    with pytest.raises(ValueError, match="PIX, PXB, PHB or NODE"):
        requirement_of({"devplugin.io/alignment": "SYS"})
    with pytest.raises(ValueError, match="preferred or required"):
        requirement_of({"devplugin.io/alignment-policy": "always"})


@pytest.mark.parametrize(
    "bad",
    [
        {},
        {"metadata": {"name": "x"}},
        {"metadata": {"name": "x"}, "status": {"devices": "no"}},
        {
            "metadata": {"name": "x"},
            "status": {"devices": [{"id": "g", "kind": "tpu", "pciAddress": "0000:01:00.0"}]},
        },
    ],
)
def test_a_record_that_is_not_one_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"missing|must be|kind"):
        node_from_record(bad)
