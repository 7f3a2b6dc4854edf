"""A stand-in for the `pynvml` module, driven by a JSON fixture.

It implements the subset of the pynvml API that devplugin calls, with the
same function names, constants, return shapes and error type, so the
production NVML code path runs unchanged in the demo and in tests.

Fixture format (exactly these keys, all required)::

    {
      "driver_version": "550.54.15",
      "cuda_driver_version": 12040,
      "gpus": [
        {
          "uuid": "GPU-...",
          "name": "NVIDIA H100 80GB HBM3",
          "pci_bus_id": "00000000:1A:00.0",
          "minor_number": 0,
          "memory_total_mib": 81559,
          "nvlink_peers": {"1": 18, "2": 18}
        }
      ]
    }

A GPU's index is its position in `gpus`; `nvlink_peers` maps a peer's index
(as a string, JSON keys being strings) to the number of NVLinks between the
two. The links must be listed symmetrically on both GPUs.

Optional per GPU: `cuda_compute_capability` ([major, minor]; without it NVML
answers Not Supported) and `mig`, which makes the GPU MIG-capable::

    "mig": {"enabled": true, "devices": [
      {"uuid": "MIG-...", "gpu_instance": 1, "compute_instance": 0,
       "gpu_slices": 1, "compute_slices": 1, "memory_mib": 9856,
       "multiprocessors": 16}
    ]}

A GPU without `mig` answers Not Supported to the MIG calls; one with MIG
disabled has no MIG devices. Tests reconfigure a GPU's MIG layout while a
daemon runs (`set_mig`), as an operator's MIG manager would.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devplugin.model import PciAddress

# Constant values as published by NVML (nvml.h) and mirrored by pynvml.
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999
NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_NVLINK_MAX_LINKS = 18
NVML_NVLINK_DEVICE_TYPE_GPU = 0x00
NVML_NVLINK_DEVICE_TYPE_SWITCH = 0x02
NVML_COMPUTEMODE_DEFAULT = 0
NVML_COMPUTEMODE_PROHIBITED = 2
NVML_COMPUTEMODE_EXCLUSIVE_PROCESS = 3
nvmlEventTypeSingleBitEccError = 0x1
nvmlEventTypeDoubleBitEccError = 0x2
nvmlEventTypeXidCriticalError = 0x8

_MESSAGES = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}

_TOP_KEYS = frozenset({"driver_version", "cuda_driver_version", "gpus"})
_GPU_KEYS = frozenset(
    {"uuid", "name", "pci_bus_id", "minor_number", "memory_total_mib", "nvlink_peers"}
)
# Optional per GPU: [major, minor]; without it NVML answers NOT_SUPPORTED.
_OPTIONAL_GPU_KEYS = frozenset({"cuda_compute_capability", "mig"})
_MIG_KEYS = frozenset({"enabled", "devices"})
_MIG_DEVICE_KEYS = frozenset(
    {
        "uuid",
        "gpu_instance",
        "compute_instance",
        "gpu_slices",
        "compute_slices",
        "memory_mib",
        "multiprocessors",
    }
)
# An A100 or H100 has at most seven MIG devices.
MAX_MIG_DEVICES = 7
# NVML's "no instance" id in an event's gpuInstanceId / computeInstanceId.
NO_INSTANCE = 0xFFFFFFFF


class NVMLError(Exception):
    """Same shape as pynvml.NVMLError: an exception carrying `.value`."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"NVML Error with code {self.value}")


class FixtureError(ValueError):
    """The fixture file does not have the documented shape."""


@dataclass(frozen=True)
class FixtureGpu:
    uuid: str
    name: str
    pci_bus_id: str
    minor_number: int
    memory_total_mib: int
    nvlink_peers: Mapping[int, int]
    cuda_compute_capability: tuple[int, int] | None = None
    mig: FixtureMig | None = None


@dataclass(frozen=True)
class FixtureMigDevice:
    uuid: str
    gpu_instance: int
    compute_instance: int
    gpu_slices: int
    compute_slices: int
    memory_mib: int
    multiprocessors: int


@dataclass(frozen=True)
class FixtureMig:
    enabled: bool
    devices: tuple[FixtureMigDevice, ...] = ()


@dataclass(frozen=True)
class Fixture:
    driver_version: str
    cuda_driver_version: int
    gpus: tuple[FixtureGpu, ...]


