"""What one container's choice of devices is judged by: the request, the
score and its tie-breaks, written once. Pure.

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

`Score.key` is the order; `Score.signed` the terms after the worst level
as the folds sum them (`TERMS` names them), and `Weights` packs them into
one integer that orders like the key. `evaluate` computes a score from the
definitions and `exhaustive` enumerates every subset with it: the fallback
the tests hold every faster search to.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from devplugin.model import DeviceKind, Refused, shown_ids
from devplugin.policy.topology import DOMAIN_DEPTH, NVLINK_SCORE, PCIE_SCORE, Level, Topology

SUPPORT_LEVELS = (Level.PIX, Level.PXB, Level.PHB, Level.NODE)

# The terms after the worst level, in the order they decide (`Score.signed`).
TERMS = (
    "reach",
    "total",
    "connectivity",
    "support_pix",
    "support_pxb",
    "support_phb",
    "support_node",
    "spread",
)


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
        """Lower is better: the worst level, then the terms in `TERMS` order."""
        return (self.worst, *self.signed())

    def signed(self) -> tuple[int, ...]:
        """The terms after the worst level in `TERMS` order, each signed so
        that lower is better (the fold sums them, weighted)."""
        s1, s2, s3, s4 = self.support
        return (-self.reach, self.total, -self.connectivity, -s1, -s2, -s3, -s4, -self.spread)

    @classmethod
    def from_signed(cls, worst: int, signed: Sequence[int], *, support: bool) -> Score:
        """The inverse of `signed` (support terms only where they count)."""
        neg_reach, total, neg_conn, s1, s2, s3, s4, neg_spread = signed
        return cls(
            worst=worst,
            total=total,
            connectivity=-neg_conn,
            support=(-s1, -s2, -s3, -s4) if support else (0, 0, 0, 0),
            spread=-neg_spread,
            reach=-neg_reach,
        )


class Choice(NamedTuple):
    """An answer and its score."""

    ids: tuple[str, ...]
    score: Score
    # GPUs first with fewer HCAs expected: the HCAs the GPUs were placed near.
    plan: tuple[str, ...] = ()


def coverage_mode(request: Request) -> bool:
    """HCAs chosen second are judged by how well they cover the GPUs."""
    return request.kind is DeviceKind.HCA and request.role is Role.SECOND


def support_mode(request: Request) -> bool:
    """HCAs chosen first are judged by the free GPUs they will be near."""
    return (
        request.kind is DeviceKind.HCA
        and request.role is Role.FIRST
        and request.expected_partners > 0
    )


def cost_partner(request: Request) -> frozenset[str]:
    """The set each chosen device's own level is measured to (cost terms)."""
    if request.role is Role.FIRST and request.expected_partners == 0:
        return frozenset()
    if coverage_mode(request):
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
    if coverage_mode(request):
        levels = [min(topology.level(q, h) for h in picked) for q in request.partner]
        worst, total = max(levels, default=0), sum(levels)
    partners = cost_partner(request)
    if partners:
        levels = [min(topology.level(d, p) for p in partners) for d in picked]
        worst, total = max(levels), sum(levels)
    if support_mode(request):
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


@dataclass(frozen=True)
class Weights:
    """Mixed-radix weights for one topology: the signed terms (`TERMS`
    order) weighted and summed give one integer that orders like
    `Score.key` among choices of one worst level; `signed` reads them back."""

    reach: int
    total: int
    connectivity: int
    support: tuple[int, int, int, int]
    spread: int
    # Larger than any value a choice can have, by a margin no sum of
    # negative terms can close: "no such choice" in the fold's rows.
    inf: int
    # (base, bound) per term from the last to the second, for decoding.
    digits: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, topology: Topology) -> Weights:
        t = topology
        n = max(1, len(t.kind))
        links = max((count for gpu in t.gpus for _, count in gpu.nvlink_peers), default=0)
        max_score = max(
            [NVLINK_SCORE * links + PCIE_SCORE[Level.PIX], *t.cross_score]
            + [klass.internal_score for klass in t.classes]
        )
        # The largest magnitude each term can reach.
        bound = {
            "reach": n,
            "total": 5 * n,
            "connectivity": max_score * n * n,
            "support_pix": n,
            "support_pxb": n,
            "support_phb": n,
            "support_node": n,
            "spread": DOMAIN_DEPTH * n * n,
        }
        bounds = [bound[name] for name in TERMS]
        weights = [1] * len(bounds)
        for i in range(len(bounds) - 2, -1, -1):
            weights[i] = weights[i + 1] * (2 * bounds[i + 1] + 1)
        w = dict(zip(TERMS, weights, strict=True))
        return cls(
            reach=w["reach"],
            total=w["total"],
            connectivity=w["connectivity"],
            support=(w["support_pix"], w["support_pxb"], w["support_phb"], w["support_node"]),
            spread=w["spread"],
            inf=4 * weights[0] * (2 * bounds[0] + 1),
            digits=tuple((2 * bounds[i] + 1, bounds[i]) for i in range(len(bounds) - 1, 0, -1)),
        )

    def signed(self, value: int) -> tuple[int, ...]:
        """A weighted sum's signed terms, first to last."""
        digits: list[int] = []
        rest = value
        for base, bound in self.digits:
            digit = rest % base
            if digit > bound:
                digit -= base
            digits.append(digit)
            rest = (rest - digit) // base
        digits.append(rest)
        return tuple(reversed(digits))
