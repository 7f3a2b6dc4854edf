"""Plain data shared by every layer: PCI addresses and paths, GPUs, HCAs.

Nothing here performs I/O or imports another devplugin module, so every other
module can depend on it without creating cycles.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

_BDF = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{2}):"
    r"(?P<device>[0-9a-fA-F]{2})\.(?P<function>[0-7])$"
)


class DeviceKind(enum.Enum):
    """The kinds of device devplugin serves; what each one is and does is
    its wing in devplugin.kinds."""

    GPU = "gpu"
    HCA = "hca"

    # Members are singletons compared by identity: hash them by identity in
    # C too. Enum's own __hash__ is Python code, and (kind, id) keys are
    # hashed on every preference (about 120 times per call on 64 GPUs).
    __hash__ = object.__hash__


class Refused(Exception):
    """A request the daemon cannot answer; `reason` is shown to the kubelet."""

    def __init__(self, reason: str, *, invalid_argument: bool, retry: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        # True: the request itself is malformed (INVALID_ARGUMENT);
        # False: it is well formed but cannot be met now (FAILED_PRECONDITION).
        self.invalid_argument = invalid_argument
        # It may be met if asked again a little later (UNAVAILABLE): a
        # cleanup of its devices is still running.
        self.retry = retry


class Health(enum.Enum):
    """The two health values the kubelet understands (wire strings)."""

    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"


@dataclass(frozen=True, order=True)
class PciAddress:
    """A PCI function address (domain:bus:device.function)."""

    domain: int
    bus: int
    device: int
    function: int

    @classmethod
    def parse(cls, text: str) -> PciAddress:
        """Accept the sysfs form (0000:1a:00.0) and NVML's (00000000:1A:00.0).

        NVML pads the domain to eight digits and upper-cases hex; sysfs uses
        four lower-case digits. Both name the same function, so both parse to
        the same value and print in the sysfs form.
        """
        match = _BDF.match(text.strip())
        if match is None:
            raise ValueError(f"not a PCI address: {text!r}")
        domain = int(match.group("domain") or "0", 16)
        if domain > 0xFFFF:
            raise ValueError(f"PCI domain out of range in {text!r}")
        return cls(
            domain=domain,
            bus=int(match.group("bus"), 16),
            device=int(match.group("device"), 16),
            function=int(match.group("function"), 16),
        )

    def __str__(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:{self.device:02x}.{self.function:x}"


@dataclass(frozen=True)
class PciPath:
    """Where a function sits in the PCIe tree.

    `root` names the host bridge (the `pciDDDD:BB` directory under
    /sys/devices); `chain` lists every function from the root port down to
    the function itself, so `chain[-1]` is the function and everything before
    it is a bridge (root port, switch upstream and downstream ports).
    """

    root: str
    chain: tuple[PciAddress, ...]

    @property
    def bridges(self) -> tuple[PciAddress, ...]:
        return self.chain[:-1]


@dataclass(frozen=True)
class PciFunction:
    """One PCI function as sysfs describes it. Optional files may be absent."""

    address: PciAddress
    path: PciPath
    vendor: int | None = None
    device: int | None = None
    pci_class: int | None = None
    numa_node: int | None = None
    local_cpulist: str | None = None
    driver: str | None = None


@dataclass(frozen=True)
class CharDevice:
    """A character device node as the container will see it.

    `path` is the real host path (what the kubelet passes to the runtime);
    `present` says whether it was found under the configured /dev root.
    """

    path: str
    present: bool
    # (major, minor) as sysfs gives them; None when it does not say.
    number: tuple[int, int] | None = None


@dataclass(frozen=True)
class CdiCatalog:
    """Which CDI devices the node's spec directories declare, per kind, as a
    runtime would resolve them (a file it would refuse declares nothing)."""

    dirs: tuple[str, ...] = ()
    # kind -> device names
    devices: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # spec files a runtime would refuse: path -> why
    refused: Mapping[str, str] = field(default_factory=dict)

    def has(self, kind: str, name: str) -> bool:
        return name in self.devices.get(kind, ())


@dataclass(frozen=True)
class MigDevice:
    """One MIG device (a GPU instance with a compute instance) as NVML lists it."""

    uuid: str
    # Its MIG device index on the parent (nvmlDeviceGetMigDeviceHandleByIndex).
    index: int
    gpu_instance: int
    compute_instance: int
    # NVIDIA's profile name, e.g. "1g.10gb" or "1c.3g.40gb".
    profile: str
    memory_mib: int
    multiprocessors: int


@dataclass(frozen=True)
class MigSlice:
    """Set on a served GPU entry that is a MIG device of a physical GPU."""

    parent_uuid: str
    parent_index: int
    device: MigDevice
    # The whole GPU's memory (the entry's own is the MIG device's).
    parent_memory_mib: int = 0
    # Its nvidia-caps minors (GPU instance, compute instance); () unread.
    caps: tuple[int, ...] = ()


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML reports it, joined to its PCI function when known."""

    index: int
    uuid: str
    name: str
    pci_address: PciAddress
    minor_number: int
    memory_total_mib: int
    # (peer GPU index, number of NVLinks to it), sorted by peer index.
    nvlink_peers: tuple[tuple[int, int], ...] = ()
    pci: PciFunction | None = None
    # Set when NVML can no longer reach a GPU it reported before (lost, or
    # its handle fails): the GPU stays listed, Unhealthy, with this reason.
    error: str | None = None
    # CUDA compute capability (major, minor); None where NVML cannot tell.
    compute_capability: tuple[int, int] | None = None
    # MIG: whether the GPU can be cut, whether it is, and its MIG devices.
    mig_capable: bool = False
    mig_enabled: bool = False
    mig_devices: tuple[MigDevice, ...] = ()
    # Set when this entry is one MIG device served in its parent's place.
    slice: MigSlice | None = None

    @property
    def physical_uuid(self) -> str:
        """The UUID of the GPU itself (a slice's parent): what NVML events,
        handles for faults and the device node belong to."""
        return self.slice.parent_uuid if self.slice is not None else self.uuid

    @property
    def numa_node(self) -> int | None:
        return self.pci.numa_node if self.pci is not None else None

    def nvlinks_to(self, peer_index: int) -> int:
        for peer, count in self.nvlink_peers:
            if peer == peer_index:
                return count
        return 0


