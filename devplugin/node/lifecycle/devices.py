"""What hooks are told about each device, from one inventory snapshot."""

from __future__ import annotations

from collections.abc import Sequence

from devplugin.model import DeviceKind, Inventory
from devplugin.node.lifecycle.hooks import HookDevice


def describe(inventory: Inventory, kind: DeviceKind, ids: Sequence[str]) -> list[HookDevice] | None:
    """Each device's PCI address, device nodes, NUMA node and name; None if
    one of them is not in the inventory."""
    found: list[HookDevice] = []
    if kind is DeviceKind.GPU:
        gpus = {gpu.uuid: gpu for gpu in inventory.gpus}
        for device_id in ids:
            gpu = gpus.get(device_id)
            if gpu is None:
                return None
            found.append(
                HookDevice(
                    device_id,
                    str(gpu.pci_address),
                    (f"/dev/nvidia{gpu.minor_number}",),
                    gpu.numa_node,
                    gpu_uuid=gpu.uuid,
                )
            )
        return found
    hcas = {hca.device_id: hca for hca in inventory.hcas}
    for device_id in ids:
        hca = hcas.get(device_id)
        if hca is None:
            return None
        nodes = tuple(node.path for node in hca.char_devices if node.present)
        found.append(
            HookDevice(device_id, str(hca.pci_address), nodes, hca.numa_node, hca_name=hca.name)
        )
    return found
