"""The NodeDevices record's field readers and bounds (pure): each value
checked for its type and range where it is read, with the path to it in the
error, and the record's kubelet section."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from devplugin.model import (
    PciAddress,
    PciFunction,
    PciPath,
)
from devplugin.policy.topology_manager import (
    CONTAINER,
    CPU_NONE,
    CPU_POLICIES,
    MAX_NUMA_NODES,
    NO_POLICY,
    NONE,
    POLICIES,
    SCOPES,
    KubeletPolicy,
    Pool,
)


def pci_address(text: object) -> PciAddress:
    if not isinstance(text, str):
        raise ValueError(f"not a PCI address: {text!r}")
    return PciAddress.parse(text)


def pci_function(address: PciAddress, path: list[str], numa: int) -> PciFunction | None:
    """A PCI function whose domain keys are the record's path (the allocator
    only compares keys, so the bridges between need not be real)."""
    if not path:
        return None
    if len(path) != 4:
        raise ValueError(f"topologyPath must name 4 domains, got {path!r}")
    _, root, port, switch = path
    port_address = pci_address(port)
    if switch == port:
        chain: tuple[PciAddress, ...] = (port_address, address)
    else:
        chain = (port_address, pci_address(switch), address, address)
    return PciFunction(
        address=address, path=PciPath(root, chain), numa_node=numa if numa >= 0 else None
    )


def field_of(
    entry: Mapping[str, Any], name: str, kind: type, where: str, default: Any = None
) -> Any:
    """`entry[name]`, which must be of `kind` (absent: `default`, unless None)."""
    value = entry.get(name, default)
    if value is None and default is None:
        raise ValueError(f"{where}.{name} missing")
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{where}.{name} must be {kind.__name__}, not {type(value).__name__}")
    return value


def strings_of(value: list[Any], where: str) -> list[str]:
    if not all(isinstance(item, str) for item in value):
        raise ValueError(f"{where} must hold strings only")
    return value


# A GPU has at most 18 NVLinks today; a count far past that is not one.
MAX_NVLINKS = 64
MAX_NUMA = 1023
# NUMA nodes a record lists at most (the CRD's limit).
MAX_NUMA_LISTED = 64
# Replicas a shared device may be served as (the CRD's limit).
MAX_REPLICAS = 1024
MAX_RESOURCE = 253


def kubelet_of(
    status: Mapping[str, Any],
) -> tuple[KubeletPolicy, tuple[int, ...], Pool | None, bool]:
    """What the record says of the node's kubelet (status.kubelet) and its
    NUMA nodes (status.numaNodes): its policy, the nodes, the exclusive
    CPUs by node where known, and whether its device hints span only the
    nodes with devices (from 1.37). Nothing said: no alignment."""
    found = field_of(status, "kubelet", dict, "status", {})
    where = "status.kubelet"
    policy = KubeletPolicy(
        _choice(found, "topologyManagerPolicy", POLICIES, where, NONE),
        _choice(found, "topologyManagerScope", SCOPES, where, CONTAINER),
        _choice(found, "cpuManagerPolicy", CPU_POLICIES, where, CPU_NONE),
    )
    version = field_of(found, "version", str, where, "")
    minor = _minor(version)
    nodes = field_of(status, "numaNodes", list, "status", [])
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
        node = field_of(entry, "id", int, at)
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
    value = field_of(found, key, str, where, default) or default
    if value not in allowed:
        raise ValueError(f"{where}.{key} {value[:40]!r} is not one of {', '.join(allowed)}")
    return value


def _count_field(entry: Mapping[str, Any], key: str, where: str) -> int:
    value: int = field_of(entry, key, int, where)
    if not 0 <= value <= 65536:
        raise ValueError(f"{where}.{key} {value} is out of range")
    return value


def _minor(version: str) -> int | None:
    """v1.37.2 -> 37; None where it does not say."""
    parts = version.lstrip("v").split(".")
    if len(parts) >= 2 and parts[0] == "1" and parts[1].isdigit():
        return int(parts[1])
    return None
