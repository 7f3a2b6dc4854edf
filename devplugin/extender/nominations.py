"""A nominated pod's room is spoken for: what the preempt verb answered,
and what the scheduler's nominations say, kept as facts.

kube-scheduler, once its preemption has evicted a pod's victims, nominates
the node (`status.nominatedNodeName`) and keeps that room for the pod:
* the pod is retried on its nominated node first (schedule_one.go,
  `evaluateNominatedNode`), as soon as its own cache sees the victims go,
  which may be before the extender's watch does;
* every other pod of lower or equal priority is filtered with the
  nominated pods added to the node (framework/runtime/framework.go,
  `RunFilterPluginsWithNominatedPods` and `addGENominatedPods`: nominated
  pods of priority >= the pod's, never the pod itself), so none of them
  takes the room.

The extender does the same. Each preempt answer becomes a `Plan` per node
it names: the victims (and the pods there already going, whose devices
the plan counted on) and the devices the pod was placed on once they are
gone. For the pod itself those victims count as gone on that node; for
every other pod of lower or equal priority the planned devices count as
taken. The watch settles a plan: the pod bound, ended, or nominated
elsewhere drops it; the pod nominated to its node keeps it while it
stays so; unconfirmed, it lasts while the victims may take to go (their
longest termination grace) and HOLD_SLACK more.

A nomination the watch shows without a plan (the extender restarted
between the answer and the retry, or another scheduler's preemption)
counts as well: for the pod, the lower-priority pods being deleted on its
node count as gone; for the others, its room is where it would be placed
once they are.

Pure apart from the plans' store: `effects` reads the pod cache and the
clock, `apply` turns an effect and a node's state into the state the
asking pod sees.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

from devplugin.policy.allocator import Allocator
from devplugin.policy.node_state import NodeState
from devplugin.policy.placement import place
from devplugin.policy.pod_request import Shape, shape_of
from devplugin.policy.podinfo import PodInfo

# Beyond the victims' termination grace, how long an answer waits for the
# scheduler's nomination to show in the watch (it patches the pod in the
# same cycle; this covers a slow API server and the retry's backoff).
HOLD_SLACK = 30.0
# How long a victim counts as gone for its preemptor while the watch still
# shows it running, not being deleted: the scheduler deletes the victims
# in the cycle that asked (asynchronously since 1.33: milliseconds). Past
# it, a victim still running was not evicted, and counts again.
DELETE_WITHIN = 15.0
# Plans kept at most (the oldest goes first).
MAX_PLANS = 4096


@dataclass(frozen=True)
class Plan:
    """One preempt answer for one node."""

    uid: str
    node: str
    priority: int
    gone: frozenset[str]  # uids: the victims, and the pods there already going
    devices: frozenset[str]  # where the pod was placed once they are gone
    made: float  # monotonic, when answered
    until: float  # monotonic: past it only the watch's nomination keeps the plan


@dataclass(frozen=True)
class Claim:
    """Another pod's room on a node: its planned devices, or (a nomination
    known only from the watch) its shape, to be placed once `gone` is."""

    uid: str
    priority: int
    devices: frozenset[str] | None
    shape: Shape | None
    gone: frozenset[str]


@dataclass(frozen=True)
class Effect:
    """What the nominations change on one node for one asking pod."""

    gone: frozenset[str] = frozenset()  # the pod's own: holders gone for it
    claims: tuple[Claim, ...] = ()  # the rooms it must leave, highest priority first


class PodSource(Protocol):
    """What the extender's pod cache tells (cluster/pods.py PodCache)."""

    def get(self, key: str) -> PodInfo | None: ...

    def on_node(self, node: str) -> tuple[PodInfo, ...]: ...

    def nominated(self) -> Mapping[str, tuple[PodInfo, ...]]: ...


@dataclass
class _Entry:
    plan: Plan
    confirmed: bool = False  # the watch showed the pod nominated to the plan's node


