"""GPUs through NVML.

This is the only module that imports `pynvml`. Everything else receives the
library as a value (`lib`), so the demo and the tests hand in the fixture
driven fake and exercise exactly this code.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from devplugin.model import GpuInfo, MigDevice, NvmlStatus, PciAddress, PciFunction
from devplugin.node.deadline import Deadlines
from devplugin.policy.mig import profile_name, report_problem, shared_uuids

log = logging.getLogger(__name__)

_MIB = 1024 * 1024
# Used only when the library does not export the constant (old bindings).
_DEFAULT_MAX_LINKS = 18
# Seconds one NVML read may take before its GPU is reported as not answering
# (the daemon passes its configured value).
READ_TIMEOUT = 5.0


@dataclass(frozen=True)
class _RawGpu:
    index: int
    uuid: str
    name: str
    address: PciAddress
    minor: int
    memory: int
    compute: tuple[int, int] | None = None
    mig_capable: bool = False
    mig_enabled: bool = False
    mig: tuple[MigDevice, ...] = ()
    # Why its MIG report cannot be true: the GPU is then served as nothing.
    problem: str | None = None


def load_pynvml() -> Any:
    """The real NVML bindings. Importing them does not touch the driver."""
    import pynvml

    return pynvml


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace").rstrip("\x00")
    return str(value)


class NvmlGpuSource:
    """Reads GPUs from an NVML library object; owns nvmlInit/nvmlShutdown.

    Initialisation is retried on every scan until it succeeds: on nodes where
    a driver container loads the kernel module after this daemon starts, the
    GPUs appear as soon as the driver does. Failures are logged once per
    distinct error, not once per scan.
    """

    def __init__(self, lib: Any, deadlines: Deadlines | None = None) -> None:
        self._lib = lib
        self._deadlines = deadlines if deadlines is not None else Deadlines(READ_TIMEOUT)
        # Deadlines made here are this source's to close.
        self._owns_deadlines = deadlines is None
        self._session = 0
        self._lock = threading.Lock()
        self._initialised = False
        self._last_error: str | None = None
        # NVLink wiring never changes while a GPU is present; reading it costs
        # dozens of NVML calls per GPU, so it is read once per UUID.
        self._peer_addresses: dict[str, tuple[tuple[str, int], ...]] = {}
        self._switch_links: dict[str, int] = {}
        # The last good description of each GPU index, so a GPU that NVML
        # loses stays listed (Unhealthy) instead of silently vanishing.
        self._known: dict[int, GpuInfo] = {}
        # GPU index -> why its MIG report was last refused.
        self._mig_problems: dict[int, str] = {}

    def _error_text(self, exc: BaseException) -> str:
        value = getattr(exc, "value", None)
        code = f" (NVML error {value})" if isinstance(value, int) else ""
        return f"{exc}{code}"

    def _ensure_init(self) -> NvmlStatus | None:
        if self._initialised:
            return None
        try:
            self._deadlines.call("nvml", self._lib.nvmlInit)
        except Exception as exc:  # noqa: BLE001 - NVML bindings raise various types
            message = self._error_text(exc)
            if message != self._last_error:
                log.error(
                    "NVML unavailable: %s; the GPU resource serves no devices until "
                    "NVML initialises (retried at every rescan)",
                    message,
                )
                self._last_error = message
            return NvmlStatus(error=message)
        self._initialised = True
        self._session += 1
        if self._last_error is not None:
            log.info("NVML initialised after earlier failure")
        self._last_error = None
        return None

    def scan(self, pci: Mapping[PciAddress, PciFunction]) -> tuple[tuple[GpuInfo, ...], NvmlStatus]:
        """Every GPU NVML reports, plus every GPU it reported before and cannot
        describe now (lost, stuck, or NVML itself failing), those with `error`."""
        with self._lock:
            failure = self._ensure_init()
            if failure is not None:
                return self._known_only(pci, failure.error or "NVML unavailable"), failure
            try:
                driver, cuda, count = self._deadlines.call("nvml", self._system)
            except Exception as exc:  # noqa: BLE001 - NVML bindings raise various types
                message = self._error_text(exc)
                if message != self._last_error:
                    log.error("NVML query failed: %s; known GPUs stay listed, Unhealthy", message)
                    self._last_error = message
                return self._known_only(pci, message), NvmlStatus(
                    error=message, session=self._session
                )
            if self._last_error is not None:
                log.info("NVML answers again")
                self._last_error = None
            raw: list[_RawGpu] = []
            failed: dict[int, str] = {}
            reads = [(f"gpu{index}", partial(self._read_gpu, index)) for index in range(count)]
            for index, outcome in enumerate(self._deadlines.call_all(reads)):
                if isinstance(outcome, Exception):  # NVML bindings raise various types
                    failed[index] = self._error_text(outcome)
                elif isinstance(outcome, BaseException):
                    raise outcome
                else:
                    raw.append(outcome)
            raw = self._sane(raw)
            index_by_address = {entry.address: entry.index for entry in raw}
            gpus = [
                GpuInfo(
                    index=entry.index,
                    uuid=entry.uuid,
                    name=entry.name,
                    pci_address=entry.address,
                    minor_number=entry.minor,
                    memory_total_mib=entry.memory,
                    compute_capability=entry.compute,
                    mig_capable=entry.mig_capable,
                    mig_enabled=entry.mig_enabled,
                    mig_devices=entry.mig,
                    nvlink_peers=self._peers(entry, raw, index_by_address),
                    pci=pci.get(entry.address),
                    error=entry.problem,
                )
                for entry in raw
            ]
            for gpu in gpus:
                self._known[gpu.index] = gpu
            seen = {gpu.uuid for gpu in gpus}
            for index, known in sorted(self._known.items()):
                if known.uuid not in seen:
                    reason = failed.get(index, "no longer reported by NVML")
                    gpus.append(
                        dataclasses.replace(known, error=reason, pci=pci.get(known.pci_address))
                    )
            gpus.sort(key=lambda gpu: gpu.index)
            status = NvmlStatus(
                driver_version=driver, cuda_driver_version=cuda, session=self._session
            )
            return tuple(gpus), status

    def _known_only(
        self, pci: Mapping[PciAddress, PciFunction], reason: str
    ) -> tuple[GpuInfo, ...]:
        """The GPUs seen before, all Unhealthy: a failing driver query must not
        make them vanish (that would drop their latched faults)."""
        return tuple(
            dataclasses.replace(known, error=reason, pci=pci.get(known.pci_address))
            for _, known in sorted(self._known.items())
        )

    def _system(self) -> tuple[str, int, int]:
        lib = self._lib
        driver = _text(lib.nvmlSystemGetDriverVersion())
        cuda = int(lib.nvmlSystemGetCudaDriverVersion())
        count = int(lib.nvmlDeviceGetCount())
        return driver, cuda, count

    def _sane(self, raw: list[_RawGpu]) -> list[_RawGpu]:
        """Each GPU whose MIG report cannot be true (policy/mig.py) failed
        closed: its devices dropped and the GPU marked with why, one line
        logged when that changes."""
        problems = shared_uuids({entry.index: entry.mig for entry in raw})
        checked = []
        for entry in raw:
            problem = problems.get(entry.index) or report_problem(entry.mig)
            if problem != self._mig_problems.get(entry.index):
                if problem is not None:
                    log.error("GPU %d (%s) not served: %s", entry.index, entry.uuid[:80], problem)
                elif entry.index in self._mig_problems:
                    log.info(
                        "GPU %d (%s): its MIG report is consistent again",
                        entry.index,
                        entry.uuid[:80],
                    )
            if problem is None:
                self._mig_problems.pop(entry.index, None)
                checked.append(entry)
                continue
            self._mig_problems[entry.index] = problem
            checked.append(dataclasses.replace(entry, mig=(), problem=f"MIG report: {problem}"))
        return checked

    def _read_gpu(self, index: int) -> _RawGpu:
        lib = self._lib
        handle = lib.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(lib.nvmlDeviceGetUUID(handle))
        capable, enabled, mig = _mig(lib, handle)
        entry = _RawGpu(
            mig_capable=capable,
            mig_enabled=enabled,
            mig=mig,
            index=index,
            uuid=uuid,
            name=_text(lib.nvmlDeviceGetName(handle)),
            address=PciAddress.parse(_text(lib.nvmlDeviceGetPciInfo(handle).busId)),
            minor=int(lib.nvmlDeviceGetMinorNumber(handle)),
            memory=int(lib.nvmlDeviceGetMemoryInfo(handle).total) // _MIB,
            compute=_compute(lib, handle),
        )
        if uuid not in self._peer_addresses:
            self._read_links(handle, uuid)
        return entry

    def _read_links(self, handle: Any, uuid: str) -> None:
        lib = self._lib
        enabled = getattr(lib, "NVML_FEATURE_ENABLED", 1)
        switch_type = getattr(lib, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
        max_links = int(getattr(lib, "NVML_NVLINK_MAX_LINKS", _DEFAULT_MAX_LINKS))
        per_peer: dict[str, int] = {}
        switch_links = 0
        for link in range(max_links):
            try:
                if lib.nvmlDeviceGetNvLinkState(handle, link) != enabled:
                    continue
            except Exception:  # noqa: BLE001 - NVML bindings raise various types
                continue
            try:
                remote_type = lib.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
            except Exception:  # noqa: BLE001 - NVML bindings raise various types
                remote_type = None
            if remote_type == switch_type:
                switch_links += 1
                continue
            try:
                remote = _text(lib.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
                key = str(PciAddress.parse(remote))
            except Exception:  # noqa: BLE001 - NVML bindings raise various types
                continue
            per_peer[key] = per_peer.get(key, 0) + 1
        self._peer_addresses[uuid] = tuple(sorted(per_peer.items()))
        self._switch_links[uuid] = switch_links

    def _peers(
        self, entry: _RawGpu, raw: list[_RawGpu], index_by_address: Mapping[PciAddress, int]
    ) -> tuple[tuple[int, int], ...]:
        counts: dict[int, int] = {}
        for address_text, links in self._peer_addresses.get(entry.uuid, ()):
            peer = index_by_address.get(PciAddress.parse(address_text))
            if peer is not None and peer != entry.index:
                counts[peer] = counts.get(peer, 0) + links
        # Through NVSwitch every pair of switch-attached GPUs talks at the
        # bandwidth of the thinner side's switch links.
        own = self._switch_links.get(entry.uuid, 0)
        if own:
            for other in raw:
                peer_links = self._switch_links.get(other.uuid, 0)
                if other.index != entry.index and peer_links:
                    counts[other.index] = counts.get(other.index, 0) + min(own, peer_links)
        return tuple(sorted(counts.items()))

    def close(self) -> None:
        with self._lock:
            if self._initialised:
                try:
                    self._deadlines.call("nvml", self._lib.nvmlShutdown)
                except Exception as exc:  # noqa: BLE001 - NVML bindings raise various types
                    log.warning("nvmlShutdown failed: %s", self._error_text(exc))
                self._initialised = False
            if self._owns_deadlines:
                self._deadlines.close()


def _compute(lib: Any, handle: Any) -> tuple[int, int] | None:
    """The CUDA compute capability, or None where NVML cannot tell (an old
    driver, a binding without the call): it only describes the GPU, so its
    absence never makes the GPU unhealthy."""
    try:
        major, minor = lib.nvmlDeviceGetCudaComputeCapability(handle)
    except Exception:  # noqa: BLE001 - NVML bindings raise various types
        return None
    return int(major), int(minor)


def _not_supported(lib: Any, exc: BaseException) -> bool:
    return getattr(exc, "value", None) == getattr(lib, "NVML_ERROR_NOT_SUPPORTED", 3)


def _mig(lib: Any, handle: Any) -> tuple[bool, bool, tuple[MigDevice, ...]]:
    """(capable, enabled, MIG devices). Not Supported means a GPU that cannot
    be cut (or bindings without MIG); any other failure is the GPU's own and
    fails its read, so a MIG GPU that cannot be listed is never served whole.
    Devices are listed as go-nvlib's VisitMigDevices does: every index up to
    the maximum, skipping Not Found and Invalid Argument."""
    try:
        current, _pending = lib.nvmlDeviceGetMigMode(handle)
    except AttributeError:
        return False, False, ()
    except Exception as exc:
        if _not_supported(lib, exc):
            return False, False, ()
        raise
    if current != getattr(lib, "NVML_FEATURE_ENABLED", 1):
        return True, False, ()
    skipped = {
        getattr(lib, "NVML_ERROR_NOT_FOUND", 6),
        getattr(lib, "NVML_ERROR_INVALID_ARGUMENT", 2),
    }
    devices: list[MigDevice] = []
    for index in range(int(lib.nvmlDeviceGetMaxMigDeviceCount(handle))):
        try:
            mig = lib.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
        except Exception as exc:
            if getattr(exc, "value", None) in skipped:
                continue
            raise
        attributes = lib.nvmlDeviceGetAttributes(mig)
        memory = int(attributes.memorySizeMB)
        devices.append(
            MigDevice(
                uuid=_text(lib.nvmlDeviceGetUUID(mig)),
                index=index,
                gpu_instance=int(lib.nvmlDeviceGetGpuInstanceId(mig)),
                compute_instance=int(lib.nvmlDeviceGetComputeInstanceId(mig)),
                profile=profile_name(
                    int(attributes.gpuInstanceSliceCount),
                    int(attributes.computeInstanceSliceCount),
                    memory,
                ),
                memory_mib=memory,
                multiprocessors=int(attributes.multiprocessorCount),
            )
        )
    return True, True, tuple(devices)
