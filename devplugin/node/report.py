"""Human and machine readable views of an inventory (`discover`, `topo`)."""

from __future__ import annotations

from typing import Any

from devplugin.model import CharDevice, GpuInfo, HcaInfo, Inventory, PciFunction
from devplugin.node.hca.resource import hca_health
from devplugin.policy.topology import Topology

LEGEND = (
    "Legend:",
    "  X    = the device itself",
    "  NV#  = GPU pair joined by # NVLinks",
    "  PIX  = at most one PCIe switch between the two",
    "  PXB  = several PCIe bridges between the two, no host bridge",
    "  PHB  = through a PCIe host bridge (one root complex)",
    "  NODE = through the interconnect between host bridges of one NUMA node",
    "  SYS  = across NUMA nodes (SMP interconnect), or position unknown",
)


def _pci(function: PciFunction | None) -> dict[str, Any] | None:
    if function is None:
        return None
    return {
        "address": str(function.address),
        "host_bridge": function.path.root,
        "path": [str(address) for address in function.path.chain],
        "vendor": f"0x{function.vendor:04x}" if function.vendor is not None else None,
        "device": f"0x{function.device:04x}" if function.device is not None else None,
        "class": f"0x{function.pci_class:06x}" if function.pci_class is not None else None,
        "numa_node": function.numa_node,
        "local_cpulist": function.local_cpulist,
        "driver": function.driver,
    }


def _char(node: CharDevice) -> dict[str, Any]:
    return {"path": node.path, "present": node.present}


def _gpu(gpu: GpuInfo) -> dict[str, Any]:
    return {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "name": gpu.name,
        "pci_bus_id": str(gpu.pci_address),
        "minor_number": gpu.minor_number,
        "memory_total_mib": gpu.memory_total_mib,
        "cuda_compute_capability": (
            list(gpu.compute_capability) if gpu.compute_capability is not None else None
        ),
        "numa_node": gpu.numa_node,
        "nvlink_peers": {str(peer): count for peer, count in gpu.nvlink_peers},
        "pci": _pci(gpu.pci),
        "mig": _mig(gpu),
    }


def _mig(gpu: GpuInfo) -> dict[str, Any]:
    """A whole GPU's MIG mode, or a MIG device's parent and instances."""
    if gpu.slice is None:
        return {"capable": gpu.mig_capable, "enabled": gpu.mig_enabled}
    device = gpu.slice.device
    return {
        "parent_uuid": gpu.slice.parent_uuid,
        "parent_index": gpu.slice.parent_index,
        "profile": device.profile,
        "gpu_instance": device.gpu_instance,
        "compute_instance": device.compute_instance,
        "multiprocessors": device.multiprocessors,
        "caps_minors": list(gpu.slice.caps),
    }


def _hca(hca: HcaInfo) -> dict[str, Any]:
    health, reason = hca_health(hca)
    return {
        "id": hca.device_id,
        "name": hca.name,
        "numa_node": hca.numa_node,
        "node_guid": hca.node_guid,
        "fw_ver": hca.fw_ver,
        "health": health.value,
        "health_reason": reason,
        "ports": [
            {
                "number": port.number,
                "state": port.state,
                "phys_state": port.phys_state,
                "link_layer": port.link_layer,
                "rate": port.rate,
            }
            for port in hca.ports
        ],
        "netdevs": list(hca.netdevs),
        "char_devices": [_char(node) for node in hca.char_devices],
        "pci": _pci(hca.pci),
    }


def inventory_dict(inventory: Inventory) -> dict[str, Any]:
    return {
        "nvml": {
            "ok": inventory.nvml.ok,
            "driver_version": inventory.nvml.driver_version,
            "cuda_driver_version": inventory.nvml.cuda_driver_version,
            "error": inventory.nvml.error,
        },
        "gpus": [_gpu(gpu) for gpu in inventory.gpus],
        "gpu_control_nodes": [_char(node) for node in inventory.gpu_control_nodes],
        "hcas": [_hca(hca) for hca in inventory.hcas],
    }


def _numa_text(node: int | None) -> str:
    return str(node) if node is not None else "N/A"


