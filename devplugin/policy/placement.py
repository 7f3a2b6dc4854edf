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
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from devplugin.model import (
    CharDevice,
    DeviceKind,
    GpuInfo,
    HcaInfo,
    PciAddress,
    PciFunction,
    PciPath,
    Refused,
)
from devplugin.policy.allocator import Allocator, Request, Role
from devplugin.policy.podinfo import ContainerInfo, PodInfo
from devplugin.policy.ranking import rank_scores
from devplugin.policy.topology import DOMAIN_DEPTH, Level, Topology
from devplugin.policy.topology_manager import (
    CONTAINER,
    CPU_NONE,
    CPU_POLICIES,
    MAX_NUMA_NODES,
    NO_POLICY,
    NONE,
    POD,
    POLICIES,
    SCOPES,
    Admission,
    Ask,
    KubeletPolicy,
    Pool,
    Refusal,
)

ALIGNMENT_ANNOTATION = "devplugin.io/alignment"
POLICY_ANNOTATION = "devplugin.io/alignment-policy"
LEVELS_BY_NAME = {level.name: level for level in Level}


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
class Shape:
    """A pod's device requests: (GPUs, HCAs) per container in admission order
    (init containers' devices are reused by later ones: they count only
    when larger than what follows)."""

    containers: tuple[tuple[int, int], ...]
    gpus: int
    hcas: int
    # Per container, the GPU and HCA resources it asks them as ("": the
    # kind's whole devices); empty: "" for every container.
    resources: tuple[tuple[str, str], ...] = ()
    # Per container, the whole CPUs it asks of a static CPU manager (a
    # Guaranteed pod's integer CPUs; 0 otherwise); empty: none anywhere.
    cpus: tuple[int, ...] = ()
    # A run-once init container asks for devices or CPUs: the Topology
    # Manager admits it on its own, which placement does not follow.
    init_asks: bool = False

    def resources_of(self, index: int) -> tuple[str, str]:
        return self.resources[index] if index < len(self.resources) else ("", "")

    def cpus_of(self, index: int) -> int:
        return self.cpus[index] if index < len(self.cpus) else 0

    @property
    def wants_devices(self) -> bool:
        return self.gpus > 0 or self.hcas > 0


@dataclass(frozen=True)
class Requirement:
    level: Level | None  # worst GPU-HCA level the pod requires or prefers
    required: bool


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


# -- records ------------------------------------------------------------------------


def _address(text: object) -> PciAddress:
    if not isinstance(text, str):
        raise ValueError(f"not a PCI address: {text!r}")
    return PciAddress.parse(text)


def _function(address: PciAddress, path: list[str], numa: int) -> PciFunction | None:
    """A PCI function whose domain keys are the record's path (the allocator
    only compares keys, so the bridges between need not be real)."""
    if not path:
        return None
    if len(path) != 4:
        raise ValueError(f"topologyPath must name 4 domains, got {path!r}")
    _, root, port, switch = path
    port_address = _address(port)
    if switch == port:
        chain: tuple[PciAddress, ...] = (port_address, address)
    else:
        chain = (port_address, _address(switch), address, address)
    return PciFunction(
        address=address, path=PciPath(root, chain), numa_node=numa if numa >= 0 else None
    )


def _field(entry: Mapping[str, Any], name: str, kind: type, where: str, default: Any = None) -> Any:
    """`entry[name]`, which must be of `kind` (absent: `default`, unless None)."""
    value = entry.get(name, default)
    if value is None and default is None:
        raise ValueError(f"{where}.{name} missing")
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{where}.{name} must be {kind.__name__}, not {type(value).__name__}")
    return value


def _strings(value: list[Any], where: str) -> list[str]:
    if not all(isinstance(item, str) for item in value):
        raise ValueError(f"{where} must hold strings only")
    return value


# Canonical GPU names, made once: every record shares the same strings.
_CANONICAL = tuple(f"gpu{i}" for i in range(4096))


