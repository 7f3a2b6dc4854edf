"""GPU choices on NVLink graphs the PCIe tree cannot express (DGX-1's hybrid
cube mesh, bridges between switches): the linked fold is exact on every real
layout; graphs it cannot carry get a search that is exact when it completes
in its budget, and bounded always (the best found so far, counted)."""

from __future__ import annotations

import logging
import math
import random

import pytest

from devplugin.model import DeviceKind
from devplugin.node.coordination import Coordinator
from devplugin.node.ledger import Ledger
from devplugin.policy.allocator import (
    Allocator,
    Request,
    evaluate,
    exhaustive,
    planned_request,
    validate,
)
from devplugin.policy.topology import Topology
from devplugin.testing.layouts import LAYOUTS
from devplugin.testing.node import NodeSpec, devices_from_spec
from devplugin.testing.random_topology import random_spec

GPU, HCA = DeviceKind.GPU, DeviceKind.HCA


def topology(name: str) -> Topology:
    return of_spec(LAYOUTS[name]())


def of_spec(spec: NodeSpec) -> Topology:
    gpus, hcas = devices_from_spec(spec)
    return Topology(gpus, hcas)


def assert_exact(mesh: Topology, allocator: Allocator, request: Request) -> None:
    """The answer is valid and scores what exhaustive search's best scores
    (GPUs first with fewer HCAs to follow: the GPUs against the planned HCAs)."""
    ours = allocator.choose(request)
    assert len(set(ours.ids)) == request.size
    assert request.must_include <= set(ours.ids) <= request.available
    if 0 < request.expected_partners < request.size:
        request = planned_request(request, validate(mesh, request), ours.plan)
        assert evaluate(mesh, request, ours.ids).key() == exhaustive(mesh, request).score.key()
        return
    assert evaluate(mesh, request, ours.ids) == ours.score
    assert ours.score.key() == exhaustive(mesh, request).score.key()


@pytest.mark.parametrize(
    ("layout", "method"),
    [
        ("dgx-1", "linked"),
        ("dgx-1x2", "linked"),
        ("16-gpu-bridged", "linked"),
        ("32-gpu-bridged", "linked"),
        ("64-gpu-bridged", "linked"),
        ("hgx-h100", "tree"),
        ("64-gpu", "tree"),
    ],
)
def test_every_real_layout_gets_an_exact_search(layout: str, method: str) -> None:
    assert Allocator(topology(layout)).method == method


def test_the_hybrid_cube_mesh_is_not_expressible_by_the_tree() -> None:
    mesh = topology("dgx-1")
    assert not mesh.tree_exact
    gpus = mesh.ids(GPU)
    assert mesh.nvlinks(gpus[0], gpus[4]) == 2  # across sockets
    assert mesh.nvlinks(gpus[0], gpus[5]) == 0
    assert sum(mesh.nvlinks(gpus[0], g) for g in gpus[1:]) == 6


