"""One verdict per node and pod kind, computed here and read by the filter,
prioritize and preempt verbs alike.

A pod kind is what a node's answer depends on: the pod's device shape, the
alignment it requires, and its priority (which failures preemption can
resolve). Verdicts are kept per kind across calls (answers.py), caught up
through the change log the watches write. What makes an answer personal,
the node a retried pod is already bound to (placed there without itself),
is worked out for that call only and never enters a shared table: any
caller could otherwise plant another pod's answer in it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from devplugin.extender.answers import Answers, ChangeLog
from devplugin.extender.holds import Holds
from devplugin.extender.liveness import Liveness, Record
from devplugin.extender.nominations import Effect, Nominations, apply
from devplugin.extender.victims import candidates, counts_fit, evictable
from devplugin.extender.views import MAX_REASON, NodeViews
from devplugin.policy.allocator import Allocator
from devplugin.policy.node_state import Holding, NodeState
from devplugin.policy.placement import check, place
from devplugin.policy.pod_request import Requirement, Shape
from devplugin.policy.podinfo import PodInfo
from devplugin.policy.preemption import Candidate, reachable

# A node's fit for a pod: it passes, fails (preemption may help), or fails
# for good (not even with every lower-priority pod gone).
PASS, FAILED, NEVER = 0, 1, 2


@dataclass(frozen=True, slots=True)
class NodeVerdict:
    """What a node says about one pod kind."""

    fit: int  # PASS, FAILED or NEVER
    reason: str  # the filter's message ("" when it passes)
    # The key its score is ranked by (None: scores 0): worst level, summed
    # levels, fragmentation.
    rank: tuple[int, ...] | None
    level: int | None  # the worst GPU-HCA level it gives (None: no pair, or no fit)
    until: float  # monotonic time it goes stale without an event (inf: only an event)


# A node without a usable record: never block scheduling on it.
UNTOLD = NodeVerdict(PASS, "", None, None, math.inf)


@dataclass(frozen=True, slots=True)
class Victims:
    """What preemption takes from a node for one pod kind: the pods whose
    eviction gives the pod its best level there, with the fewest victims."""

    uids: tuple[str, ...]  # highest priority first; (): none helps, or none is needed
    violations: int  # PodDisruptionBudgets broken
    level: int  # the pod's worst GPU-HCA level once they are gone (0: no pair)
    untold: bool = False  # the node has no usable record: nothing can be told
    # The devices the pod is placed on once they are gone, and the pods
    # already going there whose devices that counted on (uids).
    devices: frozenset[str] = frozenset()
    going: frozenset[str] = frozenset()


NO_VICTIMS = Victims((), 0, 0)
UNTOLD_VICTIMS = Victims((), 0, 0, untold=True)


@dataclass(frozen=True)
class PodKind:
    shape: Shape
    requirement: Requirement
    priority: int

    def key(self, shape_id: int) -> tuple[int, int, bool, int]:
        level = int(self.requirement.level) if self.requirement.level is not None else 0
        return (shape_id, level, self.requirement.required, self.priority)


class Verdicts:
    """Per node and pod kind, its verdict: kept ones read, the others (new,
    changed, gone stale) worked out."""

    def __init__(
        self,
        views: NodeViews,
        liveness: Liveness,
        on_node: Callable[[str], tuple[PodInfo, ...]],
        bound_node: Callable[[str], str | None],
        changes: ChangeLog,
        *,
        names: tuple[str, str],
        clock: Callable[[], float] = time.monotonic,
        count: Callable[[int, int], None] = lambda hits, asked: None,
        nominations: Nominations | None = None,
        holds: Holds | None = None,
    ) -> None:
        self.views = views
        self.liveness = liveness
        self._on_node = on_node
        self._names = names
        self._count = count
        self.answers: Answers[NodeVerdict] = Answers(changes, clock)
        # Per pod kind (and PodDisruptionBudgets as they stand), each node's
        # victims: read by the preempt verb, caught up by the same log.
        self.victims: Answers[Victims] = Answers(changes, clock)
        self.bound_node = bound_node
        self.nominations = nominations
        self.holds = holds

    def effects(self, pod: PodInfo, *, ranking: bool) -> dict[str, Effect]:
        """Node -> what the rooms spoken for change there for `pod`: the
        nominations' always, the holds' only in its ranking (holds.py)."""
        effects = self.nominations.effects(pod) if self.nominations is not None else {}
        if ranking and self.holds is not None:
            effects = self.holds.effects(pod, effects)
        return effects

    def of(
        self,
        pod: PodInfo,
        kind: PodKind,
        names: list[str],
        *,
        effects: Mapping[str, Effect] | None = None,
    ) -> dict[str, NodeVerdict]:
        """Each named node's verdict for the pod, the rooms spoken for as
        `effects` gives them (by default a filter's: `effects(ranking=False)`)."""
        key = kind.key(self.views.shape_id(kind.shape))
        personal = self.bound_node(pod.uid)
        if effects is None:
            effects = self.effects(pod, ranking=False)
        special = set(effects)
        if personal is not None:
            special.add(personal)
        if special:
            special &= set(names)
        shared = [name for name in names if name not in special] if special else names
        compute = partial(self._compute, kind, "")
        found, kept = self.answers.read(key, shared, compute)
        self._count(kept, kept)
        # What is this pod's alone: its own node, placed without it (a
        # retry), and the nodes where nominated rooms count for it (its own
        # victims gone, others' rooms taken). For this call only.
        for name in special:
            found[name] = self._personal(kind, pod.uid, name, effects.get(name, Effect()))
        return found

    def placement(self, pod: PodInfo, kind: PodKind, name: str, effect: Effect) -> frozenset[str]:
        """The devices the pod would be placed on at `name`, the node changed
        by `effect` as its ranking saw it (nothing where it does not fit, or
        is untold)."""
        record = self.liveness.fresh()(name)
        found = self.views.state_for(record.parsed, record, pod.uid) if record else None
        if found is None:
            return frozenset()
        node, allocator, _ = found
        node = apply(effect, node, allocator)
        outcome = place(node, kind.shape, allocator)
        return outcome.taken(node.free) if outcome.fits else frozenset()

    def _personal(self, kind: PodKind, asking: str, name: str, effect: Effect) -> NodeVerdict:
        record = self.liveness.fresh()(name)
        state = self.views.state_for(record.parsed, record, asking) if record is not None else None
        if record is None or state is None:
            return UNTOLD
        node, allocator, pending = state
        node = apply(effect, node, allocator)
        outcome = place(node, kind.shape, allocator)
        rank = outcome.rank_key if outcome.fits else None
        level = int(outcome.worst) if outcome.fits and outcome.worst is not None else None
        reason = outcome.reason if not outcome.fits else check(outcome, kind.requirement)
        if reason is None:
            return NodeVerdict(PASS, "", rank, level, math.inf)
        empty = self.views.empty_outcome(record.parsed, record, kind.shape)
        never = empty is not None and check(empty, kind.requirement) is not None
        bound = tuple(p for p in self._on_node(name) if p.uid not in effect.gone)
        if not never:
            never = not self._resolvable_on(node, allocator, pending, bound, kind, asking)
        message = f"devplugin: {reason}"[:MAX_REASON]
        return NodeVerdict(NEVER if never else FAILED, message, rank, level, math.inf)

    def _compute(
        self, kind: PodKind, asking: str, names: Sequence[str]
    ) -> dict[str, tuple[NodeVerdict, float]]:
        shape, requirement = kind.shape, kind.requirement
        until: dict[str, float] = {}
        fresh = self.liveness.fresh(until)
        records: dict[str, Record | None] = {}
        outcomes, hits = self.views.outcomes(names, fresh, shape, asking, seen=records)
        self._count(hits, len(names))
        relaxed = not requirement.required or requirement.level is None
        found: dict[str, tuple[NodeVerdict, float]] = {}
        failing: dict[str, str] = {}
        for name in names:
            outcome = outcomes[name]
            expiry = until.get(name, math.inf)
            if outcome is None:
                found[name] = (UNTOLD, expiry)
                continue
            rank = outcome.rank_key if outcome.fits else None
            level = int(outcome.worst) if outcome.fits and outcome.worst is not None else None
            if relaxed and outcome.fits:
                reason = None  # what check() would say, without the call
            else:
                reason = outcome.reason if not outcome.fits else check(outcome, requirement)
            if reason is None:
                found[name] = (NodeVerdict(PASS, "", rank, level, expiry), expiry)
            else:
                failing[name] = reason
                found[name] = (NodeVerdict(FAILED, reason, rank, level, expiry), expiry)
        messages = self.views.failures(failing, records, shape, requirement, asking)
        for name, (message, empty_fails) in messages.items():
            never = empty_fails or not self._resolvable(records[name], kind, asking)
            before = found[name][0]
            verdict = NodeVerdict(
                NEVER if never else FAILED, message, before.rank, before.level, before.until
            )
            found[name] = (verdict, before.until)
        return found

    def _resolvable(self, record: Record | None, kind: PodKind, asking: str) -> bool:
        """Whether the scheduler's preemption could make the pod pass: the
        pod does not fit the node by counts (where it does, no victim is
        ever proposed there), and some eviction of pods of lower priority
        bound to the node lets it pass (found by search: freeing more can
        make the daemon's container-by-container choice worse). The
        scheduler tries preemption only on nodes not marked unresolvable;
        unsure (the search's budget spent), it may try."""
        state = self.views.state(record.parsed, record) if record is not None else None
        if state is None:
            return True
        node, allocator, pending = state
        return self._resolvable_on(node, allocator, pending, self._on_node(node.name), kind, asking)

    def _resolvable_on(
        self,
        node: NodeState,
        allocator: Allocator,
        pending: frozenset[str],
        bound: tuple[PodInfo, ...],
        kind: PodKind,
        asking: str,
    ) -> bool:
        shape, requirement = kind.shape, kind.requirement
        if node.healthy is not None and counts_fit(node, bound, shape, asking, self._names):
            return False  # the scheduler's dry run would reprieve every victim
        if any(pod.uid in pending and pod.priority < kind.priority for pod in bound):
            return True  # its devices are not known yet: unsure, let it try
        back = evictable(node, bound, kind.priority)
        everyone = place(node.without([Holding("", "", None, back)]), shape, allocator)
        if check(everyone, requirement) is None:
            return True
        found, _ = candidates(node, bound, kind.priority, ())
        known = frozenset().union(*(c.devices for c in found))
        if back - known:
            # Holders the pod watch does not know: one candidate, unsure.
            found.append(Candidate("", 0, back - known))
        level = requirement.level if requirement.required else None
        return reachable(node, shape, allocator, found, level)
