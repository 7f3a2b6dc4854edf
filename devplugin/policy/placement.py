"""Where a pod's GPUs and HCAs would sit on a node, from its NodeDevices record (pure).

The cluster-side half of devplugin: the scheduler extender rebuilds each
node's topology from its record (the PCIe domain path and NVLink peers of
every device), takes the devices that are healthy and not held, and runs
the node daemon's own exact allocator on them, container by container in
admission order, the way the daemon would answer the kubelet (a GPU+HCA
container: GPUs planned for its exact HCA count, then the HCAs against
them). The result is the alignment the node would give and how much it
would fragment what stays free there.

No I/O: records and pods come in as data.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from devplugin.kinds.registry import paired_with
from devplugin.model import (
    DeviceKind,
    Refused,
)
from devplugin.policy.allocator import Allocator, Request, Role
from devplugin.policy.node_state import NodeState, Outcome
from devplugin.policy.pod_request import Requirement, Shape
from devplugin.policy.ranking import rank_scores
from devplugin.policy.topology import DOMAIN_DEPTH, Level, Topology
from devplugin.policy.topology_manager import (
    POD,
    Admission,
    Ask,
    Refusal,
)


def _spread(topology: Topology, free: Iterable[str]) -> int:
    """Sum over every domain (and the node) of the square of its free devices."""
    counts: dict[object, int] = {}
    number = 0
    for device in free:
        number += 1
        keys = topology.placement[device].keys
        for depth in range(DOMAIN_DEPTH):
            counts[(depth, keys[depth])] = counts.get((depth, keys[depth]), 0) + 1
    return number * number + sum(c * c for c in counts.values())


def _capacity(
    node: NodeState, pool: frozenset[str], free: set[str], used: Mapping[str, int]
) -> int:
    """Units free in a pool: a free exclusive device is one, a shared one
    its replicas not held."""
    replicas = node.replicas
    return sum(replicas[d] - used.get(d, 0) if d in replicas else 1 for d in pool & free)


def _short(node: NodeState, shape: Shape, free: Mapping[DeviceKind, set[str]]) -> str | None:
    """Why the pod cannot fit by counts (None: it may)."""
    needs: dict[tuple[DeviceKind, str], int] = {}
    for index, (g, h) in enumerate(shape.containers):
        g_res, h_res = shape.resources_of(index)
        needs[(DeviceKind.GPU, g_res)] = needs.get((DeviceKind.GPU, g_res), 0) + g
        needs[(DeviceKind.HCA, h_res)] = needs.get((DeviceKind.HCA, h_res), 0) + h
    # An init container larger than the rest: its count, in the first pool.
    for kind, total in ((DeviceKind.GPU, shape.gpus), (DeviceKind.HCA, shape.hcas)):
        asked = [key for key in needs if key[0] is kind and needs[key]]
        mine = sum(needs[key] for key in asked)
        if total > mine:
            key = asked[0] if asked else (kind, "")
            needs[key] = needs.get(key, 0) + total - mine
    pools = {key: node.pool(*key) for key, need in needs.items() if need}
    have = {key: _capacity(node, pool, free[key[0]], node.used) for key, pool in pools.items()}
    short = [key for key in have if have[key] < needs[key]]
    if not short:
        return None
    if all(pool == node.pool(key[0], "") for key, pool in pools.items()):
        counts = {kind: sum(n for key, n in have.items() if key[0] is kind) for kind in DeviceKind}
        if not any(key[0] is DeviceKind.GPU for key in have):
            counts[DeviceKind.GPU] = len(free[DeviceKind.GPU] & node.pool(DeviceKind.GPU, ""))
        if not any(key[0] is DeviceKind.HCA for key in have):
            counts[DeviceKind.HCA] = len(free[DeviceKind.HCA] & node.pool(DeviceKind.HCA, ""))
        return (
            f"{counts[DeviceKind.GPU]} GPUs and {counts[DeviceKind.HCA]} HCAs free; "
            f"the pod needs {shape.gpus} and {shape.hcas}"
        )
    kind, resource = short[0]
    if not pools[(kind, resource)]:
        return f"the node serves no {resource[:100]}"
    count, need = have[(kind, resource)], needs[(kind, resource)]
    return f"{count} {resource[:100]} free; the pod needs {need}"


def place(node: NodeState, shape: Shape, allocator: Allocator | None = None) -> Outcome:
    """Simulate the node daemon's choices for the pod's containers in order:
    each from the devices of the resource it asks (whole GPUs, a MIG
    profile, replicas of shared ones: one replica per GPU as long as it
    can, as the `distributed` policy does)."""
    free = {kind: set(node.free[kind]) for kind in DeviceKind}
    reason = _short(node, shape, free)
    if reason is not None:
        return Outcome(False, reason)
    topology = node.topology
    search = allocator or Allocator(topology)
    used = dict(node.used)
    chosen: set[str] = set()
    worst: Level | None = None
    total = 0
    before = _spread(topology, free[DeviceKind.GPU] | free[DeviceKind.HCA])
    admission = _admission(node, shape)
    try:
        pod_mask = _pod_affinity(admission, node, shape, free)
        for index, (gpus, hcas) in enumerate(shape.containers):
            g_res, h_res = shape.resources_of(index)
            view = {
                DeviceKind.GPU: free[DeviceKind.GPU] & node.pool(DeviceKind.GPU, g_res),
                DeviceKind.HCA: free[DeviceKind.HCA] & node.pool(DeviceKind.HCA, h_res),
            }
            if admission is not None:
                view = _aligned(admission, node, shape, index, view, pod_mask)
            count = min(gpus, len(view[DeviceKind.GPU]))
            chosen_g = _choose(search, DeviceKind.GPU, count, view, hcas)
            _take(node, DeviceKind.GPU, chosen_g, gpus, view, free, used)
            chosen.update(chosen_g)
            chosen_h: list[str] = []
            if hcas:
                count = min(hcas, len(view[DeviceKind.HCA]))
                if chosen_g:
                    request = Request(
                        DeviceKind.HCA,
                        frozenset(view[DeviceKind.HCA]),
                        count,
                        frozenset(),
                        Role.SECOND,
                        frozenset(chosen_g),
                        frozenset(free[DeviceKind.GPU]),
                    )
                    chosen_h = list(search.choose(request).ids)
                else:
                    chosen_h = _choose(search, DeviceKind.HCA, count, view, 0)
                _take(node, DeviceKind.HCA, chosen_h, hcas, view, free, used)
                chosen.update(chosen_h)
            if chosen_g and chosen_h:
                levels = [min(topology.level(g, h) for h in chosen_h) for g in chosen_g]
                level = Level(max(levels))
                worst = level if worst is None else max(worst, level)
                total += sum(levels)
    except Refused as exc:
        return Outcome(False, f"no placement: {exc.reason}")
    except Refusal as exc:
        return Outcome(False, str(exc))
    after = _spread(topology, free[DeviceKind.GPU] | free[DeviceKind.HCA])
    return Outcome(
        True,
        "",
        worst,
        total,
        before - after,
        {kind: frozenset(ids) for kind, ids in free.items()},
        used if node.replicas else None,
        frozenset(chosen),
        admission.cpus if admission is not None else None,
    )


def _admission(node: NodeState, shape: Shape) -> Admission | None:
    """The kubelet's admission of this pod on the node, where its Topology
    Manager aligns anything and placement can follow it (not for a pod
    whose run-once init containers ask for devices or CPUs)."""
    if not node.kubelet.aligns or shape.init_asks or not node.machine:
        return None
    numa = {
        d: node.topology.numa_node(d) for kind in DeviceKind for d in node.topology.id_set(kind)
    }
    return Admission(node.kubelet, node.machine, numa, node.cpus, node.device_nodes_only)


def _ask_of(
    node: NodeState, kind: DeviceKind, resource: str, free: frozenset[str] | set[str], count: int
) -> Ask:
    healthy = node.pool(kind, resource) & (node.healthy or {}).get(kind, frozenset())
    return Ask(healthy, frozenset(free) & node.pool(kind, resource), count)


def _pod_affinity(
    admission: Admission | None,
    node: NodeState,
    shape: Shape,
    free: Mapping[DeviceKind, set[str]],
) -> int | None:
    """At pod scope, the one mask the pod's summed requests get (scope_pod.go)."""
    if admission is None or admission.policy.scope != POD:
        return None
    counts: dict[tuple[DeviceKind, str], int] = {}
    for index, (gpus, hcas) in enumerate(shape.containers):
        g_res, h_res = shape.resources_of(index)
        for key, count in (((DeviceKind.GPU, g_res), gpus), ((DeviceKind.HCA, h_res), hcas)):
            counts[key] = counts.get(key, 0) + count
    asks = [_ask_of(node, k, r, free[k], n) for (k, r), n in counts.items()]
    cpus = sum(shape.cpus_of(i) for i in range(len(shape.containers)))
    mask = admission.affinity(asks, cpus)
    for index in range(len(shape.containers)):
        admission.take_cpus(mask, shape.cpus_of(index))
    return mask


