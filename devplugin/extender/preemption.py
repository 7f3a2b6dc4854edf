"""POST /scheduler/preempt: ExtenderPreemptionArgs -> ExtenderPreemptionResult.

Per candidate node the scheduler proposes, the victims that free the best
aligned set (policy/preemption.py searches them on the node's view: ended
holders back, pods bound and not in the record yet placed), keeping only
the nodes at the best level with the fewest victims (victims.py).

Bounded per call: nodes alike (one layout, the same free devices, the same
candidates' devices, priorities and budgets, as fleets of one model full
of one-GPU pods are) share one search; each search has the placement
budget; the whole call has DEADLINE, after which the nodes not searched
yet are left out and the answer is the best found so far. Both cuts are
counted in devplugin_extender_preempt_unproven_total{why}.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from devplugin.cluster.watch import WatchCache
from devplugin.extender.args import model_refusals, pod_arg, pod_kind
from devplugin.extender.budgets import DisruptionBudget
from devplugin.extender.liveness import Liveness
from devplugin.extender.metrics import ExtenderMetrics
from devplugin.extender.serving import BadRequest, Verb
from devplugin.extender.victims import answer, candidates, proposed_victims, unchanged
from devplugin.extender.views import NodeViews
from devplugin.model import DeviceKind
from devplugin.policy.allocator import Allocator
from devplugin.policy.placement import NodeState, Requirement, Shape
from devplugin.policy.podinfo import PodInfo
from devplugin.policy.preemption import Candidate, Eviction, Search, search_victims

# The scheduler waits 5 s for an extender by default (httpTimeout); the
# searches stop here, leaving time to encode and send the answer.
DEADLINE = 1.5
# Searches remembered per call for nodes alike.
MEMO = 1024


def _alike(
    node: NodeState, found: list[Candidate], allowed: Mapping[str, int]
) -> tuple[tuple[Any, ...], list[Candidate]]:
    """A key equal for nodes whose search must give the same answer, and
    the candidates in an order that maps one node's answer onto another's."""
    ordered = sorted(found, key=lambda c: (sorted(c.devices), c.priority, c.budgets))
    key = (
        id(node.topology),
        node.free[DeviceKind.GPU],
        node.free[DeviceKind.HCA],
        tuple(
            (c.devices, c.priority, tuple(allowed.get(b) for b in c.budgets), c.started)
            for c in ordered
        ),
    )
    return key, ordered


class PreemptVerb:
    def __init__(
        self,
        views: NodeViews,
        liveness: Liveness,
        on_node: Callable[[str], tuple[PodInfo, ...]],
        budgets: WatchCache[DisruptionBudget] | None,
        metrics: ExtenderMetrics,
        *,
        names: tuple[str, str],
        deadline: float = DEADLINE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.views = views
        self.liveness = liveness
        self._on_node = on_node
        self.budgets = budgets
        self.metrics = metrics
        self.gpu, self.hca = names
        self.deadline = deadline
        self._clock = clock

    def routes(self) -> dict[str, Verb]:
        return {"/scheduler/preempt": self.preempt}

    def preempt(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """Per node, the victims that free the best aligned set."""
        ends = self._clock() + self.deadline
        pod = pod_arg(args)
        try:
            proposed = proposed_victims(args)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        shape, requirement = pod_kind(pod, self.gpu, self.hca)
        if not shape.wants_devices:
            return unchanged(proposed)
        fresh = self.liveness.fresh()
        budgets = self.budgets.items().values() if self.budgets is not None else ()
        evictions: dict[str, Eviction] = {}
        untold: dict[str, tuple[list[str], int]] = {}
        refused = model_refusals(pod, list(proposed), fresh)
        memo: dict[tuple[Any, ...], tuple[Search, list[Candidate]]] = {}
        left = 0
        for node in proposed:
            if node in refused:
                continue  # no eviction gives it the GPU model the pod chose
            if self._clock() >= ends:
                left += 1
                continue
            record = fresh(node)
            state = self.views.state(record.parsed, record) if record is not None else None
            if state is None:
                untold[node] = proposed[node]
                continue
            found, allowed = candidates(state[0], self._on_node(node), pod.priority, budgets)
            eviction = self._search(state[0], shape, state[1], found, allowed, memo, ends)
            if eviction is None or not eviction.victims or not _meets(eviction, requirement):
                continue  # no eviction lets it fit (as required), or none is needed
            evictions[node] = eviction
        if left:
            self.metrics.preempt_unproven.labels("deadline").inc(left)
        return answer(evictions, untold)

    def _search(
        self,
        node: NodeState,
        shape: Shape,
        allocator: Allocator,
        found: list[Candidate],
        allowed: Mapping[str, int],
        memo: dict[tuple[Any, ...], tuple[Search, list[Candidate]]],
        ends: float,
    ) -> Eviction | None:
        key, ordered = _alike(node, found, allowed)
        known = memo.get(key)
        if known is None:
            result = search_victims(
                node, shape, allocator, ordered, allowed, deadline=ends, clock=self._clock
            )
            if not result.exact:
                self.metrics.preempt_unproven.labels("budget").inc()
            if len(memo) < MEMO:
                memo[key] = (result, ordered)
            return result.eviction
        result, theirs = known
        if result.eviction is None:
            return None
        # The same victims by place in the order, as this node's pods.
        index = {c.uid: i for i, c in enumerate(theirs)}
        victims = [ordered[index[v.uid]] for v in result.eviction.victims]
        victims.sort(key=lambda v: (-v.priority, v.uid))
        return Eviction(tuple(victims), result.eviction.outcome, result.eviction.violations)


def _meets(eviction: Eviction, requirement: Requirement) -> bool:
    return not (
        requirement.required
        and requirement.level is not None
        and eviction.level is not None
        and eviction.level > requirement.level
    )
