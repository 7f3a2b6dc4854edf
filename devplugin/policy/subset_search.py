"""A branch and bound over GPU subsets, for NVLink graphs the tree and the
linked fold cannot carry. Pure but for the clock it is given.

It scores subsets incrementally by the objective's own terms (objective.py,
the GPU request's: worst, total, connectivity, spread) and stops at a
deadline: exact when it ends in time, else the best found.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable

from devplugin.model import DeviceKind
from devplugin.policy.objective import Choice, Request, Score, cost_partner, validate
from devplugin.policy.topology import DOMAIN_DEPTH, Topology

# In `gpu_pairs`: the largest score of any pair.
TOP_PAIR = ("", "")

Pairs = dict[tuple[str, str], int]


def gpu_pairs(topology: Topology) -> Pairs:
    """Every GPU pair's score, both ways (once per topology)."""
    gpus = topology.ids(DeviceKind.GPU)
    found: Pairs = {}
    for i, a in enumerate(gpus):
        for b in gpus[i + 1 :]:
            found[(a, b)] = found[(b, a)] = topology.score(a, b)
    best = max(found.values(), default=0)
    # (g, g): g's NVLinks to every GPU, for ordering candidates.
    for gpu in gpus:
        found[(gpu, gpu)] = sum(topology.nvlinks(gpu, other) for other in gpus)
    found[TOP_PAIR] = best
    return found


def _domain_counts(topology: Topology, devices: Iterable[str]) -> dict[object, int]:
    """How many of `devices` sit in each domain, keyed (depth, domain)."""
    counts: dict[object, int] = {}
    for device in devices:
        for depth in range(DOMAIN_DEPTH):
            key = (depth, topology.placement[device].keys[depth])
            counts[key] = counts.get(key, 0) + 1
    return counts


class _Search:
    """The depth-first search's fixed inputs and running state."""

    def __init__(
        self,
        topology: Topology,
        request: Request,
        deadline: float,
        clock: Callable[[], float],
        pairs: Pairs,
    ) -> None:
        candidates = validate(topology, request)
        partner = cost_partner(request)
        cost = {
            d: (min(topology.level(d, p) for p in partner) if partner else 0) for d in candidates
        }
        self.must = sorted(request.must_include)
        # Best candidates first (lowest level to the partner, most NVLinks),
        # so the subsets scored before a deadline are the promising ones.
        self.rest = sorted(
            candidates - request.must_include, key=lambda d: (cost[d], -pairs.get((d, d), 0), d)
        )
        self.cost = cost
        self.costs = [cost[d] for d in self.rest]
        self.prefix = [0, *itertools.accumulate(self.costs)]
        self.keys = {
            d: tuple((depth, topology.placement[d].keys[depth]) for depth in range(DOMAIN_DEPTH))
            for d in candidates
        }
        self.base = _domain_counts(topology, (*request.available, *request.other_free))
        self.base_spread = sum(c * c for c in self.base.values())
        self.pair = pairs
        self.top_pair = pairs.get(TOP_PAIR, 0)
        self.deadline, self.clock = deadline, clock
        self.rank: tuple[int, ...] | None = None
        self.best: Choice | None = None
        self.stopped = False
        self.chosen: list[str] = list(self.must)
        self.taken = _domain_counts(topology, self.must)

    def start(self, size: int) -> None:
        must, cost, pair = self.must, self.cost, self.pair
        self.visit(
            0,
            size - len(must),
            max((cost[d] for d in must), default=0),
            sum(cost[d] for d in must),
            sum(pair[(a, b)] for a, b in itertools.combinations(must, 2)),
        )

    def spread_now(self) -> int:
        base = self.base
        return self.base_spread - sum(
            base[key] ** 2 - (base[key] - k) ** 2 for key, k in self.taken.items()
        )

    def hopeless(self, index: int, left: int, worst: int, total: int, conn: int) -> bool | None:
        """Whether no subset from `index` on can beat the best: True: nor
        from any later index (candidates are ordered by level); None: not
        from this one, but maybe a later one; False: it may."""
        rank = self.rank
        if rank is None:
            return False
        low_worst = max(worst, self.costs[index + left - 1])
        if low_worst != rank[0]:
            return low_worst > rank[0]
        low_total = total + self.prefix[index + left] - self.prefix[index]
        if low_total != rank[2]:
            return low_total > rank[2]
        chosen, pair = self.chosen, self.pair
        gain = max((sum(pair[(d, x)] for x in chosen) for d in self.rest[index:]), default=0)
        high_conn = conn + left * gain + left * (left - 1) // 2 * self.top_pair
        return None if -high_conn > rank[3] else False

    def visit(self, start: int, left: int, worst: int, total: int, conn: int) -> None:
        # Each visit may weigh many candidates: look at the clock every time
        # (once there is an answer; the first descent reaches one directly).
        if self.rank is not None and self.clock() > self.deadline:
            self.stopped = True
        if self.stopped:
            return
        if left == 0:
            score = Score(worst, total, conn, (0, 0, 0, 0), self.spread_now())
            if self.rank is None or score.key() < self.rank:
                self.rank, self.best = score.key(), Choice(tuple(self.chosen), score)
            return
        for index in range(start, len(self.rest) - left + 1):
            verdict = self.hopeless(index, left, worst, total, conn)
            if verdict:
                return
            if verdict is None:
                continue
            device = self.rest[index]
            add = sum(self.pair[(device, x)] for x in self.chosen)
            self.chosen.append(device)
            for key in self.keys[device]:
                self.taken[key] = self.taken.get(key, 0) + 1
            cost = self.cost[device]
            self.visit(index + 1, left - 1, max(worst, cost), total + cost, conn + add)
            for key in self.keys[device]:
                self.taken[key] -= 1
                if not self.taken[key]:
                    del self.taken[key]
            self.chosen.pop()
            if self.stopped:
                return


def bounded_search(
    topology: Topology,
    request: Request,
    deadline: float,
    clock: Callable[[], float] = time.monotonic,
    pairs: Pairs | None = None,
) -> tuple[Choice, bool]:
    """The best GPU subset found by `deadline`, and whether every subset
    was weighed (the answer is then exact)."""
    search = _Search(
        topology, request, deadline, clock, pairs if pairs is not None else gpu_pairs(topology)
    )
    search.start(request.size)
    assert search.best is not None
    return search.best, not search.stopped
