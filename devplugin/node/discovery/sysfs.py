"""PCI functions, RDMA HCAs and their character devices, read from sysfs.

Both roots are parameters: production passes /sys and /dev, tests pass trees
built under tmp_path. Paths reported to the kubelet are always the real host
paths (/dev/...), whatever root the presence check used.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from devplugin.model import (
    CharDevice,
    HcaInfo,
    IbPort,
    PciAddress,
    PciFunction,
    PciPath,
    ascii_int,
)

log = logging.getLogger(__name__)

HOST_DEV = "/dev"
_HOST_BRIDGE = re.compile(r"^pci[0-9a-f]{4,8}:[0-9a-f]{2}$")
_GPU_CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")


class DescriptorsExhausted(OSError):
    """The process (or the system) is out of file descriptors: nothing was
    learnt about the device, which is not the same as the device being bad."""


def _raise_if_exhausted(exc: OSError) -> None:
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        raise DescriptorsExhausted(exc.errno, exc.strerror) from exc


def read_text(path: str | Path) -> str | None:
    """The stripped content of a sysfs attribute, or None when unreadable.

    Optional attributes are missing on some kernels and drivers; a missing
    file must degrade one field, never the whole scan.
    """
    # os.open/os.read: a text wrapper and codec per attribute was most of a
    # health check's CPU (a check reads a hundred attributes).
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        _raise_if_exhausted(exc)
        return None
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks).decode("utf-8", "replace").strip()
    except OSError as exc:
        _raise_if_exhausted(exc)
        return None
    finally:
        os.close(fd)


def _read_hex(path: str | Path) -> int | None:
    text = read_text(path)
    if text is None:
        return None
    try:
        return int(text, 16)
    except ValueError:
        return None


# Linux supports at most 2^10 NUMA nodes; anything beyond is not a node.
MAX_NUMA_NODE = 1 << 10
_warned: set[str] = set()


def _warn_once(key: str, message: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


def _read_numa(path: Path) -> int | None:
    text = read_text(path)
    if text is None or text == "-1":
        # The kernel writes -1 when firmware gave no proximity information.
        return None
    node = ascii_int(text, MAX_NUMA_NODE)
    if node is None:
        _warn_once(str(path), "%s holds %r, not a NUMA node; treated as unknown", path, text[:40])
    return node


def pci_path_of(sysfs_root: Path, device_dir: Path, devices: str | None = None) -> PciPath | None:
    """The PCIe ancestry of a device directory, from its resolved real path.

    The real path looks like devices/pci0000:17/0000:17:01.0/0000:18:00.0;
    the last `pciDDDD:BB` component is the host bridge and every PCI address
    after it is a hop down the tree. Virtual buses may put the host bridge
    deeper (Hyper-V), so search for it rather than assume position 1.
    """
    # `devices`: the real path of the root's devices/ (a caller reading many
    # functions resolves it once).
    base = devices if devices is not None else os.path.realpath(sysfs_root / "devices")
    real = os.path.realpath(device_dir)
    if not real.startswith(base + os.sep):
        return None
    parts = tuple(part for part in real[len(base) + 1 :].split(os.sep) if part)
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
        _raise_if_exhausted(exc)
        log.warning("cannot list PCI devices under %s: %s", devices_dir, exc)
        return functions
    devices = os.path.realpath(sysfs_root / "devices")
    for entry in entries:
        try:
            address = PciAddress.parse(entry)
        except ValueError:
            continue
        device_dir = devices_dir / entry
        path = pci_path_of(sysfs_root, device_dir, devices)
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


def _char_device(dev_root: Path | str, relative: str, class_entry: str | None = None) -> CharDevice:
    """A node under /dev; `class_entry` is its sysfs class entry, whose `dev`
    attribute gives its device number (`231:192`). Without one, the number
    is the node's own when it is a character device."""
    try:
        info: os.stat_result | None = os.stat(f"{os.fspath(dev_root)}/{relative}")
    except OSError:
        info = None
    number = _device_number(f"{class_entry}/dev") if class_entry is not None else None
    if number is None and info is not None and stat.S_ISCHR(info.st_mode):
        number = (os.major(info.st_rdev), os.minor(info.st_rdev))
    return CharDevice(path=f"{HOST_DEV}/{relative}", present=info is not None, number=number)


