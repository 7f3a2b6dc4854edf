"""Exact, fast choice of the devices one container gets. Pure: data in, ids out.

The objective, lexicographic, lower is better (levels count PIX 1 .. SYS 5,
`lvl(x, S)` is the level from x to the nearest device of S):

GPUs, given a partner set P of HCAs (the HCAs just chosen for this
container; or, when GPUs come first and at least as many HCAs are expected,
every free HCA):
    1. worst  = max over chosen GPUs g of lvl(g, P)   (0 when P is empty)
    2. total  = sum of the same
    3. -connectivity: sum over chosen GPU pairs of 100 per NVLink plus
       PIX 50, PXB 40, PHB 30, NODE 20, SYS 10 (locality decides among
       equal links)
    4. -spread (fragmentation, below)

HCAs, second (the container's GPUs G were just chosen):
    1. worst  = max over g in G of lvl(g, H)
    2. total  = sum of the same
    4. -spread

HCAs, first, with p GPUs expected to follow (partner = the free GPUs F):
    1. worst  = the level within which p free GPUs have a chosen HCA (the
       p-th smallest lvl(g, H) over g in F): what the GPUs will get
    2. -how many free GPUs are within that level of H
    3. total  = sum over chosen HCAs h of lvl(h, F)
    4. -support: free GPUs within PIX of H, then PXB, PHB, NODE (HCAs next to
       the most free GPUs), then -spread

GPUs first with fewer HCAs expected (p < size) plan the HCAs first (as
above, with `size` GPUs expected) and then choose the GPUs second against
that plan: the pair then reaches the best worst level any choice of both
sets could.

Spread is the sum, over every domain (switch, root port, host bridge, NUMA
node), of the square of the free devices (both kinds) left in it. Squares
reward leaving free devices together: a lone free GPU in a half-used switch
is taken before a whole free switch is broken.

How it is exact without enumerating subsets: devices sit in a tree of nested
domains and every term above decomposes over that tree (levels are decided
by the deepest shared domain, pair scores by the domain where two devices
part, coverage by the lowest domain holding a chosen device). The worst
level is fixed by trying thresholds from a lower bound upwards; for each,
a knapsack-style fold over the tree gives the best value for every count in
every subtree. Interchangeable devices (same switch, same NVLinks) are
folded as one class with a count.

NVLinks the tree cannot express (GPU pairs parting at one domain with
different scores: DGX-1's hybrid cube mesh, bridges between GPUs under
different switches) are added by the linked fold: the same fold, whose
tables are also keyed by how many devices were taken from each class with
NVLinks leaving the part merged so far; a link's score is added where its
two ends meet. Exact, and fast while few such classes are open at once
(real layouts: at most eight). Beyond `LINKED_STATES`, GPU requests use a
branch and bound over subsets, exact when it ends within its time budget
and otherwise the best found, counted.
The tests compare all three against exhaustive search on randomized corpora.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import chain, repeat
from operator import add
from typing import Any, NamedTuple

from devplugin.model import DeviceKind, Refused, shown_ids
from devplugin.policy.topology import DOMAIN_DEPTH, NVLINK_SCORE, PCIE_SCORE, Level, Topology

try:
    from devplugin.policy import _foldc
except ImportError:  # pragma: no cover - the extension is built by every install here
    _foldc = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

SUPPORT_LEVELS = (Level.PIX, Level.PXB, Level.PHB, Level.NODE)

# The compiled fold computes on signed 128-bit integers; it takes a topology
# only when every value a fold can reach stays below 2**NATIVE_BITS (the
# weights grow with the device count: the 96 devices of 64-gpu-bridged need
# 105 bits, and each doubling of the devices adds about 12).
NATIVE_BITS = 126


def native_fold_available() -> bool:
    """Whether the compiled tree fold was built (see setup.py)."""
    return _foldc is not None


class Role(enum.Enum):
    FIRST = "first"  # the other resource is still to come: partner = its free devices
    SECOND = "second"  # the other resource was just chosen: partner = those devices


class Request(NamedTuple):
    """One container's request for devices of one kind, as the objective sees it."""

    kind: DeviceKind
    available: frozenset[str]
    size: int
    must_include: frozenset[str] = frozenset()
    role: Role = Role.FIRST
    # Devices of the other kind the objective measures against (see module doc).
    partner: frozenset[str] = frozenset()
    # Devices of the other kind that stay free after this choice (spread).
    other_free: frozenset[str] = frozenset()
    # First role: how many devices of the other kind the container is expected
    # to ask for next (None: as many as this request; 0: none).
    expected: int | None = None

    @property
    def expected_partners(self) -> int:
        if self.role is Role.SECOND or not self.partner:
            return 0
        wanted = self.size if self.expected is None else self.expected
        return min(wanted, len(self.partner))


class Score(NamedTuple):
    """The objective's terms for one answer (see the module docstring)."""

    worst: int
    total: int
    connectivity: int
    support: tuple[int, int, int, int]
    spread: int
    # HCAs first: free GPUs within `worst` of the chosen HCAs.
    reach: int = 0

    def key(self) -> tuple[int, ...]:
        return (
            self.worst,
            -self.reach,
            self.total,
            -self.connectivity,
            *(-count for count in self.support),
            -self.spread,
        )


class Choice(NamedTuple):
    """An answer and its score."""

    ids: tuple[str, ...]
    score: Score
    # GPUs first with fewer HCAs expected: the HCAs the GPUs were placed near.
    plan: tuple[str, ...] = ()


def _coverage_mode(request: Request) -> bool:
    """HCAs chosen second are judged by how well they cover the GPUs."""
    return request.kind is DeviceKind.HCA and request.role is Role.SECOND


def _support_mode(request: Request) -> bool:
    """HCAs chosen first are judged by the free GPUs they will be near."""
    return (
        request.kind is DeviceKind.HCA
        and request.role is Role.FIRST
        and request.expected_partners > 0
    )


def _cost_partner(request: Request) -> frozenset[str]:
    """The set each chosen device's own level is measured to (cost terms)."""
    if request.role is Role.FIRST and request.expected_partners == 0:
        return frozenset()
    if _coverage_mode(request):
        return frozenset()
    return request.partner


