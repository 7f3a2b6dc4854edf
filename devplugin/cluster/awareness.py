"""Knowing the container at GetPreferredAllocation, from the pod cache.

For a first resource the daemon asks the admission rule which container is
being admitted and plans for its exact partner count. Which containers
already hold devices comes from the ledger (PodResources) plus the claims
made here: the container just answered for is claimed at once, because the
kubelet only records its allocation after Allocate returns and the next
container's request may come before the next poll. Claims end when a poll
shows the container holding, or after `claim_seconds`.

The kubelet gives one container all its resources before the next, so once
a container's first resource is answered, a request for its other resource
with the expected count (within `pair_seconds`) is that container's second
(`Known(second=True)`), answered without another look at the pods.

A cache that is not current (its watch silent or failing) is not asked at
all: the daemon plans as it does without API access (`fallback-not-current`)
rather than on a frozen view of the pods.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from devplugin.cluster.pods import PodCache
from devplugin.kinds.registry import paired_with
from devplugin.model import DeviceKind
from devplugin.node.admission import Admission, ContainerKey, Outcome, admitting
from devplugin.node.coordination import Known
from devplugin.node.ledger import Ledger
from devplugin.node.lifecycle.custody import Owner
from devplugin.node.metrics import Metrics
from devplugin.policy.podinfo import PodInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Expected:
    kind: DeviceKind
    size: int
    first_size: int
    at: float
    owner: Owner
    key: ContainerKey


@dataclass(frozen=True)
class _Answered:
    """The container a request of `size` was last identified as."""

    size: int
    owner: Owner
    at: float
    key: ContainerKey


# Allocations remembered per container (for the kubelet's reuse of init
# containers' devices); pods no longer in the cache are forgotten past this.
GIVEN_LIMIT = 1024


class PodAwareness:
    def __init__(
        self,
        cache: PodCache,
        ledger: Ledger,
        names: Mapping[DeviceKind, str],
        *,
        wait: float,
        metrics: Metrics | None = None,
        claim_seconds: float = 10.0,
        pair_seconds: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cache = cache
        self._ledger = ledger
        # Every resource of each kind, the kind's own first (mixed MIG serves
        # the GPU kind as several; `add_resource` adds the others).
        self._all: dict[DeviceKind, list[str]] = {k: [n] for k, n in names.items()}
        self._wait = wait
        self._metrics = metrics
        self._claim_seconds = claim_seconds
        self._clock = clock
        self._lock = threading.Lock()
        # (kind, container) -> (when, the pod's uid): a namesake pod of
        # another uid does not inherit its predecessor's claims.
        self._claims: dict[tuple[DeviceKind, ContainerKey], tuple[float, str]] = {}
        self._pair_seconds = pair_seconds
        self._expected: _Expected | None = None
        self._answered: dict[DeviceKind, _Answered] = {}
        self._counters: dict[tuple[str, Outcome], Any] = {}
        # container -> kind -> the devices its Allocate got
        # (a namesake pod of another uid starts afresh)
        self._given: dict[ContainerKey, tuple[str, dict[DeviceKind, frozenset[str]]]] = {}
        # The last Allocate no container could be named for: (kind, ids, when).
        self._unclaimed: tuple[DeviceKind, frozenset[str], float] | None = None

    def add_resource(self, kind: DeviceKind, name: str) -> None:
        """Another resource serving `kind` (before serving starts)."""
        names = self._all.setdefault(kind, [])
        if name not in names:
            names.append(name)

    def _resources(
        self, kind: DeviceKind, resource: str | None
    ) -> tuple[str, tuple[str, ...]] | None:
        """(the asking resource, every resource of the other kind)."""
        own = self._all.get(kind)
        asking = resource if resource is not None else (own[0] if own else None)
        others = tuple(self._all.get(paired_with(kind), ()))
        if asking is None or not others:
            return None
        return asking, others

    def identify(self, kind: DeviceKind, size: int, resource: str | None = None) -> Known | None:
        """`resource`: the asking resource's name, where its kind is served
        as several (None: the kind's one)."""
        names = self._resources(kind, resource)
        if names is None:
            return None
        resource, other = names
        if not self._cache.current:
            with self._lock:
                self._expected = None
            self._count(resource, Outcome.NOT_CURRENT)
            return None
        now = self._clock()
        with self._lock:
            expected, self._expected = self._expected, None
        if (
            expected is not None
            and expected.kind is kind
            and expected.size == size
            and now - expected.at <= self._pair_seconds
        ):
            self._count(resource, Outcome.EXACT)
            with self._lock:
                self._answered[kind] = _Answered(size, expected.owner, now, expected.key)
            return Known(expected.first_size, second=True)

        def ask() -> Admission:
            # Only pods still waiting to be admitted can be asking; who holds
            # what is read again each time (a namesake may have just arrived).
            waiting = self._cache.waiting()
            return admitting(
                waiting,
                resource=resource,
                other=other,
                size=size,
                held=self._held(kind),
                waiting=True,
            )

        answer = ask()
        if answer.outcome is Outcome.NO_POD and self._wait > 0:
            # The pod may be a moment behind in the watch: wait, boundedly.
            self._cache.wait_for(lambda pods: ask().outcome is not Outcome.NO_POD, self._wait)
            answer = ask()
        self._count(resource, answer.outcome)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s x%d: %s %s",
                resource,
                size,
                answer.outcome.value,
                [(c.pod.name, c.container.name, c.partners) for c in answer.candidates][:5],
            )
        if answer.outcome is not Outcome.EXACT:
            return None
        first = answer.candidates[0]
        key = (first.pod.namespace, first.pod.name, first.container.name)
        partners = first.partners
        partner = first.partner_resource
        owner = (first.pod.namespace, first.pod.name, first.pod.uid)
        now = self._clock()
        with self._lock:
            self._answered[kind] = _Answered(size, owner, now, key)
            # The kubelet gives this container all its resources before the
            # next one: it counts as holding both from now on.
            paired = paired_with(kind)
            self._claims[(kind, key)] = (now, first.pod.uid)
            self._claims[(paired, key)] = (now, first.pod.uid)
            if self._given_locked(key, first.pod.uid, paired):
                # Its other resource came first, all reused from the pod's
                # init containers (no preference was asked): this completes it.
                return Known(partners, second=True)
            adopted = self._adopt_locked(paired, partners, now) if partners else frozenset()
            if adopted:
                self._record_locked(key, first.pod.uid, paired, tuple(adopted))
                return Known(partners, second=True)
            if partners > 0:
                self._expected = _Expected(paired, partners, size, now, owner, key)
            forced = self._reused_locked(first.pod, first.container.name, paired)
        return Known(
            partners,
            forced=forced if partners > 0 else frozenset(),
            partner_resource=partner if partners > 0 else None,
        )

    def _unclaimed_allocate(self, kind: DeviceKind, ids: Sequence[str], now: float) -> None:
        with self._lock:
            self._unclaimed = (kind, frozenset(ids), now)

    def _adopt_locked(self, kind: DeviceKind, partners: int, now: float) -> frozenset[str]:
        """The devices of `kind` the last Allocate gave when no pod could be
        named for it (the watch lagged the kubelet), if that was within the
        pairing window and of `partners` devices: then the container the
        watch now names asked for them first, and this call is its second."""
        found = self._unclaimed
        if (
            found is None
            or found[0] is not kind
            or len(found[1]) != partners
            or now - found[2] > self._pair_seconds
        ):
            return frozenset()
        self._unclaimed = None
        return found[1]

    def _given_locked(self, key: ContainerKey, uid: str, kind: DeviceKind) -> frozenset[str]:
        found = self._given.get(key)
        if found is None or found[0] != uid:
            return frozenset()
        return found[1].get(kind, frozenset())

    def _reused_locked(self, pod: PodInfo, container: str, kind: DeviceKind) -> frozenset[str]:
        """Devices of `kind` the kubelet will give `container` first: those its
        pod's finished (non-restartable) init containers got and no app
        container or sidecar has taken since."""
        pool: set[str] = set()
        for init in pod.init_containers:
            if not init.sidecar:
                pool |= self._given_locked((pod.namespace, pod.name, init.name), pod.uid, kind)
        takers = [c for c in pod.init_containers if c.sidecar] + list(pod.containers)
        for other in takers:
            if other.name != container:
                pool -= self._given_locked((pod.namespace, pod.name, other.name), pod.uid, kind)
        return frozenset(pool)

    def _record_locked(
        self, key: ContainerKey, uid: str, kind: DeviceKind, ids: Sequence[str]
    ) -> None:
        found = self._given.get(key)
        if found is None or found[0] != uid:
            found = self._given[key] = (uid, {})
        found[1][kind] = frozenset(ids)
        if len(self._given) > GIVEN_LIMIT:
            live = {(p.namespace, p.name) for p in self._cache.pods().values()}
            for gone in [k for k in self._given if k[:2] not in live]:
                del self._given[gone]

    def _count(self, resource: str, outcome: Outcome) -> None:
        if self._metrics is None:
            return
        counter = self._counters.get((resource, outcome))
        if counter is None:
            counter = self._counters[(resource, outcome)] = self._metrics.pod_aware.labels(
                resource, outcome.value
            )
        counter.inc()

    # -- the pod witness (for releases) ----------------------------------------
    def uid_of(self, namespace: str, pod: str) -> str | None:
        return self._cache.uid_of(namespace, pod)

    def ended(self, owner: Owner) -> bool | None:
        return self._cache.ended(owner)

    def init_claimant(self, resource: str) -> bool | None:
        return self._cache.init_claimant(resource)

    def holder_of(
        self, kind: DeviceKind, ids: Sequence[str], resource: str | None = None
    ) -> tuple[ContainerKey, str] | None:
        """The container (and its pod's uid) an Allocate is for: the container
        its preference was asked for, or (no preference asked) the one
        admission candidate of that size."""
        now = self._clock()
        with self._lock:
            answered = self._answered.pop(kind, None)
            if (
                answered is not None
                and answered.size == len(ids)
                and now - answered.at <= self._claim_seconds
            ):
                self._record_locked(answered.key, str(answered.owner[2]), kind, ids)
                self._unclaimed = None  # the kubelet has moved on to a named container
                return answered.key, str(answered.owner[2])
            expected = self._expected
            if (
                expected is not None
                and expected.kind is kind
                and expected.size == len(ids)
                and now - expected.at <= self._pair_seconds
            ):
                # The container's other resource, given with no preference
                # asked (all reused from its pod's init containers): nothing
                # is expected any more, or the next container's request
                # would be taken for it.
                self._expected = None
                self._record_locked(expected.key, str(expected.owner[2]), kind, ids)
                return expected.key, str(expected.owner[2])
        names = self._resources(kind, resource)
        if names is None or not self._cache.current:
            self._unclaimed_allocate(kind, ids, now)
            return None
        answer = admitting(
            self._cache.waiting(),
            resource=names[0],
            other=names[1],
            size=len(ids),
            held=self._held(kind),
            waiting=True,
        )
        if answer.outcome is not Outcome.EXACT or len(answer.candidates) != 1:
            self._unclaimed_allocate(kind, ids, now)
            return None
        (only,) = answer.candidates
        key = (only.pod.namespace, only.pod.name, only.container.name)
        with self._lock:
            self._claims[(kind, key)] = (now, only.pod.uid)
            self._record_locked(key, only.pod.uid, kind, ids)
        return key, only.pod.uid

    def _held(self, kind: DeviceKind) -> frozenset[ContainerKey]:
        """Containers holding `kind` now: per the ledger (whose pod-watch rule
        has dropped ended pods) and the claims made here, both only for the
        pod of that name alive now."""
        held = set()
        for holder in self._ledger.holders():
            key = holder.container
            if key is None or not holder.devices[kind]:
                continue
            if holder.uid is None or holder.uid == self._cache.uid_of(key[0], key[1]):
                held.add(key)
        now = self._clock()
        with self._lock:
            for claim in [c for c, v in self._claims.items() if now - v[0] > self._claim_seconds]:
                del self._claims[claim]
            claims = [(key, uid) for (k, key), (_, uid) in self._claims.items() if k is kind]
        held.update(key for key, uid in claims if uid == self._cache.uid_of(key[0], key[1]))
        return frozenset(held)
