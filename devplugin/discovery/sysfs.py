"""PCI functions, RDMA HCAs and their character devices, read from sysfs.

Both roots are parameters: production passes /sys and /dev, tests pass trees
built under tmp_path. Paths reported to the kubelet are always the real host
paths (/dev/...), whatever root the presence check used.
"""

from __future__ import annotations

import logging
import os
import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from devplugin.model import CharDevice, HcaInfo, IbPort, PciAddress, PciFunction, PciPath

log = logging.getLogger(__name__)

HOST_DEV = "/dev"
_HOST_BRIDGE = re.compile(r"^pci[0-9a-f]{4,8}:[0-9a-f]{2}$")
_GPU_CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")


def read_text(path: Path) -> str | None:
    """The stripped content of a sysfs attribute, or None when unreadable.

    Optional attributes are missing on some kernels and drivers; a missing
    file must degrade one field, never the whole scan.
    """
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def _read_hex(path: Path) -> int | None:
    text = read_text(path)
    if text is None:
        return None
    try:
        return int(text, 16)
    except ValueError:
        return None


def _read_numa(path: Path) -> int | None:
    text = read_text(path)
    if text is None:
        return None
    try:
        node = int(text)
    except ValueError:
        return None
    # The kernel writes -1 when firmware gave no proximity information.
    return node if node >= 0 else None


def pci_path_of(sysfs_root: Path, device_dir: Path) -> PciPath | None:
    """The PCIe ancestry of a device directory, from its resolved real path.

    The real path looks like devices/pci0000:17/0000:17:01.0/0000:18:00.0;
    the last `pciDDDD:BB` component is the host bridge and every PCI address
    after it is a hop down the tree. Virtual buses may put the host bridge
    deeper (Hyper-V), so search for it rather than assume position 1.
    """
    real = Path(os.path.realpath(device_dir))
    try:
        parts = real.relative_to(Path(os.path.realpath(sysfs_root / "devices"))).parts
    except ValueError:
        return None
    root_index = None
    for index, part in enumerate(parts):
        if _HOST_BRIDGE.match(part):
            root_index = index
    if root_index is None:
        return None
    chain: list[PciAddress] = []
    for part in parts[root_index + 1 :]:
        try:
            chain.append(PciAddress.parse(part))
        except ValueError:
            # Something that is not a PCI function (a subsystem directory):
            # the chain ends at the last function above it.
            break
    if not chain:
        return None
    return PciPath(root=parts[root_index], chain=tuple(chain))


def read_pci_functions(sysfs_root: Path) -> dict[PciAddress, PciFunction]:
    """Every function under bus/pci/devices, with its ancestry and attributes."""
    devices_dir = sysfs_root / "bus" / "pci" / "devices"
    functions: dict[PciAddress, PciFunction] = {}
    try:
        entries = sorted(os.listdir(devices_dir))
    except OSError as exc:
        log.warning("cannot list PCI devices under %s: %s", devices_dir, exc)
        return functions
    for entry in entries:
        try:
            address = PciAddress.parse(entry)
        except ValueError:
            continue
        device_dir = devices_dir / entry
        path = pci_path_of(sysfs_root, device_dir)
        if path is None or path.chain[-1] != address:
            log.debug("PCI device %s has no resolvable ancestry; skipped", entry)
            continue
        functions[address] = PciFunction(
            address=address,
            path=path,
            vendor=_read_hex(device_dir / "vendor"),
            device=_read_hex(device_dir / "device"),
            pci_class=_read_hex(device_dir / "class"),
            numa_node=_read_numa(device_dir / "numa_node"),
            local_cpulist=read_text(device_dir / "local_cpulist"),
            driver=_link_name(device_dir / "driver"),
        )
    return functions


def _link_name(path: Path) -> str | None:
    try:
        return os.path.basename(os.readlink(path))
    except OSError:
        return None


def _char_device(dev_root: Path, relative: str) -> CharDevice:
    return CharDevice(
        path=f"{HOST_DEV}/{relative}",
        present=os.path.exists(dev_root / relative),
    )


def gpu_control_nodes(dev_root: Path) -> tuple[CharDevice, ...]:
    """The node-wide NVIDIA device nodes every GPU container needs."""
    return tuple(_char_device(dev_root, name) for name in _GPU_CONTROL_NODES)


@dataclass(frozen=True)
class _MadNode:
    name: str
    port: int


def _class_entries(class_dir: Path) -> list[str]:
    try:
        return sorted(os.listdir(class_dir), key=_natural_key)
    except OSError:
        return []


def _natural_key(name: str) -> tuple[str, int]:
    match = re.match(r"^(.*?)(\d+)$", name)
    if match is None:
        return (name, -1)
    return (match.group(1), int(match.group(2)))


def _verbs_by_ibdev(sysfs_root: Path) -> dict[str, str]:
    class_dir = sysfs_root / "class" / "infiniband_verbs"
    found: dict[str, str] = {}
    for entry in _class_entries(class_dir):
        if not entry.startswith("uverbs"):
            continue
        ibdev = read_text(class_dir / entry / "ibdev")
        if ibdev:
            found[ibdev] = entry
    return found


