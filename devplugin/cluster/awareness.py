"""Knowing the container at GetPreferredAllocation, from the pod cache.

For a first resource the daemon asks the admission rule which container is
being admitted and plans for its exact partner count. Which containers
already hold devices comes from the ledger (PodResources) plus the claims
made here: the container just answered for is claimed at once, because the
kubelet only records its allocation after Allocate returns and the next
container's request may come before the next poll. Claims end when a poll
shows the container holding, or after `claim_seconds`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

from devplugin.admission import Admission, ContainerKey, Outcome, admitting
from devplugin.cluster.pods import PodCache
from devplugin.ledger import Ledger
from devplugin.metrics import Metrics
from devplugin.model import DeviceKind
from devplugin.podinfo import PodInfo


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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cache = cache
        self._ledger = ledger
        self._names = dict(names)
        self._wait = wait
        self._metrics = metrics
        self._claim_seconds = claim_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._claims: dict[tuple[DeviceKind, ContainerKey], float] = {}

    def partners(self, kind: DeviceKind, size: int) -> int | None:
        resource, other = self._names.get(kind), self._names.get(kind.other)
        if resource is None or other is None:
            return None
        held = self._held(kind)

        def ask(pods: Mapping[str, PodInfo]) -> Admission:
            return admitting(pods.values(), resource=resource, other=other, size=size, held=held)

        answer = ask(self._cache.pods())
        if answer.outcome is Outcome.NO_POD and self._wait > 0:
            # The pod may be a moment behind in the watch: wait, boundedly.
            self._cache.wait_for(lambda pods: ask(pods).outcome is not Outcome.NO_POD, self._wait)
            answer = ask(self._cache.pods())
        if self._metrics is not None:
            self._metrics.pod_aware.labels(resource, answer.outcome.value).inc()
        if answer.outcome is not Outcome.EXACT:
            return None
        first = answer.candidates[0]
        key = (first.pod.namespace, first.pod.name, first.container.name)
        now = self._clock()
        with self._lock:
            # The kubelet gives this container all its resources before the
            # next one: it counts as holding both from now on.
            self._claims[(kind, key)] = now
            self._claims[(kind.other, key)] = now
        return answer.partners

    def _held(self, kind: DeviceKind) -> frozenset[ContainerKey]:
        holdings = self._ledger.holdings()
        polled = {key for key, kinds in holdings.containers.items() if kinds.get(kind)}
        now = self._clock()
        with self._lock:
            for claim in [c for c, at in self._claims.items() if now - at > self._claim_seconds]:
                del self._claims[claim]
            claimed = {key for (k, key) in self._claims if k is kind}
        return frozenset(polled | claimed)
