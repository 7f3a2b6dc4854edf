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

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from types import MappingProxyType
from typing import Any

from devplugin.cluster.watch import WatchCache
from devplugin.extender.args import model_refusals, pod_arg, pod_kind
from devplugin.extender.budgets import DisruptionBudget
from devplugin.extender.liveness import Liveness
from devplugin.extender.metrics import ExtenderMetrics
from devplugin.extender.nominations import Effect, apply, going
from devplugin.extender.serving import BadRequest, Verb
from devplugin.extender.verdicts import NO_VICTIMS, UNTOLD_VICTIMS, PodKind, Verdicts, Victims
from devplugin.extender.victims import answer, candidates, proposed_victims, unchanged
from devplugin.kinds.registry import ANCHOR, PARTNER
from devplugin.policy.allocator import Allocator
from devplugin.policy.node_state import NodeState
from devplugin.policy.placement import check, place
from devplugin.policy.pod_request import Requirement, Shape
from devplugin.policy.podinfo import PodInfo
from devplugin.policy.preemption import Eviction, Search, freed, search_victims

# The scheduler waits 5 s for an extender by default (httpTimeout); the
# searches stop here, leaving time to encode and send the answer.
DEADLINE = 1.5
NO_BUDGETS: Mapping[str, DisruptionBudget] = MappingProxyType({})
NO_EFFECTS: Mapping[str, Effect] = MappingProxyType({})
# Searches remembered per call for nodes alike.
MEMO = 1024
# A node's search may take at least this long, whatever its share of the
# call's time (fewer nodes searched well beat many searched badly).
NODE_SLICE = 0.02


def _signature(
    node: NodeState, bound: tuple[PodInfo, ...], priority: int, budgeted: bool
) -> tuple[Any, ...] | None:
    """A key equal for nodes whose search must give the same answer (the
    same layout, free devices, and holdings of pods of the same priorities,
    and with budgets about, the same namespaces and labels), read without
    building the candidates; None where a holder is known only by name or
    not at all (such a node is searched on its own)."""
    by_uid = {pod.uid: pod for pod in bound}
    parts: list[tuple[Any, ...]] = []
    for holding in node.holdings:
        pod = by_uid.get(holding.uid) if holding.uid is not None else None
        if pod is None:
            return None
        if pod.priority >= priority:
            parts.append((holding.devices, None))
        elif budgeted:
            labels = tuple(sorted(pod.labels.items()))
            parts.append((holding.devices, pod.priority, pod.namespace, labels, pod.start))
        else:
            parts.append((holding.devices, pod.priority, pod.start))
    used = tuple(sorted(node.used.items())) if node.replicas else ()
    free = node.free
    aligns = (node.kubelet, node.machine, node.cpus) if node.kubelet.aligns else ()
    return (
        id(node.topology),
        free[ANCHOR],
        free[PARTNER],
        used,
        aligns,
        tuple(parts),
    )


@dataclass(frozen=True)
class _Known:
    """A search's answer as positions in the record's holdings."""

    search: Search
    victims: tuple[int, ...]  # the first holding of each victim


def _positions(node: NodeState, eviction: Eviction | None) -> tuple[int, ...]:
    if eviction is None:
        return ()
    first: dict[str, int] = {}
    for index, holding in enumerate(node.holdings):
        if holding.uid is not None:
            first.setdefault(holding.uid, index)
    return tuple(first[victim.uid] for victim in eviction.victims)


def _mapped(node: NodeState, bound: tuple[PodInfo, ...], known: _Known) -> Eviction | None:
    """The known answer as this node's pods (the same places in the record)."""
    found = known.search.eviction
    if found is None:
        return None
    by_uid = {pod.uid: pod for pod in bound}
    victims = []
    for index, original in zip(known.victims, found.victims, strict=True):
        uid = node.holdings[index].uid
        assert uid is not None  # a signature is made only where every holder has one
        victims.append(replace(original, uid=uid, started=by_uid[uid].start))
    victims.sort(key=lambda v: (-v.priority, v.uid))
    return Eviction(tuple(victims), found.outcome, found.violations)