def _aligned(
    admission: Admission,
    node: NodeState,
    shape: Shape,
    index: int,
    view: Mapping[DeviceKind, set[str]],
    pod_mask: int | None,
) -> dict[DeviceKind, set[str]]:
    """One container's devices to choose from, as the kubelet narrows them
    to its affinity (scope_container.go admits it here first)."""
    gpus, hcas = shape.containers[index]
    g_res, h_res = shape.resources_of(index)
    asks = (
        _ask_of(node, DeviceKind.GPU, g_res, view[DeviceKind.GPU], gpus),
        _ask_of(node, DeviceKind.HCA, h_res, view[DeviceKind.HCA], hcas),
    )
    mask = pod_mask
    if admission.policy.scope != POD:
        mask = admission.affinity(asks, shape.cpus_of(index))
        admission.take_cpus(mask, shape.cpus_of(index))
    return {
        DeviceKind.GPU: set(admission.within(mask, asks[0])),
        DeviceKind.HCA: set(admission.within(mask, asks[1])),
    }


def _take(
    node: NodeState,
    kind: DeviceKind,
    chosen: list[str],
    count: int,
    view: Mapping[DeviceKind, set[str]],
    free: Mapping[DeviceKind, set[str]],
    used: dict[str, int],
) -> None:
    """Take `count` units for a container: one on each chosen device, the
    rest (replicas past one per device) on those with replicas left, the
    chosen first."""
    replicas = node.replicas
    units = list(chosen)
    if count > len(units):
        spare = [d for d in chosen if d in replicas] + sorted(
            d for d in view[kind] if d in replicas and d not in chosen
        )
        for device in spare:
            room = replicas[device] - used.get(device, 0) - (1 if device in chosen else 0)
            units.extend([device] * max(0, min(room, count - len(units))))
            if len(units) >= count:
                break
    for device in units:
        if device in replicas:
            used[device] = used.get(device, 0) + 1
            if used[device] < replicas[device]:
                continue
        free[kind].discard(device)
        view[kind].discard(device)


