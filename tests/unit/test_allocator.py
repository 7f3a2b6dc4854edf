"""The allocator is exact: equal to exhaustive search on named layouts and a
seeded randomized corpus, and honours must-include, availability and errors."""

from __future__ import annotations

import itertools
import random
from functools import cache

import pytest

from devplugin.model import DeviceKind, Refused
from devplugin.policy.allocator import (
    Allocator,
    Choice,
    Request,
    Role,
    evaluate,
    exhaustive,
    plan_request,
    planned_request,
    validate,
)
from devplugin.policy.fold import convolve
from devplugin.policy.topology import PCIE_SCORE, Level, Topology
from devplugin.testing.layouts import LAYOUTS
from devplugin.testing.node import devices_from_spec
from devplugin.testing.random_topology import random_requests, random_spec

GPU, HCA = DeviceKind.GPU, DeviceKind.HCA
TABLE_LAYOUTS = ["dgx-a100", "hgx-h100", "pcie-server", "asymmetric", "16-gpu"]
# The 16-GPU node's every-size tables take seconds of exhaustive search: with
# the slow simulations (CI runs them) where a test walks every size.
EVERY_SIZE_LAYOUTS = [
    *TABLE_LAYOUTS[:-1],
    pytest.param("16-gpu", marks=pytest.mark.slow),
]


@cache
def layout(name: str) -> tuple[Topology, Allocator, list[str], list[str]]:
    gpus, hcas = devices_from_spec(LAYOUTS[name]())
    topology = Topology(gpus, hcas)
    return topology, Allocator(topology), [g.uuid for g in gpus], [h.device_id for h in hcas]


def check(topology: Topology, allocator: Allocator, request: Request) -> Choice:
    """Fast answer == exhaustive optimum, and the answer is a valid one.

    GPUs first with fewer HCAs expected are chosen in two steps (plan the
    HCAs, then the GPUs against the plan); each step must be exhaustive-optimal.
    """
    choice = allocator.choose(request)
    assert len(choice.ids) == request.size
    assert len(set(choice.ids)) == request.size
    assert set(choice.ids) <= request.available
    assert request.must_include <= set(choice.ids)
    if choice.plan:
        candidates = validate(topology, request)
        # HCAs planned where any GPUs can be nearest, or (GPUs reused from
        # init containers) nearest to the reused ones: the plan is optimal
        # for one of them.
        sources = [candidates, request.must_include] if request.must_include else [candidates]
        plans = [plan_request(request, source, request.expected_partners) for source in sources]
        assert any(
            evaluate(topology, first, choice.plan).key() == exhaustive(topology, first).score.key()
            for first in plans
        )
        request = planned_request(request, candidates, choice.plan)
    else:
        assert not (
            request.kind is GPU
            and request.role is Role.FIRST
            and 0 < request.expected_partners < request.size
        )
    assert evaluate(topology, request, choice.ids) == choice.score
    reference = exhaustive(topology, request)
    assert choice.score.key() == reference.score.key(), (choice, reference)
    return choice


