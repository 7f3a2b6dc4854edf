"""The kubelet's Topology Manager as it admits a pod, rule by rule, so the
extender can tell which nodes would refuse a pod and where on a node the
kubelet would let its devices come from.

Each rule follows the kubelet's own code (k8s.io/kubernetes pkg/kubelet/cm,
v1.35 and v1.37 alike):
* a device resource's hints: devicemanager/topology_hints.go,
  `generateDeviceTopologyHints` (every non-empty set of the NUMA nodes the
  resource's devices sit on, known to the machine; a hint where the
  available devices there are enough; preferred where the set is as small
  as any that could hold the request with every device free);
* exclusive CPUs' hints: cpumanager/policy_static.go,
  `generateCPUTopologyHints` (the same over the machine's CPUs; only for a
  Guaranteed pod's container asking whole CPUs);
* the merge: topologymanager/policy.go (`mergePermutation`: the AND of one
  hint per resource, preferred when every hint is and their masks agree;
  `HintMerger.compare`: preferred first, then the narrowest, the best
  non-preferred count rule as written there), single-numa-node keeping
  only single-node preferred hints and turning the machine's whole mask
  into "no affinity" (policy_single_numa_node.go), restricted and
  single-numa-node admitting only a preferred result (policy_restricted.go),
  best-effort admitting always (policy_best_effort.go);
* the scope: `container` admits init then app containers one at a time,
  each on what the ones before left (scope_container.go); `pod` merges the
  pod's summed requests once and gives every container that affinity
  (scope_pod.go);
* which devices a container then gets: devicemanager/manager.go
  `filterByAffinity` and `devicesToAllocate` (the available devices on the
  affinity's NUMA nodes, where they are enough).

Masks are ints, bit i for NUMA node i, compared as the kubelet's bitmask
compares them (fewer bits is narrower; among as many, the smaller value).
Pure: counts in, an affinity or a refusal out.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

NONE, BEST_EFFORT, RESTRICTED, SINGLE = "none", "best-effort", "restricted", "single-numa-node"
POLICIES = (NONE, BEST_EFFORT, RESTRICTED, SINGLE)
CONTAINER, POD = "container", "pod"
SCOPES = (CONTAINER, POD)
CPU_NONE, CPU_STATIC = "none", "static"
CPU_POLICIES = (CPU_NONE, CPU_STATIC)
# The kubelet refuses to start with more NUMA nodes than this (topology_manager.go,
# defaultMaxAllowableNUMANodes) unless an option raises it; past it nothing is predicted.
MAX_NUMA_NODES = 8


@dataclass(frozen=True)
class KubeletPolicy:
    """What a node's kubelet is configured with (its config file's
    topologyManagerPolicy, topologyManagerScope, cpuManagerPolicy)."""

    topology: str = NONE
    scope: str = CONTAINER
    cpu: str = CPU_NONE

    @property
    def aligns(self) -> bool:
        return self.topology != NONE


NO_POLICY = KubeletPolicy()


@dataclass(frozen=True)
class Hint:
    mask: int | None  # None: no NUMA preference
    preferred: bool


def bits(mask: int) -> int:
    return bin(mask).count("1")


def mask_of(nodes: Iterable[int]) -> int:
    found = 0
    for node in nodes:
        found |= 1 << node
    return found


def _narrower(first: int, second: int) -> bool:
    # bitmask.go IsNarrowerThan: fewer bits, or as many and a smaller value.
    if bits(first) == bits(second):
        return first < second
    return bits(first) < bits(second)


def _masks(nodes: Sequence[int]) -> Iterable[int]:
    # bitmask.IterateBitMasks: every non-empty subset, smaller ones first.
    for size in range(1, len(nodes) + 1):
        for chosen in itertools.combinations(sorted(nodes), size):
            yield mask_of(chosen)


@dataclass(frozen=True)
class Pool:
    """One resource on a node, by NUMA node: how many units sit there in
    all (healthy devices, or the machine's CPUs) and how many are free."""

    every: Mapping[int, int]
    free: Mapping[int, int]
    # Free units with no NUMA node (a device whose TopologyInfo is empty):
    # they count towards enough, never towards a mask.
    free_unplaced: int = 0

    def __hash__(self) -> int:
        # Its maps are plain ones; placement keys its shared answers on it.
        every, free = tuple(sorted(self.every.items())), tuple(sorted(self.free.items()))
        return hash((every, free, self.free_unplaced))


def hints(
    pool: Pool,
    request: int,
    machine: Sequence[int],
    *,
    devices: bool = True,
    device_nodes_only: bool = True,
) -> list[Hint] | None:
    """The provider's hints for `request` units (None: no preference).
    `device_nodes_only`: a device resource's masks are made of the NUMA
    nodes its devices sit on (1.37, `deviceNUMANodes`), not every node of
    the machine (1.35)."""
    if devices and not any(pool.every.values()):
        return None  # deviceHasTopologyAlignment: no device has a NUMA node
    known: list[int] = []
    if devices and device_nodes_only:
        known = [n for n in sorted(pool.every) if pool.every[n] and n in machine]
    nodes = known or list(machine)
    if devices and sum(pool.free.values()) + pool.free_unplaced < request:
        return []
    smallest = len(nodes)
    found: list[Hint] = []
    for mask in _masks(nodes):
        inside = [n for n in nodes if mask >> n & 1]
        if sum(pool.every.get(n, 0) for n in inside) >= request:
            smallest = min(smallest, bits(mask))
        if sum(pool.free.get(n, 0) for n in inside) >= request:
            found.append(Hint(mask, False))
    return [Hint(h.mask, bits(h.mask) == smallest) for h in found if h.mask is not None]


def _merged(default: int, permutation: Sequence[Hint]) -> Hint:
    preferred = True
    masks = [h.mask for h in permutation if h.mask is not None]
    for hint in permutation:
        if hint.mask is not None and hint.mask != masks[0]:
            preferred = False
        if not hint.preferred:
            preferred = False
    merged = default
    for mask in masks:
        merged &= mask
    return Hint(merged, preferred)


def _best_non_preferred_count(providers: Sequence[Sequence[Hint]]) -> int:
    # policy.go maxOfMinAffinityCounts: the widest of each provider's narrowest.
    count = 0
    for found in providers:
        narrowest: int | None = None
        for hint in found:
            if hint.mask is None:
                continue
            if narrowest is None or _narrower(hint.mask, narrowest):
                narrowest = hint.mask
        if narrowest is not None:
            count = max(count, bits(narrowest))
    return count


def _compare(current: Hint | None, candidate: Hint, best_count: int) -> Hint | None:
    """policy.go HintMerger.compare, branch by branch."""
    assert candidate.mask is not None
    if bits(candidate.mask) == 0:
        return current
    if current is None:
        return candidate
    assert current.mask is not None

    def narrowest() -> Hint:
        if candidate.mask == current.mask:
            return current
        return current if _narrower(current.mask, candidate.mask) else candidate  # type: ignore[arg-type]

    if not current.preferred and candidate.preferred:
        return candidate
    if current.preferred and not candidate.preferred:
        return current
    if current.preferred and candidate.preferred:
        return narrowest()
    have, new = bits(current.mask), bits(candidate.mask)
    if have > best_count:
        return narrowest()
    if have == best_count:
        return current if new != best_count else narrowest()
    if new > best_count:
        return current
    if new == best_count:
        return candidate
    if new > have:
        return candidate
    if new < have:
        return current
    return narrowest()


def merge(
    policy: str, providers: Sequence[list[Hint] | None], machine: Sequence[int]
) -> tuple[Hint, bool]:
    """The best merged hint and whether the policy admits it."""
    default = mask_of(machine)
    if policy == NONE:
        return Hint(None, True), True
    lists: list[list[Hint]] = []
    for found in providers:
        if found is None:
            lists.append([Hint(None, True)])  # no preference
        elif not found:
            lists.append([Hint(None, False)])  # nothing fits
        else:
            lists.append(list(found))
    if policy == SINGLE:
        lists = [
            [h for h in found if h.preferred and (h.mask is None or bits(h.mask) == 1)]
            for found in lists
        ]
    best_count = _best_non_preferred_count(lists)
    best: Hint | None = None
    for permutation in itertools.product(*lists):
        best = _compare(best, _merged(default, permutation), best_count)
    if best is None:
        best = Hint(default, False)
    if policy == SINGLE and best.mask == default:
        best = Hint(None, best.preferred)
    admit = policy == BEST_EFFORT or best.preferred
    return best, admit


class Refusal(Exception):
    """The kubelet would refuse the pod: TopologyAffinityError."""


@dataclass(frozen=True)
class Ask:
    """One resource a container (or, at pod scope, the pod) asks for: the
    healthy devices of the resource, those free, and how many."""

    healthy: frozenset[str]
    free: frozenset[str]
    count: int


@dataclass
class Admission:
    """A pod's admission on one node, asked container by container as the
    kubelet admits them. `numa` gives a device's NUMA node; `cpus` the
    exclusive CPUs by NUMA node (None: no static CPU manager, or not known)."""

    policy: KubeletPolicy
    machine: tuple[int, ...]
    numa: Mapping[str, int | None]
    cpus: Pool | None = None
    device_nodes_only: bool = True

    def _pool(self, ask: Ask) -> Pool:
        every: dict[int, int] = {}
        free: dict[int, int] = {}
        unplaced = 0
        for device in ask.healthy:
            node = self.numa.get(device)
            if node is not None:
                every[node] = every.get(node, 0) + 1
        for device in ask.free:
            node = self.numa.get(device)
            if node is None:
                unplaced += 1
            else:
                free[node] = free.get(node, 0) + 1
        return Pool(every, free, free_unplaced=unplaced)

    def affinity(self, asks: Sequence[Ask], cpus: int = 0) -> int | None:
        """The NUMA mask the kubelet gives what is asked (None: any); Refusal
        where its policy turns the pod away."""
        providers: list[list[Hint] | None] = []
        for ask in asks:
            if ask.count:
                pool = self._pool(ask)
                nodes_only = self.device_nodes_only
                providers.append(hints(pool, ask.count, self.machine, device_nodes_only=nodes_only))
        if cpus and self.policy.cpu == CPU_STATIC and self.cpus is not None:
            providers.append(hints(self.cpus, cpus, self.machine, devices=False))
        best, admit = merge(self.policy.topology, providers, self.machine)
        if not admit:
            raise Refusal(
                f"the kubelet's topology manager ({self.policy.topology}, "
                f"{self.policy.scope} scope) would refuse it: TopologyAffinityError"
            )
        return best.mask

    def take_cpus(self, mask: int | None, count: int) -> None:
        """The static CPU manager's exclusive CPUs for a container, taken from
        the affinity's NUMA nodes (the lowest first; all of them with one node)."""
        if not count or self.policy.cpu != CPU_STATIC or self.cpus is None:
            return
        free = dict(self.cpus.free)
        order = sorted(free) if mask is None else [n for n in sorted(free) if mask >> n & 1]
        order += [n for n in sorted(free) if n not in order]
        for node in order:
            taken = min(count, free[node])
            free[node] -= taken
            count -= taken
            if not count:
                break
        self.cpus = Pool(self.cpus.every, free)

    def within(self, mask: int | None, ask: Ask) -> frozenset[str]:
        """The devices of `ask.free` the kubelet lets the daemon choose from
        (filterByAffinity's aligned ones where they are enough, else all)."""
        if mask is None:
            return ask.free
        aligned = frozenset(
            d for d in ask.free if (node := self.numa.get(d)) is not None and mask >> node & 1
        )
        return aligned if len(aligned) >= ask.count else ask.free
