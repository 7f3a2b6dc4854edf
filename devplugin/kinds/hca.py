"""The HCA wing: RDMA host channel adapters (InfiniBand or RoCE), the
partner each GPU is paired with."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from devplugin.kinds.base import Box, HookFacts, Kind, PairRole, PictureError, SliceFields
from devplugin.model import DeviceKind, HcaInfo, Inventory, PciAddress, PciFunction
from devplugin.wire.nodedevices import MAX_PORTS, MAX_TEXT
from devplugin.wire.resourceslice import string_value

# A port state the picture draws as good (sysfs "4: ACTIVE", "5: LinkUp").
PORT_GOOD = ("ACTIVE", "LINKUP")


class HcaKind(Kind[HcaInfo]):
    kind = DeviceKind.HCA
    key = "hca"
    plural = "hcas"
    noun = "HCA"
    role = PairRole.PARTNER
    slice_rank = 1
    record_schema: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "name": {
            "type": "string",
            "maxLength": MAX_TEXT,
            "description": "The HCA's kernel name (mlx5_0).",
        },
        "ports": {
            "type": "array",
            "maxItems": MAX_PORTS,
            "description": "The HCA's ports, their link layer, rate and state as sysfs says.",
            "items": {
                "type": "object",
                "required": ["port", "linkLayer", "rate"],
                "properties": {
                    "port": {"type": "integer", "minimum": 0},
                    "linkLayer": {"type": "string", "maxLength": MAX_TEXT},
                    "rate": {"type": "string", "maxLength": MAX_TEXT},
                    "state": {"type": "string", "maxLength": MAX_TEXT},
                },
            },
        },
    }

    def devices(self, inventory: Inventory) -> Sequence[HcaInfo]:
        return sorted(inventory.hcas, key=lambda h: h.device_id)

    def device_id(self, device: HcaInfo) -> str:
        return device.device_id

    def pci(self, device: HcaInfo) -> tuple[PciAddress, PciFunction | None, int | None]:
        return device.pci_address, device.pci, device.numa_node

    def record_fields(self, device: HcaInfo, inventory: Inventory) -> dict[str, Any]:
        """Its kernel name and each port's link layer (InfiniBand or
        Ethernet), rate and state, as sysfs says."""
        del inventory
        ports = [
            {
                "port": port.number,
                "linkLayer": port.link_layer[:MAX_TEXT],
                "rate": port.rate[:MAX_TEXT],
                "state": port.state[:MAX_TEXT],
            }
            for port in device.ports[:MAX_PORTS]
        ]
        return {"name": device.name[:MAX_TEXT], "ports": ports}

    def slice_fields(self, device: HcaInfo, context: Any) -> SliceFields:
        """Its kernel name, first netdev, and its first port's link layer and state."""
        del context
        attributes: dict[str, Any] = {
            "type": string_value("hca"),
            "ibdev": string_value(device.name),
        }
        if device.netdevs:
            attributes["netdev"] = string_value(device.netdevs[0])
        if device.ports:
            port = device.ports[0]
            attributes["linkLayer"] = string_value(port.link_layer)
            attributes["portState"] = string_value(_port_state(port.state))
        return SliceFields(attributes, {})

    def box(self, entry: Mapping[str, Any]) -> Box:
        rows = []
        for port in entry.get("ports") or ():
            if not isinstance(port, Mapping):
                raise PictureError("status.devices[].ports[]: expected objects")
            state = str(port.get("state", ""))
            good = not state or any(word in state.upper() for word in PORT_GOOD)
            line = f"port {port.get('port')}: {port.get('linkLayer', '')} {port.get('rate', '')}"
            rows.append((f"{line} {state}".strip(), good))
        first = f"HCA {entry.get('name', entry['id'])}"
        return Box("hca", (first, str(entry.get("pciAddress", ""))), tuple(rows))

    def hook_facts(self, device: HcaInfo) -> HookFacts:
        nodes = tuple(node.path for node in device.char_devices if node.present)
        extra, env = {"hca_name": device.name}, {"NAME": device.name}
        return HookFacts(str(device.pci_address), nodes, device.numa_node, extra, env)


def _port_state(text: str) -> str:
    # sysfs says "4: ACTIVE"; the name is what a selector compares.
    return text.split(":", 1)[-1].strip() or text.strip()


HCA = HcaKind()