def _choose(
    search: Allocator,
    kind: DeviceKind,
    size: int,
    free: Mapping[DeviceKind, set[str]],
    partners: int,
) -> list[str]:
    if size <= 0:
        return []
    other = frozenset(free[paired_with(kind)])
    request = Request(
        kind,
        frozenset(free[kind]),
        size,
        frozenset(),
        Role.FIRST,
        other,
        other,
        partners,
    )
    return list(search.choose(request).ids)


def check(outcome: Outcome, requirement: Requirement) -> str | None:
    """Why the node fails the pod (None when it passes)."""
    if not outcome.fits:
        return outcome.reason
    if (
        requirement.required
        and requirement.level is not None
        and outcome.worst is not None
        and outcome.worst > requirement.level
    ):
        return (
            f"best GPU-HCA alignment here is {outcome.worst.name}; the pod requires "
            f"{requirement.level.name} or better"
        )
    return None


def scores(outcomes: Mapping[str, Outcome | None], top: int = 10) -> dict[str, int]:
    """Rank scores: nodes with the best (worst level, total, fragmentation)
    get `top`, each worse distinct key one less (down to 1); nodes without a
    usable record, or where the pod does not fit, get 0."""
    return rank_scores(
        {name: o.rank_key if o is not None and o.fits else None for name, o in outcomes.items()},
        top,
    )