@dataclass(frozen=True)
class ParsedRecord:
    """A record's content, read in time linear in its devices; the topology
    (more than linear to build) comes apart, once per distinct `layout_key`."""

    name: str
    # Everything the topology is built from: equal keys, equal topologies.
    layout_key: tuple[Any, ...]
    gpus: tuple[GpuInfo, ...]
    hcas: tuple[HcaInfo, ...]
    free: Mapping[DeviceKind, frozenset[str]]
    healthy: Mapping[DeviceKind, frozenset[str]]
    holdings: tuple[Holding, ...]
    total: Mapping[DeviceKind, int]
    # Each GPU's product as the record names it ("" where it does not): what
    # a pod's choice of model is judged against.
    products: tuple[str, ...] = ()
    pools: Mapping[str, frozenset[str]] = field(default_factory=dict)
    mig: frozenset[str] = frozenset()
    replicas: Mapping[str, int] = field(default_factory=dict)
    used: Mapping[str, int] = field(default_factory=dict)
    kubelet: KubeletPolicy = NO_POLICY
    machine: tuple[int, ...] = ()
    cpus: Pool | None = None
    device_nodes_only: bool = True

    def node(self, topology: Topology) -> NodeState:
        return NodeState(
            name=self.name,
            topology=topology,
            free=self.free,
            total=self.total,
            holders=frozenset((h.namespace, h.pod) for h in self.holdings),
            holdings=self.holdings,
            healthy=self.healthy,
            pools=self.pools,
            mig=self.mig,
            replicas=self.replicas,
            used=self.used,
            kubelet=self.kubelet,
            machine=self.machine,
            cpus=self.cpus,
            device_nodes_only=self.device_nodes_only,
        )


def node_from_record(record: Mapping[str, Any]) -> NodeState:
    """The node a NodeDevices record describes; ValueError when it is not one."""
    parsed = parse_record(record)
    return parsed.node(Topology(parsed.gpus, parsed.hcas))


# A GPU has at most 18 NVLinks today; a count far past that is not one.
MAX_NVLINKS = 64
MAX_NUMA = 1023
# NUMA nodes a record lists at most (the CRD's limit).
MAX_NUMA_LISTED = 64


def _check_unique(devices: list[Any]) -> None:
    """One entry per device id and per PCI function: a record naming a
    device twice, or two devices at one address, describes no real node.
    The MIG devices of one GPU share its address (and nothing else may)."""
    ids: set[str] = set()
    addresses: dict[str, str] = {}
    parents: dict[str, object] = {}
    for i, entry in enumerate(devices):
        if not isinstance(entry, dict):
            raise ValueError(f"status.devices[{i}] must be an object")
        device_id, address = entry.get("id"), entry.get("pciAddress")
        if isinstance(device_id, str):
            if device_id in ids:
                raise ValueError(f"device {device_id[:80]!r} is listed twice")
            ids.add(device_id)
        if isinstance(address, str):
            key = address.lower()
            mig = entry.get("mig")
            parent = mig.get("parentUUID") if isinstance(mig, dict) else None
            if key in addresses and parent is not None and parents.get(key) == parent:
                continue
            parents.setdefault(key, parent)
            if key in addresses:
                raise ValueError(
                    f"devices {addresses[key][:80]!r} and {str(device_id)[:80]!r} share "
                    f"PCI address {address[:40]}"
                )
            addresses[key] = str(device_id)


