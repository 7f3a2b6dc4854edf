"""The NodeDevices record's status, built from what the daemon knows (pure).

One record per node (`nodedevices.devplugin.io/v1alpha1`, cluster-scoped,
named after the node). Its status lists every physical device the node
serves with its health (and why, when not Healthy), PCI address, NUMA node
and place in the PCIe tree
(domain ids from the NUMA node down to its switch), NVLink peers for GPUs;
every container holding devices with its worst GPU-to-HCA level and, when
known, its pod's uid (a holder not identified yet has empty names); a summary
for `kubectl get` (free and total per kind, unhealthy); and whether the
daemon is registered with the kubelet. `updated` is stamped by the writer.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from devplugin.kinds.registry import KINDS
from devplugin.model import DeviceKind, Health, Inventory, PciFunction
from devplugin.node.alignment import ContainerAlignment
from devplugin.node.resources import ResourceState
from devplugin.wire.nodedevices import MAX_TEXT


@dataclass(frozen=True)
class Registration:
    registered: bool
    message: str


def tree_path(function: PciFunction | None) -> list[str]:
    """Domain ids from the NUMA node down to the switch (or root port) a device
    hangs off: `numa0`, the host bridge, the root port, the switch's upstream
    port. Devices sharing a prefix share those domains."""
    if function is None:
        return []
    numa = function.numa_node if function.numa_node is not None else -1
    chain = function.path.chain
    path = [f"numa{numa}" if numa >= 0 else "numa-unknown", function.path.root]
    if chain:
        path.append(str(chain[0]))
        # Behind a switch: its upstream port is two hops above the device.
        path.append(str(chain[-3]) if len(chain) >= 3 else str(chain[0]))
    return path


def _health(
    states: Mapping[DeviceKind, ResourceState], kind: DeviceKind, device: str
) -> dict[str, str]:
    """`health`, and `reason` when it is not Healthy."""
    state = states.get(kind)
    served = (state.backing or state).device(device) if state is not None else None
    if served is None:
        return {"health": Health.UNHEALTHY.value, "reason": "not served"}
    if served.health is Health.HEALTHY:
        return {"health": served.health.value}
    return {"health": served.health.value, "reason": served.reason[:MAX_TEXT]}


def build_status(
    inventory: Inventory,
    states: Mapping[DeviceKind, ResourceState],
    containers: Iterable[ContainerAlignment],
    registration: Registration,
    served: Mapping[str, tuple[str, int]] | None = None,
    *,
    kubelet: Mapping[str, Any] | None = None,
    numa: list[dict[str, int]] | None = None,
) -> dict[str, Any]:
    """The record's status (without `updated`); equal inputs give equal output.
    `kubelet` and `numa`: what the node's kubelet aligns and its NUMA nodes
    (status.kubelet, status.numaNodes; left out when not known).
    `served`: device id -> the resource the kubelet serves it under and its
    replicas (time-slicing, shared HCAs), written on each device."""
    served = served or {}
    devices: list[dict[str, Any]] = []
    for wing in KINDS:
        if wing.kind not in states:
            continue
        for device in wing.devices(inventory):
            device_id = wing.device_id(device)
            address, function, numa_node = wing.pci(device)
            devices.append({
                "id": device_id, "kind": wing.key,
                **_health(states, wing.kind, device_id),
                "pciAddress": str(address), "numaNode": _numa(numa_node),
                "topologyPath": tree_path(function),
                **wing.record_fields(device, inventory), **_served(served, device_id),
            })  # fmt: skip
    allocations: list[dict[str, Any]] = []
    held: set[str] = set()
    for item in sorted(containers, key=lambda c: c.name):
        ids = [*item.gpus, *item.hcas]
        if not ids:
            continue
        held.update(ids)
        allocation = {
            "namespace": item.namespace, "pod": item.pod, "container": item.container,
            "devices": ids, "worstLevel": item.worst.name if item.worst is not None else "",
        }  # fmt: skip
        if item.uid:
            allocation["podUID"] = item.uid
        allocations.append(allocation)
    summary: dict[str, int] = {"unhealthy": 0}
    for info in KINDS:
        mine = [d for d in devices if d["kind"] == info.key]
        summary[f"{info.plural}Total"] = len(mine)
        summary[f"{info.plural}Free"] = sum(
            1 for d in mine if d["health"] == Health.HEALTHY.value and d["id"] not in held
        )
        summary["unhealthy"] += sum(1 for d in mine if d["health"] != Health.HEALTHY.value)
    status: dict[str, Any] = {
        "devices": devices,
        "allocations": allocations,
        "summary": summary,
        "conditions": [{
            "type": "Registered",
            "status": "True" if registration.registered else "False",
            "reason": "KubeletRegistration" if registration.registered else "NotRegistered",
            "message": registration.message[:MAX_TEXT],
        }],
    }  # fmt: skip
    if kubelet:
        status["kubelet"] = dict(kubelet)
    if numa:
        status["numaNodes"] = [dict(entry) for entry in numa]
    return status


def _served(served: Mapping[str, tuple[str, int]], device: str) -> dict[str, Any]:
    found = served.get(device)
    if found is None:
        return {}
    name, replicas = found
    return {"resource": name, "replicas": replicas} if replicas > 1 else {"resource": name}


def _numa(node: int | None) -> int:
    return node if node is not None else -1


def now_stamp() -> str:
    """The time as the record's stamps say it (RFC 3339, seconds, UTC)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Stamps:
    """What a writer adds to a built status: `updated`, and each condition's
    `lastTransitionTime`, kept while the condition keeps its status. One per
    node, shared by whoever hands the record out (the writer, /record)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._transitions: dict[tuple[str, str], str] = {}

    def apply(self, status: Mapping[str, Any]) -> dict[str, Any]:
        now = now_stamp()
        stamped = dict(status, updated=now)
        conditions = []
        with self._lock:
            for condition in status.get("conditions", []):
                key = (condition["type"], condition["status"])
                since = self._transitions.setdefault(key, now)
                # Keep only the current status's transition per type.
                for other in [k for k in self._transitions if k[0] == key[0] and k != key]:
                    del self._transitions[other]
                conditions.append(dict(condition, lastTransitionTime=since))
        stamped["conditions"] = conditions
        return stamped