@dataclass(frozen=True)
class IbPort:
    """One port of an RDMA HCA (the raw sysfs strings are kept for display)."""

    number: int
    state: str
    phys_state: str
    link_layer: str
    rate: str

    @property
    def state_code(self) -> int | None:
        return _leading_int(self.state)

    @property
    def phys_state_code(self) -> int | None:
        return _leading_int(self.phys_state)


@dataclass(frozen=True)
class HcaInfo:
    """One RDMA HCA: its InfiniBand class entry, PCI function and device nodes."""

    name: str
    pci_address: PciAddress
    pci: PciFunction | None
    node_guid: str | None
    fw_ver: str | None
    ports: tuple[IbPort, ...]
    netdevs: tuple[str, ...]
    uverbs: CharDevice | None
    umads: tuple[CharDevice, ...]
    issms: tuple[CharDevice, ...]
    rdma_cm: CharDevice
    # Set when the HCA's attributes could not be read this check (a read that
    # did not return in time): the HCA stays listed, Unhealthy, with this reason.
    error: str | None = None

    @property
    def device_id(self) -> str:
        """The id served to the kubelet: the PCI address of the HCA's function.

        It survives reboots and driver reloads (the kernel may renumber
        mlx5_N names and uverbsN nodes, but not slots), and it is the key the
        topology is built on.
        """
        return str(self.pci_address)

    @property
    def numa_node(self) -> int | None:
        return self.pci.numa_node if self.pci is not None else None

    @property
    def own_devices(self) -> tuple[CharDevice, ...]:
        """The nodes this HCA cannot be used without: its uverbs, umad and
        issm nodes."""
        nodes: list[CharDevice] = []
        if self.uverbs is not None:
            nodes.append(self.uverbs)
        nodes.extend(self.umads)
        nodes.extend(self.issms)
        return tuple(nodes)

    @property
    def char_devices(self) -> tuple[CharDevice, ...]:
        """Every node this HCA names, rdma_cm last. rdma_cm (the RDMA CM's
        node, there once rdma_ucm is loaded) is optional: verbs work without
        it, only connection setup through the CM does not."""
        return (*self.own_devices, self.rdma_cm)


@dataclass(frozen=True)
class NvmlStatus:
    """What NVML said about the driver; `error` is set when it is unusable."""

    driver_version: str | None = None
    cuda_driver_version: int | None = None
    error: str | None = None
    # Counts successful nvmlInit calls of the source: a new value means NVML
    # (re)started, so anything registered with the old session (event sets)
    # must be registered again.
    session: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class Inventory:
    """One whole, immutable snapshot of what discovery found on the node."""

    gpus: tuple[GpuInfo, ...] = ()
    hcas: tuple[HcaInfo, ...] = ()
    # /dev/nvidiactl, /dev/nvidia-uvm, /dev/nvidia-uvm-tools with presence.
    gpu_control_nodes: tuple[CharDevice, ...] = ()
    nvml: NvmlStatus = field(default_factory=NvmlStatus)
    pci: Mapping[PciAddress, PciFunction] = field(default_factory=dict)
    # The CDI spec directories, when a CDI strategy needs them read.
    cdi: CdiCatalog | None = None


@dataclass(frozen=True)
class PluginDevice:
    """One entry of a ListAndWatch response."""

    id: str
    health: Health
    numa_node: int | None = None
    # Why the device is unhealthy; empty when healthy. Logged, not sent.
    reason: str = ""


def _leading_int(text: str) -> int | None:
    head = text.split(":", 1)[0].strip()
    return ascii_int(head)


def ascii_int(text: str, limit: int = 1 << 31) -> int | None:
    """A plain decimal number below `limit`, or None. `int()` alone also takes
    other scripts' digits, and `isdigit()` says yes to '²' that int() refuses."""
    if not text or not text.isascii() or not text.isdigit() or len(text) > 12:
        return None
    value = int(text)
    return value if value < limit else None


# What one id may add to an error detail or a log line, and how many ids.
ID_SHOWN = 80
IDS_SHOWN = 5


def shown(text: str, limit: int = ID_SHOWN) -> str:
    """`text` made safe for one log line or status detail: control and other
    non-printable characters escaped, cut to `limit` characters."""
    if len(text) > limit:
        return _escape(text[:limit]) + f"...({len(text)} chars)"
    return _escape(text)


def _escape(text: str) -> str:
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def shown_ids(ids: Iterable[str], limit: int = IDS_SHOWN) -> str:
    """A bounded list: the first `limit` ids (each bounded) and how many more."""
    items = list(ids)
    head = ", ".join(shown(i) for i in items[:limit])
    return head + (f" and {len(items) - limit} more" if len(items) > limit else "")
