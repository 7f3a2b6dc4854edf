"""The room a pod is about to take: what prioritize ranked first for it,
held in the other pods' rankings until the pod watch shows where it went.

kube-scheduler assumes a pod on the node it chose at the end of the
scheduling cycle (schedule_one.go, `assume`), counts it there for every
pod after it and binds it in the background; the binding reaches the
extender's pod watch milliseconds later, or, in a burst of pending pods
(a scheduler restarted, a job's workers created at once), after several
more cycles have asked. Those pods would be ranked on a node whose best
devices are already spoken for, and sent where they get worse.

So each prioritize answer for a pod not bound yet holds, on the node it
ranked first alone, the devices the pod would be placed on there;
other pods' rankings see them taken, whatever their priority (an assumed
pod is as real to the scheduler as a bound one). Rankings only: a hold
never fails a filter. The scheduler may bind elsewhere (its other scores,
a bind that failed), and a filter failed on a guess would leave a pod
unschedulable until its backoff ends.

A hold ends when the watch shows its pod bound (the node's view then
places it), ending or gone, when the pod is ranked again, or after
HOLD_FOR seconds.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from devplugin.extender.nominations import Claim, Effect, Nominations
from devplugin.policy.podinfo import PodInfo

# Longer than a bind takes (an API call), short enough that a hold whose
# pod went nowhere stops steering soon.
HOLD_FOR = 15.0
MAX_HOLDS = 4096


@dataclass(frozen=True)
class Hold:
    uid: str
    node: str
    priority: int
    devices: frozenset[str]
    until: float  # monotonic


@dataclass
class Holds:
    """The holds in force; safe to share between threads."""

    pending: Callable[[str], PodInfo | None]  # the watch's pod by uid
    clock: Callable[[], float] = time.monotonic
    limit: int = MAX_HOLDS
    _holds: OrderedDict[str, Hold] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def copy(self) -> Holds:
        with self._lock:
            return Holds(self.pending, self.clock, self.limit, OrderedDict(self._holds))

    def ranked(self, pod: PodInfo, node: str, devices: frozenset[str]) -> None:
        """Prioritize ranked `node` first, alone, for `pod`, which would get
        `devices` there. Not for a pod the watch shows bound or ending; one
        it does not show yet (the scheduler's watch is ahead) is held, and
        its first event lets go of the hold if it is bound already."""
        if not devices:
            return
        hold = Hold(pod.uid, node, pod.priority, devices, self.clock() + HOLD_FOR)
        with self._lock:
            # Looked at under the lock: the watch's map changes before its
            # listener (pod_changed) runs, so an event is either seen here
            # or lets go of the hold after.
            known = self.pending(pod.uid)
            if known is not None and (known.node or known.deleting or known.terminal):
                return
            self._holds[pod.uid] = hold
            self._holds.move_to_end(pod.uid)
            while len(self._holds) > self.limit:
                self._holds.popitem(last=False)

    def unranked(self, uid: str) -> None:
        """The pod was ranked again with no node first alone."""
        with self._lock:
            self._holds.pop(uid, None)

    def pod_changed(self, uid: str, before: PodInfo | None, after: PodInfo | None) -> None:
        """A pod watch event (the cache's listener)."""
        if after is None or after.node or after.deleting or after.terminal:
            with self._lock:
                self._holds.pop(uid, None)

    def holds(self) -> list[Hold]:
        now = self.clock()
        with self._lock:
            for uid in [u for u, h in self._holds.items() if h.until <= now]:
                del self._holds[uid]
            return list(self._holds.values())

    def effects(self, pod: PodInfo, effects: dict[str, Effect]) -> dict[str, Effect]:
        """`effects` (what the nominations change per node for `pod`) with
        every other pod's hold added as a claim on its node."""
        found = dict(effects)
        for hold in self.holds():
            if hold.uid == pod.uid:
                continue
            known = self.pending(hold.uid)
            if known is not None and known.node:
                continue  # bound: its node's view places it already
            effect = found.get(hold.node, Effect())
            if any(c.uid == hold.uid for c in effect.claims):
                continue
            claim = Claim(hold.uid, hold.priority, hold.devices, None, frozenset())
            found[hold.node] = Effect(effect.gone, (*effect.claims, claim))
        return found


@dataclass(frozen=True)
class Rooms:
    """The rooms spoken for that an extender keeps: its preempt answers'
    and the scheduler's nominations, and its prioritize answers' holds."""

    nominations: Nominations
    holds: Holds

    def copy(self) -> Rooms:
        """Stores of their own with the same contents (what a fresh
        computation over the same facts starts from)."""
        return Rooms(self.nominations.copy(), self.holds.copy())