def _device_number(path: str) -> tuple[int, int] | None:
    text = read_text(path)
    if text is None:
        return None
    major, colon, minor = text.partition(":")
    numbers = (ascii_int(major), ascii_int(minor))
    if not colon or numbers[0] is None or numbers[1] is None:
        return None
    return numbers[0], numbers[1]


def gpu_control_nodes(dev_root: Path) -> tuple[CharDevice, ...]:
    """The node-wide NVIDIA device nodes every GPU container needs."""
    return tuple(_char_device(dev_root, name) for name in _GPU_CONTROL_NODES)


@dataclass(frozen=True)
class _MadNode:
    name: str
    port: int


def _class_entries(class_dir: str | Path) -> list[str]:
    try:
        return sorted(os.listdir(class_dir), key=_natural_key)
    except OSError as exc:
        _raise_if_exhausted(exc)
        return []


def _natural_key(name: str) -> tuple[str, int]:
    match = re.match(r"^(.*?)([0-9]+)$", name)
    if match is None:
        return (name, -1)
    return (match.group(1), int(match.group(2)))


def _verbs_by_ibdev(sysfs_root: Path) -> dict[str, str]:
    # Plain string paths: these are read at every health check.
    class_dir = f"{os.fspath(sysfs_root)}/class/infiniband_verbs"
    found: dict[str, str] = {}
    for entry in _class_entries(class_dir):
        if not entry.startswith("uverbs"):
            continue
        ibdev = read_text(f"{class_dir}/{entry}/ibdev")
        if ibdev:
            found[ibdev] = entry
    return found


def _mads_by_ibdev(sysfs_root: Path) -> dict[str, dict[str, list[_MadNode]]]:
    """ibdev -> {"umad": [...], "issm": [...]}, each sorted by port."""
    class_dir = f"{os.fspath(sysfs_root)}/class/infiniband_mad"
    found: dict[str, dict[str, list[_MadNode]]] = defaultdict(lambda: defaultdict(list))
    for entry in _class_entries(class_dir):
        kind = "umad" if entry.startswith("umad") else "issm" if entry.startswith("issm") else None
        if kind is None:
            continue
        where = f"{class_dir}/{entry}"
        ibdev = read_text(f"{where}/ibdev")
        port_text = read_text(f"{where}/port")
        port = ascii_int(port_text) if port_text is not None else None
        if not ibdev or port is None:
            if port_text is not None and port is None:
                _warn_once(where, "%s: port %r is not a number; ignored", where, port_text[:40])
            continue
        found[ibdev][kind].append(_MadNode(entry, port))
    for kinds in found.values():
        for nodes in kinds.values():
            nodes.sort(key=lambda node: node.port)
    return found


def _read_ports(ib_dir: str) -> tuple[IbPort, ...]:
    ports_dir = f"{ib_dir}/ports"
    ports: list[IbPort] = []
    for entry in _class_entries(ports_dir):
        number = ascii_int(entry)
        port_dir = f"{ports_dir}/{entry}"
        if number is None:
            _warn_once(port_dir, "%s is not a port number; ignored", port_dir)
            continue
        ports.append(
            IbPort(
                number=number,
                state=read_text(f"{port_dir}/state") or "",
                phys_state=read_text(f"{port_dir}/phys_state") or "",
                link_layer=read_text(f"{port_dir}/link_layer") or "",
                rate=read_text(f"{port_dir}/rate") or "",
            )
        )
    ports.sort(key=lambda port: port.number)
    return tuple(ports)


# (HCA name, port number, state, phys_state) of every port: what the port
# watch compares between reads.
PortStates = tuple[tuple[str, int, str, str], ...]