def _mads_by_ibdev(sysfs_root: Path) -> dict[str, dict[str, list[_MadNode]]]:
    """ibdev -> {"umad": [...], "issm": [...]}, each sorted by port."""
    class_dir = sysfs_root / "class" / "infiniband_mad"
    found: dict[str, dict[str, list[_MadNode]]] = defaultdict(lambda: defaultdict(list))
    for entry in _class_entries(class_dir):
        kind = "umad" if entry.startswith("umad") else "issm" if entry.startswith("issm") else None
        if kind is None:
            continue
        ibdev = read_text(class_dir / entry / "ibdev")
        port_text = read_text(class_dir / entry / "port")
        if not ibdev or port_text is None or not port_text.isdigit():
            continue
        found[ibdev][kind].append(_MadNode(entry, int(port_text)))
    for kinds in found.values():
        for nodes in kinds.values():
            nodes.sort(key=lambda node: node.port)
    return found


def _read_ports(ib_dir: Path) -> tuple[IbPort, ...]:
    ports_dir = ib_dir / "ports"
    ports: list[IbPort] = []
    for entry in _class_entries(ports_dir):
        if not entry.isdigit():
            continue
        port_dir = ports_dir / entry
        ports.append(
            IbPort(
                number=int(entry),
                state=read_text(port_dir / "state") or "",
                phys_state=read_text(port_dir / "phys_state") or "",
                link_layer=read_text(port_dir / "link_layer") or "",
                rate=read_text(port_dir / "rate") or "",
            )
        )
    ports.sort(key=lambda port: port.number)
    return tuple(ports)


@dataclass(frozen=True)
class RdmaNames:
    """The InfiniBand class entries and which char devices belong to each."""

    names: tuple[str, ...]
    verbs: Mapping[str, str]
    mads: Mapping[str, Mapping[str, list[_MadNode]]]


def list_hcas(sysfs_root: Path) -> RdmaNames:
    """Directory listings only: which RDMA devices exist and their node names."""
    return RdmaNames(
        names=tuple(_class_entries(sysfs_root / "class" / "infiniband")),
        verbs=_verbs_by_ibdev(sysfs_root),
        mads=_mads_by_ibdev(sysfs_root),
    )


def hca_address(sysfs_root: Path, name: str) -> PciAddress | None:
    """The PCI function behind an RDMA device; None for software devices."""
    device_link = sysfs_root / "class" / "infiniband" / name / "device"
    try:
        return PciAddress.parse(os.path.basename(os.path.realpath(device_link)))
    except ValueError:
        return None


def read_hca(
    sysfs_root: Path,
    dev_root: Path,
    pci: Mapping[PciAddress, PciFunction],
    names: RdmaNames,
    *,
    name: str,
    address: PciAddress,
) -> HcaInfo:
    """One HCA's attributes, ports and device nodes (the reads that can block)."""
    ib_dir = sysfs_root / "class" / "infiniband" / name
    uverbs_name = names.verbs.get(name)
    mad = names.mads.get(name, {})
    try:
        netdevs = tuple(sorted(os.listdir(ib_dir / "device" / "net")))
    except OSError:
        netdevs = ()
    return HcaInfo(
        name=name,
        pci_address=address,
        pci=pci.get(address),
        node_guid=read_text(ib_dir / "node_guid"),
        fw_ver=read_text(ib_dir / "fw_ver"),
        ports=_read_ports(ib_dir),
        netdevs=netdevs,
        uverbs=(
            _char_device(dev_root, f"infiniband/{uverbs_name}") if uverbs_name is not None else None
        ),
        umads=tuple(
            _char_device(dev_root, f"infiniband/{node.name}") for node in mad.get("umad", [])
        ),
        issms=tuple(
            _char_device(dev_root, f"infiniband/{node.name}") for node in mad.get("issm", [])
        ),
        rdma_cm=_char_device(dev_root, "infiniband/rdma_cm"),
    )


def hca_addresses(sysfs_root: Path, names: RdmaNames) -> list[tuple[str, PciAddress]]:
    """(name, PCI function) of every PCI-backed RDMA device, one name per function."""
    found: list[tuple[str, PciAddress]] = []
    seen: dict[PciAddress, str] = {}
    for name in names.names:
        address = hca_address(sysfs_root, name)
        if address is None:
            # Software RDMA devices (rxe, siw) have no PCI function: they
            # have no place in the PCIe topology and are not served.
            log.info("RDMA device %s is not backed by a PCI function; not served", name)
            continue
        if address in seen:
            log.warning(
                "RDMA devices %s and %s share PCI function %s; serving only %s",
                seen[address],
                name,
                address,
                seen[address],
            )
            continue
        seen[address] = name
        found.append((name, address))
    return found


def read_hcas(
    sysfs_root: Path,
    dev_root: Path,
    pci: Mapping[PciAddress, PciFunction],
) -> tuple[HcaInfo, ...]:
    """Every PCI-backed entry of class/infiniband, with ports and device nodes."""
    names = list_hcas(sysfs_root)
    return tuple(
        read_hca(sysfs_root, dev_root, pci, names, name=name, address=address)
        for name, address in hca_addresses(sysfs_root, names)
    )