@dataclass
class Nominations:
    pods: PodSource
    names: tuple[str, str]
    clock: Callable[[], float] = time.monotonic
    limit: int = MAX_PLANS
    _plans: OrderedDict[tuple[str, str], _Entry] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def copy(self) -> Nominations:
        """A store of its own holding the same plans (what a fresh
        computation over the same facts starts from)."""
        with self._lock:
            plans = OrderedDict((k, replace(e)) for k, e in self._plans.items())
        return Nominations(self.pods, self.names, self.clock, self.limit, plans)

    # -- what the verbs and the watch tell
    def answered(
        self, pod: PodInfo, plans: Mapping[str, tuple[frozenset[str], frozenset[str]]]
    ) -> None:
        """The preempt verb's answer for `pod`: per node, (the uids gone
        for it there, the devices planned for it)."""
        graces = [
            found.grace
            for gone, _ in plans.values()
            for uid in gone
            if (found := self.pods.get(uid)) is not None
        ]
        now = self.clock()
        until = now + max(graces, default=0) + HOLD_SLACK
        with self._lock:
            for key in [k for k in self._plans if k[0] == pod.uid and k[1] not in plans]:
                del self._plans[key]  # a new answer replaces the pod's earlier ones
            for node, (gone, devices) in plans.items():
                plan = Plan(pod.uid, node, pod.priority, gone, devices, now, until)
                self._plans[(pod.uid, node)] = _Entry(plan, confirmed=pod.nominated == node)
                self._plans.move_to_end((pod.uid, node))
            while len(self._plans) > self.limit:
                self._plans.popitem(last=False)

    def pod_changed(self, uid: str, before: PodInfo | None, after: PodInfo | None) -> None:
        """A pod watch event (the cache's listener): a plan lasts while its
        pod waits, and no longer than the scheduler's nomination of it."""
        with self._lock:
            keys = [k for k in self._plans if k[0] == uid]
            changed = after is not None and (before is None or before.nominated != after.nominated)
            for key in keys:
                entry = self._plans[key]
                if after is None or after.node or after.terminal or after.deleting:
                    del self._plans[key]  # bound (its node's view has it), or ending
                elif after.nominated == entry.plan.node:
                    entry.confirmed = True
                elif entry.confirmed or (changed and after.nominated):
                    # The nomination taken back, or made for another node.
                    del self._plans[key]

    def plans(self) -> list[Plan]:
        """The plans in force now (an expired unconfirmed one is dropped)."""
        now = self.clock()
        with self._lock:
            for key in [
                k for k, e in self._plans.items() if not e.confirmed and e.plan.until <= now
            ]:
                del self._plans[key]
            return [entry.plan for entry in self._plans.values()]

    # -- what they mean for one pod
    def effects(self, pod: PodInfo) -> dict[str, Effect]:
        """Node -> what the nominations change there for `pod` (only the
        nodes where they change something)."""
        own: dict[str, set[str]] = {}
        claims: dict[str, dict[str, Claim]] = {}
        now = self.clock()
        for plan in self.plans():
            if plan.uid == pod.uid:
                own.setdefault(plan.node, set()).update(self._going_still(plan, now))
            elif plan.priority >= pod.priority:
                claim = Claim(plan.uid, plan.priority, plan.devices, None, plan.gone)
                claims.setdefault(plan.node, {})[plan.uid] = claim
        for node, waiting in self.pods.nominated().items():
            for other in waiting:
                if other.uid != pod.uid and other.priority < pod.priority:
                    continue
                going = self._going(node, other.priority)
                if other.uid == pod.uid:
                    own.setdefault(node, set()).update(going)
                elif other.uid not in claims.get(node, {}):
                    shape = shape_of(other, *self.names)
                    claim = Claim(other.uid, other.priority, None, shape, going)
                    claims.setdefault(node, {})[other.uid] = claim
        found: dict[str, Effect] = {}
        for node in own.keys() | claims.keys():
            ordered = sorted(claims.get(node, {}).values(), key=lambda c: (-c.priority, c.uid))
            found[node] = Effect(frozenset(own.get(node, ())), tuple(ordered))
        return found

    def _going_still(self, plan: Plan, now: float) -> frozenset[str]:
        """The plan's gone pods that still count as going: gone from the
        watch, being deleted, or not yet past DELETE_WITHIN."""
        if now < plan.made + DELETE_WITHIN:
            return plan.gone
        return frozenset(
            uid for uid in plan.gone if (pod := self.pods.get(uid)) is None or pod.deleting
        )

    def _going(self, node: str, priority: int) -> frozenset[str]:
        return going(self.pods.on_node(node), priority)


def going(bound: Iterable[PodInfo], priority: int) -> frozenset[str]:
    """The uids of the pods among `bound` of lower priority than `priority`
    already being deleted: they are going, whoever asked them to."""
    return frozenset(p.uid for p in bound if p.deleting and p.priority < priority)


def without_pods(node: NodeState, gone: frozenset[str]) -> NodeState:
    """The node once the pods `gone` (uids) have ended: their devices back,
    their holdings dropped."""
    if not gone:
        return node
    ending = [h for h in node.holdings if h.uid is not None and h.uid in gone]
    if not ending:
        return node
    left = tuple(h for h in node.holdings if h not in ending)
    holders = frozenset((h.namespace, h.pod) for h in left)
    return replace(node.without(ending), holdings=left, holders=holders)


def apply(effect: Effect, node: NodeState, allocator: Allocator) -> NodeState:
    """The node as the asking pod sees it: its own gone holders back, then
    every claim's room taken (a claim known only by shape is placed on the
    node as it would be once its own gone have ended, after the rooms of
    the claims before it)."""
    seen = without_pods(node, effect.gone)
    taken: list[frozenset[str]] = []
    for claim in effect.claims:
        devices = claim.devices
        if devices is None:
            base = without_pods(node, claim.gone)
            for earlier in taken:
                base = base.reserve(earlier)
            assert claim.shape is not None
            outcome = place(base, claim.shape, allocator)
            devices = outcome.taken(base.free) if outcome.fits else frozenset()
        taken.append(devices)
        seen = seen.reserve(devices)
    return seen
