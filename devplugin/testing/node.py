"""Declarative simulated nodes: a PCIe tree of GPUs and HCAs, built on disk.

A `NodeSpec` lists root complexes; each holds switches, GPUs and HCAs
(switches nest). `build_node` writes the sysfs tree, the /dev tree and the
NVML fixture, numbering buses, minors and device nodes the way a real node
would, and returns where everything went.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

from devplugin.model import (
    CharDevice,
    GpuInfo,
    HcaInfo,
    IbPort,
    PciAddress,
    PciFunction,
    PciPath,
)
from devplugin.testing.sysfs import PciNode, SysfsBuilder

NVIDIA = 0x10DE
MELLANOX = 0x15B3
BROADCOM_PLX = 0x1000
INTEL = 0x8086
CLASS_BRIDGE = 0x060400
CLASS_3D = 0x030200
CLASS_INFINIBAND = 0x020700

ACTIVE = ("4: ACTIVE", "5: LinkUp")
DOWN = ("1: DOWN", "3: Disabled")


@dataclass
class Port:
    state: str = ACTIVE[0]
    phys_state: str = ACTIVE[1]
    link_layer: str = "InfiniBand"
    rate: str = "400 Gb/sec (4X NDR)"


@dataclass
class Gpu:
    name: str = "NVIDIA H100 80GB HBM3"
    memory_mib: int = 81559
    # The CUDA compute capability NVML reports (None: it answers Not Supported).
    compute: tuple[int, int] | None = None
    # MIG: None, not capable; (), capable with MIG disabled; else MIG-enabled
    # and cut into devices of these profiles (keys of MIG_PROFILES).
    mig: tuple[str, ...] | None = None
    # Omitted sysfs attributes (to simulate older kernels / odd platforms).
    omit: tuple[str, ...] = ()
    dev_node: bool = True


@dataclass
class Hca:
    ports: list[Port] = field(default_factory=lambda: [Port()])
    netdevs: int = 1  # how many netdevs; 0 for an HCA without one
    fw_ver: str = "28.39.1002"
    omit: tuple[str, ...] = ()
    # Device nodes to leave out of /dev ("uverbs", "umad", "issm", "rdma_cm").
    missing_nodes: tuple[str, ...] = ()


@dataclass
class Switch:
    children: list[Child] = field(default_factory=list)


Child = Union[Switch, Gpu, Hca]  # noqa: UP007 - forward reference in a runtime alias


@dataclass
class RootComplex:
    numa_node: int | None
    local_cpulist: str
    children: list[Child] = field(default_factory=list)


@dataclass
class NodeSpec:
    roots: list[RootComplex]
    # NVLinks between every pair of GPUs (0: none), then per-pair overrides.
    nvlink_all_to_all: int = 0
    nvlink_pairs: dict[tuple[int, int], int] = field(default_factory=dict)
    driver_version: str = "550.54.15"
    cuda_driver_version: int = 12040


@dataclass(frozen=True)
class BuiltGpu:
    index: int
    uuid: str
    address: PciAddress
    minor: int
    directory: Path


@dataclass(frozen=True)
class BuiltHca:
    name: str
    address: PciAddress
    directory: Path
    uverbs: int
    umads: tuple[int, ...]
    issms: tuple[int, ...]

    @property
    def device_id(self) -> str:
        return str(self.address)


@dataclass(frozen=True)
class BuiltNode:
    sysfs_root: Path
    dev_root: Path
    fixture: Path
    gpus: tuple[BuiltGpu, ...]
    hcas: tuple[BuiltHca, ...]
    bridges: dict[PciAddress, Path]
    # /proc/driver/nvidia/capabilities as the driver writes it for MIG.
    caps_root: Path | None = None

    def gpu_uuid(self, index: int) -> str:
        return self.gpus[index].uuid

    def hca(self, name: str) -> BuiltHca:
        for hca in self.hcas:
            if hca.name == name:
                return hca
        raise KeyError(name)

    def hca_by_id(self, device_id: str) -> BuiltHca:
        for hca in self.hcas:
            if hca.device_id == device_id:
                return hca
        raise KeyError(device_id)

    def settings(self, base: Path) -> dict[str, object]:
        """Dotted config overrides that point a daemon at this node, with its
        kubelet sockets (dp/, pr/kubelet.sock) and checkpoint under `base`."""
        return {
            "paths.sysfs_root": str(self.sysfs_root),
            "paths.dev_root": str(self.dev_root),
            **({"paths.nvidia_caps_root": str(self.caps_root)} if self.caps_root else {}),
            "paths.device_plugin_dir": str(base / "dp"),
            "paths.pod_resources_socket": str(base / "pr" / "kubelet.sock"),
            "nvml.fixture": str(self.fixture),
            "lifecycle.checkpoint_file": str(base / "checkpoint.json"),
        }

    def run_config(self, sock_dir: Path, checkpoint: Path) -> dict[str, object]:
        """The v1 config file content for `devplugin run` on this node: its
        sysfs, dev and NVML fixture, the kubelet sockets under `sock_dir`
        (dp/ and pr/kubelet.sock, as the kubelet simulator serves them), and
        metrics on a free port. Callers add the sections they need."""
        return {
            "version": "v1",
            "paths": {
                "sysfs_root": str(self.sysfs_root),
                "dev_root": str(self.dev_root),
                "device_plugin_dir": str(sock_dir / "dp"),
                "pod_resources_socket": str(sock_dir / "pr" / "kubelet.sock"),
                **({"nvidia_caps_root": str(self.caps_root)} if self.caps_root else {}),
            },
            "nvml": {"fixture": str(self.fixture)},
            "lifecycle": {"checkpoint_file": str(checkpoint)},
            "metrics": {"addresses": ["127.0.0.1:0"]},
        }


class _Builder:
    def __init__(self, spec: NodeSpec, base: Path) -> None:
        self.spec = spec
        self.base = base
        self.sysfs = SysfsBuilder(base / "sys", base / "dev")
        self.gpus: list[BuiltGpu] = []
        self.hcas: list[BuiltHca] = []
        self.bridges: dict[PciAddress, Path] = {}
        self.fixture_gpus: list[dict[str, object]] = []
        self.next_bus = 0
        self.domain = 0
        self.next_umad = 0
        self.next_issm = 0

    def bus(self) -> int:
        self.next_bus += 1
        if self.next_bus > 0xFF:
            raise ValueError("simulated node needs more than 256 PCI buses")
        return self.next_bus

    def build(self) -> BuiltNode:
        for root_index, root in enumerate(self.spec.roots):
            self.domain, self.next_bus = root_bus_of(root_index, self.domain, self.next_bus)
            root_bus = self.next_bus
            bridge = self.sysfs.host_bridge(
                self.domain, root_bus, numa_node=root.numa_node, local_cpulist=root.local_cpulist
            )
            for port_index, child in enumerate(root.children):
                root_port = self.sysfs.function(
                    bridge,
                    PciAddress(self.domain, root_bus, 1 + port_index, 0),
                    vendor=INTEL,
                    device=0x352A,
                    pci_class=CLASS_BRIDGE,
                    driver="pcieport",
                )
                self.bridges[PciAddress(self.domain, root_bus, 1 + port_index, 0)] = (
                    root_port.directory
                )
                self.child(root_port, child)
        # nvidiactl's number is fixed; nvidia-uvm's major is the kernel's
        # choice (510 here).
        self.sysfs.dev_node("nvidiactl", (195, 255))
        self.sysfs.dev_node("nvidia-uvm", (510, 0))
        self.sysfs.dev_node("nvidia-uvm-tools", (510, 1))
        if self.hcas:
            self.sysfs.rdma_cm()
        fixture = self.base / "nvml.json"
        fixture.write_text(json.dumps(self.fixture(), indent=2) + "\n", encoding="utf-8")
        caps_root = self.base / "nvidia-capabilities"
        self.mig_caps(caps_root)
        return BuiltNode(
            caps_root=caps_root,
            sysfs_root=self.sysfs.sysfs,
            dev_root=self.sysfs.dev,
            fixture=fixture,
            gpus=tuple(self.gpus),
            hcas=tuple(self.hcas),
            bridges=self.bridges,
        )

    def mig_caps(self, root: Path) -> None:
        """The driver's capability files and nvidia-caps nodes for every MIG
        device: gpu<minor>/mig/gi<gi>/access and .../ci<ci>/access, each
        naming the minor of its /dev/nvidia-caps node."""
        root.mkdir(parents=True, exist_ok=True)
        for gpu in self.fixture_gpus:
            mig = gpu.get("mig")
            if not isinstance(mig, dict):
                continue
            minor = gpu["minor_number"]
            assert isinstance(minor, int)
            for device in mig["devices"]:
                instance = root / f"gpu{minor}" / "mig" / f"gi{device['gpu_instance']}"
                compute = instance / f"ci{device['compute_instance']}"
                compute.mkdir(parents=True, exist_ok=True)
                first = CAPS_BASE + 100 * minor + 2 * device["gpu_instance"]
                for path, number in ((instance, first), (compute, first + 1)):
                    (path / "access").write_text(
                        f"DeviceFileMinor: {number}\nDeviceFileMode: 292\nDeviceFileModify: 1\n"
                    )
                    self.sysfs.dev_node(f"nvidia-caps/nvidia-cap{number}", (CAPS_MAJOR, number))

    def child(self, parent: PciNode, child: Child) -> None:
        address = PciAddress(self.domain, self.bus(), 0, 0)
        if isinstance(child, Switch):
            upstream = self.sysfs.function(
                parent,
                address,
                vendor=BROADCOM_PLX,
                device=0xC030,
                pci_class=CLASS_BRIDGE,
                driver="pcieport",
            )
            self.bridges[address] = upstream.directory
            down_bus = self.bus()
            for index, grandchild in enumerate(child.children):
                down = self.sysfs.function(
                    upstream,
                    PciAddress(self.domain, down_bus, index, 0),
                    vendor=BROADCOM_PLX,
                    device=0xC030,
                    pci_class=CLASS_BRIDGE,
                    driver="pcieport",
                )
                self.bridges[PciAddress(self.domain, down_bus, index, 0)] = down.directory
                self.child(down, grandchild)
        elif isinstance(child, Gpu):
            self.gpu(parent, address, child)
        else:
            self.hca(parent, address, child)

    def gpu(self, parent: PciNode, address: PciAddress, spec: Gpu) -> None:
        index = len(self.gpus)
        node = self.sysfs.function(
            parent,
            address,
            vendor=NVIDIA,
            device=0x2330,
            pci_class=CLASS_3D,
            driver="nvidia",
            omit=spec.omit,
        )
        uuid = gpu_uuid(index, address)
        if spec.dev_node:
            self.sysfs.dev_node(f"nvidia{index}", (195, index))
        self.gpus.append(BuiltGpu(index, uuid, address, index, node.directory))
        self.fixture_gpus.append(
            {
                "uuid": uuid,
                "name": spec.name,
                "pci_bus_id": f"{address.domain:08X}:{address.bus:02X}:"
                f"{address.device:02X}.{address.function:X}",
                "minor_number": index,
                "memory_total_mib": spec.memory_mib,
            }
        )
        if spec.compute is not None:
            self.fixture_gpus[-1]["cuda_compute_capability"] = list(spec.compute)
        if spec.mig is not None:
            self.fixture_gpus[-1]["mig"] = mig_fixture(uuid, spec.mig)

    def hca(self, parent: PciNode, address: PciAddress, spec: Hca) -> None:
        index = len(self.hcas)
        name = f"mlx5_{index}"
        node = self.sysfs.function(
            parent,
            address,
            vendor=MELLANOX,
            device=0x1021,
            pci_class=CLASS_INFINIBAND,
            driver="mlx5_core",
            omit=spec.omit,
        )
        netdevs = tuple(f"ibp{address.bus}s0" + (f"f{n}" if n else "") for n in range(spec.netdevs))
        self.sysfs.ib_device(
            node,
            name,
            node_guid=f"b83f:d203:00{index:02x}:{address.bus:04x}",
            fw_ver=spec.fw_ver,
            ports=[(p.state, p.phys_state, p.link_layer, p.rate) for p in spec.ports],
            netdevs=netdevs,
        )
        self.sysfs.uverbs(node, index, name, with_dev_node="uverbs" not in spec.missing_nodes)
        umads: list[int] = []
        issms: list[int] = []
        for port in range(1, len(spec.ports) + 1):
            self.sysfs.mad(
                node,
                "umad",
                self.next_umad,
                name,
                port,
                with_dev_node="umad" not in spec.missing_nodes,
            )
            self.sysfs.mad(
                node,
                "issm",
                self.next_issm,
                name,
                port,
                with_dev_node="issm" not in spec.missing_nodes,
            )
            umads.append(self.next_umad)
            issms.append(self.next_issm)
            self.next_umad += 1
            self.next_issm += 1
        self.hcas.append(BuiltHca(name, address, node.directory, index, tuple(umads), tuple(issms)))

    def fixture(self) -> dict[str, object]:
        count = len(self.fixture_gpus)
        for i, gpu in enumerate(self.fixture_gpus):
            peers: dict[str, int] = {}
            for j in range(count):
                if i == j:
                    continue
                links = self.spec.nvlink_pairs.get(
                    (min(i, j), max(i, j)), self.spec.nvlink_all_to_all
                )
                if links:
                    peers[str(j)] = links
            gpu["nvlink_peers"] = peers
        return {
            "driver_version": self.spec.driver_version,
            "cuda_driver_version": self.spec.cuda_driver_version,
            "gpus": self.fixture_gpus,
        }


# nvidia-caps: its major is the kernel's choice; minors from 3 up (1 and 2
# are the driver's config and monitor capabilities).
CAPS_MAJOR, CAPS_BASE = 237, 3
# An H100 80GB's MIG profiles: (GPU slices, compute slices, MiB, SMs).
MIG_PROFILES: dict[str, tuple[int, int, int, int]] = {
    "1g.10gb": (1, 1, 9856, 16),
    "1g.20gb": (1, 1, 19968, 26),
    "2g.20gb": (2, 2, 19968, 32),
    "3g.40gb": (3, 3, 40192, 60),
    "4g.40gb": (4, 4, 40192, 64),
    "7g.80gb": (7, 7, 81408, 132),
}


def mig_uuid(parent: str, index: int) -> str:
    return f"MIG-{parent.removeprefix('GPU-')[:28]}-{index:04d}"


def mig_fixture(parent: str, profiles: tuple[str, ...]) -> dict[str, object]:
    """A fake NVML `mig` entry: MIG enabled with one device per profile
    (GPU instance i+1, compute instance 0), or disabled when none."""
    devices = []
    for i, profile in enumerate(profiles):
        gpu_slices, compute_slices, memory, sms = MIG_PROFILES[profile]
        devices.append({
            "uuid": mig_uuid(parent, i), "gpu_instance": i + 1, "compute_instance": 0,
            "gpu_slices": gpu_slices, "compute_slices": compute_slices, "memory_mib": memory,
            "multiprocessors": sms,
        })  # fmt: skip
    return {"enabled": bool(profiles), "devices": devices}


def build_node(spec: NodeSpec, base: Path) -> BuiltNode:
    """Write `spec` under `base` (sys/, dev/, nvml.json)."""
    base.mkdir(parents=True, exist_ok=True)
    node = _Builder(spec, base).build()
    write_numa_nodes(node.sysfs_root, _numa_cpus(spec))
    if any(missing == "rdma_cm" for root in spec.roots for missing in _missing(root.children)):
        (node.dev_root / "infiniband" / "rdma_cm").unlink(missing_ok=True)
    return node


def _numa_cpus(spec: NodeSpec) -> dict[int, str]:
    """NUMA node -> the CPUs its root complexes say are local (cpulist form)."""
    found: dict[int, list[str]] = {}
    for root in spec.roots:
        if root.numa_node is not None and root.local_cpulist not in found.get(root.numa_node, []):
            found.setdefault(root.numa_node, []).append(root.local_cpulist)
    return {node: ",".join(parts) for node, parts in found.items()}


def write_numa_nodes(sysfs_root: Path, cpus: dict[int, str]) -> None:
    """devices/system/node as the kernel writes it: a nodeN folder per NUMA
    node with its cpulist (what the kubelet's cadvisor and the daemon read),
    replacing any there."""
    base = sysfs_root / "devices" / "system" / "node"
    if base.exists():
        for old in base.glob("node*"):
            for entry in old.iterdir():
                entry.unlink()
            old.rmdir()
    base.mkdir(parents=True, exist_ok=True)
    for node, cpulist in sorted(cpus.items()):
        folder = base / f"node{node}"
        folder.mkdir()
        (folder / "cpulist").write_text(cpulist + "\n")


def _missing(children: list[Child]) -> list[str]:
    found: list[str] = []
    for child in children:
        if isinstance(child, Switch):
            found.extend(_missing(child.children))
        elif isinstance(child, Hca):
            found.extend(child.missing_nodes)
    return found


def hgx_node(sockets: int = 2, pairs_per_socket: int = 4, nvlinks: int = 18) -> NodeSpec:
    """An HGX-H100-like node: one GPU and one HCA behind each PCIe switch,
    every GPU joined to every other through NVSwitch."""
    roots = []
    for socket in range(sockets):
        first_cpu = socket * 56
        cpulist = f"{first_cpu}-{first_cpu + 55}"
        for _ in range(pairs_per_socket):
            roots.append(
                RootComplex(
                    numa_node=socket, local_cpulist=cpulist, children=[Switch([Gpu(), Hca()])]
                )
            )
    return NodeSpec(roots=roots, nvlink_all_to_all=nvlinks)


# Host bridges per PCI domain: buses 0x10, 0x20, .. 0xF0 start them.
ROOTS_PER_DOMAIN = 15


def root_bus_of(root_index: int, domain: int, next_bus: int) -> tuple[int, int]:
    """(domain, bus) of the `root_index`-th host bridge, given the domain and
    last bus used so far. Room is left below each host bridge, as firmware
    does; past 15 host bridges the next PCI domain starts (large servers have
    several)."""
    wanted = root_index // ROOTS_PER_DOMAIN
    if wanted != domain:
        next_bus = 0
    return wanted, max(next_bus + 1, 0x10 * (root_index % ROOTS_PER_DOMAIN + 1))


def gpu_uuid(index: int, address: PciAddress) -> str:
    return f"GPU-{index:08x}-5a1e-4c0d-9e00-{address.bus:012x}"


def devices_from_spec(spec: NodeSpec) -> tuple[tuple[GpuInfo, ...], tuple[HcaInfo, ...]]:
    """The GPUs and HCAs discovery would find on `build_node(spec)`, built in
    memory (no files): for large randomized corpora and benchmarks."""
    gpus: list[GpuInfo] = []
    hcas: list[HcaInfo] = []
    next_bus = 0
    domain = 0

    def bus() -> int:
        nonlocal next_bus
        next_bus += 1
        return next_bus

    def function(
        address: PciAddress, root: str, chain: tuple[PciAddress, ...], numa: int | None, cpus: str
    ) -> PciFunction:
        return PciFunction(
            address, PciPath(root, (*chain, address)), numa_node=numa, local_cpulist=cpus
        )

    def walk(
        child: Child, root: str, chain: tuple[PciAddress, ...], numa: int | None, cpus: str
    ) -> None:
        address = PciAddress(domain, bus(), 0, 0)
        if isinstance(child, Switch):
            down_bus = bus()
            for index, grandchild in enumerate(child.children):
                walk(
                    grandchild,
                    root,
                    (*chain, address, PciAddress(domain, down_bus, index, 0)),
                    numa,
                    cpus,
                )
        elif isinstance(child, Gpu):
            index = len(gpus)
            gpus.append(
                GpuInfo(
                    index,
                    gpu_uuid(index, address),
                    child.name,
                    address,
                    index,
                    child.memory_mib,
                    (),
                    function(address, root, chain, numa, cpus),
                )
            )
        else:
            index = len(hcas)
            node = CharDevice(f"/dev/infiniband/uverbs{index}", True)
            ports = tuple(
                IbPort(n, p.state, p.phys_state, p.link_layer, p.rate)
                for n, p in enumerate(child.ports, start=1)
            )
            hcas.append(
                HcaInfo(
                    f"mlx5_{index}",
                    address,
                    function(address, root, chain, numa, cpus),
                    None,
                    child.fw_ver,
                    ports,
                    (),
                    node,
                    (),
                    (),
                    CharDevice("/dev/infiniband/rdma_cm", True),
                )
            )

    for root_index, root in enumerate(spec.roots):
        domain, next_bus = root_bus_of(root_index, domain, next_bus)
        root_bus = next_bus
        name = f"pci{domain:04x}:{root_bus:02x}"
        for port_index, child in enumerate(root.children):
            port = PciAddress(domain, root_bus, 1 + port_index, 0)
            walk(child, name, (port,), root.numa_node, root.local_cpulist)
    count = len(gpus)
    linked = []
    for i, gpu in enumerate(gpus):
        peers = []
        for j in range(count):
            if i != j:
                links = spec.nvlink_pairs.get((min(i, j), max(i, j)), spec.nvlink_all_to_all)
                if links:
                    peers.append((j, links))
        linked.append(dataclasses.replace(gpu, nvlink_peers=tuple(peers)))
    return tuple(linked), tuple(hcas)


@dataclass
class Unplugged:
    """What `unplug_hca` took away, so `replug` can put it back."""

    stash: Path
    directory: Path
    links: list[tuple[Path, str]]
    dev_nodes: list[Path]


def unplug_hca(node: BuiltNode, name: str, stash: Path) -> Unplugged:
    """Remove an HCA from the sysfs and /dev trees as a hot-unplug would:
    its PCI function directory, every class and bus link to it, its nodes."""
    hca = node.hca(name)
    directory = hca.directory
    links: list[tuple[Path, str]] = []
    for link in node.sysfs_root.rglob("*"):
        if link.is_symlink() and "devices" not in link.relative_to(node.sysfs_root).parts[:1]:
            target = os.path.realpath(link)
            if target == str(directory) or target.startswith(str(directory) + os.sep):
                links.append((link, os.readlink(link)))
    for link, _ in links:
        link.unlink()
    nodes = [node.dev_root / "infiniband" / f"uverbs{hca.uverbs}"]
    nodes += [node.dev_root / "infiniband" / f"umad{i}" for i in hca.umads]
    nodes += [node.dev_root / "infiniband" / f"issm{i}" for i in hca.issms]
    for path in nodes:
        path.unlink(missing_ok=True)
    stash.mkdir(parents=True, exist_ok=True)
    shutil.move(str(directory), str(stash / directory.name))
    return Unplugged(stash, directory, links, nodes)


def replug(unplugged: Unplugged) -> None:
    """Put an unplugged HCA back (a hot-add of the same card)."""
    shutil.move(str(unplugged.stash / unplugged.directory.name), str(unplugged.directory))
    for link, target in unplugged.links:
        os.symlink(target, link)
    for path in unplugged.dev_nodes:
        path.touch()
