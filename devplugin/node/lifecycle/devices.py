"""What hooks are told about each device, from one inventory snapshot."""

from __future__ import annotations

from collections.abc import Sequence

from devplugin.kinds.registry import wing
from devplugin.model import DeviceKind, Inventory
from devplugin.node.lifecycle.hooks import HookDevice


def describe(inventory: Inventory, kind: DeviceKind, ids: Sequence[str]) -> list[HookDevice] | None:
    """Each device's PCI address, device nodes, NUMA node and the kind's own
    fields; None if one of them is not in the inventory."""
    own = wing(kind)
    by_id = {own.device_id(device): device for device in own.devices(inventory)}
    found: list[HookDevice] = []
    for device_id in ids:
        device = by_id.get(device_id)
        if device is None:
            return None
        facts = own.hook_facts(device)
        found.append(
            HookDevice(
                device_id,
                facts.pci_address,
                facts.device_nodes,
                facts.numa_node,
                facts.extra,
                facts.env,
            )
        )
    return found