def inventory_text(inventory: Inventory) -> str:
    lines: list[str] = []
    nvml = inventory.nvml
    if nvml.ok:
        lines.append(
            f"NVML: driver {nvml.driver_version}, CUDA {nvml.cuda_driver_version}, "
            f"{len(inventory.gpus)} GPUs"
        )
    else:
        lines.append(f"NVML: unavailable ({nvml.error})")
    for gpu in inventory.gpus:
        if gpu.slice is not None:
            device = gpu.slice.device
            lines.append(
                f"  MIG {gpu.uuid} {device.profile} of GPU{gpu.slice.parent_index} "
                f"(GPU instance {device.gpu_instance}, compute instance "
                f"{device.compute_instance}) {gpu.memory_total_mib} MiB "
                f"NUMA {_numa_text(gpu.numa_node)}"
            )
            continue
        nv = ", ".join(f"GPU{peer}:NV{count}" for peer, count in gpu.nvlink_peers) or "none"
        lines.append(
            f"  GPU{gpu.index} {gpu.uuid} {gpu.name} bus {gpu.pci_address} "
            f"minor {gpu.minor_number} {gpu.memory_total_mib} MiB "
            f"NUMA {_numa_text(gpu.numa_node)} NVLink {nv}"
        )
    present = [node.path for node in inventory.gpu_control_nodes if node.present]
    lines.append(f"  control nodes: {', '.join(present) or 'none found'}")
    lines.append(f"HCAs: {len(inventory.hcas)}")
    for hca in inventory.hcas:
        health, reason = hca_health(hca)
        ports = "; ".join(
            f"port {p.number} {p.state} / {p.phys_state} {p.link_layer} {p.rate}".strip()
            for p in hca.ports
        )
        nodes = ", ".join(
            node.path + ("" if node.present else " (missing)") for node in hca.char_devices
        )
        lines.append(
            f"  {hca.name} id {hca.device_id} NUMA {_numa_text(hca.numa_node)} "
            f"guid {hca.node_guid or '?'} fw {hca.fw_ver or '?'} "
            f"{health.value}{' (' + reason + ')' if reason else ''}"
        )
        lines.append(f"    {ports or 'no ports'}")
        lines.append(f"    netdevs: {', '.join(hca.netdevs) or 'none'}")
        lines.append(f"    device nodes: {nodes}")
    return "\n".join(lines)


def _gpu_label(gpu: GpuInfo) -> str:
    if gpu.slice is not None:
        return f"MIG{gpu.slice.parent_index}:{gpu.slice.device.index}"
    return f"GPU{gpu.index}"


def topo_matrix(inventory: Inventory) -> list[list[str]]:
    """Header row then one row per device: the cells `devplugin topo` prints."""
    topology = Topology.from_inventory(inventory)
    labels = [_gpu_label(gpu) for gpu in inventory.gpus] + [hca.name for hca in inventory.hcas]
    ids = [gpu.uuid for gpu in inventory.gpus] + [hca.device_id for hca in inventory.hcas]
    functions = [gpu.pci for gpu in inventory.gpus] + [hca.pci for hca in inventory.hcas]
    rows = [["", *labels, "CPU Affinity", "NUMA Affinity"]]
    for i, label in enumerate(labels):
        row = [label]
        for j in range(len(labels)):
            row.append("X" if i == j else topology.link(ids[i], ids[j]).label)
        function = functions[i]
        row.append(function.local_cpulist or "N/A" if function is not None else "N/A")
        row.append(_numa_text(function.numa_node if function is not None else None))
        rows.append(row)
    return rows


def topo_text(inventory: Inventory) -> str:
    rows = topo_matrix(inventory)
    widths = [max(len(row[col]) for row in rows) for col in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(widths[col]) for col, cell in enumerate(row)).rstrip() for row in rows
    ]
    hca_ids = [f"  {hca.name} = {hca.device_id}" for hca in inventory.hcas]
    return "\n".join([*lines, "", *LEGEND, *(["", "HCA ids:", *hca_ids] if hca_ids else [])])