@pytest.mark.parametrize("seed", range(12))
def test_on_dgx1_every_answer_equals_exhaustive_search(seed: int) -> None:
    mesh = topology("dgx-1")
    allocator = Allocator(mesh)
    rng = random.Random(seed)
    gpus, hcas = mesh.ids(GPU), mesh.ids(HCA)
    for size in range(1, len(gpus) + 1):
        available = frozenset(rng.sample(gpus, rng.randint(size, len(gpus))))
        must = frozenset(rng.sample(sorted(available), rng.randint(0, min(2, size))))
        partner = frozenset(rng.sample(hcas, rng.randint(0, len(hcas))))
        request = Request(
            GPU,
            available,
            size,
            must,
            partner=partner,
            other_free=partner,
            expected=rng.choice([None, 0, 1, size]),
        )
        assert_exact(mesh, allocator, request)
    assert allocator.budget_hits == 0


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dgx-1x2", "16-gpu-bridged"])
@pytest.mark.parametrize("seed", range(2))
def test_sixteen_gpu_nvlink_graphs_are_exact_at_every_size(seed: int, layout: str) -> None:
    # Two DGX-1 meshes; a PCIe tree whose NVLink bridges join neighbouring switches.
    mesh = topology(layout)
    assert not mesh.tree_exact
    allocator = Allocator(mesh)
    rng = random.Random(seed)
    gpus, hcas = mesh.ids(GPU), mesh.ids(HCA)
    for size in range(1, len(gpus) + 1):
        available = frozenset(rng.sample(gpus, rng.randint(size, len(gpus))))
        must = frozenset(rng.sample(sorted(available), rng.randint(0, 1)))
        partner = frozenset(rng.sample(hcas, rng.randint(size // 2, len(hcas))))
        request = Request(
            GPU,
            available,
            size,
            must,
            partner=partner,
            other_free=partner,
            expected=rng.choice([None, 0, max(1, size // 2)]),
        )
        assert_exact(mesh, allocator, request)
    assert allocator.budget_hits == 0


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["32-gpu-bridged", "64-gpu-bridged"])
def test_large_bridged_trees_are_exact_where_exhaustive_search_can_check(layout: str) -> None:
    """Every GPU free at the smallest sizes with at most 2,100 subsets and
    the two largest; then 11 GPUs left free in random places (every size,
    must-include, fewer or no HCAs to follow)."""
    mesh = topology(layout)
    allocator = Allocator(mesh)
    rng = random.Random(layout)
    gpus, hcas = mesh.ids(GPU), mesh.ids(HCA)
    everything = frozenset(hcas)
    for size in range(1, len(gpus) + 1):
        # (Leaving two of 64 out is 2,016 subsets too, but the reference
        # scores each of their 1,891 pairs; one left out is enough there.)
        if math.comb(len(gpus), size) <= 2_100 and (size <= 3 or size >= len(gpus) - 1):
            assert_exact(
                mesh,
                allocator,
                Request(GPU, frozenset(gpus), size, partner=everything, other_free=everything),
            )
    for size in range(1, 12):
        available = frozenset(rng.sample(gpus, 11))
        must = frozenset(rng.sample(sorted(available), rng.randint(0, min(2, size))))
        partner = frozenset(rng.sample(hcas, rng.randint(1, len(hcas))))
        request = Request(
            GPU,
            available,
            size,
            must,
            partner=partner,
            other_free=partner,
            expected=rng.choice([None, 0, 1, size]),
        )
        assert_exact(mesh, allocator, request)
    assert allocator.budget_hits == 0


def random_nvlink_spec(rng: random.Random) -> NodeSpec:
    """A random PCIe tree (up to 10 GPUs) with a random NVLink graph: sparse,
    dense, or bridges between GPU pairs anywhere, of 1-18 links."""
    spec = random_spec(rng, max_gpus=10)
    count = len(devices_from_spec(spec)[0])
    density = rng.choice([0.15, 0.35, 0.7])
    spec.nvlink_all_to_all = 0
    spec.nvlink_pairs = {
        (i, j): rng.choice([1, 2, 4, 12, 18])
        for i in range(count)
        for j in range(i + 1, count)
        if rng.random() < density
    }
    return spec


def test_random_nvlink_graphs_equal_exhaustive_search() -> None:
    """600 seeded random nodes and NVLink graphs, three requests each: random
    availability, must-include, partner HCAs and expected counts."""
    methods: dict[str, int] = {}
    cases = 0
    for seed in range(600):
        rng = random.Random(seed)
        mesh = of_spec(random_nvlink_spec(rng))
        allocator = Allocator(mesh)
        methods[allocator.method] = methods.get(allocator.method, 0) + 1
        gpus, hcas = mesh.ids(GPU), mesh.ids(HCA)
        for _ in range(3):
            available = [g for g in gpus if rng.random() < 0.8] or gpus[:1]
            size = rng.randint(1, len(available))
            must = frozenset(rng.sample(available, rng.randint(0, min(2, size))))
            partner = frozenset(h for h in hcas if rng.random() < 0.7)
            expected = rng.choice([None, 0, 1, size])
            request = Request(
                GPU,
                frozenset(available),
                size,
                must,
                partner=partner,
                other_free=partner,
                expected=expected,
            )
            assert_exact(mesh, allocator, request)
            cases += 1
        assert allocator.budget_hits == 0
    assert methods.get("linked", 0) > 400, methods
    assert cases == 1800


def crossed_mesh() -> Topology:
    """The 16-GPU tree with every GPU linked to its counterpart on the other
    socket and its neighbour: eight linked classes open on each socket, more
    than the linked fold carries."""
    spec = LAYOUTS["16-gpu"]()
    spec.nvlink_pairs = {(i, i + 8): 2 for i in range(8)}
    spec.nvlink_pairs.update({(i, i + 1): 1 for i in range(0, 16, 2)})
    return of_spec(spec)


def test_a_graph_too_wide_for_the_linked_fold_is_searched_within_the_budget() -> None:
    mesh = crossed_mesh()
    allocator = Allocator(mesh)
    assert allocator.method == "bounded"
    gpus, hcas = mesh.ids(GPU), mesh.ids(HCA)
    rng = random.Random(7)
    for size in (1, 2, 3, 15, 16):
        available = frozenset(gpus)
        partner = frozenset(rng.sample(hcas, 4))
        assert_exact(
            mesh, allocator, Request(GPU, available, size, partner=partner, other_free=partner)
        )
    assert allocator.budget_hits == 0


def test_a_linked_fold_past_its_budget_answers_and_is_counted() -> None:
    # No real layout comes near the budget; a budget nothing fits in shows
    # the way out: the subset search's first answer, counted.
    mesh = topology("dgx-1x2")
    hits: list[int] = []
    allocator = Allocator(mesh, budget=1e-9, on_budget=lambda: hits.append(1))
    assert allocator.method == "linked"
    hcas = frozenset(mesh.ids(HCA))
    choice = allocator.choose(
        Request(GPU, frozenset(mesh.ids(GPU)), 8, partner=hcas, other_free=hcas)
    )
    assert len(set(choice.ids)) == 8
    assert set(choice.ids) <= set(mesh.ids(GPU))
    assert allocator.budget_hits == len(hits) == 1


def test_a_search_past_its_budget_answers_its_best_and_is_counted() -> None:
    mesh = crossed_mesh()
    hits: list[int] = []
    allocator = Allocator(mesh, budget=0.0002, on_budget=lambda: hits.append(1))
    request = Request(GPU, frozenset(mesh.ids(GPU)), 8)  # 12,870 subsets
    choice = allocator.choose(request)
    assert allocator.budget_hits == 1
    assert hits == [1]
    assert len(set(choice.ids)) == 8
    assert set(choice.ids) <= set(mesh.ids(GPU))
    # Candidates best first (most NVLinks): the answer is linked throughout.
    assert all(any(mesh.nvlinks(g, other) for other in choice.ids) for g in choice.ids), choice.ids


def test_the_daemon_logs_which_search_a_node_gets(caplog: pytest.LogCaptureFixture) -> None:
    coordinator = Coordinator(Ledger())
    with caplog.at_level(logging.INFO, logger="devplugin.node.coordination"):
        coordinator.set_topology(topology("dgx-1"))
        coordinator.set_topology(topology("dgx-1"))  # the same search: said once
        coordinator.set_topology(crossed_mesh())
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GPU search")]
    assert said == ["GPU search: linked (8 GPUs)", "GPU search: bounded (16 GPUs)"]


@pytest.mark.parametrize(
    "links",
    [
        # A bridged pair inside a switch (one class of two) linked to a GPU
        # of the next switch: the class's count, 0-2, is what the fold carries.
        {(0, 1): 4, (0, 2): 2, (1, 2): 2},
        # Two such pairs linked to each other across the host bridges.
        {(0, 1): 4, (4, 5): 4, (0, 4): 1, (0, 5): 1, (1, 4): 1, (1, 5): 1},
        # A ring through every switch of one socket and a chord to the other.
        {(1, 2): 2, (3, 4): 2, (5, 6): 2, (7, 0): 2, (0, 8): 1},
    ],
    ids=["pair-to-neighbour", "pairs-across-bridges", "ring-and-chord"],
)
def test_linked_classes_of_several_gpus_are_carried_by_count(
    links: dict[tuple[int, int], int],
) -> None:
    spec = LAYOUTS["16-gpu"]()
    spec.nvlink_pairs = links
    mesh = of_spec(spec)
    allocator = Allocator(mesh)
    assert allocator.method == "linked"
    gpus, hcas = mesh.ids(GPU), mesh.ids(HCA)
    rng = random.Random(str(sorted(links)))
    for size in range(1, 9):
        available = frozenset(rng.sample(gpus, rng.randint(max(size, 10), len(gpus))))
        must = frozenset(rng.sample(sorted(available), rng.randint(0, 1)))
        partner = frozenset(rng.sample(hcas, rng.randint(1, len(hcas))))
        request = Request(
            GPU,
            available,
            size,
            must,
            partner=partner,
            other_free=partner,
            expected=rng.choice([None, 0]),
        )
        assert_exact(mesh, allocator, request)
