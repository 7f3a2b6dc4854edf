"""Who holds which device: one ledger, read by planning, the record and cleanup.

The planning view (`taken`, `holders`) is moved by events. Each source is
applied as it arrives, stamped with the moment its word was true, and a
source never overrides a newer word about the same device:

1. Allocate: the devices are taken, by the container the pod cache
   identified when it could (`holder`, with the pod's uid), else by an
   unknown holder.
2. The pod watch: a pod that ended (deleted, Succeeded/Failed, replaced by a
   namesake) holds nothing. Every device its containers held is free at
   once, and the pod is remembered, so a PodResources answer that lists it
   (one begun earlier, or a kubelet slow to forget) cannot bring them back.
3. GetPreferredAllocation's `available` list, the kubelet's own word on
   one kind at that instant: the devices it lists (less must-include, which
   the pod reuses) are free; the kubelet frees a pod's devices together, so
   a pod that held one of them holds none of either kind any more; a device
   we thought free that it does not list is taken (holder unknown).
4. A PodResources poll, begun at `polled_at`, reconciles: a device it lists
   is held by that container (unless its pod is known to have ended); a
   device it does not list is free, except one allocated within `grace`
   before the poll (the kubelet records an allocation just after Allocate
   returns) or one the available list said was taken (PodResources does
   not list init containers, which keep their devices for their pod). It
   is the only source without API access.

A finished non-restartable init container's devices stay with its pod for
the pod's later containers (the kubelet reuses them first): they are taken
until a poll has not listed them for `grace` seconds, as before.

The release view (`in_use`, read by the custody book's releases) is older and
stricter: held per the last poll, or allocated since and not yet confirmed.
Cleanup keeps counting its own confirmations on it and fails closed; being
free for planning is not being released for cleanup. (A device whose
cleanup is owed or running is Unhealthy, so it is never free for planning.)

Bounded whatever the sources do: one planning entry per physical device
(Allocate validates ids first, the available list is limited to devices
served), ended pods kept at most `ENDED_LIMIT`, and an entry no source has
confirmed expires after `max_age` seconds even if every poll fails.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from devplugin.model import DeviceKind

BOOKKEEPING_GRACE = 5.0
MAX_AGE = 300.0
# Ended pods remembered (so late PodResources answers do not revive them).
ENDED_LIMIT = 4096


# (namespace, pod, container)
ContainerKey = tuple[str, str, str]


@dataclass(frozen=True)
class Holdings:
    """What one PodResources answer said, per container and per kind."""

    # (namespace, pod, container) -> kind -> physical device ids
    containers: Mapping[tuple[str, str, str], Mapping[DeviceKind, tuple[str, ...]]] = field(
        default_factory=dict
    )

    def held(self, kind: DeviceKind) -> frozenset[str]:
        return frozenset(
            device for kinds in self.containers.values() for device in kinds.get(kind, ())
        )


class Source(enum.Enum):
    ALLOCATE = "allocate"
    POLL = "poll"
    AVAILABLE = "available"


@dataclass(frozen=True)
class Hold:
    """Who holds a device in the planning view, and whose word that is."""

    container: ContainerKey | None
    uid: str | None
    at: float
    source: Source


@dataclass(frozen=True)
class Held:
    """One holder's devices in the planning view (container None: not known yet)."""

    container: ContainerKey | None
    uid: str | None
    devices: Mapping[DeviceKind, tuple[str, ...]]


@dataclass(frozen=True)
class _Ended:
    uid: str
    at: float


Key = tuple[DeviceKind, str]


