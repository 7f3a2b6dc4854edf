"""A node as placement sees it (pure): its topology, what is free, healthy
and held there, its kubelet's policy, and what one placement on it gives."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

from devplugin.model import (
    DeviceKind,
)
from devplugin.policy.topology import Level, Topology
from devplugin.policy.topology_manager import (
    NO_POLICY,
    KubeletPolicy,
    Pool,
)


@dataclass(frozen=True)
class Holding:
    """One container's devices, per a record."""

    namespace: str
    pod: str
    uid: str | None
    devices: frozenset[str]


@dataclass(frozen=True)
class NodeState:
    """One node as its record describes it."""

    name: str
    topology: Topology
    free: Mapping[DeviceKind, frozenset[str]]
    total: Mapping[DeviceKind, int]
    # Who holds what per the record: (namespace, pod) pairs.
    holders: frozenset[tuple[str, str]]
    # The same with their devices (a holder not identified yet has empty names).
    holdings: tuple[Holding, ...] = ()
    # Healthy devices, held or not.
    healthy: Mapping[DeviceKind, frozenset[str]] | None = None
    # The resource each device is served under (pool key -> ids; see
    # `pool`); empty: every device of a kind in one pool, as older records say.
    pools: Mapping[str, frozenset[str]] = field(default_factory=dict)
    mig: frozenset[str] = frozenset()  # MIG devices (their parent's place)
    # Shared devices: how many replicas each is served as, and how many are held.
    replicas: Mapping[str, int] = field(default_factory=dict)
    used: Mapping[str, int] = field(default_factory=dict)
    # What the node's kubelet aligns (its Topology and CPU Managers), the
    # NUMA nodes it knows, the exclusive CPUs by NUMA node (None: unknown),
    # and whether its device hints span only the nodes with devices (1.37).
    kubelet: KubeletPolicy = NO_POLICY
    machine: tuple[int, ...] = ()
    cpus: Pool | None = None
    device_nodes_only: bool = True

    def without(self, ended: Iterable[Holding]) -> NodeState:
        """The node once these holders' devices are back (their pods ended):
        an exclusive device is free again, a shared one has a replica back."""
        used = dict(self.used)
        back: set[str] = set()
        for holding in ended:
            for device in holding.devices:
                if device in self.replicas:
                    used[device] = max(0, used.get(device, 0) - 1)
                back.add(device)
        healthy = self.healthy or {}
        free = {
            kind: self.free[kind]
            | frozenset(
                d
                for d in back & healthy.get(kind, frozenset())
                if used.get(d, 0) < self.replicas.get(d, 1)
            )
            for kind in DeviceKind
        }
        return replace(self, free=free, used=used)

    def reserve(self, devices: Iterable[str]) -> NodeState:
        """The node with these devices spoken for (the room a nominated pod
        waits for): an exclusive device is neither free nor freed by any
        eviction (it leaves `healthy`), a shared one has a replica held."""
        used = dict(self.used)
        gone: set[str] = set()
        for device in devices:
            if device in self.replicas:
                used[device] = used.get(device, 0) + 1
                if used[device] >= self.replicas[device]:
                    gone.add(device)
            else:
                gone.add(device)
        exclusive = gone - self.replicas.keys()
        free = {kind: self.free[kind] - gone for kind in DeviceKind}
        healthy = (
            {kind: ids - exclusive for kind, ids in self.healthy.items()}
            if self.healthy is not None
            else None
        )
        return replace(self, free=free, used=used, healthy=healthy)

    def after(self, outcome: Outcome) -> NodeState:
        """The node once a placement's devices are taken (unchanged when it
        does not fit)."""
        if outcome.free_after is None:
            return self
        used = outcome.used_after if outcome.used_after is not None else self.used
        cpus = outcome.cpus_after if outcome.cpus_after is not None else self.cpus
        return replace(self, free=outcome.free_after, used=used, cpus=cpus)

    def pool(self, kind: DeviceKind, resource: str) -> frozenset[str]:
        """The devices served under `resource` ("": the kind's whole devices,
        MIG devices apart). A record that does not say (an older daemon)
        serves whole devices under the kind's name and MIG devices under
        `<domain>/mig-<profile>`."""
        ids = self.topology.id_set(kind)
        if not self.pools or not resource:
            return ids - self.mig
        found = self.pools.get(resource)
        if found is None:
            found = self.pools.get(_fallback(resource), frozenset())
        return found & ids


@dataclass(frozen=True)
class Outcome:
    """What placing the pod on a node would give."""

    fits: bool
    reason: str
    # Worst GPU-HCA level over the pod's GPU+HCA containers (None without any).
    worst: Level | None = None
    total: int = 0
    # How much squared-free-capacity the node's domains lose (lower keeps
    # whole switches, NUMA nodes and nodes free for large requests).
    fragmentation: int = 0
    free_after: Mapping[DeviceKind, frozenset[str]] | None = None
    # Shared devices' held replicas after it (None: none shared).
    used_after: Mapping[str, int] | None = None
    # The devices it takes (a shared one once, however many replicas).
    chosen: frozenset[str] = frozenset()
    # The exclusive CPUs left by NUMA node after it (None: not counted).
    cpus_after: Pool | None = None

    def taken(self, free: Mapping[DeviceKind, frozenset[str]]) -> frozenset[str]:
        """The devices this placement takes from `free` (the node's free
        devices it was made on); nothing for an outcome that does not fit."""
        if self.free_after is None:
            return frozenset()
        gone = frozenset().union(*(free[kind] - self.free_after[kind] for kind in DeviceKind))
        return gone | self.chosen

    def key(self) -> tuple[int, int, int]:
        return self.rank_key

    @cached_property
    def rank_key(self) -> tuple[int, int, int]:
        # Kept: the extender ranks thousands of nodes' outcomes per call.
        worst = int(self.worst) if self.worst is not None else 0
        return (worst, self.total, self.fragmentation)


def _fallback(resource: str) -> str:
    """The pool key an older record (no `resource` on its devices) gives a
    resource: a MIG profile's `mig-<profile>`, else the kind's whole devices."""
    _, slash, name = resource.rpartition("/")
    return name if slash and name.startswith("mig-") else ""