def _nvlink_peers(
    entry: Mapping[str, Any],
    where: str,
    device_id: str,
    index_of: Mapping[str, int],
    wired: dict[tuple[str, str], int],
) -> list[tuple[int, int]]:
    """A GPU entry's NVLink peers as (index, links); each link also goes in
    `wired` (by the record's ids) for the symmetry check."""
    peers = []
    for j, peer in enumerate(_field(entry, "nvlinkPeers", list, where, [])):
        if not isinstance(peer, dict):
            raise ValueError(f"{where}.nvlinkPeers[{j}] must be an object")
        peer_id = _field(peer, "id", str, f"{where}.nvlinkPeers[{j}]")
        links = _field(peer, "links", int, f"{where}.nvlinkPeers[{j}]")
        if peer_id == device_id:
            raise ValueError(f"{where}: GPU {device_id[:80]!r} is its own NVLink peer")
        if not 0 <= links <= MAX_NVLINKS:
            raise ValueError(f"{where}.nvlinkPeers[{j}].links {links} is not a count")
        if peer_id in index_of and links > 0:
            peers.append((index_of[peer_id], links))
            wired[(device_id, peer_id)] = links
    return peers


def _holdings(allocations: list[Any], named: Mapping[str, str]) -> list[Holding]:
    holdings: list[Holding] = []
    for i, allocation in enumerate(allocations):
        where = f"status.allocations[{i}]"
        if not isinstance(allocation, dict):
            raise ValueError(f"{where} must be an object")
        listed = _strings(_field(allocation, "devices", list, where), f"{where}.devices")
        ids = frozenset(named.get(d, d) for d in listed)
        namespace = _field(allocation, "namespace", str, where, "")
        pod = _field(allocation, "pod", str, where, "")
        uid = _field(allocation, "podUID", str, where, "")
        holdings.append(Holding(namespace, pod, uid or None, ids))
    return holdings


def _gpu(
    index: int,
    uuid: str,
    address: PciAddress,
    function: PciFunction | None,
    peers: list[tuple[int, int]],
) -> GpuInfo:
    """A GPU as a record describes it (no NVML facts)."""
    return GpuInfo(
        index=index,
        uuid=uuid,
        name="",
        pci_address=address,
        minor_number=index,
        memory_total_mib=0,
        nvlink_peers=tuple(peers),
        pci=function,
    )


def _hca(name: str, address: PciAddress, function: PciFunction | None) -> HcaInfo:
    """An HCA as a record describes it (no ports or device nodes)."""
    return HcaInfo(
        name=name,
        pci_address=address,
        pci=function,
        node_guid=None,
        fw_ver=None,
        ports=(),
        netdevs=(),
        uverbs=None,
        umads=(),
        issms=(),
        rdma_cm=CharDevice("/dev/infiniband/rdma_cm", True),
    )


