"""A third kind, for the tests only: NVMe drives, as GPUDirect Storage pairs
one with a GPU. It is a wing like the shipped ones, and nothing outside this
folder, its registry line (`KINDS.extended`) and its CRD entry (`CRD_ENTRY`)
knows of it.

Its devices come from the PCI functions discovery already reads: every
function of class 0x0108 (mass storage, non-volatile memory) with NVMe's
programming interface.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from devplugin.kinds.base import Box, HookFacts, Kind, PairRole, SliceFields
from devplugin.model import DeviceKind, Inventory, PciAddress, PciFunction
from devplugin.wire.nodedevices import MAX_TEXT
from devplugin.wire.resourceslice import string_value

NVME_CLASS = 0x010802
SAMSUNG = 0x144D


class NvmeKind(Kind[PciFunction]):
    key = "nvme"
    plural = "nvmes"
    noun = "NVMe drive"
    role = PairRole.PARTNER
    slice_rank = 2
    record_schema: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "vendorId": {"type": "string", "maxLength": 6, "description": "The drive's PCI vendor."},
        "deviceId": {"type": "string", "maxLength": 6, "description": "The drive's PCI device."},
    }

    def __init__(self, kind: DeviceKind) -> None:
        self.kind = kind

    def devices(self, inventory: Inventory) -> Sequence[PciFunction]:
        return sorted(
            (f for f in inventory.pci.values() if f.pci_class == NVME_CLASS),
            key=lambda f: f.address,
        )

    def device_id(self, device: PciFunction) -> str:
        return str(device.address)

    def pci(self, device: PciFunction) -> tuple[PciAddress, PciFunction | None, int | None]:
        return device.address, device, device.numa_node

    def record_fields(self, device: PciFunction, inventory: Inventory) -> dict[str, Any]:
        del inventory
        return {"vendorId": _hex(device.vendor), "deviceId": _hex(device.device)}

    def slice_fields(self, device: PciFunction, inventory: Inventory) -> SliceFields:
        del inventory
        return SliceFields(
            {"type": string_value("nvme"), "vendorId": string_value(_hex(device.vendor))}, {}
        )

    def box(self, entry: Mapping[str, Any]) -> Box:
        model = str(entry.get("deviceId", ""))[:MAX_TEXT]
        return Box("nvme", (f"NVMe {model}".rstrip(), str(entry.get("pciAddress", ""))))

    def hook_facts(self, device: PciFunction) -> HookFacts:
        return HookFacts(
            str(device.address), (), device.numa_node, {"nvme_pci": str(device.address)}, {}
        )


def _hex(value: int | None) -> str:
    return f"0x{value:04x}" if value is not None else ""


# Its entry in the NodeDevices CRD: the wing's fields, its kind's value and
# its summary counts, added where the shipped CRD has the others'.
def crd_entry(crd: dict[str, Any], wing: NvmeKind) -> dict[str, Any]:
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    items = schema["properties"]["devices"]["items"]
    items["properties"].update(wing.record_schema)
    items["properties"]["kind"]["enum"].append(wing.key)
    for what in ("Total", "Free"):
        schema["properties"]["summary"]["properties"][f"{wing.plural}{what}"] = {
            "type": "integer",
            "minimum": 0,
        }
    return crd