def validate(topology: Topology, request: Request) -> frozenset[str]:
    """The usable candidates; raises Refused for unanswerable requests."""
    if request.size < 1:
        raise Refused(
            f"allocation size must be at least 1, got {request.size}", invalid_argument=True
        )
    unknown = sorted(request.must_include - topology.id_set(request.kind))
    if unknown:
        raise Refused(
            f"unknown must-include device ids: {shown_ids(unknown)}", invalid_argument=True
        )
    if len(request.must_include) > request.size:
        raise Refused(
            f"{len(request.must_include)} must-include ids exceed the allocation size "
            f"{request.size}",
            invalid_argument=True,
        )
    candidates = request.available & topology.id_set(request.kind)
    missing = sorted(request.must_include - candidates)
    if missing:
        raise Refused(
            f"must-include device ids not available: {shown_ids(missing)}",
            invalid_argument=False,
        )
    if request.size > len(candidates):
        raise Refused(
            f"requested {request.size} devices, only {len(candidates)} available",
            invalid_argument=False,
        )
    return candidates


def evaluate(topology: Topology, request: Request, chosen: Iterable[str]) -> Score:
    """The objective of one candidate answer, computed from the definitions.

    Slow and obvious on purpose: the exhaustive search and the tests use it
    as the reference the fast search is checked against.
    """
    picked = list(chosen)
    worst = total = reach = 0
    support = (0, 0, 0, 0)
    if _coverage_mode(request):
        levels = [min(topology.level(q, h) for h in picked) for q in request.partner]
        worst, total = max(levels, default=0), sum(levels)
    cost_partner = _cost_partner(request)
    if cost_partner:
        levels = [min(topology.level(d, p) for p in cost_partner) for d in picked]
        worst, total = max(levels), sum(levels)
    if _support_mode(request):
        covered = sorted(min(topology.level(q, h) for h in picked) for q in request.partner)
        worst = covered[request.expected_partners - 1]
        reach = sum(1 for level in covered if level <= worst)
        s1, s2, s3, s4 = (sum(1 for lv in covered if lv <= limit) for limit in SUPPORT_LEVELS)
        support = (s1, s2, s3, s4)
    connectivity = 0
    if request.kind is DeviceKind.GPU:
        connectivity = sum(topology.score(a, b) for a, b in itertools.combinations(picked, 2))
    chosen_set = set(picked)
    spread = 0
    for depth in range(DOMAIN_DEPTH):
        free: dict[object, int] = {}
        for device in request.available:
            if device not in chosen_set:
                key = topology.placement[device].keys[depth]
                free[key] = free.get(key, 0) + 1
        for device in request.other_free:
            key = topology.placement[device].keys[depth]
            free[key] = free.get(key, 0) + 1
        spread += sum(count * count for count in free.values())
    return Score(worst, total, connectivity, support, spread, reach)


def exhaustive(topology: Topology, request: Request) -> Choice:
    """The optimum by enumerating every subset (reference; exponential)."""
    candidates = validate(topology, request)
    must = sorted(request.must_include)
    rest = sorted(candidates - request.must_include)
    best: Choice | None = None
    for extra in itertools.combinations(rest, request.size - len(must)):
        ids = (*must, *extra)
        score = evaluate(topology, request, ids)
        if best is None or score.key() < best.score.key():
            best = Choice(ids, score)
    assert best is not None
    return best


# In `gpu_pairs`: the largest score of any pair.
TOP_PAIR = ("", "")


def _domain_counts(topology: Topology, devices: Iterable[str]) -> dict[object, int]:
    """How many of `devices` sit in each domain, keyed (depth, domain)."""
    counts: dict[object, int] = {}
    for device in devices:
        for depth in range(DOMAIN_DEPTH):
            key = (depth, topology.placement[device].keys[depth])
            counts[key] = counts.get(key, 0) + 1
    return counts


def bounded_search(
    topology: Topology,
    request: Request,
    deadline: float,
    clock: Callable[[], float] = time.monotonic,
    pairs: dict[tuple[str, str], int] | None = None,
) -> tuple[Choice, bool]:
    """Exhaustive search over GPU subsets, scored incrementally (the same
    objective `evaluate` defines), stopping at `deadline`: (best found,
    whether every subset was scored, i.e. the answer is exact).

    For GPU requests on NVLink graphs the tree cannot express. Candidates
    are ordered best first (lowest level to the partner, most NVLinks), so
    the subsets scored before a deadline are the promising ones."""
    candidates = validate(topology, request)
    partner = _cost_partner(request)
    cost = {d: (min(topology.level(d, p) for p in partner) if partner else 0) for d in candidates}
    # Ordering only (best candidates first): NVLinks to every GPU will do.
    links = (
        {d: sum(topology.nvlinks(d, e) for e in topology.ids(DeviceKind.GPU)) for d in candidates}
        if pairs is None
        else {d: pairs.get((d, d), 0) for d in candidates}
    )
    must = sorted(request.must_include)
    rest = sorted(candidates - request.must_include, key=lambda d: (cost[d], -links[d], d))
    keys = {
        d: tuple((depth, topology.placement[d].keys[depth]) for depth in range(DOMAIN_DEPTH))
        for d in candidates
    }
    base = _domain_counts(topology, (*request.available, *request.other_free))
    base_spread = sum(c * c for c in base.values())
    pair = pairs if pairs is not None else gpu_pairs(topology)
    need = request.size - len(must)
    # Running state of the depth-first search over `rest` (best first).
    worst0 = max((cost[d] for d in must), default=0)
    total0 = sum(cost[d] for d in must)
    conn0 = sum(pair[(a, b)] for a, b in itertools.combinations(must, 2))
    costs = [cost[d] for d in rest]
    prefix = [0, *itertools.accumulate(costs)]
    top_pair = pair.get(TOP_PAIR, 0)
    best: list[Any] = [None, None]  # [rank, Choice]
    visited = [0]
    stopped = [False]
    chosen: list[str] = list(must)
    taken = _domain_counts(topology, must)

    def spread_now() -> int:
        return base_spread - sum(base[key] ** 2 - (base[key] - k) ** 2 for key, k in taken.items())

    def visit(start: int, left: int, worst: int, total: int, conn: int) -> None:
        visited[0] += 1
        # Each visit may weigh many candidates: look at the clock every time
        # (once there is an answer; the first descent reaches one directly).
        if best[0] is not None and clock() > deadline:
            stopped[0] = True
        if stopped[0]:
            return
        if left == 0:
            score = Score(worst, total, conn, (0, 0, 0, 0), spread_now())
            rank = score.key()
            if best[0] is None or rank < best[0]:
                best[0], best[1] = rank, Choice(tuple(chosen), score)
            return
        for index in range(start, len(rest) - left + 1):
            # Bounds from the cheapest `left` candidates from here on (they are
            # ordered by level): worst and total can only be this or worse.
            if best[0] is not None:
                low_worst = max(worst, costs[index + left - 1])
                if low_worst > best[0][0]:
                    return  # later candidates cost at least as much
                if low_worst == best[0][0]:
                    low_total = total + prefix[index + left] - prefix[index]
                    if low_total > best[0][2]:
                        return
                    if low_total == best[0][2]:
                        gain = max(
                            (sum(pair[(d, x)] for x in chosen) for d in rest[index:]),
                            default=0,
                        )
                        high_conn = conn + left * gain + left * (left - 1) // 2 * top_pair
                        if -high_conn > best[0][3]:
                            continue
            device = rest[index]
            add = sum(pair[(device, x)] for x in chosen)
            chosen.append(device)
            for key in keys[device]:
                taken[key] = taken.get(key, 0) + 1
            visit(index + 1, left - 1, max(worst, cost[device]), total + cost[device], conn + add)
            for key in keys[device]:
                taken[key] -= 1
                if not taken[key]:
                    del taken[key]
            chosen.pop()
            if stopped[0]:
                return

    visit(0, need, worst0, total0, conn0)
    assert best[1] is not None
    return best[1], not stopped[0]