def parse_record(record: Mapping[str, Any], *, canonical: bool = False) -> ParsedRecord:
    """A NodeDevices record's content; ValueError when it is not one.
    Strict: a field of the wrong type anywhere refuses the whole record (a
    node described wrongly must not steer pods).

    `canonical`: GPUs are named by their place in the record (`gpu0`, ...)
    instead of their UUIDs, here and in the holdings. HCAs are named by PCI
    address already, so nodes of one model then have equal layouts and can
    share one topology (placement never reports device names)."""
    meta = record.get("metadata")
    status = record.get("status")
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
        raise ValueError("metadata.name missing")
    if not isinstance(status, dict):
        raise ValueError("status missing")
    devices = _field(status, "devices", list, "status")
    allocations = _field(status, "allocations", list, "status", [])
    gpus: list[GpuInfo] = []
    hcas: list[HcaInfo] = []
    products: list[str] = []
    layout: list[tuple[Any, ...]] = []
    healthy: dict[DeviceKind, set[str]] = {kind: set() for kind in DeviceKind}
    pools: dict[str, set[str]] = {}
    mig: set[str] = set()
    replicas: dict[str, int] = {}
    # (GPU id, peer id) -> links, as the record says them (before renaming).
    wired: dict[tuple[str, str], int] = {}
    for i, entry in enumerate(devices):
        if not isinstance(entry, dict):
            raise ValueError(f"status.devices[{i}] must be an object")
    _check_unique(devices)
    gpu_entries = [d for d in devices if d.get("kind") == "gpu"]
    index_of = {str(d.get("id")): i for i, d in enumerate(gpu_entries)}
    named = {uuid: _CANONICAL[i] for uuid, i in index_of.items()} if canonical else {}
    for i, entry in enumerate(devices):
        where = f"status.devices[{i}]"
        device_id = _field(entry, "id", str, where)
        address = _address(_field(entry, "pciAddress", str, where))
        path = _strings(_field(entry, "topologyPath", list, where, []), f"{where}.topologyPath")
        numa = _field(entry, "numaNode", int, where, -1)
        if not -1 <= numa <= MAX_NUMA:
            raise ValueError(f"{where}.numaNode {numa} is not a NUMA node")
        health = _field(entry, "health", str, where)
        function = _function(address, path, numa)
        kind = entry.get("kind")
        if kind == "gpu":
            peers = _nvlink_peers(entry, where, device_id, index_of, wired)
            device_id = named.get(device_id, device_id)
            layout.append((device_id, str(address), tuple(path), numa, tuple(peers)))
            gpus.append(_gpu(index_of[entry["id"]], device_id, address, function, peers))
            products.append(_field(entry, "product", str, where, ""))
            kind_value = DeviceKind.GPU
        elif kind == "hca":
            if device_id != str(address):
                raise ValueError(f"HCA {device_id!r} is not named by its PCI address")
            name = _field(entry, "name", str, where, device_id) or device_id
            layout.append((device_id, str(address), tuple(path), numa, name))
            hcas.append(_hca(name, address, function))
            kind_value = DeviceKind.HCA
        else:
            raise ValueError(f"device {device_id!r}: unknown kind {kind!r}")
        if health == "Healthy":
            healthy[kind_value].add(device_id)
        _serving(entry, where, device_id, pools, mig, replicas)
    for (one, other), links in wired.items():
        if wired.get((other, one)) != links:
            raise ValueError(
                f"GPU {one[:80]!r} lists {links} NVLinks to {other[:80]!r}, which does not "
                "list as many back"
            )
    holdings = _holdings(allocations, named)
    used, held = _held(holdings, replicas)
    kubelet, machine, cpus, nodes_only = _kubelet(status)
    return ParsedRecord(
        name=meta["name"],
        layout_key=tuple(layout),
        gpus=tuple(gpus),
        hcas=tuple(hcas),
        free={kind: frozenset(healthy[kind] - held) for kind in DeviceKind},
        healthy={kind: frozenset(ids) for kind, ids in healthy.items()},
        holdings=tuple(holdings),
        total={DeviceKind.GPU: len(gpus), DeviceKind.HCA: len(hcas)},
        products=tuple(products),
        pools={key: frozenset(ids) for key, ids in pools.items()},
        mig=frozenset(mig),
        replicas=replicas,
        used=used,
        kubelet=kubelet,
        machine=machine,
        cpus=cpus,
        device_nodes_only=nodes_only,
    )


def _kubelet(status: Mapping[str, Any]) -> tuple[KubeletPolicy, tuple[int, ...], Pool | None, bool]:
    """What the record says of the node's kubelet (status.kubelet) and its
    NUMA nodes (status.numaNodes): its policy, the nodes, the exclusive
    CPUs by node where known, and whether its device hints span only the
    nodes with devices (from 1.37). Nothing said: no alignment."""
    found = _field(status, "kubelet", dict, "status", {})
    where = "status.kubelet"
    policy = KubeletPolicy(
        _choice(found, "topologyManagerPolicy", POLICIES, where, NONE),
        _choice(found, "topologyManagerScope", SCOPES, where, CONTAINER),
        _choice(found, "cpuManagerPolicy", CPU_POLICIES, where, CPU_NONE),
    )
    version = _field(found, "version", str, where, "")
    minor = _minor(version)
    nodes = _field(status, "numaNodes", list, "status", [])
    if len(nodes) > MAX_NUMA_LISTED:
        raise ValueError(f"status.numaNodes: more than {MAX_NUMA_LISTED}")
    machine: list[int] = []
    every: dict[int, int] = {}
    free: dict[int, int] = {}
    known = True
    for i, entry in enumerate(nodes):
        at = f"status.numaNodes[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{at} must be an object")
        node = _field(entry, "id", int, at)
        if not 0 <= node <= MAX_NUMA or node in machine:
            raise ValueError(f"{at}.id {node} is not a NUMA node, or listed twice")
        machine.append(node)
        every[node] = _count_field(entry, "cpus", at)
        if "freeCpus" in entry:
            free[node] = min(_count_field(entry, "freeCpus", at), every[node])
        else:
            known = False
    cpus = Pool(every, free) if machine and known else None
    if len(machine) > MAX_NUMA_NODES:
        policy = NO_POLICY  # the kubelet does not start so (or an option raised it): unsure
    return policy, tuple(sorted(machine)), cpus, minor is None or minor >= 37


