"""What this node publishes as ResourceSlices (pure: inventory in, dicts out).

Devices are named from their PCI address (`gpu-0000-1b-00-0`), which
survives reboots and driver reloads and is a DNS label. Besides the
standard attributes, every placed device carries the two keys that make
switch-level alignment expressible as a plain `matchAttribute`:

* `pcieSwitch`: equal for two devices exactly when they are PIX to each
  other (the bridge the shared switch hangs from, or the shared root port);
* `pcieTopSwitch`: equal exactly when they are at most PXB (the root port);

and GPUs joined by NVLink share `nvlinkDomain`. A device with no known PCI
path has none of the three, so no constraint on them can pick it with
another device: it is SYS to everything, as the node's own allocator sees it.

Limits come from the API: at most 128 devices per slice, 64 when any device
may carry taints; at most 32 attributes and capacities per device (these
have at most 13); string values at most 64 characters. The API imitation
checks every slice written against those limits (testing/dra_limits.py).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from devplugin.kinds.base import Kind
from devplugin.kinds.registry import KINDS
from devplugin.model import DeviceKind, Health, Inventory, PciAddress, PciFunction
from devplugin.node.resources import ResourceState
from devplugin.wire.resourceslice import string_value

STANDARD = "resource.kubernetes.io"
PCIE_ROOT = f"{STANDARD}/pcieRoot"
PCI_BUS_ID = f"{STANDARD}/pciBusID"
# The NUMA node is the driver's own attribute: Kubernetes reserves its
# domain and defines only pcieRoot and pciBusID there
# (dynamic-resource-allocation deviceattribute/attribute.go).
NUMA_NODE = "numaNode"

MAX_DEVICES = 128
MAX_DEVICES_TAINTED = 64
TAINT_EFFECT = "NoSchedule"


def device_name(kind: DeviceKind, address: PciAddress) -> str:
    a = address
    return f"{kind.value}-{a.domain:04x}-{a.bus:02x}-{a.device:02x}-{a.function:x}"


def switch_keys(function: PciFunction | None) -> tuple[str, str] | None:
    """(pcieSwitch, pcieTopSwitch) for a function, as the topology's
    placement keys decide PIX and PXB: the switch key is the bridge above
    the downstream ports (or the root port a device sits on directly); a
    function on the root bus has only itself."""
    if function is None:
        return None
    chain = function.path.chain
    top = str(chain[0])
    if len(chain) >= 3:
        return str(chain[-3]), top
    if len(chain) == 2:
        return str(chain[0]), top
    return str(chain[-1]), top


@dataclass(frozen=True)
class SliceDevice:
    kind: DeviceKind
    id: str  # the node's id: GPU UUID or HCA PCI address
    name: str  # the slice's
    body: Mapping[str, Any]


# NUMA node published when sysfs says none (-1: single-socket hosts, most
# VMs). The topology takes every unknown node as one shared node, and so
# does a matchAttribute on this value.
UNKNOWN_NUMA = -1


def unplaced_numa(address: PciAddress) -> int:
    """A NUMA value no other device has (below UNKNOWN_NUMA), for a device
    whose place in the tree is unknown: SYS to everything, as in the
    topology."""
    packed = (address.domain << 16) | (address.bus << 8) | (address.device << 3) | address.function
    return UNKNOWN_NUMA - 1 - packed


def _placement(function: PciFunction | None, address: PciAddress) -> dict[str, Any]:
    """Where a device sits, as the claim templates' rungs match it. Every
    device has every rung's attribute: the real allocator refuses a device
    that lacks an attribute any constraint naming its request matches
    (structured/allocator.go, matchAttributeConstraint.add), and each pair's
    HCA request is named by every rung. So what is unknown is published as
    a value that matches what the topology says it is: an unknown NUMA node
    as the one shared UNKNOWN_NUMA, an unknown position as values of its own
    (matching no other device, so only the `any` rung pairs it)."""
    attributes: dict[str, Any] = {PCI_BUS_ID: string_value(str(address))}
    keys = switch_keys(function)
    if function is None or keys is None:
        own = f"unplaced-{address}"
        attributes[PCIE_ROOT] = string_value(own)
        attributes[NUMA_NODE] = {"int": unplaced_numa(address)}
        attributes["pcieSwitch"] = attributes["pcieTopSwitch"] = string_value(own)
        return attributes
    attributes[PCIE_ROOT] = string_value(function.path.root)
    numa = function.numa_node
    attributes[NUMA_NODE] = {"int": numa if numa is not None and numa >= 0 else UNKNOWN_NUMA}
    attributes["pcieSwitch"] = string_value(keys[0])
    attributes["pcieTopSwitch"] = string_value(keys[1])
    return attributes


def slice_device(wing: Kind[Any], device: Any, context: Any) -> SliceDevice:
    """One device as its slice lists it: where it sits, and what its wing says
    (`context`: the wing's slice context for the device's inventory)."""
    address, function, _ = wing.pci(device)
    own = wing.slice_fields(device, context)
    attributes = {"type": own.attributes["type"], **_placement(function, address)}
    attributes.update(own.attributes)
    body: dict[str, Any] = {"attributes": attributes}
    if own.capacity:
        body["capacity"] = dict(own.capacity)
    name = device_name(wing.kind, address) + own.name_suffix
    return SliceDevice(wing.kind, wing.device_id(device), name, body)


def node_devices(inventory: Inventory, kinds: Collection[DeviceKind]) -> list[SliceDevice]:
    """Every device of these kinds, ordered so that first fit tends to align:
    grouped by switch (devices under one switch together), anchors before
    partners within a switch."""
    devices: list[tuple[tuple[str, str, int], SliceDevice]] = []
    for wing in KINDS:
        if wing.kind not in kinds:
            continue
        context = wing.slice_context(inventory)
        for device in wing.devices(inventory):
            keys = switch_keys(wing.pci(device)[1]) or ("~", "~")
            entry = slice_device(wing, device, context)
            devices.append(((keys[1], keys[0], wing.slice_rank), entry))
    devices.sort(key=lambda item: (item[0], item[1].name))
    return [device for _, device in devices]


def names(devices: Iterable[SliceDevice]) -> dict[str, tuple[DeviceKind, str]]:
    """Slice name -> (kind, node id)."""
    return {device.name: (device.kind, device.id) for device in devices}


def taint(reason: str, domain: str) -> dict[str, str]:
    """The taint of a device that must not be allocated now. The value says
    which kind of problem (a label value); the reason goes to the log and the
    health stream."""
    value = "cleanup" if "cleanup" in reason or "awaiting" in reason else "unhealthy"
    return {"key": f"{domain}/unhealthy", "value": value, "effect": TAINT_EFFECT}


def published(
    devices: Sequence[SliceDevice],
    served: Mapping[DeviceKind, ResourceState | None],
    *,
    domain: str,
    unhealthy: str,
    held: Collection[str] = frozenset(),
) -> list[dict[str, Any]]:
    """The device entries as the slice holds them: healthy devices as they
    are, unhealthy ones tainted (or left out, `unhealthy == "remove"`), all
    with the free counts (`held`: the names prepared claims hold). A device
    no judged state covers yet is not offered."""
    entries: list[dict[str, Any]] = []
    for device in devices:
        state = served.get(device.kind)
        judged = state.device(device.id) if state is not None else None
        healthy = judged is not None and judged.health is Health.HEALTHY
        if not healthy and unhealthy == "remove":
            continue
        entry: dict[str, Any] = {"name": device.name, **device.body}
        if not healthy:
            reason = judged.reason if judged is not None else "not judged yet"
            entry["taints"] = [taint(reason, domain)]
        entries.append(entry)
    return with_free_counts(entries, held)


# What a claim template's first request checks before the allocator walks
# (policy/claim_templates.py, `gate`): how many devices of each type no
# prepared claim holds and no taint keeps out, and on a GPU with NVLink,
# how many of its domain are so. The allocator walks every order of a
# claim's interchangeable requests before it gives up, so without these a
# node one device short holds the scheduler for millions of tries.
FREE_GPUS = "freeGpus"
FREE_HCAS = "freeHcas"
FREE_IN_NVLINK_DOMAIN = "freeInNvlinkDomain"
# On a MIG device: how many MIG devices of its profile are free (a MIG
# claim's gate reads it; freeGpus counts whole GPUs only).
FREE_OF_PROFILE = "freeOfProfile"


def with_free_counts(
    entries: Sequence[Mapping[str, Any]], held: Collection[str]
) -> list[dict[str, Any]]:
    """The entries, each with the node's free counts. `held` names the
    devices prepared claims hold. A claim the scheduler allocated and the
    kubelet has not prepared yet still counts as free: the counts can be
    high for a moment (the walk then runs as without them), never low, so
    they never turn away a node that fits."""
    free = [e for e in entries if not e.get("taints") and e["name"] not in held]
    by_type: dict[str, int] = {"gpu": 0, "hca": 0}
    by_domain: dict[str, int] = {}
    by_profile: dict[str, int] = {}
    for entry in free:
        attributes = entry["attributes"]
        kind = attributes["type"]["string"]
        by_type[kind] = by_type.get(kind, 0) + 1
        if "nvlinkDomain" in attributes:
            domain = attributes["nvlinkDomain"]["string"]
            by_domain[domain] = by_domain.get(domain, 0) + 1
        if kind == "mig":
            profile = attributes["profile"]["string"]
            by_profile[profile] = by_profile.get(profile, 0) + 1
    counted = []
    for entry in entries:
        attributes = dict(entry["attributes"])
        attributes[FREE_GPUS] = {"int": by_type["gpu"]}
        attributes[FREE_HCAS] = {"int": by_type["hca"]}
        if "nvlinkDomain" in attributes:
            domain = attributes["nvlinkDomain"]["string"]
            attributes[FREE_IN_NVLINK_DOMAIN] = {"int": by_domain.get(domain, 0)}
        if attributes["type"]["string"] == "mig":
            profile = attributes["profile"]["string"]
            attributes[FREE_OF_PROFILE] = {"int": by_profile.get(profile, 0)}
        counted.append({**entry, "attributes": attributes})
    return counted


def split(entries: Sequence[dict[str, Any]], *, tainting: bool) -> list[list[dict[str, Any]]]:
    """Devices cut into slices within the per-slice limit; one empty slice
    when there are none (the pool then says so)."""
    size = MAX_DEVICES_TAINTED if tainting else MAX_DEVICES
    if not entries:
        return [[]]
    return [list(entries[i : i + size]) for i in range(0, len(entries), size)]