def gpu_pairs(topology: Topology) -> dict[tuple[str, str], int]:
    """Every GPU pair's score, both ways (once per topology)."""
    gpus = topology.ids(DeviceKind.GPU)
    found: dict[tuple[str, str], int] = {}
    for i, a in enumerate(gpus):
        for b in gpus[i + 1 :]:
            found[(a, b)] = found[(b, a)] = topology.score(a, b)
    best = max(found.values(), default=0)
    # (g, g): g's NVLinks to every GPU, for ordering candidates.
    for gpu in gpus:
        found[(gpu, gpu)] = sum(topology.nvlinks(gpu, other) for other in gpus)
    found[TOP_PAIR] = best
    return found


def plan_request(request: Request, candidates: frozenset[str], expected: int) -> Request:
    """GPUs first with `expected` < size HCAs to follow: the HCA request that
    places those HCAs where the GPUs can be nearest."""
    return Request(
        DeviceKind.HCA,
        request.partner,
        expected,
        role=Role.FIRST,
        partner=candidates,
        other_free=candidates,
        expected=request.size,
    )


def planned_request(request: Request, candidates: frozenset[str], plan: Iterable[str]) -> Request:
    """The GPU request, chosen second against the planned HCAs."""
    planned = frozenset(plan)
    return Request(
        DeviceKind.GPU,
        candidates,
        request.size,
        request.must_include,
        Role.SECOND,
        planned,
        request.partner - planned,
    )


# A class or subtree that takes nothing, at no cost (never mutated).
_NOTHING: list[int] = [0]


def _convolve(first: list[int], second: list[int], low: int, high: int, inf: int) -> list[int]:
    """out[s] = min over a + b = s of first[a] + second[b], for s <= high
    (both at least two long); slots under `low` may be left infinite (nobody
    needs them). Whole rows go through map() so the inner loop runs in C."""
    if len(second) == 2 or len(first) == 2:
        if len(second) != 2:
            first, second = second, first
        zero, one = second
        out = list(
            map(
                min,
                chain(map(add, first, repeat(zero)), (inf,)),
                chain((inf,), map(add, first, repeat(one))),
            )
        )
        del out[high + 1 :]
        return out
    out = [inf] * (high + 1)
    half = inf >> 1
    width = len(first)
    if low <= 0 and high == width + len(second) - 2:
        # Every slot wanted: each row lands whole.
        for taken, value in enumerate(second):
            if value < half:
                to = taken + width
                out[taken:to] = map(min, out[taken:to], map(add, first, repeat(value)))
        return out
    for taken, value in enumerate(second):
        if value >= half:
            continue
        start, stop = max(low - taken, 0), min(width, high - taken + 1)
        if start < stop:
            at, to = start + taken, stop + taken
            out[at:to] = map(min, out[at:to], map(add, first[start:stop], repeat(value)))
    return out


@dataclass(frozen=True)
class _FoldNode:
    """One node of the compressed tree as a fold of one kind walks it."""

    node: int
    level: int
    children: tuple[int, ...]  # child nodes (their lowest kept node)
    mine: tuple[int, ...]  # classes of the kind being chosen
    others: tuple[int, ...]  # classes of the other kind (free room, partners)


@dataclass(frozen=True)
class _FoldTables:
    """What the tree fold reads per request kind, built once per topology.

    GPU pair scores decompose over the tree: a pair parting at node N scores
    cross[N], so the connectivity of a choice is the sum over nodes of
    C(k_N, 2) * (cross[N] - cross[parent]) plus, per class, C(k_c, 2) *
    (internal - cross[its node]), where k is how many were taken below. Each
    node then adds one row after its merge instead of a term per pair of
    counts inside it. A node no pair parts at takes its parent's score, so
    it adds nothing."""

    walk: tuple[_FoldNode, ...]  # children before parents
    classes: tuple[int, ...]  # the classes of this kind
    # Per class and cost level (0-5), the value of taking k of it.
    class_values: tuple[tuple[list[int], ...], ...]
    # Per node, the connectivity row added after its merge (None: nothing).
    node_penalty: tuple[list[int] | None, ...]
    # Per node, by free devices below it: the connectivity and spread rows
    # added together after its merge (None per node: nothing to add; per
    # room: not built yet). Filled as rooms are met.
    finish: tuple[list[list[int] | None] | None, ...]


class _OutOfTime(Exception):
    """The linked fold passed the request's budget."""


@dataclass
class _Inputs:
    """Per-request arrays, indexed by class (per node where named)."""

    cap: list[int]  # candidates per class
    must: list[int]  # must-include devices per class
    cost: list[int]  # level to the partner set per class (cost modes)
    partner: list[int]  # partner devices per class
    other: list[int]  # free devices of the other kind per class

    def per_node(self, topology: Topology) -> tuple[list[int], list[int]]:
        """Free devices (both kinds) per node before the choice, and partners
        per subtree (the tree fold sums these as it goes; the linked fold
        reads them here)."""
        free = [0] * len(topology.nodes)
        targets = [0] * len(topology.nodes)
        for c, path in enumerate(topology.class_path):
            room, pending = self.cap[c] + self.other[c], self.partner[c]
            if room or pending:
                for node in path:
                    free[node] += room
                    targets[node] += pending
        return free, targets