def _choice(
    found: Mapping[str, Any], key: str, allowed: tuple[str, ...], where: str, default: str
) -> str:
    value = _field(found, key, str, where, default) or default
    if value not in allowed:
        raise ValueError(f"{where}.{key} {value[:40]!r} is not one of {', '.join(allowed)}")
    return value


def _count_field(entry: Mapping[str, Any], key: str, where: str) -> int:
    value: int = _field(entry, key, int, where)
    if not 0 <= value <= 65536:
        raise ValueError(f"{where}.{key} {value} is out of range")
    return value


def _minor(version: str) -> int | None:
    """v1.37.2 -> 37; None where it does not say."""
    parts = version.lstrip("v").split(".")
    if len(parts) >= 2 and parts[0] == "1" and parts[1].isdigit():
        return int(parts[1])
    return None


# Replicas a shared device may be served as (the CRD's limit).
MAX_REPLICAS = 1024
MAX_RESOURCE = 253


def _held(
    holdings: Iterable[Holding], replicas: Mapping[str, int]
) -> tuple[dict[str, int], set[str]]:
    """Each shared device's replicas held (one per holding listing it), and
    the devices with nothing left: exclusive ones held, shared ones full."""
    used: dict[str, int] = {}
    held: set[str] = set()
    for holding in holdings:
        for device in holding.devices:
            if device not in replicas:
                held.add(device)
                continue
            used[device] = used.get(device, 0) + 1
            if used[device] >= replicas[device]:
                held.add(device)
    return used, held


def _fallback(resource: str) -> str:
    """The pool key an older record (no `resource` on its devices) gives a
    resource: a MIG profile's `mig-<profile>`, else the kind's whole devices."""
    _, slash, name = resource.rpartition("/")
    return name if slash and name.startswith("mig-") else ""


def _serving(
    entry: Mapping[str, Any],
    where: str,
    device_id: str,
    pools: dict[str, set[str]],
    mig: set[str],
    replicas: dict[str, int],
) -> None:
    """The resource a device entry is served under, whether it is a MIG
    device, and its replicas when shared."""
    slice_ = entry.get("mig")
    if slice_ is not None and not isinstance(slice_, dict):
        raise ValueError(f"{where}.mig must be an object")
    profile = slice_.get("profile") if isinstance(slice_, dict) else None
    if slice_ is not None:
        if not isinstance(profile, str) or not profile:
            raise ValueError(f"{where}.mig.profile must be a profile name")
        mig.add(device_id)
    resource = _field(entry, "resource", str, where, "")
    if len(resource) > MAX_RESOURCE:
        raise ValueError(f"{where}.resource is longer than {MAX_RESOURCE} characters")
    if not resource:
        resource = f"mig-{profile}" if profile else ""
    pools.setdefault(resource, set()).add(device_id)
    count = _field(entry, "replicas", int, where, 1)
    if not 1 <= count <= MAX_REPLICAS:
        raise ValueError(f"{where}.replicas {count} is not between 1 and {MAX_REPLICAS}")
    if count > 1:
        replicas[device_id] = count