def port_states_of(hcas: Sequence[HcaInfo]) -> PortStates:
    """The port states a scan read, in the order `read_port_files` gives."""
    return tuple(
        sorted(
            (hca.name, port.number, port.state, port.phys_state)
            for hca in hcas
            for port in hca.ports
        )
    )


# (HCA name, port number, its state file, its phys_state file): what the
# port watch reads, worked out once per scan.
PortFiles = tuple[tuple[str, int, str, str], ...]


def port_files(sysfs_root: Path, hcas: Sequence[HcaInfo]) -> PortFiles:
    """The state files of the ports the scan found, as plain paths."""
    base = sysfs_root / "class" / "infiniband"
    found = []
    for hca in hcas:
        for port in hca.ports:
            where = base / hca.name / "ports" / str(port.number)
            found.append((hca.name, port.number, str(where / "state"), str(where / "phys_state")))
    return tuple(found)


def _small_read(path: str) -> str:
    """A sysfs attribute's stripped text ("" when unreadable), without the
    path objects and codecs `read_text` goes through: read every second."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        _raise_if_exhausted(exc)
        return ""
    try:
        return os.read(fd, 256).decode("utf-8", "replace").strip()
    except OSError:
        return ""
    finally:
        os.close(fd)


def read_port_files(files: PortFiles) -> PortStates:
    """The states of these ports now, in the order `port_states_of` gives."""
    return tuple(
        sorted(
            (name, number, _small_read(state), _small_read(phys))
            for name, number, state, phys in files
        )
    )


@dataclass(frozen=True)
class RdmaNames:
    """The InfiniBand class entries and which char devices belong to each."""

    names: tuple[str, ...]
    verbs: Mapping[str, str]
    mads: Mapping[str, Mapping[str, list[_MadNode]]]


def list_hcas(sysfs_root: Path) -> RdmaNames:
    """Directory listings only: which RDMA devices exist and their node names."""
    return RdmaNames(
        names=tuple(_class_entries(f"{os.fspath(sysfs_root)}/class/infiniband")),
        verbs=_verbs_by_ibdev(sysfs_root),
        mads=_mads_by_ibdev(sysfs_root),
    )


def hca_address(sysfs_root: Path, name: str) -> PciAddress | None:
    """The PCI function behind an RDMA device; None for software devices."""
    device_link = f"{os.fspath(sysfs_root)}/class/infiniband/{name}/device"
    try:
        # The link's own target names the function (../../../0000:18:00.0)
        # without resolving every component the way realpath does.
        return PciAddress.parse(os.path.basename(os.readlink(device_link)))
    except (OSError, ValueError):
        pass
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
    # Plain string paths: these are read at every health check.
    root = os.fspath(sysfs_root)
    ib_dir = f"{root}/class/infiniband/{name}"
    verbs_class = f"{root}/class/infiniband_verbs"
    mad_class = f"{root}/class/infiniband_mad"
    uverbs_name = names.verbs.get(name)
    mad = names.mads.get(name, {})
    try:
        netdevs = tuple(sorted(os.listdir(f"{ib_dir}/device/net")))
    except OSError as exc:
        _raise_if_exhausted(exc)
        netdevs = ()
    return HcaInfo(
        name=name,
        pci_address=address,
        pci=pci.get(address),
        node_guid=read_text(f"{ib_dir}/node_guid"),
        fw_ver=read_text(f"{ib_dir}/fw_ver"),
        ports=_read_ports(ib_dir),
        netdevs=netdevs,
        uverbs=(
            _char_device(dev_root, f"infiniband/{uverbs_name}", f"{verbs_class}/{uverbs_name}")
            if uverbs_name is not None
            else None
        ),
        umads=tuple(
            _char_device(dev_root, f"infiniband/{node.name}", f"{mad_class}/{node.name}")
            for node in mad.get("umad", [])
        ),
        issms=tuple(
            _char_device(dev_root, f"infiniband/{node.name}", f"{mad_class}/{node.name}")
            for node in mad.get("issm", [])
        ),
        rdma_cm=_char_device(dev_root, "infiniband/rdma_cm", f"{root}/class/misc/rdma_cm"),
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
