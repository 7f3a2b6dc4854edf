"""Exact, fast choice of the devices one container gets. Pure: data in, ids out.

`Allocator` is the front door, one per topology (rebuilt when devices
change). What a choice is judged by is objective.py (the request, the
score and its tie-breaks); this module only decides how to find the best:

* HCAs, and GPUs where the tree expresses every pair's score: the fold
  (fold.py, compiled as _foldc.c where it was built) over the tables
  fold_tables.py builds once, one threshold of the worst level at a time,
  from a lower bound upwards: the first that has an answer has the best.
* GPUs on NVLink graphs the tree cannot express: the same fold carrying
  the linked classes' counts (`LinkedPlan`); past `LINKED_STATES`, or past
  the request's time budget, the branch and bound of subset_search.py,
  exact when it ends in time and otherwise the best found, counted.
* GPUs first with fewer HCAs expected: the HCAs planned first (where
  `size` GPUs can be nearest), then the GPUs chosen second against them.

`exhaustive` (objective.py) enumerates every subset: the fallback of last
resort and the oracle the tests hold all of the above to.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from devplugin.model import DeviceKind, Refused
from devplugin.policy.fold import OutOfTime, fold
from devplugin.policy.fold_tables import LINKED_STATES, FoldTables, Inputs
from devplugin.policy.objective import (
    Choice,
    Request,
    Role,
    Score,
    cost_partner,
    coverage_mode,
    evaluate,
    exhaustive,
    support_mode,
    validate,
)
from devplugin.policy.subset_search import Pairs, bounded_search, gpu_pairs
from devplugin.policy.topology import Topology

try:
    from devplugin.policy import _foldc
except ImportError:  # pragma: no cover - the extension is built by every install here
    _foldc = None  # type: ignore[assignment]

__all__ = [
    "LINKED_STATES",
    "SEARCH_BUDGET",
    "Allocator",
    "Choice",
    "Request",
    "Role",
    "Score",
    "evaluate",
    "exhaustive",
    "native_fold_available",
    "validate",
]

log = logging.getLogger(__name__)

# The time a GPU search on an NVLink graph the tree cannot express may take.
SEARCH_BUDGET = 0.2


def native_fold_available() -> bool:
    """Whether the compiled tree fold was built (see setup.py)."""
    return _foldc is not None


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


class Allocator:
    """The search for one topology."""

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
        self._pairs: Pairs | None = None
        self.tables = FoldTables(topology)
        # The compiled fold per kind (None: the Python fold).
        self._native: dict[DeviceKind, _foldc.Tables | None] = {
            kind: self.tables.native(kind) if native else None for kind in DeviceKind
        }

    @property
    def fold(self) -> str:
        """Which tree fold answers: "native" (compiled) or "python"."""
        return "native" if any(self._native.values()) else "python"

    @property
    def method(self) -> str:
        """How GPU requests are searched: "tree" (exact), "linked" (exact, NVLink
        graph beyond the tree), "bounded" (exact within the budget)."""
        if self.topology.tree_exact:
            return "tree"
        return "bounded" if self.tables.linked is None else "linked"

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
            except OutOfTime:
                pass
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

    def _search(
        self, request: Request, candidates: frozenset[str], deadline: float | None = None
    ) -> Choice:
        """The fold at each worst level from a lower bound up; the first
        with an answer has the best."""
        tables = self.tables
        inputs = tables.inputs(request, candidates)
        support = support_mode(request)
        if support:
            thresholds: Iterable[int] = range(1, 6)
        elif cost_partner(request) or coverage_mode(request):
            thresholds = range(tables.lower_bound(request, inputs), 6)
        else:
            thresholds = (0,)
        for threshold in thresholds:
            found = self._fold(request, threshold, inputs, deadline)
            if found is None:
                continue
            value, counts = found
            score = Score.from_signed(threshold, tables.weights.signed(value), support=support)
            if support and score.reach < request.expected_partners:
                continue
            return Choice(self._materialize(request, candidates, counts), score)
        raise Refused("no feasible allocation", invalid_argument=False)  # pragma: no cover

    def _fold(
        self, request: Request, threshold: int, inputs: Inputs, deadline: float | None
    ) -> tuple[int, dict[int, int]] | None:
        """The compiled fold where it was built (the same values and choices
        as fold.py's; the tests compare them), else fold.py's."""
        linked = self.tables.linked if request.kind is DeviceKind.GPU else None
        if linked is not None:
            return fold(self.tables, request, threshold, inputs, plan=linked, deadline=deadline)
        native = self._native[request.kind]
        if native is None:
            return fold(self.tables, request, threshold, inputs)
        try:
            return native.fold(
                inputs.cap,
                inputs.must,
                inputs.cost,
                inputs.partner,
                inputs.other,
                request.size,
                self.tables.prune_above(request, threshold),
                self.tables.cover_units(request, threshold),
            )
        except RuntimeError:  # pragma: no cover - a defect in the C fold
            # Keep answering, exactly, with the Python fold from now on.
            log.exception("the compiled fold failed; using the Python fold")
            self._native[request.kind] = None
            return fold(self.tables, request, threshold, inputs)

    def _materialize(
        self, request: Request, candidates: frozenset[str], counts: dict[int, int]
    ) -> tuple[str, ...]:
        alone = self.tables.alone
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
