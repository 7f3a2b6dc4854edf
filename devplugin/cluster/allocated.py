"""Which of this node's devices the scheduler has allocated, ahead of the
kubelet's prepare.

The free counts a claim template's gate reads (frontends/dra/slices.py)
must move when the scheduler allocates, not when the kubelet prepares: in
between, a node one device short would pass the gate and the scheduler's
allocator would walk every order of the claim's requests before it gave up
(millions of tries for a few pairs). The scheduler writes a claim's
allocation before it binds the pod, so a pod bound to this node, as the
node's pod watch sees it, names claims that are already allocated here.

On each pod event the claims the node's live pods name are compared with
those read before; new ones are read (on this loop's thread, never on an
RPC path), gone ones forgotten, and when the devices they hold in this
driver's pool change the slices are written again at once. A claim read
before its allocation was visible is read again shortly; every claim is
read again each `resync` seconds, the safety net for a change no pod
event shows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from devplugin.cluster.pods import PodCache
from devplugin.loops import Backoff, ThreadLoop
from devplugin.policy.claims import ClaimReader

ClaimKey = tuple[str, str]  # (namespace, name)
# A claim read without its allocation is read again after this long.
RETRY_SECONDS = 0.5


def pool_devices(claim: Mapping[str, Any] | None, driver: str, pool: str) -> frozenset[str]:
    """The devices of `driver`'s `pool` that an allocated claim holds (an
    admin-access result holds none, as the scheduler counts them)."""
    if claim is None:
        return frozenset()
    allocation = (claim.get("status") or {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    return frozenset(
        str(result["device"])
        for result in results
        if isinstance(result, Mapping)
        and result.get("driver") == driver
        and result.get("pool") == pool
        and not result.get("adminAccess")
        and "device" in result
    )


def allocated(claim: Mapping[str, Any] | None) -> bool:
    return bool(((claim or {}).get("status") or {}).get("allocation"))


class AllocatedClaims(ThreadLoop):
    def __init__(
        self,
        pods: PodCache,
        reader: ClaimReader,
        *,
        driver: str,
        pool: str,
        changed: Callable[[], None],
        resync: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            "allocated-claims",
            backoff=Backoff(0.5, 10.0),
            join_timeout=2.0,
            failing="allocated claims not read",
        )
        self._pods = pods
        self._reader = reader
        self._driver = driver
        self._pool = pool
        self._changed = changed
        self._resync = resync
        self._clock = clock
        self._lock = threading.Lock()
        # claim -> (the devices it holds here, when it is read next, how long
        # the wait before was: doubling while it shows no allocation)
        self._read: dict[ClaimKey, tuple[frozenset[str], float, float]] = {}
        self._devices: frozenset[str] = frozenset()
        pods.listen(self.poke)

    def devices(self) -> frozenset[str]:
        """The devices (as slices name them) claims of this node's pods hold."""
        with self._lock:
            return self._devices

    def wanted(self) -> set[ClaimKey]:
        """The claims the node's live pods name."""
        return {
            (pod.namespace, name)
            for pod in self._pods.pods().values()
            if not pod.terminal
            for name in pod.claims
        }

    def step(self) -> float | None:
        wanted = self.wanted()
        now = self._clock()
        wait: float | None = self._resync
        with self._lock:
            known = dict(self._read)
        for key in [k for k in known if k not in wanted]:
            del known[key]
        for key in sorted(wanted):
            entry = known.get(key)
            if entry is not None and now < entry[1]:
                wait = min(wait, entry[1] - now) if wait is not None else entry[1] - now
                continue
            if self.stopping:
                return None
            claim = self._reader.get(*key)
            if allocated(claim):
                delay = self._resync
            else:
                # Not allocated yet as read (or gone): again soon, then less often.
                delay = min(self._resync, 2 * entry[2]) if entry is not None else RETRY_SECONDS
            due = self._clock() + delay
            known[key] = (pool_devices(claim, self._driver, self._pool), due, delay)
            wait = min(wait, delay) if wait is not None else delay
        devices = frozenset().union(*(entry[0] for entry in known.values()))
        with self._lock:
            self._read = known
            before, self._devices = self._devices, devices
        if devices != before:
            self._changed()
        return wait
