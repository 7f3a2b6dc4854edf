"""The victims search (policy/preemption.py) where freeing more devices
makes the daemon's choice worse, and its bounds on a large full node."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from devplugin.model import DeviceKind
from devplugin.policy.allocator import Allocator
from devplugin.policy.node_record import node_from_record
from devplugin.policy.node_state import NodeState
from devplugin.policy.placement import place
from devplugin.policy.pod_request import Shape
from devplugin.policy.preemption import (
    BUDGET,
    SKIP_COST,
    Candidate,
    exhaustive,
    floor_level,
    freed,
    reachable,
    search_victims,
)
from devplugin.policy.topology import Level
from tests.extender_support import inventory, record


def shape(containers: tuple[tuple[int, int], ...]) -> Shape:
    return Shape(containers, sum(g for g, _ in containers), sum(h for _, h in containers))


def one_pod_per_device(layout: str, base: Path) -> tuple[NodeState, Allocator, list[Candidate]]:
    """A node whose every device is held by a pod of its own."""
    node = node_from_record(record(inventory(layout, base)))
    pods = [
        Candidate(f"p-{device}", 0, frozenset({device}))
        for kind in DeviceKind
        for device in sorted(node.free[kind])
    ]
    empty = {kind: frozenset[str]() for kind in DeviceKind}
    return replace(node, free=empty), Allocator(node.topology), pods


def test_the_best_level_is_searched_for_where_evicting_everyone_gives_a_worse_one(
    tmp_path: Path,
) -> None:
    # On the asymmetric node the daemon places this pod at NODE when every
    # device is free, and at PIX when one GPU is held: a search that takes
    # evicting everyone as the best level stops at NODE.
    node, allocator, pods = one_pod_per_device("asymmetric", tmp_path)
    wanted = shape(((1, 2), (2, 1)))
    everyone = place(freed(node, pods), wanted, allocator)
    assert everyone.fits
    assert everyone.worst is Level.NODE
    reference = exhaustive(node, wanted, allocator, pods)
    assert reference is not None
    assert reference[0] < int(Level.NODE)
    found = search_victims(node, wanted, allocator, pods)
    assert found.exact
    assert found.eviction is not None
    level = found.eviction.level
    assert level is not None
    assert (int(level), len(found.eviction.victims)) == reference
    # The filter's question: can preemption give PIX here? Yes.
    assert reachable(node, wanted, allocator, pods, Level.PIX)


def test_floor_is_never_beaten_by_any_placement(tmp_path: Path) -> None:
    node, allocator, pods = one_pod_per_device("asymmetric", tmp_path)
    for containers in (((1, 1),), ((2, 2), (1, 1)), ((4, 1),), ((1, 2), (2, 1))):
        wanted = shape(containers)
        reference = exhaustive(node, wanted, allocator, pods)
        assert reference is not None
        assert floor_level(freed(node, pods), wanted) <= reference[0]


def test_a_full_64_gpu_node_is_searched_within_the_budget(tmp_path: Path) -> None:
    # 64 one-GPU pods and an 8-GPU preemptor: sets of 1..7 pods can never
    # cover it and are not walked; sets of 8 number 4.4e9, so the budget
    # (placements, and sets skipped by count at SKIP_COST each) ends it.
    node = node_from_record(record(inventory("64-gpu", tmp_path)))
    pods = [
        Candidate(f"p{i}", 0, frozenset({gpu}))
        for i, gpu in enumerate(sorted(node.free[DeviceKind.GPU]))
    ]
    full = replace(node, free={**node.free, DeviceKind.GPU: frozenset()})
    allocator = Allocator(node.topology)
    wanted = shape(((8, 1),))
    found = search_victims(full, wanted, allocator, pods, budget=300)
    assert found.eviction is not None
    assert len(found.eviction.victims) == 8
    assert found.placements <= 300
    assert found.looked <= 300 / SKIP_COST
    # Pods that share a switch come first: the first set found is aligned.
    assert found.eviction.level == floor_level(full, wanted)
    # A deadline already passed: the best found so far, said not proven.
    ended = search_victims(full, wanted, allocator, pods, deadline=0.0, clock=lambda: 1.0)
    assert not ended.exact
    assert ended.placements <= 1
    assert BUDGET >= 300