# Finishing rows (see `_FoldTables.finish`) up to this long are kept: at
# most this many squared per node, a few hundred KiB for 128 devices.
FINISH_CACHED = 129

# The time a GPU search on an NVLink graph the tree cannot express may take.
SEARCH_BUDGET = 0.2

# The linked fold carries, through each merge, one table per combination of
# counts of the classes whose NVLinks still leave the merged part; past this
# many combinations meeting in one merge, the bounded search is used instead
# (the two DGX-1 meshes need 256; bridged PCIe trees 4).
LINKED_STATES = 4096


@dataclass(frozen=True)
class _Step:
    """One item folded into a node by the linked fold."""

    is_class: bool
    item: int
    # (position in the state so far, position in the item's state, score per
    # pair of chosen devices): the NVLinks this merge closes.
    edges: tuple[tuple[int, int, int], ...]
    # Positions of the joined state (so far + item) still linked outside.
    keep: tuple[int, ...]
    keeps_all: bool


@dataclass(frozen=True)
class _LinkedPlan:
    """How the linked fold walks one topology (built once).

    The tree fold gives each subtree its best value per count. NVLinks that
    the tree cannot express make a subtree's value depend on which linked
    devices it took, so the linked fold keeps a table per count *and* per
    state: the counts taken from each class whose NVLinks reach beyond the
    part merged so far. When a merge brings both ends of a link together,
    the link's score is added and the class drops out of the state. The
    states stay few when the NVLink graph is local to the tree (meshes
    within a node, bridges between neighbouring switches)."""

    steps: tuple[tuple[_Step, ...], ...]  # per node
    open_class: tuple[bool, ...]  # per class: linked to another class
    pcie: tuple[int, ...]  # per node: PCIe score of a pair parting there

    @staticmethod
    def build(
        topology: Topology, order: list[int], node_items: list[list[tuple[bool, int]]]
    ) -> _LinkedPlan | None:
        t = topology
        gpus = [k for k in t.classes if k.kind is DeviceKind.GPU]
        links: list[dict[int, int]] = [{} for _ in t.classes]
        for a in gpus:
            for b in gpus:
                count = t.nvlinks(a.devices[0], b.devices[0]) if a is not b else 0
                if count:
                    links[a.index][b.index] = NVLINK_SCORE * count
        under: list[frozenset[int]] = [frozenset()] * len(t.nodes)
        opened: list[tuple[int, ...]] = [()] * len(t.nodes)
        steps: list[tuple[_Step, ...]] = [()] * len(t.nodes)
        for node in order:
            merged: set[int] = set()
            frontier: list[int] = []
            node_steps: list[_Step] = []
            for is_class, item in node_items[node]:
                if is_class and t.classes[item].kind is not DeviceKind.GPU:
                    continue  # never taken by a GPU request: nothing to fold
                if is_class:
                    members: frozenset[int] = frozenset((item,))
                    item_open = [item] if links[item] else []
                else:
                    members, item_open = under[item], list(opened[item])
                joined = frontier + item_open
                combos = 1
                for c in joined:
                    combos *= len(t.classes[c].devices) + 1
                if combos > LINKED_STATES:
                    return None
                edges = tuple(
                    (i, j, links[a][b])
                    for i, a in enumerate(frontier)
                    for j, b in enumerate(item_open)
                    if b in links[a]
                )
                merged |= members
                keep = tuple(i for i, c in enumerate(joined) if not links[c].keys() <= merged)
                frontier = [joined[i] for i in keep]
                node_steps.append(_Step(is_class, item, edges, keep, len(keep) == len(joined)))
            under[node], opened[node] = frozenset(merged), tuple(frontier)
            steps[node] = tuple(node_steps)
        return _LinkedPlan(
            tuple(steps),
            tuple(bool(row) for row in links),
            tuple(PCIE_SCORE[node.level] for node in t.nodes),
        )


