"""Which lower-priority pods to evict on a node so a pod gets an aligned set.

kube-scheduler's own preemption counts GPUs and HCAs as numbers: it frees
whatever the victims held. Here the node's topology decides. For a node,
the pod and the pods that may go (lower priority, holding devices there),
the answer is the eviction whose placement gives the best worst-pair
level, with the fewest victims for that level; among as few, those
breaking the fewest PodDisruptionBudgets, then the lowest highest
priority, then the lowest sum of priorities, then the better placement.

The best level is searched for, not assumed: the daemon places a pod
container by container, so freeing more devices can make its choice worse
(evicting everyone is not always best). Sets are tried by size, from the
smallest that can cover the pod's counts, in an order that keeps pods of
one PCIe domain together (so the first sets of a size are the ones most
likely to give a good level); the search ends once a set reaches the best
level the node's pairs allow and its size is done. It is bounded: every
set looked at counts (placements dearly, sets skipped by count cheaply),
and past the budget or the caller's deadline it answers with the best set
found so far, saying it is not proven. A slow reference beside it
(`exhaustive`) tries every subset.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from devplugin.model import DeviceKind
from devplugin.policy.allocator import Allocator
from devplugin.policy.node_state import Holding, NodeState, Outcome
from devplugin.policy.placement import place
from devplugin.policy.pod_request import Shape
from devplugin.policy.topology import DOMAIN_DEPTH, Level

# Placements tried per node at most (a placement is 0.1-1 ms).
BUDGET = 4_000


@dataclass(frozen=True)
class Candidate:
    """A pod that may be evicted: lower priority than the preemptor, bound
    to the node, holding `devices` there (as the node's record names them)."""

    uid: str
    priority: int
    devices: frozenset[str]
    # The PodDisruptionBudgets (namespace/name) whose selector matches it.
    budgets: tuple[str, ...] = ()
    # RFC 3339 start time ("" when unknown): the scheduler's last tie-break.
    started: str = ""


@dataclass(frozen=True)
class Eviction:
    victims: tuple[Candidate, ...]  # highest priority first, as the scheduler reads them
    outcome: Outcome  # the pod placed once they are gone
    violations: int  # PodDisruptionBudgets broken

    @property
    def level(self) -> Level | None:
        return self.outcome.worst


def violations(victims: Iterable[Candidate], allowed: Mapping[str, int]) -> int:
    """Victims whose eviction a PodDisruptionBudget does not allow: each
    budget allows `allowed[name]` disruptions, spent victim by victim, as
    the scheduler's default preemption counts them."""
    left = dict(allowed)
    broken = 0
    for victim in victims:
        over = False
        for name in victim.budgets:
            if name not in left:
                continue
            left[name] -= 1
            over |= left[name] < 0
        broken += over
    return broken


def _level(outcome: Outcome) -> int:
    # A pod without GPU+HCA containers has no level: any fit is the best.
    return int(outcome.worst) if outcome.worst is not None else 0


def freed(node: NodeState, victims: Sequence[Candidate]) -> NodeState:
    """The node once the victims' devices are back (a replica each of a
    shared device)."""
    return node.without([Holding("", "", None, victim.devices) for victim in victims])


def _units(node: NodeState, kind: DeviceKind) -> int:
    """Units free of a kind: a free exclusive device is one, a shared one
    its replicas not held."""
    replicas, used = node.replicas, node.used
    return sum(replicas[d] - used.get(d, 0) if d in replicas else 1 for d in node.free[kind])


def _covers(node: NodeState, shape: Shape, victims: Sequence[Candidate]) -> bool:
    """Whether the devices back would be enough by count (no placement
    tried): each victim gives back a unit of each device it holds (a
    replica of a shared one). Counted per kind, not per resource: never
    less than the pod could get, so no set is skipped wrongly."""
    for kind, need in ((DeviceKind.GPU, shape.gpus), (DeviceKind.HCA, shape.hcas)):
        ids = node.topology.id_set(kind)
        back = sum(len(victim.devices & ids) for victim in victims)
        if _units(node, kind) + back < need:
            return False
    return True


def _order(victims: Sequence[Candidate]) -> tuple[Candidate, ...]:
    return tuple(sorted(victims, key=lambda v: (-v.priority, v.uid)))


def _key(eviction: Eviction) -> tuple[int, int, int, int, tuple[int, int, int]]:
    priorities = [v.priority for v in eviction.victims]
    return (
        len(priorities),
        eviction.violations,
        max(priorities, default=0),
        sum(priorities),
        eviction.outcome.rank_key,
    )


def _evict(
    node: NodeState,
    shape: Shape,
    allocator: Allocator,
    victims: Sequence[Candidate],
    allowed: Mapping[str, int],
) -> Eviction:
    ordered = _order(victims)
    return Eviction(
        ordered, place(freed(node, ordered), shape, allocator), violations(ordered, allowed)
    )


@dataclass(frozen=True)
class Search:
    """What a search for victims found."""

    eviction: Eviction | None  # None: no set of candidates lets the pod fit
    exact: bool  # False: the budget or the deadline ended it first
    placements: int  # sets placed
    looked: int  # sets looked at (placed, or skipped by count)
    timed_out: bool = False  # the deadline ended it (an answer that depends on time)


def floor_level(node: NodeState, shape: Shape) -> int:
    """A level no placement on the node can beat for the pod (0 for a pod
    without GPU+HCA containers, whose every fit is as good). A container
    of g GPUs and h HCAs at level L needs each GPU within L of one of its
    HCAs: the h largest domains of that level holding a healthy HCA must
    hold g healthy GPUs between them."""
    needs = [(g, h) for g, h in shape.containers if g and h]
    if not needs:
        return 0
    healthy = node.healthy or {}
    topology = node.topology
    gpus = healthy.get(DeviceKind.GPU, topology.id_set(DeviceKind.GPU))
    hcas = healthy.get(DeviceKind.HCA, topology.id_set(DeviceKind.HCA))
    # Level L: devices sharing their first DOMAIN_DEPTH + 1 - L keys (PIX: all four).
    cover: dict[int, list[int]] = {}
    for level in range(int(Level.PIX), int(Level.SYS) + 1):
        depth = DOMAIN_DEPTH + int(Level.PIX) - level
        gpus_in: dict[object, int] = {}
        for gpu in gpus:
            key = topology.placement[gpu].keys[:depth]
            gpus_in[key] = gpus_in.get(key, 0) + 1
        with_hca = {topology.placement[hca].keys[:depth] for hca in hcas}
        cover[level] = sorted((gpus_in.get(key, 0) for key in with_hca), reverse=True)
    floor = 0
    for g, h in needs:
        fitting = [level for level, counts in cover.items() if sum(counts[:h]) >= g]
        floor = max(floor, min(fitting, default=int(Level.SYS)))
    return floor


def _smallest_size(node: NodeState, shape: Shape, useful: Sequence[Candidate]) -> int:
    """The fewest candidates whose devices could cover the pod's counts."""
    gpu_ids, hca_ids = node.topology.id_set(DeviceKind.GPU), node.topology.id_set(DeviceKind.HCA)
    short_g = shape.gpus - _units(node, DeviceKind.GPU)
    short_h = shape.hcas - _units(node, DeviceKind.HCA)
    sizes = []
    for short, ids in ((short_g, gpu_ids), (short_h, hca_ids)):
        counts = sorted((len(c.devices & ids) for c in useful), reverse=True)
        size, left = 0, short
        while left > 0 and size < len(counts):
            left -= counts[size]
            size += 1
        sizes.append(size if left <= 0 else len(useful) + 1)
    return max(sizes)


def _locality(node: NodeState, candidate: Candidate) -> tuple[object, ...]:
    placement = node.topology.placement
    keys = sorted(
        tuple(str(k) for k in placement[d].keys) for d in candidate.devices if d in placement
    )
    return (keys[0] if keys else (), candidate.uid)


# Sets skipped by count cost this fraction of a placement against the budget.
SKIP_COST = 1 / 64
# Placements spent finishing a size once the best level is reached (the
# tie-breaks after the victim count).
TIE_BUDGET = 64


def search_victims(
    node: NodeState,
    shape: Shape,
    allocator: Allocator,
    candidates: Sequence[Candidate],
    allowed: Mapping[str, int] | None = None,
    *,
    budget: int = BUDGET,
    deadline: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Search:
    """The eviction (module docstring), with whether the search proved it."""
    allowed = allowed or {}
    useful = sorted((c for c in candidates if c.devices), key=partial(_locality, node))
    floor = floor_level(node, shape)
    best: Eviction | None = None
    spent = 0.0
    placements = looked = 0
    for size in range(_smallest_size(node, shape, useful), len(useful) + 1):
        reached_at: float | None = None
        for victims in itertools.combinations(useful, size):
            spent += SKIP_COST
            looked += 1
            if spent >= budget:
                return Search(best, False, placements, looked)
            if deadline is not None and placements % 16 == 0 and clock() >= deadline:
                return Search(best, False, placements, looked, timed_out=True)
            if reached_at is not None and spent - reached_at > TIE_BUDGET:
                break  # the level and count are proven; enough tie-breaking
            if not _covers(node, shape, victims):
                continue
            spent += 1
            placements += 1
            found = _evict(node, shape, allocator, victims, allowed)
            if not found.outcome.fits:
                continue
            if best is None or _rank(found) < _rank(best):
                best = found
            if reached_at is None and _level(best.outcome) == floor:
                reached_at = spent
        if best is not None and _level(best.outcome) == floor:
            # Nothing larger can give a better level, and it has more victims.
            return Search(best, True, placements, looked)
    return Search(best, True, placements, looked)


def _rank(eviction: Eviction) -> tuple[int, tuple[int, int, int, int, tuple[int, int, int]]]:
    return (_level(eviction.outcome), _key(eviction))


def choose_victims(
    node: NodeState,
    shape: Shape,
    allocator: Allocator,
    candidates: Sequence[Candidate],
    allowed: Mapping[str, int] | None = None,
    *,
    budget: int = BUDGET,
) -> Eviction | None:
    """The eviction that gives the pod the best level with the fewest
    victims (module docstring); None when no set of candidates lets it
    fit. Past `budget`: the best set found so far."""
    return search_victims(node, shape, allocator, candidates, allowed, budget=budget).eviction


def reachable(
    node: NodeState,
    shape: Shape,
    allocator: Allocator,
    candidates: Sequence[Candidate],
    level: Level | None,
    *,
    budget: int = BUDGET // 4,
) -> bool:
    """Whether some set of candidates lets the pod fit at `level` or better
    (any fit when None); True too when the budget ends the search first
    (unsure: the scheduler may try)."""
    found = search_victims(node, shape, allocator, candidates, budget=budget)
    if found.eviction is None:
        return not found.exact
    if level is None or _level(found.eviction.outcome) <= int(level):
        return True
    return not found.exact


def exhaustive(
    node: NodeState,
    shape: Shape,
    allocator: Allocator,
    candidates: Sequence[Candidate],
    allowed: Mapping[str, int] | None = None,
) -> tuple[int, int] | None:
    """The reference: over every subset of the candidates, the best level
    the pod gets and the fewest victims that reach it (level as an int, 0
    for a pod without GPU+HCA containers); None when no subset fits it."""
    allowed = allowed or {}
    found: tuple[int, int] | None = None
    for size in range(len(candidates) + 1):
        for victims in itertools.combinations(candidates, size):
            if not _covers(node, shape, victims):
                continue  # too few devices by count: cannot fit, whatever the placement
            outcome = _evict(node, shape, allocator, victims, allowed).outcome
            if outcome.fits:
                here = (_level(outcome), size)
                found = here if found is None else min(found, here)
    return found
