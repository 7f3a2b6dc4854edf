"""Which lower-priority pods to evict on a node so a pod gets an aligned set.

kube-scheduler's own preemption counts GPUs and HCAs as numbers: it frees
whatever the victims held. Here the node's topology decides. For a node,
the pod and the pods that may go (lower priority, holding devices there):

1. the best worst-pair level any eviction can give is what evicting every
   one of them gives (the allocator is exact: more free devices never make
   its choice worse);
2. the victims are the fewest pods whose devices, back with the node's
   free ones, let the pod be placed at that level; among as few, those
   breaking the fewest PodDisruptionBudgets, then the lowest highest
   priority, then the lowest sum of priorities, then the better placement.

Sets are tried by size, smallest first, each set only when its devices
cover the pod's counts; past `budget` placements the search keeps the best
set found so far (or, with none yet, every candidate). A slow reference
beside it (`exhaustive`) tries every subset.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from devplugin.model import DeviceKind
from devplugin.policy.allocator import Allocator
from devplugin.policy.placement import Holding, NodeState, Outcome, Shape, place
from devplugin.policy.topology import Level

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
    """The node once the victims' devices are back."""
    devices = frozenset(d for victim in victims for d in victim.devices)
    return node.without([Holding("", "", None, devices)])


def _covers(node: NodeState, shape: Shape, victims: Sequence[Candidate]) -> bool:
    """Whether the devices back would be enough by count (no placement tried)."""
    freed = {d for victim in victims for d in victim.devices}
    gpus = node.free[DeviceKind.GPU] | (freed & node.topology.id_set(DeviceKind.GPU))
    hcas = node.free[DeviceKind.HCA] | (freed & node.topology.id_set(DeviceKind.HCA))
    return len(gpus) >= shape.gpus and len(hcas) >= shape.hcas


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
    victims (module docstring); None when evicting every candidate still
    leaves the pod without a place. Past `budget` placements: the best set
    found so far, or every candidate."""
    allowed = allowed or {}
    useful = [c for c in candidates if c.devices]
    everyone = _evict(node, shape, allocator, useful, allowed)
    if not everyone.outcome.fits:
        return None
    target = _level(everyone.outcome)
    best: Eviction | None = None
    tried = 1
    # From none: a pod that fits at the best level already needs no victim.
    for size in range(len(useful) + 1):
        for victims in itertools.combinations(useful, size):
            if not _covers(node, shape, victims):
                continue
            if tried >= budget:
                return best or everyone
            tried += 1
            found = _evict(node, shape, allocator, victims, allowed)
            if not found.outcome.fits or _level(found.outcome) > target:
                continue
            if best is None or _key(found) < _key(best):
                best = found
        if best is not None:
            return best
    return everyone


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