class Allocator:
    """The fast exact search for one topology (rebuilt when devices change)."""

    def __init__(
        self,
        topology: Topology,
        *,
        budget: float = SEARCH_BUDGET,
        on_budget: Callable[[], None] | None = None,
        native: bool = True,
    ) -> None:
        self.topology = topology
        self._budget = budget
        self._on_budget = on_budget
        # Searches that ran out of time and answered their best so far.
        self.budget_hits = 0
        self._pairs: dict[tuple[str, str], int] | None = None
        t = topology
        n = max(1, len(t.kind))
        links = max((count for gpu in t.gpus for _, count in gpu.nvlink_peers), default=0)
        max_score = max(
            [NVLINK_SCORE * links + PCIE_SCORE[Level.PIX], *t.cross_score]
            + [klass.internal_score for klass in t.classes]
        )
        # Mixed-radix weights: one integer orders like the lexicographic key.
        # Each bound covers the largest magnitude a component can reach.
        bounds = [
            n,  # reach (HCAs first)
            5 * n,  # total
            max_score * n * n,  # connectivity
            n, n, n, n,  # support within PIX, PXB, PHB, NODE
            DOMAIN_DEPTH * n * n,  # spread
        ]  # fmt: skip
        weights = [1] * len(bounds)
        for i in range(len(bounds) - 2, -1, -1):
            weights[i] = weights[i + 1] * (2 * bounds[i + 1] + 1)
        # Decoding peels the components off from the last (spread) to the second.
        self._digits = [(2 * bounds[i] + 1, bounds[i]) for i in range(len(bounds) - 1, 0, -1)]
        self._w_reach, self._w_total, self._w_conn = weights[0], weights[1], weights[2]
        self._w_support = weights[3:7]
        self._w_spread = weights[7]
        # The fold visits a compressed tree: a node with one child and no
        # classes has the same subtree as that child, so it adds nothing but
        # a second copy of the child's spread term. Chains collapse into
        # their lowest node, which counts the spread term once per domain in
        # the chain (`spread_copies`).
        keep = [
            node.index == 0 or len(node.children) != 1 or bool(node.classes) for node in t.nodes
        ]
        self._spread_copies = [0] * len(t.nodes)

        def lowest(node: int) -> int:
            copies = 0
            while True:
                if 0 < t.nodes[node].depth <= DOMAIN_DEPTH:
                    copies += 1
                if keep[node]:
                    self._spread_copies[node] += copies
                    return node
                node = t.nodes[node].children[0]

        self._node_items: list[list[tuple[bool, int]]] = [[] for _ in t.nodes]
        self._order: list[int] = []
        for node in t.postorder:
            if not keep[node]:
                continue
            self._order.append(node)
            self._node_items[node] = [
                (False, lowest(child)) for child in t.nodes[node].children
            ] + [(True, c) for c in t.nodes[node].classes]
        if 0 < t.nodes[0].depth <= DOMAIN_DEPTH:  # pragma: no cover - the root is no domain
            self._spread_copies[0] += 1
        self._node_level = [int(node.level) for node in t.nodes]
        # Per class, the nodes from it to the root as bits. A child's index is
        # above its parent's, so the deepest node two paths share is the
        # highest bit they have in common.
        self._path_bits = [sum(1 << node for node in path) for path in t.class_path]
        # Per class, its device when it has only one.
        self._alone = [k.devices[0] if len(k.devices) == 1 else None for k in t.classes]
        # Larger than any value a choice can have, by a margin no sum of
        # negative terms can close: "no such choice" in the fold's rows.
        self._inf = 4 * weights[0] * (2 * bounds[0] + 1)
        # Devices (both kinds) under each node: the spread rows' length.
        under = [0] * len(t.nodes)
        for klass in t.classes:
            for node in t.class_path[klass.index]:
                under[node] += len(klass.devices)
        self._under = under
        self._spread_rows: list[list[int] | None] = [
            [j * j * copies * self._w_spread for j in range(under[node] + 1)] if copies else None
            for node, copies in enumerate(self._spread_copies)
        ]
        self._tables = {kind: self._fold_tables(kind) for kind in DeviceKind}
        # The compiled fold per kind (None: the Python fold).
        self._native: dict[DeviceKind, _foldc.Tables | None] = {
            kind: self._native_tables(kind) if native else None for kind in DeviceKind
        }
        # NVLink graphs the tree cannot express: the fold that carries the
        # counts of linked classes until their links are inside (None when
        # those would be too many to carry; then the bounded search).
        self._linked = None if t.tree_exact else _LinkedPlan.build(t, self._order, self._node_items)

    def _fold_tables(self, kind: DeviceKind) -> _FoldTables:
        t = self.topology
        gpu = kind is DeviceKind.GPU
        w_total, w_conn = self._w_total, self._w_conn
        parent = [0] * len(t.nodes)
        walk: list[_FoldNode] = []
        for node in self._order:
            children: list[int] = []
            mine: list[int] = []
            others: list[int] = []
            for is_class, item in self._node_items[node]:
                if not is_class:
                    parent[item] = node
                    children.append(item)
                elif t.classes[item].kind is kind:
                    mine.append(item)
                else:
                    others.append(item)
            walk.append(
                _FoldNode(node, self._node_level[node], tuple(children), tuple(mine), tuple(others))
            )
        # The score of pairs parting at each node; where none part (one
        # child holds every GPU below), the parent's, so the step is zero.
        parting = [False] * len(t.nodes)
        for node, score in enumerate(t.cross_score):
            parting[node] = bool(score)
        cross = [0] * len(t.nodes)
        if gpu:
            for node in reversed(self._order):  # parents before children
                up = cross[parent[node]] if node else 0
                cross[node] = t.cross_score[node] if parting[node] else up
        classes = tuple(k.index for k in t.classes if k.kind is kind)
        class_values: list[tuple[list[int], ...]] = [()] * len(t.classes)
        of_kind = [0] * len(t.nodes)
        for c in classes:
            klass = t.classes[c]
            step = klass.internal_score - cross[klass.node] if gpu else 0
            class_values[c] = tuple(
                [
                    k * per * w_total - step * (k * (k - 1) // 2) * w_conn
                    for k in range(len(klass.devices) + 1)
                ]
                for per in range(6)
            )
            for node in t.class_path[c]:
                of_kind[node] += len(klass.devices)
        penalty: list[list[int] | None] = [None] * len(t.nodes)
        for node in self._order:
            step = cross[node] - (cross[parent[node]] if node else 0)
            if step:
                penalty[node] = [
                    -step * (k * (k - 1) // 2) * w_conn for k in range(of_kind[node] + 1)
                ]
        finish: list[list[list[int] | None] | None] = [
            [None] * (self._under[node] + 1)
            if spread is not None or penalty[node] is not None
            else None
            for node, spread in enumerate(self._spread_rows)
        ]
        return _FoldTables(tuple(walk), classes, tuple(class_values), tuple(penalty), tuple(finish))

    def _native_tables(self, kind: DeviceKind) -> _foldc.Tables | None:
        """The compiled fold's copy of `kind`'s tables, or None where it was
        not built or a fold's values could pass 128 bits."""
        if _foldc is None:
            return None
        t, tables = self.topology, self._tables[kind]
        # A fold's value is a sum of at most this many terms, each a table
        # entry, the infinity or a partner count times a level's unit; the
        # infinity is larger than any of the others (the weights' bounds
        # cover every component), so it bounds each term's factor.
        terms = 2 * len(t.classes) + 4 * len(t.nodes) + 4
        if (self._inf * (len(t.kind) + 1) * terms).bit_length() > NATIVE_BITS:
            return None
        return _foldc.Tables(
            len(t.nodes),
            [(n.node, n.level, n.children, n.mine, n.others) for n in tables.walk],
            [values or None for values in tables.class_values],
            tables.node_penalty,
            self._spread_rows,
            self._inf,
            self._w_total,
            self._w_reach,
            self._w_support,
            [int(level) for level in SUPPORT_LEVELS],
            self._digits,
        )

    @property
    def fold(self) -> str:
        """Which tree fold answers: "native" (compiled) or "python"."""
        return "native" if any(self._native.values()) else "python"

    def _finish_row(self, tables: _FoldTables, node: int, room: int) -> list[int]:
        """What a node adds to taking k below it, for k up to `room`: its
        connectivity term and its spread term with `room` free before."""
        penalty = tables.node_penalty[node]
        spread = self._spread_rows[node]
        count = room + 1 if penalty is None else min(room + 1, len(penalty))
        row = list(penalty[:count]) if penalty is not None else [0] * count
        if spread is not None:
            row = [value - spread[room - k] for k, value in enumerate(row)]
        return row

    # -- public --------------------------------------------------------------
    def choose(self, request: Request) -> Choice:
        candidates = validate(self.topology, request)
        expected = request.expected_partners
        if (
            request.kind is DeviceKind.GPU
            and request.role is Role.FIRST
            and 0 < expected < request.size
        ):
            return self._plan_then_choose(request, candidates, expected)
        if request.kind is DeviceKind.GPU:
            return self._gpus(request, candidates)
        return self._search(request, candidates)

    def _gpus(self, request: Request, candidates: frozenset[str]) -> Choice:
        """A GPU request, within the budget whatever the NVLink graph: the
        tree or linked fold, and if the linked fold runs past the budget
        (only graphs near `LINKED_STATES` could) the subset search's first
        answer."""
        deadline = time.monotonic() + self._budget
        if self.method != "bounded":
            try:
                return self._search(request, candidates, deadline)
            except _OutOfTime:
                pass
        return self._bounded(request, deadline)

    @property
    def method(self) -> str:
        """How GPU requests are searched: "tree" (exact), "linked" (exact, NVLink
        graph beyond the tree), "bounded" (exact within the budget)."""
        if self.topology.tree_exact:
            return "tree"
        return "bounded" if self._linked is None else "linked"

    def _bounded(self, request: Request, deadline: float) -> Choice:
        if self._pairs is None:
            self._pairs = gpu_pairs(self.topology)
        choice, complete = bounded_search(self.topology, request, deadline, pairs=self._pairs)
        if not complete:
            self.budget_hits += 1
            if self._on_budget is not None:
                self._on_budget()
        return choice

    def _plan_then_choose(
        self, request: Request, candidates: frozenset[str], expected: int
    ) -> Choice:
        """GPUs first, fewer HCAs to come: place the HCAs where `size` GPUs can
        be nearest, then choose the GPUs against those HCAs."""
        first = plan_request(request, candidates, expected)
        plan = self._search(first, validate(self.topology, first))
        choice = self._gpus(planned_request(request, candidates, plan.ids), candidates)
        best = Choice(choice.ids, choice.score, plan.ids)
        if request.must_include:
            # GPUs the kubelet reuses from the pod's init containers are in
            # the answer whatever the plan: also plan the HCAs nearest to
            # them, and keep whichever plan the GPUs end up closer to.
            near = plan_request(request, request.must_include, expected)
            plan = self._search(near, validate(self.topology, near))
            choice = self._gpus(planned_request(request, candidates, plan.ids), candidates)
            if choice.score.key() < best.score.key():
                best = Choice(choice.ids, choice.score, plan.ids)
        return best

    # -- the tree search -----------------------------------------------------
    def _search(
        self, request: Request, candidates: frozenset[str], deadline: float | None = None
    ) -> Choice:
        t = self.topology
        class_of = t.class_of.__getitem__
        nclasses = len(t.classes)
        cap = [0] * nclasses
        must = [0] * nclasses
        partner = [0] * nclasses
        other = [0] * nclasses
        for tally, devices in (
            (cap, candidates),
            (must, request.must_include),
            (partner, request.partner),
            (other, request.other_free),
        ):
            for c in map(class_of, devices):
                tally[c] += 1
        cost = [0] * nclasses
        cost_partner = set(map(class_of, _cost_partner(request)))
        if cost_partner:
            # The level to the nearest partner is the level of the deepest
            # domain that holds one (the root holds them all).
            bits, node_level = self._path_bits, self._node_level
            holding = 0
            for q in cost_partner:
                holding |= bits[q]
            for c in range(nclasses):
                if cap[c]:
                    cost[c] = node_level[(bits[c] & holding).bit_length() - 1]
        inputs = _Inputs(cap, must, cost, partner, other)
        support = _support_mode(request)
        if support:
            thresholds: Iterable[int] = range(1, 6)
        elif cost_partner or _coverage_mode(request):
            thresholds = range(self._lower_bound(request, inputs), 6)
        else:
            thresholds = (0,)
        linked = self._linked if request.kind is DeviceKind.GPU else None
        for threshold in thresholds:
            if linked is not None:
                assert deadline is not None
                found = self._fold_linked(request, threshold, inputs, linked, deadline)
            else:
                found = self._fold(request, threshold, inputs)
            if found is None:
                continue
            value, counts, parts = found
            score = self._decode(parts or self._components(value), threshold, support)
            if support and score.reach < request.expected_partners:
                continue
            return Choice(self._materialize(request, candidates, counts), score)
        raise Refused("no feasible allocation", invalid_argument=False)  # pragma: no cover

    def _lower_bound(self, request: Request, inputs: _Inputs) -> int:
        cap, must, cost = inputs.cap, inputs.must, inputs.cost
        if _coverage_mode(request):
            # Every partner needs a candidate within the threshold.
            bits, node_level, partner = self._path_bits, self._node_level, inputs.partner
            holding = 0
            for c in self._tables[request.kind].classes:
                if cap[c]:
                    holding |= bits[c]
            bound = 0
            for q, pending in enumerate(partner):
                if pending:
                    shared = bits[q] & holding
                    if shared:
                        bound = max(bound, node_level[shared.bit_length() - 1])
            return bound
        bound = 0
        have = [0] * 6
        for c in self._tables[request.kind].classes:
            if cap[c]:
                have[cost[c]] += cap[c]
                if must[c] and cost[c] > bound:
                    bound = cost[c]
        count = 0
        for level, more in enumerate(have):
            count += more
            if count >= request.size:
                return max(bound, level)
        return 5  # pragma: no cover - validate() guarantees capacity

    @staticmethod
    def _merge(
        steps: list[tuple[bool, int, list[int], list[int], list[int]]],
        is_class: bool,
        item: int,
        current: list[int],
        row: list[int],
        *,
        size: int,
        rest: int,
        inf: int,
    ) -> list[int]:
        """Fold one item's row (at least two long) into the node's row so far
        (`_NOTHING` before the first; recorded in `steps` for the walk back).
        `rest`: how many the items not merged yet could take at most."""
        if current is _NOTHING:
            merged = row  # the first item that can take something, as it is
        else:
            high = min(size, len(current) + len(row) - 2)
            # Counts the rest could not make up to `size` are never used.
            merged = _convolve(current, row, size - rest, high, inf)
        steps.append((is_class, item, row, current, merged))
        return merged

    def _fold(
        self, request: Request, threshold: int, inputs: _Inputs
    ) -> tuple[int, dict[int, int], tuple[int, ...] | None] | None:
        """The tree fold, compiled where it was built (the same values and
        choices as `_fold_python`; the tests compare them)."""
        native = self._native[request.kind]
        if native is None:
            return self._fold_python(request, threshold, inputs)
        mode = 1 if _coverage_mode(request) else 2 if _support_mode(request) else 0
        try:
            return native.fold(
                inputs.cap,
                inputs.must,
                inputs.cost,
                inputs.partner,
                inputs.other,
                request.size,
                threshold,
                mode,
            )
        except RuntimeError:  # pragma: no cover - a defect in the C fold
            # Keep answering, exactly, with the Python fold from now on.
            log.exception("the compiled fold failed; using the Python fold")
            self._native[request.kind] = None
            return self._fold_python(request, threshold, inputs)

    # Kept whole on purpose (a listed lint exception): this is the readable
    # specification _foldc.c follows step by step, and the twin tests compare
    # them on thousands of cases; split, it would no longer read side by side.
    def _fold_python(  # noqa: PLR0912, PLR0915
        self, request: Request, threshold: int, inputs: _Inputs
    ) -> tuple[int, dict[int, int], tuple[int, ...] | None] | None:
        """The tree fold: per node, the best value for each count taken below
        it (half of `self._inf` or more: no such choice). GPU pair scores are
        charged per node as C(k, 2) times the score's step from the parent
        (see `_FoldTables`), so the merges themselves are plain (min, +)
        convolutions, done in C by map() over whole rows."""
        t = self.topology
        tables = self._tables[request.kind]
        cap, must, cost = inputs.cap, inputs.must, inputs.cost
        partner, other = inputs.partner, inputs.other
        size = request.size
        inf = self._inf
        coverage = _coverage_mode(request)
        support = _support_mode(request)
        # Cost levels above the threshold are infeasible only when the
        # threshold bounds the chosen devices' own levels.
        prune = not coverage and not support
        # The value of one partner first covered at each level (index = level).
        cover_unit = [0] * 6
        if coverage:
            cover_unit = [inf if level > threshold else level * self._w_total for level in range(6)]
        elif support:
            for depth_level in range(1, 6):
                gain = -self._w_reach if depth_level <= threshold else 0
                for w, bound_level in zip(self._w_support, SUPPORT_LEVELS, strict=True):
                    if depth_level <= bound_level:
                        gain -= w
                cover_unit[depth_level] = gain

        class_values: list[list[int]] = [_NOTHING] * len(t.classes)
        # Per node: how many the classes below it could take at most.
        capacity = [0] * len(t.nodes)
        total = 0
        for c in tables.classes:
            if not cap[c]:
                continue
            per, need = cost[c], must[c]
            if prune and per > threshold:
                values = _NOTHING if not need else [inf]
            else:
                values = tables.class_values[c][per][: min(cap[c], size) + 1]
                if need:
                    values = [inf] * need + values[need:]
            class_values[c] = values
            total += len(values) - 1

        node_values: list[list[int]] = [_NOTHING] * len(t.nodes)
        # Per node: free devices (both kinds) and partners below it.
        free = [0] * len(t.nodes)
        targets = [0] * len(t.nodes)
        # Per node, the merges that took something: (item, its row, the
        # row before it, the merged row), for walking back.
        steps_of: list[list[tuple[bool, int, list[int], list[int], list[int]]]] = [
            [] for _ in t.nodes
        ]
        finish = tables.finish
        for fold_node in tables.walk:
            node = fold_node.node
            unit = cover_unit[fold_node.level]
            current = _NOTHING
            # `shift`: added to every count (items that take nothing whatever
            # happens); `zero`: the value when the whole node takes nothing,
            # its partners then covered further up, not here.
            zero = shift = below = room = waiting = 0
            steps = steps_of[node]
            for child in fold_node.children:
                values, pending = node_values[child], targets[child]
                room += free[child]
                first = values[0]
                zero += first
                if pending:
                    waiting += pending
                    # When this child takes nothing, its partners are covered here.
                    adjusted = first + pending * unit
                    row = [adjusted, *values[1:]] if len(values) > 1 else _NOTHING
                else:
                    adjusted, row = first, values
                if len(values) == 1:
                    shift += adjusted
                    continue
                below += capacity[child]
                current = self._merge(
                    steps, False, child, current, row, size=size, rest=total - below, inf=inf
                )
            for c in fold_node.mine:
                values = class_values[c]
                room += cap[c]
                if values is _NOTHING:
                    continue
                first = values[0]
                zero += first
                if len(values) == 1:
                    shift += first
                    continue
                below += len(values) - 1
                current = self._merge(
                    steps, True, c, current, values, size=size, rest=total - below, inf=inf
                )
            for c in fold_node.others:
                room += other[c]
                pending = partner[c]
                if pending:
                    waiting += pending
                    shift += pending * unit
            free[node], targets[node], capacity[node] = room, waiting, below
            if shift:
                current = list(map(add, current, repeat(shift)))
            if current[0] != zero:
                current = [zero, *current[1:]]
            ends = finish[node]
            if ends is not None:
                end = ends[room]
                if end is None:
                    end = self._finish_row(tables, node, room)
                    if len(end) <= FINISH_CACHED:
                        ends[room] = end
                current = list(map(add, current, end))
            node_values[node] = current
        root = node_values[0]
        best_value = root[size] if len(root) > size else inf
        if best_value >= inf >> 1:
            return None
        counts: dict[int, int] = {}
        stack = [(0, size)]
        while stack:
            node, k = stack.pop()
            for is_class, item, row, before, merged in reversed(steps_of[node]):
                if not k:
                    break
                goal = merged[k]
                # The largest count of this item that reaches the best value
                # (the tie-break the forward pass had when it kept the first).
                take = min(k, len(row) - 1)
                while k - take >= len(before) or before[k - take] + row[take] != goal:
                    take -= 1
                if take:
                    if is_class:
                        counts[item] = take
                    else:
                        stack.append((item, take))
                k -= take
        return best_value, counts, None  # components decoded by the caller

    # The linked fold's twin in _foldc.c: kept whole, as _fold_python.
    def _fold_linked(  # noqa: PLR0912, PLR0915
        self,
        request: Request,
        threshold: int,
        inputs: _Inputs,
        plan: _LinkedPlan,
        deadline: float,
    ) -> tuple[int, dict[int, int], tuple[int, ...] | None] | None:
        """The tree fold for GPUs on NVLink graphs the tree cannot express
        (see `_LinkedPlan`): per state, the best value for each count (None:
        no such choice). Raises _OutOfTime past `deadline`."""
        t = self.topology
        cap, must, cost = inputs.cap, inputs.must, inputs.cost
        free, _ = inputs.per_node(t)
        size = request.size
        w_total, w_conn, w_spread = self._w_total, self._w_conn, self._w_spread
        Row = list[int | None]
        Table = dict[tuple[int, ...], Row]
        class_tables: list[Table] = []
        for klass in t.classes:
            c = klass.index
            opened = plan.open_class[c]
            table: Table = {}
            if klass.kind is not DeviceKind.GPU:
                pass  # not in the plan's steps
            elif not cap[c]:
                table[(0,) if opened else ()] = [0]
            else:
                per, internal = cost[c], klass.internal_score
                high = min(cap[c], size)
                shared: Row = [None] * (high + 1)
                for k in range(must[c], high + 1):
                    if k and per > threshold:
                        break
                    value = k * per * w_total - internal * (k * (k - 1) // 2) * w_conn
                    if opened:
                        table[(k,)] = [None] * k + [value]
                    else:
                        shared[k] = value
                if not opened:
                    table[()] = shared
            class_tables.append(table)

        tables: list[Table] = [{} for _ in t.nodes]
        # Per node and step, per state and count: where the best value came
        # from, as (state so far, item state), and the item's count.
        Back = dict[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...], int] | None]]
        backs: list[list[Back]] = [[] for _ in t.nodes]
        copies = self._spread_copies
        for node in self._order:
            cross = plan.pcie[node] * w_conn
            current: Table = {(): [0]}
            for step in plan.steps[node]:
                other = class_tables[step.item] if step.is_class else tables[step.item]
                edges, keep = step.edges, step.keep
                merged: Table = {}
                back: Back = {}
                # Only the counts that have a value, each row once.
                others = [
                    (s2, [(k2, v2) for k2, v2 in enumerate(row2) if v2 is not None], len(row2))
                    for s2, row2 in other.items()
                ]
                for s1, row1 in current.items():
                    firsts = [(k1, v1) for k1, v1 in enumerate(row1) if v1 is not None]
                    for s2, seconds, width in others:
                        # One pair of rows is at most a few thousand steps.
                        if time.monotonic() > deadline:
                            raise _OutOfTime
                        link = sum(w * s1[i] * s2[j] for i, j, w in edges) * w_conn if edges else 0
                        joined = s1 + s2
                        state = joined if step.keeps_all else tuple([joined[i] for i in keep])
                        limit = min(size, len(row1) + width - 2)
                        out = merged.get(state)
                        if out is None:
                            out = merged[state] = [None] * (limit + 1)
                            way = back[state] = [None] * (limit + 1)
                        else:
                            way = back[state]
                            if len(out) <= limit:
                                out.extend([None] * (limit + 1 - len(out)))
                                way.extend([None] * (limit + 1 - len(way)))
                        origin = (s1, s2)
                        for k1, v1 in firsts:
                            base = v1 - link
                            cross_k1 = cross * k1
                            room = limit - k1
                            for k2, v2 in seconds:
                                if k2 > room:
                                    break
                                value = base + v2 - cross_k1 * k2
                                slot = k1 + k2
                                best = out[slot]
                                if best is None or value < best:
                                    out[slot] = value
                                    way[slot] = (*origin, k2)
                current = merged
                backs[node].append(back)
            if copies[node]:
                room, weight = free[node], copies[node] * w_spread
                for row in current.values():
                    for k, entry in enumerate(row):
                        if entry is not None:
                            row[k] = entry - (room - k) * (room - k) * weight
            tables[node] = current
        root = tables[0].get((), [])
        best_value = root[size] if len(root) > size else None
        if best_value is None:
            return None
        counts: dict[int, int] = {}
        stack: list[tuple[int, tuple[int, ...], int]] = [(0, (), size)]
        while stack:
            node, state, k = stack.pop()
            for step, back in zip(reversed(plan.steps[node]), reversed(backs[node]), strict=True):
                way_k = back[state][k]
                assert way_k is not None
                s1, s2, taken = way_k
                if taken:
                    if step.is_class:
                        counts[step.item] = taken
                    else:
                        stack.append((step.item, s2, taken))
                state, k = s1, k - taken
        return best_value, counts, None  # components decoded by the caller

    def _materialize(
        self, request: Request, candidates: frozenset[str], counts: dict[int, int]
    ) -> tuple[str, ...]:
        alone = self._alone
        if all(alone[c] is not None for c in counts):
            # One device per class (every class on most PCIe layouts).
            return tuple(alone[c] for c in sorted(counts))  # type: ignore[misc]
        ids: list[str] = []
        classes, must = self.topology.classes, request.must_include
        for c, count in sorted(counts.items()):
            devices = classes[c].devices  # sorted
            if len(devices) == 1:
                ids.append(devices[0])
                continue
            members = [d for d in devices if d in candidates]
            if must and not must.isdisjoint(members):
                # Must-include devices first: they are taken whatever the count.
                members = [d for d in members if d in must] + [d for d in members if d not in must]
            ids.extend(members[:count])
        return tuple(ids)

    def _components(self, value: int) -> tuple[int, ...]:
        """A value's eight components, first to last (the compiled fold
        returns the same with its value)."""
        digits: list[int] = []
        rest = value
        for base, bound in self._digits:
            digit = rest % base
            if digit > bound:
                digit -= base
            digits.append(digit)
            rest = (rest - digit) // base
        digits.append(rest)
        return tuple(reversed(digits))

    @staticmethod
    def _decode(parts: tuple[int, ...], threshold: int, support: bool) -> Score:
        neg_reach, total, neg_conn, s1, s2, s3, s4, neg_spread = parts
        return Score(
            worst=threshold,
            total=total,
            connectivity=-neg_conn,
            support=(-s1, -s2, -s3, -s4) if support else (0, 0, 0, 0),
            spread=-neg_spread,
            reach=-neg_reach,
        )
