"""A node read from its NodeDevices record (pure): the devices and their
places in the PCIe tree, NVLink peers, health, holdings and sharing, strict
about every field (a node described wrongly must not steer pods)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from devplugin.model import (
    CharDevice,
    DeviceKind,
    GpuInfo,
    HcaInfo,
    PciAddress,
    PciFunction,
)
from devplugin.policy.node_state import Holding, NodeState
from devplugin.policy.record_fields import (
    MAX_NUMA,
    MAX_NVLINKS,
    MAX_REPLICAS,
    MAX_RESOURCE,
    field_of,
    kubelet_of,
    pci_address,
    pci_function,
    strings_of,
)
from devplugin.policy.topology import Topology
from devplugin.policy.topology_manager import (
    NO_POLICY,
    KubeletPolicy,
    Pool,
)

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
    for j, peer in enumerate(field_of(entry, "nvlinkPeers", list, where, [])):
        if not isinstance(peer, dict):
            raise ValueError(f"{where}.nvlinkPeers[{j}] must be an object")
        peer_id = field_of(peer, "id", str, f"{where}.nvlinkPeers[{j}]")
        links = field_of(peer, "links", int, f"{where}.nvlinkPeers[{j}]")
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
        listed = strings_of(field_of(allocation, "devices", list, where), f"{where}.devices")
        ids = frozenset(named.get(d, d) for d in listed)
        namespace = field_of(allocation, "namespace", str, where, "")
        pod = field_of(allocation, "pod", str, where, "")
        uid = field_of(allocation, "podUID", str, where, "")
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
    devices = field_of(status, "devices", list, "status")
    allocations = field_of(status, "allocations", list, "status", [])
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
        device_id = field_of(entry, "id", str, where)
        address = pci_address(field_of(entry, "pciAddress", str, where))
        path = strings_of(field_of(entry, "topologyPath", list, where, []), f"{where}.topologyPath")
        numa = field_of(entry, "numaNode", int, where, -1)
        if not -1 <= numa <= MAX_NUMA:
            raise ValueError(f"{where}.numaNode {numa} is not a NUMA node")
        health = field_of(entry, "health", str, where)
        function = pci_function(address, path, numa)
        kind = entry.get("kind")
        if kind == "gpu":
            peers = _nvlink_peers(entry, where, device_id, index_of, wired)
            device_id = named.get(device_id, device_id)
            layout.append((device_id, str(address), tuple(path), numa, tuple(peers)))
            gpus.append(_gpu(index_of[entry["id"]], device_id, address, function, peers))
            products.append(field_of(entry, "product", str, where, ""))
            kind_value = DeviceKind.GPU
        elif kind == "hca":
            if device_id != str(address):
                raise ValueError(f"HCA {device_id!r} is not named by its PCI address")
            name = field_of(entry, "name", str, where, device_id) or device_id
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
    kubelet, machine, cpus, nodes_only = kubelet_of(status)
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
    resource = field_of(entry, "resource", str, where, "")
    if len(resource) > MAX_RESOURCE:
        raise ValueError(f"{where}.resource is longer than {MAX_RESOURCE} characters")
    if not resource:
        resource = f"mig-{profile}" if profile else ""
    pools.setdefault(resource, set()).add(device_id)
    count = field_of(entry, "replicas", int, where, 1)
    if not 1 <= count <= MAX_REPLICAS:
        raise ValueError(f"{where}.replicas {count} is not between 1 and {MAX_REPLICAS}")
    if count > 1:
        replicas[device_id] = count
