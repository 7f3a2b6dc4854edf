"""Writes real sysfs and /dev trees (directories, files, relative symlinks).

Used by the demo and the tests to create nodes that discovery reads exactly
as it reads /sys: links are relative, as the kernel's are, so a tree can be
moved or inspected with ordinary tools.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from devplugin.model import PciAddress


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="utf-8")


def _link(link: Path, target: Path) -> None:
    """Create `link` pointing at `target` with a relative path."""
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(os.path.relpath(target, link.parent), link)


@dataclass(frozen=True)
class PciNode:
    """A directory under devices/ that PCI functions can be created below."""

    directory: Path
    address: PciAddress | None  # None for the host bridge itself
    numa_node: int | None
    local_cpulist: str


class SysfsBuilder:
    """Creates host bridges, PCI functions, RDMA devices and device nodes."""

    def __init__(self, sysfs_root: Path, dev_root: Path) -> None:
        self.sysfs = sysfs_root
        self.dev = dev_root
        (self.sysfs / "devices").mkdir(parents=True, exist_ok=True)
        (self.sysfs / "bus" / "pci" / "devices").mkdir(parents=True, exist_ok=True)
        self.dev.mkdir(parents=True, exist_ok=True)
        verbs = self.sysfs / "class" / "infiniband_verbs"
        verbs.mkdir(parents=True, exist_ok=True)
        # Present on real systems next to the uverbsN entries; discovery must skip it.
        _write(verbs / "abi_version", "6")

    def host_bridge(
        self, domain: int, bus: int, *, numa_node: int | None, local_cpulist: str
    ) -> PciNode:
        directory = self.sysfs / "devices" / f"pci{domain:04x}:{bus:02x}"
        directory.mkdir(parents=True, exist_ok=True)
        return PciNode(directory, None, numa_node, local_cpulist)

    def function(
        self,
        parent: PciNode,
        address: PciAddress,
        *,
        vendor: int,
        device: int,
        pci_class: int,
        driver: str | None = None,
        omit: tuple[str, ...] = (),
    ) -> PciNode:
        directory = parent.directory / str(address)
        directory.mkdir(parents=True, exist_ok=True)
        attributes = {
            "vendor": f"0x{vendor:04x}",
            "device": f"0x{device:04x}",
            "class": f"0x{pci_class:06x}",
            "numa_node": str(parent.numa_node if parent.numa_node is not None else -1),
            "local_cpulist": parent.local_cpulist,
        }
        for name, value in attributes.items():
            if name not in omit:
                _write(directory / name, value)
        _link(self.sysfs / "bus" / "pci" / "devices" / str(address), directory)
        if driver is not None:
            driver_dir = self.sysfs / "bus" / "pci" / "drivers" / driver
            driver_dir.mkdir(parents=True, exist_ok=True)
            _link(directory / "driver", driver_dir)
        return PciNode(directory, address, parent.numa_node, parent.local_cpulist)

    def rdma_cm(self) -> None:
        """The rdma_cm misc device (its number is the kernel's choice: 10:58 here)."""
        _write(self.sysfs / "devices" / "virtual" / "misc" / "rdma_cm" / "dev", "10:58")
        _link(
            self.sysfs / "class" / "misc" / "rdma_cm",
            self.sysfs / "devices" / "virtual" / "misc" / "rdma_cm",
        )
        self.dev_node("infiniband/rdma_cm", (10, 58))

    def dev_node(self, relative: str, number: tuple[int, int] | None = None) -> Path:
        """A node of the simulated /dev: a plain file, whose text says which
        character device it stands for (`mark_device`), for the tests' model
        of a runtime's host lookup. The daemon never reads it."""
        path = self.dev / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        if number is not None:
            mark_device(path, "c", *number)
        return path

    def ib_device(
        self,
        function: PciNode,
        name: str,
        *,
        node_guid: str,
        fw_ver: str,
        ports: list[tuple[str, str, str, str]],
        netdevs: tuple[str, ...],
    ) -> Path:
        """An entry of class/infiniband with ports as (state, phys_state, link_layer, rate)."""
        ib_dir = function.directory / "infiniband" / name
        ib_dir.mkdir(parents=True, exist_ok=True)
        # As the kernel writes it: up past the function and down to it by name.
        (ib_dir / "device").unlink(missing_ok=True)
        os.symlink(f"../../../{function.directory.name}", ib_dir / "device")
        _write(ib_dir / "node_guid", node_guid)
        _write(ib_dir / "fw_ver", fw_ver)
        _write(ib_dir / "node_type", "1: CA")
        for number, (state, phys_state, link_layer, rate) in enumerate(ports, start=1):
            port_dir = ib_dir / "ports" / str(number)
            _write(port_dir / "state", state)
            _write(port_dir / "phys_state", phys_state)
            _write(port_dir / "link_layer", link_layer)
            _write(port_dir / "rate", rate)
        _link(self.sysfs / "class" / "infiniband" / name, ib_dir)
        for netdev in netdevs:
            net_dir = function.directory / "net" / netdev
            _write(net_dir / "address", "00:00:00:00:00:00")
            _link(self.sysfs / "class" / "net" / netdev, net_dir)
        return ib_dir

    def uverbs(
        self, function: PciNode, index: int, ibdev: str, *, with_dev_node: bool = True
    ) -> None:
        entry = function.directory / "infiniband_verbs" / f"uverbs{index}"
        _write(entry / "ibdev", ibdev)
        _write(entry / "dev", f"231:{192 + index}")
        _link(self.sysfs / "class" / "infiniband_verbs" / f"uverbs{index}", entry)
        if with_dev_node:
            self.dev_node(f"infiniband/uverbs{index}", (231, 192 + index))

    def mad(
        self,
        function: PciNode,
        kind: str,
        index: int,
        ibdev: str,
        port: int,
        *,
        with_dev_node: bool = True,
    ) -> None:
        """A umadN or issmN entry of class/infiniband_mad for one port."""
        entry = function.directory / "infiniband_mad" / f"{kind}{index}"
        _write(entry / "ibdev", ibdev)
        _write(entry / "port", str(port))
        minor = index if kind == "umad" else 64 + index
        _write(entry / "dev", f"231:{minor}")
        _link(self.sysfs / "class" / "infiniband_mad" / f"{kind}{index}", entry)
        if with_dev_node:
            self.dev_node(f"infiniband/{kind}{index}", (231, minor))


def mark_device(path: Path, kind: str, major: int, minor: int) -> None:
    """Make a plain file of a simulated /dev tree stand for a device node."""
    path.write_text(f"{kind} {major}:{minor}\n", encoding="ascii")