# -- pods --------------------------------------------------------------------------


def resource_kind(resource: str, gpu: str, hca: str) -> DeviceKind | None:
    """Which kind of device a requested resource is: the GPU resource, a
    name it is renamed to for time-slicing (`<gpu>.<suffix>`, NVIDIA's
    convention: nvidia.com/gpu.shared) or a MIG profile of its domain
    (`<domain>/mig-<profile>`); the HCA resource or `<hca>.<suffix>`."""
    if resource == gpu or resource.startswith(gpu + "."):
        return DeviceKind.GPU
    if resource == hca or resource.startswith(hca + "."):
        return DeviceKind.HCA
    if resource.startswith(gpu.split("/", 1)[0] + "/mig-"):
        return DeviceKind.GPU
    return None


def _asks(container: ContainerInfo, gpu: str, hca: str) -> list[tuple[int, int, str, str]]:
    """A container's requests as (GPUs, HCAs, GPU resource, HCA resource);
    one entry per distinct resource of a kind (the first of each paired)."""
    by_kind: dict[DeviceKind, list[tuple[str, int]]] = {kind: [] for kind in DeviceKind}
    for resource, count in container.requests.items():
        kind = resource_kind(resource, gpu, hca)
        if kind is not None and count:
            by_kind[kind].append((resource, count))
    gpus, hcas = by_kind[DeviceKind.GPU], by_kind[DeviceKind.HCA]
    found = []
    for index in range(max(len(gpus), len(hcas))):
        g_res, g = gpus[index] if index < len(gpus) else ("", 0)
        h_res, h = hcas[index] if index < len(hcas) else ("", 0)
        found.append((g, h, g_res, h_res))
    return found


def shape_of(pod: PodInfo, gpu: str, hca: str) -> Shape:
    """The pod's containers in admission order, as (GPUs, HCAs) with the
    resources they ask them as."""
    once = [c for c in pod.init_containers if not c.sidecar]
    init = [a for c in once for a in _asks(c, gpu, hca)]
    held: list[tuple[int, int, str, str]] = []
    cpus: list[int] = []
    for container in (*[c for c in pod.init_containers if c.sidecar], *pod.containers):
        # A container asking only whole CPUs still takes them from a NUMA
        # node where the kubelet aligns: it is one step of the admission.
        asks = _asks(container, gpu, hca) or ([(0, 0, "", "")] if container.cpus else [])
        held.extend(asks)
        cpus.extend([container.cpus] + [0] * (len(asks) - 1) if asks else [])
    gpus = sum(a[0] for a in held)
    hcas = sum(a[1] for a in held)
    # A larger init container decides the count the node must have free.
    for g, h, _, _ in init:
        gpus, hcas = max(gpus, g), max(hcas, h)
    return Shape(
        tuple((g, h) for g, h, _, _ in held),
        gpus,
        hcas,
        tuple((g_res, h_res) for _, _, g_res, h_res in held),
        tuple(cpus) if any(cpus) else (),
        init_asks=bool(init) or any(c.cpus for c in once),
    )


def requirement_of(annotations: Mapping[str, str]) -> Requirement:
    """The alignment a pod asks for; ValueError for a level or policy not understood."""
    name = annotations.get(ALIGNMENT_ANNOTATION)
    policy = annotations.get(POLICY_ANNOTATION, "preferred")
    if policy not in ("preferred", "required"):
        raise ValueError(f"{POLICY_ANNOTATION} must be preferred or required, not {policy!r}")
    if name is None:
        return Requirement(None, False)
    level = LEVELS_BY_NAME.get(name)
    if level is None or level is Level.SYS:
        raise ValueError(f"{ALIGNMENT_ANNOTATION} must be PIX, PXB, PHB or NODE, not {name!r}")
    return Requirement(level, policy == "required")


# -- placing -------------------------------------------------------------------------


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
    other = frozenset(free[kind.other])
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
