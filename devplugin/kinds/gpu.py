"""The GPU wing: NVIDIA GPUs (and the MIG devices served in their place),
the anchor of every pairing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from devplugin.kinds._fields import short, text
from devplugin.kinds.base import Box, HookFacts, Kind, PairRole, PictureError, SliceFields
from devplugin.model import DeviceKind, GpuInfo, Inventory, PciAddress, PciFunction
from devplugin.wire.nodedevices import MAX_TEXT
from devplugin.wire.resourceslice import mebibytes, string_value


def family(major: int, minor: int) -> str:
    """The architecture family of a compute capability, as GPU Feature
    Discovery names it ("undefined" past what it knows)."""
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    return {1: "tesla", 2: "fermi", 3: "kepler", 5: "maxwell", 6: "pascal", 9: "hopper"}.get(
        major, "undefined"
    )


def nvlink_domains(gpus: Sequence[GpuInfo]) -> dict[str, str]:
    """GPU UUID -> its NVLink domain (the connected NVLink component, named by
    its lowest PCI address); GPUs without NVLink have none."""
    by_index = {gpu.index: gpu for gpu in gpus}
    parent = {gpu.index: gpu.index for gpu in gpus}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    linked: set[int] = set()
    for gpu in gpus:
        for peer, count in gpu.nvlink_peers:
            if count > 0 and peer in by_index and peer != gpu.index:
                linked.update((gpu.index, peer))
                parent[find(gpu.index)] = find(peer)
    lowest: dict[int, PciAddress] = {}
    for index in linked:
        root = find(index)
        address = by_index[index].pci_address
        if root not in lowest or address < lowest[root]:
            lowest[root] = address
    return {by_index[i].uuid: f"nvl-{_address_name(lowest[find(i)])}" for i in linked}


def _address_name(a: PciAddress) -> str:
    return f"{a.domain:04x}-{a.bus:02x}-{a.device:02x}-{a.function:x}"


class GpuKind(Kind[GpuInfo]):
    kind = DeviceKind.GPU
    key = "gpu"
    plural = "gpus"
    noun = "GPU"
    role = PairRole.ANCHOR
    slice_rank = 0
    cut = True
    link_kind = "nvlink"
    link_label = "NV"
    fabric = ("nvswitch", "NVSwitch fabric")
    record_schema: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "nvlinkPeers": {
            "type": "array",
            "maxItems": 1024,
            "description": "The GPUs this GPU has NVLinks to, and how many.",
            "items": {
                "type": "object",
                "required": ["id", "links"],
                "properties": {
                    "id": {"type": "string", "maxLength": MAX_TEXT},
                    "links": {"type": "integer", "minimum": 1},
                },
            },
        },
        "product": {
            "type": "string",
            "maxLength": MAX_TEXT,
            "description": "The GPU's product as NVML names it.",
        },
        "memoryMiB": {"type": "integer", "minimum": 0, "description": "The GPU's memory."},
        "computeCapability": {
            "type": "string",
            "maxLength": 16,
            "description": "The GPU's CUDA compute capability (9.0), where NVML tells it.",
        },
        "family": {
            "type": "string",
            "maxLength": 32,
            "description": "The GPU's architecture family from its compute capability, "
            "as GPU Feature Discovery names it (hopper, ampere, ...).",
        },
        "mig": {
            "type": "object",
            "description": "Set on a MIG device served in its GPU's place (the same PCI "
            "address and topology path): its parent GPU and its profile.",
            "required": ["parentUUID", "profile"],
            "properties": {
                "parentUUID": {"type": "string", "maxLength": MAX_TEXT},
                "profile": {"type": "string", "maxLength": MAX_TEXT},
            },
        },
    }

    def devices(self, inventory: Inventory) -> Sequence[GpuInfo]:
        return sorted(inventory.gpus, key=lambda g: g.index)

    def device_id(self, device: GpuInfo) -> str:
        return device.uuid

    def pci(self, device: GpuInfo) -> tuple[PciAddress, PciFunction | None, int | None]:
        return device.pci_address, device.pci, device.numa_node

    def record_fields(self, device: GpuInfo, inventory: Inventory) -> dict[str, Any]:
        """Its NVLink peers (by UUID), its product as NVML names it, its
        memory, and where NVML tells it, its compute capability and the
        family that gives; a MIG device names its parent and profile."""
        by_index = {gpu.index: gpu for gpu in inventory.gpus}
        peers = sorted(
            (
                {"id": by_index[peer].uuid, "links": links}
                for peer, links in device.nvlink_peers
                if links > 0 and peer in by_index
            ),
            key=lambda p: str(p["id"]),
        )
        found: dict[str, Any] = {
            "nvlinkPeers": peers,
            "product": device.name[:MAX_TEXT],
            "memoryMiB": device.memory_total_mib,
        }
        if device.compute_capability is not None:
            major, minor = device.compute_capability
            found["computeCapability"] = f"{major}.{minor}"
            found["family"] = family(major, minor)
        if device.slice is not None:
            found["mig"] = {
                "parentUUID": device.slice.parent_uuid[:MAX_TEXT],
                "profile": device.slice.device.profile[:MAX_TEXT],
            }
        return found

    def slice_context(self, inventory: Inventory) -> dict[str, str]:
        return nvlink_domains(inventory.gpus)

    def slice_fields(self, device: GpuInfo, context: Any) -> SliceFields:
        """A whole GPU, or a MIG device (NVIDIA's DRA driver's attributes:
        type mig, parentUUID, profile), which keeps its parent's place, so
        the claim templates' ladders pair a slice with an HCA as a GPU."""
        attributes: dict[str, Any] = {
            "type": string_value("gpu" if device.slice is None else "mig"),
            "uuid": string_value(device.uuid),
            "productName": string_value(device.name),
        }
        capacity: dict[str, Any] = {}
        suffix = ""
        if device.memory_total_mib > 0:
            capacity["memory"] = {"value": mebibytes(device.memory_total_mib)}
        if device.slice is not None:
            mig = device.slice.device
            attributes["parentUUID"] = string_value(device.slice.parent_uuid)
            attributes["profile"] = string_value(mig.profile)
            capacity["multiprocessors"] = {"value": str(mig.multiprocessors)}
            # Unique on the node: one name per GPU and compute instance.
            suffix = f"-mig-{mig.gpu_instance}-{mig.compute_instance}"
        domain = context.get(device.uuid)
        if domain is not None:
            attributes["nvlinkDomain"] = string_value(domain)
        return SliceFields(attributes, capacity, suffix)

    def box(self, entry: Mapping[str, Any]) -> Box:
        mig = entry.get("mig")
        if isinstance(mig, Mapping):
            parent = text(mig.get("parentUUID"), "mig.parentUUID")
            return Box(
                "mig",
                (f"MIG {mig.get('profile', '?')}", short(entry["id"])),
                cluster=(f"cluster_gpu:{parent}", f"GPU {parent} (MIG)"),
            )
        first = f"GPU {entry.get('product', '')}".rstrip()
        return Box("gpu", (first, str(entry.get("pciAddress", "")), short(entry["id"])))

    def links(
        self, entries: Sequence[Mapping[str, Any]]
    ) -> tuple[dict[tuple[str, str], int], tuple[str, ...]]:
        """NVLinks between recorded whole GPUs (a MIG device has none of its own)."""
        ids = {entry["id"] for entry in entries if not isinstance(entry.get("mig"), Mapping)}
        pairs: dict[tuple[str, str], int] = {}
        for entry in entries:
            if entry["id"] not in ids:
                continue
            for peer in entry.get("nvlinkPeers") or ():
                if not isinstance(peer, Mapping):
                    raise PictureError("status.devices[].nvlinkPeers[]: expected objects")
                other = text(peer.get("id"), "nvlinkPeers[].id")
                count = peer.get("links", 0)
                if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                    raise PictureError("status.devices[].nvlinkPeers[].links: expected a count")
                if other in ids and other != entry["id"]:
                    a, b = sorted((str(entry["id"]), other))
                    pairs[(a, b)] = count
        return pairs, tuple(sorted(ids))

    def hook_facts(self, device: GpuInfo) -> HookFacts:
        return HookFacts(
            str(device.pci_address),
            (f"/dev/nvidia{device.minor_number}",),
            device.numa_node,
            {"gpu_uuid": device.uuid},
            {"UUID": device.uuid},
        )


GPU = GpuKind()