class Ledger:
    """Thread-safe; every method is O(devices) at most and never blocks on I/O."""

    def __init__(
        self,
        *,
        grace: float = BOOKKEEPING_GRACE,
        max_age: float = MAX_AGE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._grace = grace
        self._max_age = max(max_age, grace)
        self._clock = clock
        self._lock = threading.Lock()
        self._version = 0
        self._listeners: list[Callable[[], None]] = []
        self._freed_listeners: list[Callable[[], None]] = []
        # -- the planning view --
        self._holds: dict[Key, Hold] = {}
        # The last moment a source said a device was free.
        self._freed: dict[Key, float] = {}
        # (namespace, pod) -> the ended pod of that name.
        self._ended: OrderedDict[tuple[str, str], _Ended] = OrderedDict()
        # When a source last confirmed the view (for its age).
        self._confirmed = -math.inf
        self._holders_cache: tuple[int, tuple[Held, ...]] | None = None
        # No entry can expire before this (monotonic seconds).
        self._next_expiry = -math.inf
        self.corrections = 0
        # -- the release view --
        self._holdings = Holdings()
        self._held: dict[DeviceKind, frozenset[str]] = {k: frozenset() for k in DeviceKind}
        # (kind, device) -> when it was last allocated and not yet seen held.
        self._recent: dict[Key, float] = {}

    # -- change notification ---------------------------------------------------
    @property
    def version(self) -> int:
        """Changes whenever `taken` may have changed (for callers' caches)."""
        with self._lock:
            self._expire_locked(self._clock())
            return self._version

    def listen(self, listener: Callable[[], None]) -> None:
        """Call `listener` (on the caller's thread, no lock held) after a
        change of the planning view."""
        self._listeners.append(listener)

    def listen_freed(self, listener: Callable[[], None]) -> None:
        """Call `listener` (no lock held) when the pod watch's word that a
        pod ended frees devices."""
        self._freed_listeners.append(listener)

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    # -- sources -----------------------------------------------------------------
    def allocated(
        self,
        kind: DeviceKind,
        ids: Iterable[str],
        *,
        holder: ContainerKey | None = None,
        uid: str | None = None,
    ) -> None:
        """Rule 1: an Allocate succeeded."""
        now = self._clock()
        with self._lock:
            for device in ids:
                self._holds[(kind, device)] = Hold(holder, uid, now, Source.ALLOCATE)
                self._recent[(kind, device)] = now
            self._confirmed = now
            self._expire_locked(now)
            self._version += 1
        self._changed()

    def pod_ended(self, namespace: str, pod: str, uid: str, *, successor: bool = False) -> bool:
        """Rule 2: the pod watch saw this pod end. `successor`: a live pod of
        the same name exists (a namesake), so only holds known to be this
        uid's are freed. Whether anything was freed."""
        now = self._clock()
        with self._lock:
            self._ended[(namespace, pod)] = _Ended(uid, now)
            self._ended.move_to_end((namespace, pod))
            while len(self._ended) > ENDED_LIMIT:
                self._ended.popitem(last=False)
            self._confirmed = now
            freed = self._free_pod_locked(namespace, pod, uid, now, strict=successor)
            if freed:
                self._version += 1
        if freed:
            self._changed()
            for listener in self._freed_listeners:
                listener()
        return freed

    def pod_started(self, namespace: str, pod: str, uid: str) -> None:
        """The pod watch saw a live pod: a namesake of an ended pod is a new
        holder, so PodResources answers naming it count again."""
        with self._lock:
            ended = self._ended.get((namespace, pod))
            if ended is not None and ended.uid != uid:
                del self._ended[(namespace, pod)]

    def available(
        self,
        kind: DeviceKind,
        listed: Iterable[str],
        must: Iterable[str],
        served: Iterable[str],
    ) -> bool:
        """Rule 3: the kubelet offered `listed` (with `must` reused by the pod
        asking) out of the healthy devices we serve (`served`). Whether the
        view changed."""
        now = self._clock()
        reused = frozenset(must)
        free = frozenset(listed) - reused
        changed = False
        with self._lock:
            self._confirmed = now
            ended_pods: set[tuple[str, str, str | None]] = set()
            for device in free:
                hold = self._holds.pop((kind, device), None)
                self._freed[(kind, device)] = now
                if hold is not None:
                    changed = True
                    if hold.container is not None:
                        ended_pods.add((hold.container[0], hold.container[1], hold.uid))
            for namespace, pod, uid in ended_pods:
                # The kubelet released that pod: its other devices too.
                self._free_pod_locked(namespace, pod, uid, now, strict=False)
            for device in frozenset(served) - free - reused:
                key = (kind, device)
                if key not in self._holds:
                    self._holds[key] = Hold(None, None, now, Source.AVAILABLE)
                    changed = True
            if changed:
                self.corrections += 1
                self._version += 1
        if changed:
            self._changed()
        return changed

    def observe(self, holdings: Holdings, polled_at: float) -> None:
        """Rule 4: a PodResources poll that began at `polled_at` answered `holdings`."""
        changed = False
        with self._lock:
            # The release view: as before.
            self._holdings = holdings
            self._held = {kind: holdings.held(kind) for kind in DeviceKind}
            for key, at in list(self._recent.items()):
                if at > polled_at:
                    continue  # allocated after the poll began: it proves nothing
                kind, device = key
                if device in self._held[kind] or polled_at - at > self._grace:
                    del self._recent[key]
            # The planning view.
            listed: dict[Key, ContainerKey] = {}
            for container, kinds in holdings.containers.items():
                if self._ended_locked(container):
                    continue
                for kind, devices in kinds.items():
                    for device in devices:
                        listed[(kind, device)] = container
            for key, container in listed.items():
                if self._freed.get(key, -math.inf) > polled_at:
                    continue  # a newer word says it is free
                hold = self._holds.get(key)
                if hold is not None and hold.at > polled_at:
                    continue  # a newer word says who holds it
                uid = hold.uid if hold is not None and hold.container == container else None
                if hold is None or hold.container != container or hold.source is not Source.POLL:
                    changed = True
                self._holds[key] = Hold(container, uid, polled_at, Source.POLL)
            for key, hold in list(self._holds.items()):
                if key in listed or hold.at > polled_at:
                    continue
                if hold.source is Source.ALLOCATE and polled_at - hold.at <= self._grace:
                    continue  # the kubelet may not have recorded it yet
                if hold.source is Source.AVAILABLE:
                    continue  # PodResources cannot see what the kubelet said
                del self._holds[key]
                self._freed[key] = polled_at
                changed = True
            self._confirmed = max(self._confirmed, polled_at)
            self._expire_locked(self._clock())
            self._version += 1
        if changed:
            self._changed()

    # -- the planning view -------------------------------------------------------
    def taken(self, kind: DeviceKind) -> frozenset[str]:
        """Devices of `kind` someone holds, as the latest word says."""
        with self._lock:
            self._expire_locked(self._clock())
            return frozenset(device for (k, device) in self._holds if k is kind)

    def holders(self) -> tuple[Held, ...]:
        """Every holder with its devices (sorted), holders known by name first
        (built once per change: the pod-aware preference reads it each time)."""
        with self._lock:
            self._expire_locked(self._clock())
            cached = self._holders_cache
            if cached is not None and cached[0] == self._version:
                return cached[1]
            found: dict[ContainerKey | None, dict[DeviceKind, list[str]]] = {}
            uids: dict[ContainerKey | None, str] = {}
            for (kind, device), hold in self._holds.items():
                found.setdefault(hold.container, {k: [] for k in DeviceKind})[kind].append(device)
                if hold.uid is not None:
                    uids[hold.container] = hold.uid
            built = tuple(
                Held(
                    container, uids.get(container), {k: tuple(sorted(v)) for k, v in kinds.items()}
                )
                for container, kinds in sorted(found.items(), key=lambda item: item[0] or ("~",))
            )
            self._holders_cache = (self._version, built)
            return built

    def age(self) -> float:
        """Seconds since a source last confirmed the view (inf before any)."""
        with self._lock:
            return max(0.0, self._clock() - self._confirmed)

    # -- the release view (cleanup) ------------------------------------------------
    def settling(self) -> bool:
        """Whether an Allocate still awaits its container in a poll."""
        with self._lock:
            return bool(self._recent)

    def in_use(self, kind: DeviceKind) -> frozenset[str]:
        """Held per the last poll, or allocated since and not yet confirmed."""
        with self._lock:
            self._expire_locked(self._clock())
            recent = [device for (k, device) in self._recent if k is kind]
            return self._held[kind].union(recent) if recent else self._held[kind]

    def holdings(self) -> Holdings:
        with self._lock:
            return self._holdings

    def __len__(self) -> int:
        """Devices with an entry besides what the last poll confirmed (at most
        one each): the part bounded by `max_age`. Ended pods are bounded
        apart, by ENDED_LIMIT."""
        with self._lock:
            self._expire_locked(self._clock())
            unconfirmed = {k for k, hold in self._holds.items() if hold.source is not Source.POLL}
            return len(self._recent.keys() | unconfirmed)

    # -- internals -------------------------------------------------------------------
    def _ended_locked(self, container: ContainerKey) -> bool:
        """Whether a poll's listing of this container is to be ignored: its
        pod ended (and no namesake took the name since)."""
        return (container[0], container[1]) in self._ended

    def _free_pod_locked(
        self, namespace: str, pod: str, uid: str | None, now: float, *, strict: bool
    ) -> bool:
        freed = False
        for key, hold in list(self._holds.items()):
            container = hold.container
            if container is None or container[0] != namespace or container[1] != pod:
                continue
            if hold.uid is not None and uid is not None and hold.uid != uid:
                continue  # a namesake's
            if strict and hold.uid is None:
                continue
            del self._holds[key]
            self._freed[key] = now
            freed = True
        return freed

    def _expire_locked(self, now: float) -> None:
        # Every read passes here: scan only once something can have expired.
        if now < self._next_expiry:
            return
        stale = [key for key, at in self._recent.items() if now - at > self._max_age]
        for key in stale:
            del self._recent[key]
        # Unconfirmed for that long whatever every poll said: let it go.
        old = [
            key
            for key, hold in self._holds.items()
            if hold.source is not Source.POLL and now - hold.at > self._max_age
        ]
        for key in old:
            del self._holds[key]
        if stale or old:
            self._version += 1
        # Entries only ever get younger or new: the oldest left sets the next scan.
        ages = [*self._recent.values()]
        ages.extend(h.at for h in self._holds.values() if h.source is not Source.POLL)
        self._next_expiry = (min(ages) if ages else now) + self._max_age
