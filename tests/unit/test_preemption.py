"""Victims for a preemptor (policy/preemption.py): the best level eviction
can give, with the fewest victims, against a reference over every subset."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from devplugin.model import DeviceKind
from devplugin.policy.allocator import Allocator
from devplugin.policy.node_record import node_from_record
from devplugin.policy.node_state import NodeState
from devplugin.policy.placement import place
from devplugin.policy.pod_request import Shape
from devplugin.policy.preemption import Candidate, choose_victims, exhaustive, violations
from devplugin.policy.topology import Level
from tests.extender_support import inventory, record

# The every-subset reference takes seconds per layout: one layout in the
# suite, the others with the slow simulations (CI runs them).
SLOW_LAYOUTS = ["hgx-h100", "asymmetric", "dgx-a100"]
LAYOUTS = [
    "pcie-server",
    *(pytest.param(name, marks=pytest.mark.slow) for name in SLOW_LAYOUTS),
]
HOLDER_SHAPES = [(1, 1), (2, 1), (2, 2), (4, 2), (1, 0), (3, 1), (4, 4)]
PREEMPTORS = [((8, 8),), ((4, 4),), ((4, 2),), ((2, 2),), ((1, 1),), ((2, 2), (2, 2)), ((2, 0),)]


def shape(containers: tuple[tuple[int, int], ...]) -> Shape:
    return Shape(containers, sum(g for g, _ in containers), sum(h for _, h in containers))


def filled(
    layout: str, base: Path, rng: random.Random
) -> tuple[NodeState, Allocator, list[Candidate]]:
    """A node filled with lower-priority pods (those that still fit of 16
    tries), each placed as the daemon would, with its devices."""
    node = node_from_record(record(inventory(layout, base)))
    allocator = Allocator(node.topology)
    holders: list[Candidate] = []
    for index in range(16):
        wanted = shape((rng.choice(HOLDER_SHAPES),))
        outcome = place(node, wanted, allocator)
        if not outcome.fits or outcome.free_after is None:
            continue
        taken = outcome.taken(node.free)
        holders.append(Candidate(f"p{index}", rng.choice([0, 100, 200]), taken))
        node = replace(node, free=outcome.free_after)
    return node, allocator, holders


@pytest.mark.parametrize("layout", LAYOUTS)
def test_victims_give_the_best_level_with_the_fewest_pods_as_every_subset_says(
    layout: str, tmp_path: Path
) -> None:
    rng = random.Random(layout)
    checked = 0
    for case in range(12):
        node, allocator, holders = filled(layout, tmp_path / str(case), rng)
        wanted = shape(rng.choice(PREEMPTORS))
        reference = exhaustive(node, wanted, allocator, holders)
        chosen = choose_victims(node, wanted, allocator, holders)
        if reference is None:
            assert chosen is None
            continue
        assert chosen is not None
        level = int(chosen.level) if chosen.level is not None else 0
        assert (level, len(chosen.victims)) == reference, (layout, case, wanted)
        priorities = [v.priority for v in chosen.victims]
        assert priorities == sorted(priorities, reverse=True)
        checked += bool(chosen.victims)
    assert checked >= 6  # most cases need some eviction and can get it


def test_among_as_few_victims_the_lower_priorities_go(tmp_path: Path) -> None:
    node = node_from_record(record(inventory("hgx-h100", tmp_path)))
    allocator = Allocator(node.topology)
    # Two pods each holding one PIX pair; the preemptor needs one pair.
    holders = []
    for uid, priority in (("high", 200), ("low", 0)):
        outcome = place(node, shape(((1, 1),)), allocator)
        assert outcome.free_after is not None
        taken = outcome.taken(node.free)
        holders.append(Candidate(uid, priority, taken))
        node = replace(node, free=outcome.free_after)
    # Nothing else free: take every remaining device away.
    node = replace(node, free={kind: frozenset() for kind in DeviceKind})
    chosen = choose_victims(node, shape(((1, 1),)), allocator, holders)
    assert chosen is not None
    assert [v.uid for v in chosen.victims] == ["low"]
    assert chosen.level is Level.PIX


def test_none_when_evicting_every_lower_pod_still_leaves_no_room(tmp_path: Path) -> None:
    node, allocator, holders = filled("pcie-server", tmp_path, random.Random(3))
    # The preemptor asks for more than the node has.
    assert choose_victims(node, shape(((64, 1),)), allocator, holders) is None


def test_budget_violations_are_spent_victim_by_victim() -> None:
    a = Candidate("a", 0, frozenset({"g0"}), budgets=("ns/web",))
    b = Candidate("b", 0, frozenset({"g1"}), budgets=("ns/web",))
    c = Candidate("c", 0, frozenset({"g2"}), budgets=("ns/db", "ns/web"))
    assert violations([a], {"ns/web": 1}) == 0
    assert violations([a, b], {"ns/web": 1}) == 1
    assert violations([a, b, c], {"ns/web": 2, "ns/db": 5}) == 1
    assert violations([a, b], {}) == 0  # a budget not watched counts for nothing