def _require(condition: bool, where: str, message: str) -> None:
    if not condition:
        raise FixtureError(f"{where}: {message}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_fixture(data: object, source: str = "fixture") -> Fixture:
    """Validate the decoded JSON; every error names the offending field."""
    _require(isinstance(data, dict), source, "must be a JSON object")
    assert isinstance(data, dict)
    unknown = sorted(set(data) - _TOP_KEYS)
    _require(not unknown, f"{source}: {unknown[0] if unknown else ''}", "unknown key")
    missing = sorted(_TOP_KEYS - set(data))
    _require(not missing, f"{source}: {missing[0] if missing else ''}", "missing key")
    _require(
        isinstance(data["driver_version"], str), f"{source}: driver_version", "must be a string"
    )
    _require(
        _is_int(data["cuda_driver_version"]), f"{source}: cuda_driver_version", "must be an integer"
    )
    _require(isinstance(data["gpus"], list), f"{source}: gpus", "must be a list")
    seen = _Seen()
    count = len(data["gpus"])
    gpus = [
        _parse_gpu(raw, f"{source}: gpus[{index}]", index, count, seen)
        for index, raw in enumerate(data["gpus"])
    ]
    for index, gpu in enumerate(gpus):
        for peer, links in gpu.nvlink_peers.items():
            back = gpus[peer].nvlink_peers.get(index, 0)
            _require(
                back == links,
                f"{source}: gpus[{index}].nvlink_peers.{peer}",
                f"{links} links to GPU {peer}, but GPU {peer} lists {back} back",
            )
    return Fixture(
        driver_version=data["driver_version"],
        cuda_driver_version=data["cuda_driver_version"],
        gpus=tuple(gpus),
    )


@dataclass
class _Seen:
    """What the GPUs before this one used: each must be unique."""

    uuids: set[str] = field(default_factory=set)
    bus: set[PciAddress] = field(default_factory=set)
    minor: set[int] = field(default_factory=set)


def _parse_gpu(raw: object, where: str, index: int, count: int, seen: _Seen) -> FixtureGpu:
    """One entry of `gpus`: its fields, unique ids, and its NVLink peers."""
    _require(isinstance(raw, dict), where, "must be an object")
    assert isinstance(raw, dict)
    unknown = sorted(set(raw) - _GPU_KEYS - _OPTIONAL_GPU_KEYS)
    _require(not unknown, f"{where}.{unknown[0] if unknown else ''}", "unknown key")
    missing = sorted(_GPU_KEYS - set(raw))
    _require(not missing, f"{where}.{missing[0] if missing else ''}", "missing key")
    for key in ("uuid", "name", "pci_bus_id"):
        _require(
            isinstance(raw[key], str) and raw[key], f"{where}.{key}", "must be a non-empty string"
        )
    for key in ("minor_number", "memory_total_mib"):
        _require(_is_int(raw[key]) and raw[key] >= 0, f"{where}.{key}", "must be an integer >= 0")
    try:
        bus = PciAddress.parse(raw["pci_bus_id"])
    except ValueError as exc:
        raise FixtureError(f"{where}.pci_bus_id: {exc}") from exc
    _require(raw["uuid"] not in seen.uuids, f"{where}.uuid", "duplicate UUID")
    _require(bus not in seen.bus, f"{where}.pci_bus_id", "duplicate PCI bus id")
    _require(
        raw["minor_number"] not in seen.minor, f"{where}.minor_number", "duplicate minor number"
    )
    seen.uuids.add(raw["uuid"])
    seen.bus.add(bus)
    seen.minor.add(raw["minor_number"])
    peers_raw = raw["nvlink_peers"]
    _require(isinstance(peers_raw, dict), f"{where}.nvlink_peers", "must be an object")
    peers: dict[int, int] = {}
    for key, links in peers_raw.items():
        field_name = f"{where}.nvlink_peers.{key}"
        _require(
            key.isdigit() and int(key) < count,
            field_name,
            f"peer must be a GPU index below {count}",
        )
        _require(int(key) != index, field_name, "a GPU cannot link to itself")
        _require(_is_int(links) and links > 0, field_name, "link count must be an integer > 0")
        peers[int(key)] = links
    compute = raw.get("cuda_compute_capability")
    if compute is not None:
        _require(
            isinstance(compute, list)
            and len(compute) == 2
            and all(_is_int(v) and v >= 0 for v in compute),
            f"{where}.cuda_compute_capability",
            "must be [major, minor], integers >= 0",
        )
    return FixtureGpu(
        mig=_parse_mig(raw.get("mig"), f"{where}.mig", seen.uuids),
        uuid=raw["uuid"],
        name=raw["name"],
        pci_bus_id=raw["pci_bus_id"],
        minor_number=raw["minor_number"],
        memory_total_mib=raw["memory_total_mib"],
        nvlink_peers=peers,
        cuda_compute_capability=(compute[0], compute[1]) if compute else None,
    )


def _parse_mig(raw: object, where: str, seen_uuids: set[str]) -> FixtureMig | None:
    if raw is None:
        return None
    _require(isinstance(raw, dict), where, "must be an object")
    assert isinstance(raw, dict)
    unknown = sorted(set(raw) - _MIG_KEYS)
    _require(not unknown, f"{where}.{unknown[0] if unknown else ''}", "unknown key")
    _require(isinstance(raw.get("enabled"), bool), f"{where}.enabled", "must be true or false")
    listed = raw.get("devices", [])
    _require(isinstance(listed, list), f"{where}.devices", "must be a list")
    _require(len(listed) <= MAX_MIG_DEVICES, f"{where}.devices", f"at most {MAX_MIG_DEVICES}")
    _require(raw["enabled"] or not listed, f"{where}.devices", "MIG is disabled: none")
    devices: list[FixtureMigDevice] = []
    for i, entry in enumerate(listed):
        at = f"{where}.devices[{i}]"
        _require(isinstance(entry, dict), at, "must be an object")
        unknown = sorted(set(entry) ^ _MIG_DEVICE_KEYS)
        _require(not unknown, f"{at}.{unknown[0] if unknown else ''}", "unknown or missing key")
        _require(
            isinstance(entry["uuid"], str) and bool(entry["uuid"]), f"{at}.uuid", "must be a string"
        )
        _require(entry["uuid"] not in seen_uuids, f"{at}.uuid", "duplicate UUID")
        seen_uuids.add(entry["uuid"])
        for key in sorted(_MIG_DEVICE_KEYS - {"uuid"}):
            _require(
                _is_int(entry[key]) and entry[key] >= 0, f"{at}.{key}", "must be an integer >= 0"
            )
        devices.append(FixtureMigDevice(**entry))
    return FixtureMig(raw["enabled"], tuple(devices))


def load_fixture(path: Path) -> Fixture:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise FixtureError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise FixtureError(f"{path}: not UTF-8 (byte {exc.start})") from exc
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise FixtureError(f"{path}: not valid JSON: {str(exc)[:200]}") from exc
    return parse_fixture(data, str(path))


@dataclass(frozen=True)
class _PciInfo:
    busId: str
    busIdLegacy: str


@dataclass(frozen=True)
class _Memory:
    total: int
    free: int
    used: int


@dataclass(frozen=True)
class _Handle:
    index: int


@dataclass(frozen=True)
class _MigHandle:
    parent: int
    index: int


@dataclass(frozen=True)
class _Attributes:
    multiprocessorCount: int
    gpuInstanceSliceCount: int
    computeInstanceSliceCount: int
    memorySizeMB: int


@dataclass(frozen=True)
class _EventData:
    device: _Handle
    eventType: int
    eventData: int
    gpuInstanceId: int = 0
    computeInstanceId: int = 0


@dataclass(frozen=True)
class _Process:
    pid: int
    usedGpuMemory: int


class _EventSet:
    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # GPU index -> event type mask
        # SimpleQueue: its timed get waits in C, as NVML waits in the driver
        # (a Python-level timed wait would bill the daemon for the fake).
        self.queue: queue.SimpleQueue[_EventData] = queue.SimpleQueue()
        self.freed = False


def _nvml_bus_id(text: str) -> str:
    address = PciAddress.parse(text)
    return f"{address.domain:08X}:{address.bus:02X}:{address.device:02X}.{address.function:X}"


class FakeNvml:
    """Module-like object: use it wherever the `pynvml` module is expected.

    Tests may change its state while a daemon runs (fail initialisation,
    lose a GPU); every call reads the current state under a lock.
    """

    NVMLError = NVMLError
    NVML_SUCCESS = NVML_SUCCESS
    NVML_ERROR_UNINITIALIZED = NVML_ERROR_UNINITIALIZED
    NVML_ERROR_INVALID_ARGUMENT = NVML_ERROR_INVALID_ARGUMENT
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_NOT_FOUND = NVML_ERROR_NOT_FOUND
    NVML_ERROR_DRIVER_NOT_LOADED = NVML_ERROR_DRIVER_NOT_LOADED
    NVML_ERROR_TIMEOUT = NVML_ERROR_TIMEOUT
    NVML_COMPUTEMODE_DEFAULT = NVML_COMPUTEMODE_DEFAULT
    NVML_COMPUTEMODE_PROHIBITED = NVML_COMPUTEMODE_PROHIBITED
    NVML_COMPUTEMODE_EXCLUSIVE_PROCESS = NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    nvmlEventTypeSingleBitEccError = nvmlEventTypeSingleBitEccError
    nvmlEventTypeDoubleBitEccError = nvmlEventTypeDoubleBitEccError
    nvmlEventTypeXidCriticalError = nvmlEventTypeXidCriticalError
    NVML_ERROR_LIBRARY_NOT_FOUND = NVML_ERROR_LIBRARY_NOT_FOUND
    NVML_ERROR_GPU_IS_LOST = NVML_ERROR_GPU_IS_LOST
    NVML_ERROR_UNKNOWN = NVML_ERROR_UNKNOWN
    NVML_FEATURE_DISABLED = NVML_FEATURE_DISABLED
    NVML_FEATURE_ENABLED = NVML_FEATURE_ENABLED
    NVML_NVLINK_MAX_LINKS = NVML_NVLINK_MAX_LINKS
    NVML_NVLINK_DEVICE_TYPE_GPU = NVML_NVLINK_DEVICE_TYPE_GPU
    NVML_NVLINK_DEVICE_TYPE_SWITCH = NVML_NVLINK_DEVICE_TYPE_SWITCH

    def __init__(self, fixture: Fixture, *, init_error: int | None = None) -> None:
        self._fixture = fixture
        self._lock = threading.Lock()
        self._init_count = 0
        self.init_error = init_error
        self.lost: set[int] = set()
        # Test controls and observations beyond the fixture.
        self.processes: dict[int, list[int]] = {}
        # MIG device UUID -> pids running on it.
        self.mig_processes: dict[str, list[int]] = {}
        self.compute_mode: dict[int, int] = {}
        self.clock_resets: list[int] = []
        self.events_unsupported: set[int] = set()
        # Fault injection: calls about a GPU in `wedged` block until its
        # event is set (a GPU that stopped answering); `system_error` makes
        # the driver-level queries fail (a blip in the driver).
        self.wedged: dict[int, threading.Event] = {}
        self.system_error: int | None = None
        # Each GPU's MIG state, changed by `set_mig` (None: not MIG-capable).
        self.mig: dict[int, FixtureMig | None] = {i: g.mig for i, g in enumerate(fixture.gpus)}
        self._event_sets: list[_EventSet] = []
        # Per GPU: the remote bus id of each NVLink, in link order.
        self._links: list[list[str]] = []
        for gpu in fixture.gpus:
            links: list[str] = []
            for peer in sorted(gpu.nvlink_peers):
                remote = _nvml_bus_id(fixture.gpus[peer].pci_bus_id)
                links.extend([remote] * gpu.nvlink_peers[peer])
            self._links.append(links)
        # A fixture may describe all-to-all NVLink through switches as direct
        # peer counts (NV12 to each of seven peers); widen the link range so
        # every described link is reachable by index.
        self.NVML_NVLINK_MAX_LINKS = max([NVML_NVLINK_MAX_LINKS, *map(len, self._links)])

    @classmethod
    def from_file(cls, path: Path) -> FakeNvml:
        return cls(load_fixture(path))

    # -- library lifecycle -------------------------------------------------
    def nvmlInit(self) -> None:
        with self._lock:
            if self.init_error is not None:
                raise NVMLError(self.init_error)
            self._init_count += 1

    def nvmlShutdown(self) -> None:
        with self._lock:
            self._require_init()
            self._init_count -= 1

    @property
    def initialised(self) -> bool:
        with self._lock:
            return self._init_count > 0

    def _require_init(self) -> None:
        if self._init_count <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

    def wedge(self, index: int) -> threading.Event:
        """Make every call about GPU `index` block until the returned event is set."""
        gate = threading.Event()
        self.wedged[index] = gate
        return gate

    def _block_if_wedged(self, index: object) -> None:
        gate = self.wedged.get(index) if isinstance(index, int) else None
        if gate is not None:
            gate.wait()  # outside the lock: only this GPU's callers block

    def _gpu(self, handle: Any) -> tuple[int, FixtureGpu]:
        self._block_if_wedged(getattr(handle, "index", None))
        with self._lock:
            self._require_init()
            if not isinstance(handle, _Handle) or not 0 <= handle.index < len(self._fixture.gpus):
                raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
            if handle.index in self.lost:
                raise NVMLError(NVML_ERROR_GPU_IS_LOST)
            return handle.index, self._fixture.gpus[handle.index]

    # -- system ------------------------------------------------------------
    def nvmlSystemGetDriverVersion(self) -> str:
        with self._lock:
            self._require_init()
            if self.system_error is not None:
                raise NVMLError(self.system_error)
            return self._fixture.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        with self._lock:
            self._require_init()
            return self._fixture.cuda_driver_version

    def nvmlDeviceGetCount(self) -> int:
        with self._lock:
            self._require_init()
            return len(self._fixture.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._block_if_wedged(index)
        with self._lock:
            self._require_init()
            if not 0 <= index < len(self._fixture.gpus):
                raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
            if index in self.lost:
                raise NVMLError(NVML_ERROR_GPU_IS_LOST)
            return _Handle(index)

    # -- per device --------------------------------------------------------
    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        if isinstance(handle, _MigHandle):
            return self._mig_device(handle).uuid
        return self._gpu(handle)[1].uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._gpu(handle)[1].name

    def nvmlDeviceGetPciInfo(self, handle: Any) -> _PciInfo:
        gpu = self._gpu(handle)[1]
        bus = _nvml_bus_id(gpu.pci_bus_id)
        return _PciInfo(busId=bus, busIdLegacy=bus[4:])

    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        return self._gpu(handle)[1].minor_number

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        compute = self._gpu(handle)[1].cuda_compute_capability
        if compute is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return compute

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> _Memory:
        if isinstance(handle, _MigHandle):
            total = self._mig_device(handle).memory_mib * 1024 * 1024
            return _Memory(total=total, free=total, used=0)
        total = self._gpu(handle)[1].memory_total_mib * 1024 * 1024
        return _Memory(total=total, free=total, used=0)

    def _link(self, handle: Any, link: int) -> str:
        index, _ = self._gpu(handle)
        links = self._links[index]
        if not links:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < self.NVML_NVLINK_MAX_LINKS:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return links[link] if link < len(links) else ""

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:
        return NVML_FEATURE_ENABLED if self._link(handle, link) else NVML_FEATURE_DISABLED

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int) -> int:
        if not self._link(handle, link):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return NVML_NVLINK_DEVICE_TYPE_GPU

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: Any, link: int) -> _PciInfo:
        remote = self._link(handle, link)
        if not remote:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return _PciInfo(busId=remote, busIdLegacy=remote[4:])

    # -- lookups, compute state --------------------------------------------------
    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> _Handle | _MigHandle:
        with self._lock:
            self._require_init()
            for index, gpu in enumerate(self._fixture.gpus):
                mig = self.mig.get(index)
                slices = [d.uuid for d in mig.devices] if mig is not None else []
                if gpu.uuid == uuid or uuid in slices:
                    if index in self.lost:
                        raise NVMLError(NVML_ERROR_GPU_IS_LOST)
                    if gpu.uuid == uuid:
                        return _Handle(index)
                    return _MigHandle(index, slices.index(uuid))
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    # -- MIG ---------------------------------------------------------------------
    def set_mig(self, index: int, mig: FixtureMig | None) -> None:
        """Reconfigure GPU `index` (an operator's MIG manager at work)."""
        with self._lock:
            self.mig[index] = mig

    def _mig_of(self, handle: Any) -> tuple[int, FixtureMig]:
        index, _ = self._gpu(handle)
        with self._lock:
            mig = self.mig.get(index)
        if mig is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return index, mig

    def _mig_device(self, handle: _MigHandle) -> FixtureMigDevice:
        _, mig = self._mig_of(_Handle(handle.parent))
        if not mig.enabled or not 0 <= handle.index < len(mig.devices):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)  # the instance is gone
        return mig.devices[handle.index]

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        _, mig = self._mig_of(handle)
        mode = NVML_FEATURE_ENABLED if mig.enabled else NVML_FEATURE_DISABLED
        return [mode, mode]  # [current, pending]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
        self._mig_of(handle)
        return MAX_MIG_DEVICES

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: int) -> _MigHandle:
        parent, mig = self._mig_of(handle)
        if not 0 <= index < MAX_MIG_DEVICES:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if not mig.enabled or index >= len(mig.devices):
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return _MigHandle(parent, index)

    def nvmlDeviceIsMigDeviceHandle(self, handle: Any) -> bool:
        return isinstance(handle, _MigHandle)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: Any) -> _Handle:
        if not isinstance(handle, _MigHandle):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(handle.parent)

    def nvmlDeviceGetGpuInstanceId(self, handle: Any) -> int:
        if not isinstance(handle, _MigHandle):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self._mig_device(handle).gpu_instance

    def nvmlDeviceGetComputeInstanceId(self, handle: Any) -> int:
        if not isinstance(handle, _MigHandle):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self._mig_device(handle).compute_instance

    def nvmlDeviceGetAttributes(self, handle: Any) -> _Attributes:
        if not isinstance(handle, _MigHandle):
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        device = self._mig_device(handle)
        return _Attributes(
            multiprocessorCount=device.multiprocessors,
            gpuInstanceSliceCount=device.gpu_slices,
            computeInstanceSliceCount=device.compute_slices,
            memorySizeMB=device.memory_mib,
        )

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[_Process]:
        if isinstance(handle, _MigHandle):
            uuid = self._mig_device(handle).uuid
            return [_Process(pid, 1 << 30) for pid in self.mig_processes.get(uuid, [])]
        index, _ = self._gpu(handle)
        return [_Process(pid, 1 << 30) for pid in self.processes.get(index, [])]

    def nvmlDeviceGetComputeMode(self, handle: Any) -> int:
        index, _ = self._gpu(handle)
        return self.compute_mode.get(index, NVML_COMPUTEMODE_DEFAULT)

    def nvmlDeviceSetComputeMode(self, handle: Any, mode: int) -> None:
        index, _ = self._gpu(handle)
        self.compute_mode[index] = mode

    def nvmlDeviceResetApplicationsClocks(self, handle: Any) -> None:
        index, _ = self._gpu(handle)
        self.clock_resets.append(index)

    # -- events ----------------------------------------------------------------
    def nvmlEventSetCreate(self) -> _EventSet:
        with self._lock:
            self._require_init()
            event_set = _EventSet()
            self._event_sets.append(event_set)
            return event_set

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: _EventSet) -> None:
        index, _ = self._gpu(handle)
        if index in self.events_unsupported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        event_set.registered[index] = event_set.registered.get(index, 0) | event_types

    def nvmlEventSetWait_v2(self, event_set: _EventSet, timeout_ms: int) -> _EventData:
        try:
            return event_set.queue.get(timeout=timeout_ms / 1000.0)
        except queue.Empty:
            raise NVMLError(NVML_ERROR_TIMEOUT) from None

    def nvmlEventSetFree(self, event_set: _EventSet) -> None:
        event_set.freed = True

    def inject_event(
        self,
        index: int,
        event_type: int,
        data: int = 0,
        *,
        gpu_instance: int = NO_INSTANCE,
        compute_instance: int = NO_INSTANCE,
    ) -> int:
        """Deliver an event to every set registered for it; returns how many.
        A MIG device's fault names its GPU and compute instance; a fault of
        the whole GPU names none (NO_INSTANCE)."""
        delivered = 0
        with self._lock:
            sets = list(self._event_sets)
        for event_set in sets:
            if not event_set.freed and event_set.registered.get(index, 0) & event_type:
                event_set.queue.put(
                    _EventData(_Handle(index), event_type, data, gpu_instance, compute_instance)
                )
                delivered += 1
        return delivered

    def inject_xid(
        self,
        index: int,
        xid: int,
        *,
        gpu_instance: int = NO_INSTANCE,
        compute_instance: int = NO_INSTANCE,
    ) -> int:
        return self.inject_event(
            index,
            nvmlEventTypeXidCriticalError,
            xid,
            gpu_instance=gpu_instance,
            compute_instance=compute_instance,
        )
