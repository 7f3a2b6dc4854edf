"""The tier's reference for alignment, written apart from the allocator it
judges: the best worst GPU-to-nearest-HCA level a shape can get from a set
of free devices, by trying every HCA subset, and the level a pod got."""

from __future__ import annotations

import itertools

from devplugin.policy.topology import Topology
from tests.real_cluster.stand_ins import Admitted


def best_level(
    topology: Topology, gpus: frozenset[str], hcas: frozenset[str], shape: tuple[int, int]
) -> int | None:
    """The best worst GPU-to-nearest-HCA level (as an int) any choice of the
    shape's counts from these devices gives; None when they are too few.
    For a set of HCAs the best GPUs are those nearest to one of them, so
    every HCA subset is tried and the GPUs follow."""
    want_g, want_h = shape
    if len(gpus) < want_g or len(hcas) < want_h:
        return None
    best: int | None = None
    for chosen in itertools.combinations(sorted(hcas), want_h):
        nearest = sorted(min(int(topology.level(g, h)) for h in chosen) for g in gpus)
        worst = nearest[want_g - 1]
        best = worst if best is None else min(best, worst)
    return best


def level_of(topology: Topology, held: Admitted) -> int:
    return max(min(int(topology.level(g, h)) for h in held.hcas) for g in held.gpus)
