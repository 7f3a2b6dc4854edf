"""One container, two resources: the state both DevicePlugin servers share.

The kubelet asks for a container's GPUs and HCAs one resource at a time (its
own preference, then Allocate, then the next resource), in an order that is
not defined (it walks a Go map), and the requests carry no pod identity. So:

* When a request comes with no recent allocation of the other resource, it
  is treated as the first of a pair and chosen so the other resource can
  still be aligned: GPUs next to free HCAs, HCAs next to the most free GPUs
  (`Role.FIRST`, partner = the other kind's free devices).
* An Allocate records what was just given. A request for the other resource
  within `pairing_window` seconds is the same container's second resource
  and is chosen against that set (`Role.SECOND`). The kubelet handles one
  container's resources back to back, so the window can be short; a stale
  pairing only biases a choice towards one set of devices, it never makes a
  choice invalid.
* The first resource's choice depends on how many devices of the other
  kind will follow, which the kubelet does not say. The coordinator
  remembers, per (kind, count), the partner count of the last completed
  pair (0 when no partner followed) and assumes it again; with no history it
  assumes as many as requested (one HCA per GPU). When the assumption holds,
  the pair reaches the best worst level any choice of both sets could.
* When the pod cache names the container being admitted (`Known`), that
  beats the clock: a request known to be a container's first resource is
  planned for its exact partner count even if an unrelated allocation of
  the other kind (a single-resource container) was made a moment ago, and
  its Allocate starts a new pair instead of completing that one.
* Which devices of the other kind are free is read from the holdings
  ledger (moved by Allocates, the pod watch, the kubelet's available lists
  and PodResources polls); the coordinator never calls out. Each request's
  own available list is handed to the ledger first (`observe_available`):
  it is the kubelet's word on that kind at that instant.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from math import comb

from devplugin.kinds.registry import ANCHOR, PARTNER, is_anchor, paired_with
from devplugin.model import DeviceKind
from devplugin.node.ledger import Ledger
from devplugin.policy.allocator import SEARCH_BUDGET, Allocator, Choice, Request, Role
from devplugin.policy.topology import Topology

log = logging.getLogger(__name__)


# How many completions of a partly forced partner set are tried at most.
FORCED_SETS = 256


@dataclass(frozen=True)
class Known:
    """What the pod cache says about the container a request is for."""

    # How many devices of the other resource the same container asks for.
    partners: int
    # The container already got the other resource (this request completes it).
    second: bool = False
    # Devices of the other resource the kubelet will give the container
    # whatever is preferred: its pod's finished init containers' (reused).
    forced: frozenset[str] = frozenset()
    # Where the other kind is served as several resources (mixed MIG): the
    # one the container asks for, and (filled in by its servicer) that
    # resource's devices: its partner is planned among these only.
    partner_resource: str | None = None
    partner_ids: frozenset[str] | None = None


@dataclass(frozen=True)
class _Given:
    kind: DeviceKind
    ids: frozenset[str]
    at: float


class Coordinator:
    """Topology, health, free-device estimates and pairing for both resources."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        pairing_window: float = 2.0,
        search_budget: float = SEARCH_BUDGET,
        on_budget: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ledger = ledger
        self._window = pairing_window
        self._budget = search_budget
        self._on_budget = on_budget
        self._clock = clock
        self._lock = threading.Lock()
        self._topology = Topology((), ())
        self._allocator = Allocator(self._topology)
        self._healthy: dict[DeviceKind, frozenset[str]] = {k: frozenset() for k in DeviceKind}
        self._pending: _Given | None = None
        # A request known to be a container's first resource was answered:
        # the next Allocate of that kind starts a new pair.
        self._starting: DeviceKind | None = None
        # (kind, count) of a first resource -> partner count that followed.
        self._shapes: dict[tuple[DeviceKind, int], int] = {}
        # Free sets, recomputed only after something they depend on changed
        # (health here, or the ledger's version).
        self._free_cache: dict[DeviceKind, frozenset[str]] = {}
        self._ledger_version = -1

    # -- inputs ----------------------------------------------------------------
    @property
    def topology(self) -> Topology:
        with self._lock:
            return self._topology

    def set_topology(self, topology: Topology) -> None:
        """A new device set: precompute the search structures once, here."""
        allocator = Allocator(topology, budget=self._budget, on_budget=self._on_budget)
        with self._lock:
            previous = self._allocator.method
            self._topology = topology
            self._allocator = allocator
            self._free_cache.clear()
        if allocator.method != previous:
            log.info("GPU search: %s (%d GPUs)", allocator.method, len(topology.gpus))

    def set_healthy(self, kind: DeviceKind, ids: Iterable[str]) -> None:
        with self._lock:
            self._healthy[kind] = frozenset(ids)
            self._free_cache.clear()

    def allocated(self, kind: DeviceKind, ids: Sequence[str]) -> None:
        """An Allocate succeeded (the ledger has it): pairing advances."""
        now = self._clock()
        given = _Given(kind, frozenset(ids), now)
        with self._lock:
            pending = self._pending
            if self._starting is kind:
                self._starting = None
                if pending is not None and pending.kind is not kind:
                    self._shapes[(pending.kind, len(pending.ids))] = 0
                self._pending = given
                return
            if (
                pending is not None
                and pending.kind is not kind
                and now - pending.at <= self._window
            ):
                # The container's second resource: the pair is complete.
                self._shapes[(pending.kind, len(pending.ids))] = len(given.ids)
                self._shapes[(kind, len(given.ids))] = len(pending.ids)
                self._pending = None
                return
            if pending is not None:
                # Nothing of the other kind followed it.
                self._shapes[(pending.kind, len(pending.ids))] = 0
            self._pending = given

    def observe_available(
        self,
        kind: DeviceKind,
        available: Iterable[str],
        must_include: Iterable[str],
        scope: frozenset[str] | None = None,
    ) -> bool:
        """A GetPreferredAllocation's lists for `kind` (exclusive devices only):
        correct the holdings before planning. Whether they changed. `scope`:
        the devices the asking resource serves, where its kind is served as
        several (mixed MIG): the kubelet's list says nothing of the others."""
        with self._lock:
            known = self._topology.id_set(kind)
            served = self._healthy[kind] & known
            if scope is not None:
                served &= scope
        listed = frozenset(available) & known
        must = frozenset(must_include) & known
        # A kubelet whose Topology Manager aligns asks with the devices of its
        # affinity's NUMA nodes only (devicemanager/manager.go, devicesToAllocate:
        # the aligned set), so what it leaves out elsewhere proves nothing.
        nodes = {self._topology.numa_node(d) for d in listed | must}
        served = frozenset(d for d in served if self._topology.numa_node(d) in nodes)
        return self._ledger.available(kind, listed, must, served)

    # -- queries ---------------------------------------------------------------
    def free(self, kind: DeviceKind) -> frozenset[str]:
        with self._lock:
            return self._free_locked(kind)

    def _free_locked(self, kind: DeviceKind) -> frozenset[str]:
        version = self._ledger.version
        if version != self._ledger_version:
            self._free_cache.clear()
            self._ledger_version = version
        cached = self._free_cache.get(kind)
        if cached is not None:
            return cached
        free = self._healthy[kind] - self._ledger.taken(kind)
        self._free_cache[kind] = free
        return free

    def preferred(
        self,
        kind: DeviceKind,
        available: Iterable[str],
        must_include: Iterable[str],
        size: int,
        *,
        known: Known | None = None,
    ) -> tuple[Choice, Role]:
        """The choice for one container request (raises Refused). `known`: what
        the pod cache says about the container, when it can tell."""
        now = self._clock()
        must = frozenset(must_include)
        with self._lock:
            healthy = self._healthy[kind]
            # Unhealthy devices are never offered, whatever the kubelet lists;
            # a must-include id the kubelet did not list as available is
            # refused (FAILED_PRECONDITION), not quietly added.
            candidates = frozenset(available) & healthy
            other = paired_with(kind)
            other_free = self._free_locked(other)
            if known is not None and known.partner_ids is not None:
                other_free = other_free & known.partner_ids
            pending = self._pending
            expected: int | None = None
            paired = (
                pending is not None and pending.kind is other and now - pending.at <= self._window
            )
            if known is not None and not known.second:
                paired = False
                self._starting = kind
            if paired and pending is not None:
                role, partner = Role.SECOND, pending.ids
                other_free = other_free - pending.ids
            else:
                role, partner = Role.FIRST, other_free
                expected = (
                    known.partners if known is not None else self._shapes.get((kind, size), size)
                )
            allocator = self._allocator
        forced = known.forced if known is not None else frozenset()
        if role is Role.FIRST and known is not None and forced:
            choice = self._around_forced(
                allocator,
                kind=kind,
                candidates=candidates,
                must=must,
                size=size,
                known=known,
                other_free=other_free,
            )
            if choice is not None:
                return choice, role
        if (
            role is Role.FIRST
            and not is_anchor(kind)
            and expected
            and len(other_free | forced) >= expected
        ):
            # Too many completions of a forced GPU set to try each: plan the
            # GPUs with the forced ones in, as the kubelet will give them.
            planned_must = forced if expected >= len(forced) else frozenset()
            return self._hcas_for_planned_gpus(
                allocator, candidates=candidates, must=must, size=size, gpus=expected,
                free_gpus=other_free | forced, must_gpus=planned_must,
            ), role  # fmt: skip
        request = Request(kind, candidates, size, must, role, partner, other_free, expected)
        return allocator.choose(request), role

    @staticmethod
    def _hcas_for_planned_gpus(
        allocator: Allocator,
        *,
        candidates: frozenset[str],
        must: frozenset[str],
        size: int,
        gpus: int,
        free_gpus: frozenset[str],
        must_gpus: frozenset[str] = frozenset(),
    ) -> Choice:
        """HCAs first with `gpus` GPUs to follow (`must_gpus` among them): plan
        those GPUs as a first GPU request would (nearest to the HCAs, then
        best connected: on one socket under NVSwitch), then choose the HCAs
        against the plan. The pair is the one the other call order gives."""
        plan = allocator.choose(
            Request(
                ANCHOR,
                free_gpus,
                gpus,
                must_gpus,
                Role.FIRST,
                candidates,
                candidates,
                size,
            )
        )
        planned = frozenset(plan.ids)
        choice = allocator.choose(
            Request(
                PARTNER,
                candidates,
                size,
                must,
                Role.SECOND,
                planned,
                free_gpus - planned,
            )
        )
        return Choice(choice.ids, choice.score, plan.ids)

    @staticmethod
    def _around_forced(
        allocator: Allocator,
        *,
        kind: DeviceKind,
        candidates: frozenset[str],
        must: frozenset[str],
        size: int,
        known: Known,
        other_free: frozenset[str],
    ) -> Choice | None:
        """A first resource whose container will be given `known.forced` of the
        other kind (reused from its pod's init containers) and the rest from
        `other_free`: the best choice against every way the other set can be
        completed, each scored as a second resource against it. None when
        there are too many ways (the usual first-resource plan then)."""
        forced = known.forced
        need = known.partners - len(forced)
        if need <= 0:
            # The kubelet takes the partners among the forced ones.
            sets = [forced]
        else:
            pool = sorted(other_free - forced)
            if need > len(pool) or comb(len(pool), need) > FORCED_SETS:
                return None
            sets = [forced | frozenset(extra) for extra in itertools.combinations(pool, need)]
        best: Choice | None = None
        for partner in sets:
            request = Request(
                kind, candidates, size, must, Role.SECOND, partner, other_free - partner
            )
            choice = allocator.choose(request)
            if best is None or choice.score.key() < best.score.key():
                best = choice
        return best

    def expected_partners(self, kind: DeviceKind, size: int) -> int:
        """How many devices of the other kind a first request is assumed to get."""
        with self._lock:
            return self._shapes.get((kind, size), size)

    def nearest(self, gpu_ids: Sequence[str], kind: DeviceKind = PARTNER) -> list[str]:
        """Per GPU, the healthy device of `kind` closest to it (attach mode)."""
        with self._lock:
            topology = self._topology
            healthy = sorted(self._healthy[kind])
        chosen: list[str] = []
        for gpu in gpu_ids:
            if gpu not in topology.kind or not healthy:
                continue
            best = min(healthy, key=lambda device: (topology.level(gpu, device), device))
            if best not in chosen:
                chosen.append(best)
        return chosen