class PreemptVerb:
    def __init__(
        self,
        verdicts: Verdicts,
        liveness: Liveness,
        on_node: Callable[[str], tuple[PodInfo, ...]],
        budgets: WatchCache[DisruptionBudget] | None,
        metrics: ExtenderMetrics,
        *,
        names: tuple[str, str],
        deadline: float = DEADLINE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.verdicts = verdicts
        self.views = verdicts.views
        self.liveness = liveness
        # The budgets snapshot last seen and its number (verdicts key on it).
        self._budgets_seen: tuple[int, Mapping[str, DisruptionBudget] | None] = (0, None)
        self._on_node = on_node
        self.budgets = budgets
        self.metrics = metrics
        self.gpu, self.hca = names
        self.deadline = deadline
        self._clock = clock

    def routes(self) -> dict[str, Verb]:
        return {"/scheduler/preempt": self.preempt}

    def preempt(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """Per node, the victims that free the best aligned set: kept per
        node and pod kind (verdicts.Victims) across calls, as the filter's
        verdicts are; the nodes the watches touched since are searched again."""
        ends = self._clock() + self.deadline
        pod = pod_arg(args)
        try:
            proposed = proposed_victims(args)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        shape, requirement = pod_kind(pod, self.gpu, self.hca)
        if not shape.wants_devices:
            return unchanged(proposed)
        refused = model_refusals(pod, list(proposed), self.liveness.fresh())
        order = [node for node in proposed if node not in refused]
        budgets = self.budgets.items() if self.budgets is not None else NO_BUDGETS
        kind = PodKind(shape, requirement, pod.priority)
        # A budget's change is no node's event: the budgets as they stand are
        # part of the question (their snapshot is replaced on every change).
        key = ("victims", kind.key(self.views.shape_id(shape)), self._budgets_token(budgets))
        personal = self.verdicts.bound_node(pod.uid)
        nominations = self.verdicts.nominations
        effects = nominations.effects(pod) if nominations is not None else {}
        if self._room_held(pod, shape, requirement, effects):
            # Its victims are on their way: evicting more would be the
            # second eviction the scheduler's retry asks for too early.
            self.metrics.preempt_answers.labels("waiting").inc()
            return {"NodeNameToMetaVictims": {}}
        special = set(effects) | ({personal} if personal is not None else set())
        if special:
            special &= set(order)
        shared = [node for node in order if node not in special]
        compute = partial(self._victims, pod, shape, list(budgets.values()), ends)
        found, kept = self.verdicts.victims.read(key, shared, compute, partial=True)
        if kept:
            self.metrics.memo.labels("hit").inc(kept)
        # Nodes where nominated rooms count for this pod: for this call only.
        for node in special:
            found.update({n: v for n, (v, _) in compute([node], effects).items()})
        left = len(order) - len(found)
        if left:
            self.metrics.preempt_unproven.labels("deadline").inc(left)
        evictions: dict[str, Victims] = {}
        untold: dict[str, tuple[list[str], int]] = {}
        for node, victims in found.items():
            if victims.untold:
                untold[node] = proposed[node]
            elif victims.uids and _meets(victims.level, requirement):
                evictions[node] = victims
        result = answer(evictions, untold)
        told = result["NodeNameToMetaVictims"]
        if nominations is not None:
            # What was answered is a fact until the watch settles it.
            plans = {
                node: (frozenset(victims.uids) | victims.going, victims.devices)
                for node, victims in evictions.items()
                if node in told
            }
            if plans:
                nominations.answered(pod, plans)
        outcome = "victims" if evictions else "untold" if told else "none"
        self.metrics.preempt_answers.labels(outcome).inc()
        return result

    def _room_held(
        self, pod: PodInfo, shape: Shape, requirement: Requirement, effects: Mapping[str, Effect]
    ) -> bool:
        """Whether the pod fits, at the level it requires, on a node where
        its own victims (an earlier answer's, or pods going on the node it
        is nominated to) count as gone."""
        fresh = self.liveness.fresh()
        for node, effect in effects.items():
            if not effect.gone:
                continue
            record = fresh(node)
            state = self.views.state_for(record.parsed, record, pod.uid) if record else None
            if state is None:
                continue
            outcome = place(apply(effect, state[0], state[1]), shape, state[1])
            if outcome.fits and check(outcome, requirement) is None:
                return True
        return False

    def _budgets_token(self, budgets: Mapping[str, DisruptionBudget]) -> int:
        if budgets is not self._budgets_seen[1]:
            self._budgets_seen = (self._budgets_seen[0] + 1, budgets)
        return self._budgets_seen[0]

    def _victims(
        self,
        pod: PodInfo,
        shape: Shape,
        budgets: list[DisruptionBudget],
        ends: float,
        names: Sequence[str],
        effects: Mapping[str, Effect] = NO_EFFECTS,
    ) -> dict[str, tuple[Victims, float]]:
        """Each node's victims, searched in order until the call's deadline;
        an answer the deadline cut short is for this call only. Pods already
        being deleted are going: their devices count as back, and they are
        never victims again. `effects`: the nominated rooms that count there
        for this pod (nominations.py)."""
        until: dict[str, float] = {}
        fresh = self.liveness.fresh(until)
        memo: dict[tuple[Any, ...], _Known] = {}
        found: dict[str, tuple[Victims, float]] = {}
        for done, node in enumerate(names):
            now = self._clock()
            if now >= ends:
                break
            record = fresh(node)
            state = self.views.state(record.parsed, record) if record is not None else None
            if state is None:
                found[node] = (UNTOLD_VICTIMS, until.get(node, math.inf))
                continue
            # Each node at least its share of the time left, or a floor.
            slice_ends = min(ends, now + max(NODE_SLICE, (ends - now) / (len(names) - done)))
            bound = self._on_node(node)
            effect = effects.get(node, Effect())
            gone = going(bound, pod.priority) | effect.gone
            seen = apply(Effect(gone, effect.claims), state[0], state[1])
            staying = tuple(p for p in bound if p.uid not in gone) if gone else bound
            eviction, timed_out = self._search(
                seen, staying, pod.priority, shape, state[1], budgets, memo, slice_ends
            )
            kept_until = now if timed_out else until.get(node, math.inf)
            found[node] = (_victims_of(eviction, seen, gone), kept_until)
        return found

    def _search(
        self,
        node: NodeState,
        bound: tuple[PodInfo, ...],
        priority: int,
        shape: Shape,
        allocator: Allocator,
        budgets: list[DisruptionBudget],
        memo: dict[tuple[Any, ...], _Known],
        until: float,
    ) -> tuple[Eviction | None, bool]:
        """The node's eviction, and whether the deadline cut its search."""
        key = _signature(node, bound, priority, bool(budgets))
        known = memo.get(key) if key is not None else None
        if known is not None:
            return _mapped(node, bound, known), known.search.timed_out
        found, allowed = candidates(node, bound, priority, budgets)
        result = search_victims(
            node, shape, allocator, found, allowed, deadline=until, clock=self._clock
        )
        if not result.exact and not result.timed_out:
            self.metrics.preempt_unproven.labels("budget").inc()
        if key is not None and len(memo) < MEMO:
            memo[key] = _Known(result, _positions(node, result.eviction))
        return result.eviction, result.timed_out


def _victims_of(eviction: Eviction | None, node: NodeState, going: frozenset[str]) -> Victims:
    if eviction is None or not eviction.victims:
        return NO_VICTIMS
    level = int(eviction.level) if eviction.level is not None else 0
    planned = eviction.outcome.taken(freed(node, eviction.victims).free)
    uids = tuple(v.uid for v in eviction.victims)
    return Victims(uids, eviction.violations, level, devices=planned, going=going)


def _meets(level: int, requirement: Requirement) -> bool:
    return not (
        requirement.required and requirement.level is not None and level > int(requirement.level)
    )