def scenarios(name: str) -> list[tuple[str, frozenset[str], frozenset[str], frozenset[str]]]:
    """(label, available GPUs, free HCAs, must-include GPUs) situations on a layout."""
    _, _, gpus, hcas = layout(name)
    rng = random.Random(name)
    in_use = frozenset(rng.sample(gpus, len(gpus) // 4))
    unhealthy = frozenset(rng.sample(sorted(set(gpus) - in_use), 1))
    busy_hcas = frozenset(rng.sample(hcas, len(hcas) // 3))
    return [
        ("all free", frozenset(gpus), frozenset(hcas), frozenset()),
        ("some in use", frozenset(gpus) - in_use, frozenset(hcas) - busy_hcas, frozenset()),
        ("unhealthy left out", frozenset(gpus) - unhealthy, frozenset(hcas), frozenset()),
        ("must include", frozenset(gpus) - in_use, frozenset(hcas),
         frozenset(sorted(set(gpus) - in_use)[-1:])),
    ]  # fmt: skip


@pytest.mark.parametrize("name", EVERY_SIZE_LAYOUTS)
def test_gpus_first_every_size_equals_exhaustive(name: str) -> None:
    topology, allocator, _, _ = layout(name)
    limit = 6 if name == "16-gpu" else 99  # keep exhaustive search affordable
    for _, available, free_hcas, must in scenarios(name):
        for size in range(max(1, len(must)), min(len(available), limit) + 1):
            request = Request(GPU, available, size, must, Role.FIRST, free_hcas, free_hcas)
            check(topology, allocator, request)


@pytest.mark.parametrize("name", EVERY_SIZE_LAYOUTS)
def test_gpus_second_against_chosen_hcas_equals_exhaustive(name: str) -> None:
    topology, allocator, _, _hcas = layout(name)
    rng = random.Random(f"{name}-second")
    limit = 6 if name == "16-gpu" else 99
    for _, available, free_hcas, must in scenarios(name):
        chosen = frozenset(rng.sample(sorted(free_hcas), min(2, len(free_hcas))))
        for size in range(max(1, len(must)), min(len(available), limit) + 1):
            request = Request(GPU, available, size, must, Role.SECOND, chosen, free_hcas - chosen)
            check(topology, allocator, request)


@pytest.mark.parametrize("name", TABLE_LAYOUTS)
@pytest.mark.parametrize("role", [Role.FIRST, Role.SECOND])
def test_hcas_every_size_equals_exhaustive(name: str, role: Role) -> None:
    topology, allocator, _gpus, _hcas = layout(name)
    rng = random.Random(f"{name}-hca")
    for _, free_gpus, available, _ in scenarios(name):
        if role is Role.SECOND:
            partner = frozenset(rng.sample(sorted(free_gpus), min(3, len(free_gpus))))
            other_free = free_gpus - partner
        else:
            partner = other_free = free_gpus
        must = frozenset(sorted(available)[:1])
        for size in range(1, len(available) + 1):
            check(
                topology, allocator, Request(HCA, available, size, must, role, partner, other_free)
            )


def test_randomized_corpus_equals_exhaustive() -> None:
    """1500 seeded random nodes (nested switches, 1-2 NUMA nodes, no / all-to-all /
    random NVLink), four random requests each, every mode."""
    cases = 0
    for seed in range(1500):
        rng = random.Random(seed)
        gpus, hcas = devices_from_spec(random_spec(rng, max_gpus=10))
        topology = Topology(gpus, hcas)
        allocator = Allocator(topology)
        gpu_ids = [g.uuid for g in gpus]
        hca_ids = [h.device_id for h in hcas]
        for request in random_requests(rng, gpu_ids, hca_ids, 4):
            check(topology, allocator, request)
            cases += 1
    assert cases == 6000


def joint_optimum(
    topology: Topology, free_gpus: frozenset[str], free_hcas: frozenset[str], m: int, k: int
) -> int:
    """Best worst GPU-to-nearest-HCA level over every pair of sets (brute force)."""
    best = int(Level.SYS)
    for hcas in itertools.combinations(sorted(free_hcas), k):
        levels = sorted(min(topology.level(g, h) for h in hcas) for g in free_gpus)
        best = min(best, levels[m - 1])
    return best


def two_steps(
    allocator: Allocator,
    first: DeviceKind,
    *,
    free_g: frozenset[str],
    free_h: frozenset[str],
    m: int,
    k: int,
) -> int:
    """One container through both steps, as the coordinator drives them."""
    if first is GPU:
        gpus = allocator.choose(
            Request(GPU, free_g, m, partner=free_h, other_free=free_h, expected=k)
        ).ids
        hcas = allocator.choose(
            Request(HCA, free_h, k, role=Role.SECOND, partner=frozenset(gpus))
        ).ids
    else:
        hcas = allocator.choose(
            Request(HCA, free_h, k, partner=free_g, other_free=free_g, expected=m)
        ).ids
        gpus = allocator.choose(
            Request(GPU, free_g, m, role=Role.SECOND, partner=frozenset(hcas))
        ).ids
    return max(min(allocator.topology.level(g, h) for h in hcas) for g in gpus)


def test_two_steps_reach_the_joint_optimum_when_the_partner_count_is_known() -> None:
    """Either order, any shape: with the other count known (the coordinator
    learns it from completed pairs), the pair's worst level is the best any
    choice of both sets could reach. Seeded corpus of random nodes and states."""
    cases = 0
    for seed in range(600):
        rng = random.Random(10_000 + seed)
        gpus, hcas = devices_from_spec(random_spec(rng, max_gpus=10))
        if not hcas:
            continue
        topology = Topology(gpus, hcas)
        allocator = Allocator(topology)
        free_g = frozenset(g.uuid for g in gpus if rng.random() < 0.8) or frozenset([gpus[0].uuid])
        free_h = frozenset(h.device_id for h in hcas if rng.random() < 0.8) or frozenset(
            [hcas[0].device_id]
        )
        for _ in range(3):
            m = rng.randint(1, len(free_g))
            k = rng.randint(1, min(len(free_h), 4))
            expected = joint_optimum(topology, free_g, free_h, m, k)
            for first in (GPU, HCA):
                assert (
                    two_steps(allocator, first, free_g=free_g, free_h=free_h, m=m, k=k) == expected
                ), (seed, m, k)
                cases += 1
    assert cases > 2000


def reused_optimum(
    topology: Topology,
    must: frozenset[str],
    free_gpus: frozenset[str],
    free_hcas: frozenset[str],
    m: int,
    k: int,
) -> int:
    """Best worst level over GPU sets holding `must` and HCA sets (brute force)."""
    best = int(Level.SYS)
    for hcas in itertools.combinations(sorted(free_hcas), k):
        near = {g: min(topology.level(g, h) for h in hcas) for g in free_gpus | must}
        rest = sorted(near[g] for g in free_gpus - must)
        worst = max([near[g] for g in must] + rest[: m - len(must)])
        best = min(best, worst)
    return best


def test_gpus_first_with_a_reused_gpu_reach_the_optimum_with_fewer_hcas_to_come() -> None:
    """GPUs asked first with some reused from the pod's init containers
    (must-include) and fewer HCAs to follow: the HCAs are planned where
    the GPUs, the reused ones included, can be nearest. Seeded corpus, and
    the case the node tier's kubelet order found on HGX (GPU 1 reused, two
    GPUs and one HCA: its own switch's HCA and a GPU of its NUMA node)."""
    topology, allocator, gpus, hcas = layout("hgx-h100")
    free_g = frozenset(gpus) - {gpus[2], gpus[3]}
    free_h = frozenset(hcas) - {hcas[0]}
    reused = frozenset([gpus[1]])
    request = Request(GPU, free_g, 2, reused, partner=free_h, other_free=free_h, expected=1)
    choice = allocator.choose(request)
    assert choice.score.worst == Level.NODE
    assert set(choice.ids) == {gpus[0], gpus[1]}
    cases = 0
    for seed in range(300):
        rng = random.Random(20_000 + seed)
        spec_gpus, spec_hcas = devices_from_spec(random_spec(rng, max_gpus=10))
        if len(spec_gpus) < 2 or not spec_hcas:
            continue
        topology = Topology(spec_gpus, spec_hcas)
        allocator = Allocator(topology)
        free_g = frozenset(g.uuid for g in spec_gpus if rng.random() < 0.8)
        free_h = frozenset(h.device_id for h in spec_hcas if rng.random() < 0.8)
        if len(free_g) < 2 or not free_h:
            continue
        must = frozenset(rng.sample(sorted(free_g), rng.randint(1, len(free_g) - 1)))
        m = rng.randint(len(must) + 1, len(free_g))
        k = rng.randint(1, min(len(free_h), m - 1)) if m > 1 else 1
        if k >= m:
            continue
        gpus_chosen = allocator.choose(
            Request(GPU, free_g, m, must, partner=free_h, other_free=free_h, expected=k)
        ).ids
        assert must <= set(gpus_chosen)
        hcas_chosen = allocator.choose(
            Request(HCA, free_h, k, role=Role.SECOND, partner=frozenset(gpus_chosen))
        ).ids
        got = max(min(topology.level(g, h) for h in hcas_chosen) for g in gpus_chosen)
        assert got == reused_optimum(topology, must, free_g, free_h, m, k), (seed, m, k)
        cases += 1
    assert cases > 100


# -- behaviour on hand-checked cases ------------------------------------------


def test_hgx_gpus_first_sit_next_to_free_hcas_in_one_numa_node() -> None:
    topology, allocator, gpus, hcas = layout("hgx-h100")
    free = frozenset(hcas)
    choice = allocator.choose(Request(GPU, frozenset(gpus), 4, partner=free, other_free=free))
    assert choice.score.worst == Level.PIX
    assert len({topology.numa_node(g) for g in choice.ids}) == 1


def test_second_resource_is_chosen_against_the_first() -> None:
    _topology, allocator, gpus, hcas = layout("dgx-a100")
    chosen_gpus = frozenset([gpus[2], gpus[3]])
    request = Request(HCA, frozenset(hcas), 2, role=Role.SECOND, partner=chosen_gpus)
    choice = allocator.choose(request)
    assert choice.score.worst == Level.PIX
    assert sorted(choice.ids) == sorted([hcas[2], hcas[3]])


def test_pcie_pair_is_taken_from_one_switch_next_to_the_hca() -> None:
    topology, allocator, gpus, hcas = layout("pcie-server")
    free = frozenset(hcas)
    choice = allocator.choose(Request(GPU, frozenset(gpus), 2, partner=free, other_free=free))
    assert choice.score.worst == Level.PIX
    assert topology.level(*choice.ids) is Level.PIX


def test_lone_free_gpu_is_taken_before_breaking_a_whole_free_switch() -> None:
    _topology, allocator, gpus, _ = layout("pcie-server")
    # GPU2 and GPU3 share a switch; with GPU2 in use, GPU3 is the lone one.
    available = frozenset(gpus) - {gpus[2]}
    choice = allocator.choose(Request(GPU, available, 1))
    assert choice.ids == (gpus[3],)


def test_nvlink_pairs_outrank_pcie_closeness() -> None:
    topology, allocator, gpus, _ = layout("asymmetric")
    choice = allocator.choose(Request(GPU, frozenset(gpus[4:]), 2))
    assert sorted(choice.ids) == sorted([gpus[5], gpus[6]])  # NV4 beats PXB
    # 100 per link plus the pair's PCIe locality.
    assert choice.score.connectivity == 400 + PCIE_SCORE[topology.level(gpus[5], gpus[6])]


def test_hcas_first_go_next_to_the_most_free_gpus() -> None:
    topology, allocator, gpus, hcas = layout("pcie-server")
    # NUMA 0 has two free GPUs left, NUMA 1 four: the HCA of NUMA 1 is preferred.
    free = frozenset(gpus) - {gpus[0], gpus[1]}
    hca = allocator.choose(Request(HCA, frozenset(hcas), 1, partner=free, other_free=free))
    assert topology.numa_node(hca.ids[0]) == 1


@pytest.mark.parametrize(
    ("request_", "message", "invalid"),
    [
        (lambda g: Request(GPU, frozenset(g), 0), "at least 1", True),
        (lambda g: Request(GPU, frozenset(g[:2]), 3), "requested 3 devices, only 2", False),
        (lambda g: Request(GPU, frozenset(g[:2]), 1, frozenset(["GPU-x"])), "unknown must", True),
        (lambda g: Request(GPU, frozenset(g[:2]), 2, frozenset([g[5]])), "not available", False),
        (lambda g: Request(GPU, frozenset(g), 1, frozenset(g[:2])), "exceed", True),
    ],
)
def test_unanswerable_requests_are_refused_clearly(
    request_: object, message: str, invalid: bool
) -> None:
    _, allocator, gpus, _ = layout("hgx-h100")
    assert callable(request_)
    with pytest.raises(Refused, match=message) as info:
        allocator.choose(request_(gpus))
    assert info.value.invalid_argument is invalid


def test_unknown_available_ids_are_ignored() -> None:
    _, allocator, gpus, _ = layout("hgx-h100")
    choice = allocator.choose(Request(GPU, frozenset([gpus[0], "GPU-gone"]), 1))
    assert choice.ids == (gpus[0],)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_under_nvswitch_equal_links_leave_the_choice_to_the_socket(size: int) -> None:
    # Every pair is NV18 on the HGX node: PCIe locality decides, so a
    # request that fits one NUMA node stays on it.
    topology, allocator, gpus, hcas = layout("hgx-h100")
    alone = allocator.choose(Request(GPU, frozenset(gpus), size))
    assert len({topology.numa_node(g) for g in alone.ids}) == 1
    # The same with HCAs to follow (the daemon's first-resource request).
    free = frozenset(hcas)
    paired = allocator.choose(
        Request(GPU, frozenset(gpus), size, partner=free, other_free=free, expected=size)
    )
    assert len({topology.numa_node(g) for g in paired.ids}) == 1


def test_row_merge_equals_brute_force_min_plus() -> None:
    """The fold's merge of two rows (infinite entries included) against the
    definition, over every slot it promises: low..high."""
    inf = 1 << 100
    rng = random.Random(7)
    for _ in range(3000):
        first = [rng.choice([inf, rng.randint(-50, 50)]) for _ in range(rng.randint(2, 9))]
        second = [rng.choice([inf, rng.randint(-50, 50)]) for _ in range(rng.randint(2, 9))]
        high = rng.randint(0, len(first) + len(second) - 2)
        low = rng.randint(-3, high)
        out = convolve(first, second, low, high, inf)
        assert len(out) == high + 1
        for slot in range(max(low, 0), high + 1):
            sums = [
                first[a] + second[slot - a]
                for a in range(len(first))
                if 0 <= slot - a < len(second)
            ]
            best = min(sums)
            if best >= inf >> 1:
                assert out[slot] >= inf >> 1, (first, second, low, high, slot)
            else:
                assert out[slot] == best, (first, second, low, high, slot)
