"""GPU faults between health checks, from NVML's event set.

Critical XID errors and double-bit ECC errors are reported as faults of the
GPU they came from; XIDs in the ignore list (application-caused: 13, 31,
43, 45, 68, 109 by default) change nothing. GPUs that cannot register for
events (not supported) are still watched by the periodic health checks.
The NVML library is passed in, so the fake drives this same code in tests.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from devplugin.loops import Backoff, ThreadLoop
from devplugin.model import Inventory
from devplugin.node.lifecycle.health import HealthTracker

log = logging.getLogger(__name__)

# Event type bits and the timeout code, as nvml.h defines them.
XID_CRITICAL = 0x8
DOUBLE_BIT_ECC = 0x2
TIMEOUT = 10
# Event waits are not interruptible; this bounds how long a stop waits.
WAIT_MS = 250


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace").rstrip("\x00")
    return str(value)


# NVML's "no instance" id in an event's gpuInstanceId / computeInstanceId.
NO_INSTANCE = 0xFFFFFFFF


class XidWatcher(ThreadLoop):
    """One thread waiting on an NVML event set for every reachable GPU.

    The set is (re)registered whenever the GPUs the check loop found, or the
    NVML session they were found in, change (`track`): a driver that loads
    after the daemon, a GPU that was unreachable at start and answers later,
    or a hot-added GPU are all watched from the next check on.
    """

    def __init__(
        self,
        lib: Any,
        *,
        ignore: Iterable[int],
        health: HealthTracker,
        good_checks: int,
        on_fault: Callable[[], None] = lambda: None,
    ) -> None:
        # The periodic checks watch the GPUs while an event wait fails.
        super().__init__(
            "xid",
            backoff=Backoff(1.0, 1.0),
            join_timeout=5.0,
            failing="NVML event wait failed; health checks continue",
        )
        self._lib = lib
        self._timeout_code = getattr(lib, "NVML_ERROR_TIMEOUT", TIMEOUT)
        self._ignore = frozenset(ignore)
        self._health = health
        self._good_checks = good_checks
        self._on_fault = on_fault
        self._settled = threading.Event()
        self._lock = threading.Lock()
        self._wanted: tuple[int, frozenset[str]] = (0, frozenset())
        self._armed: tuple[int, frozenset[str]] | None = None
        # Parent UUID -> its served MIG devices as (GPU instance, compute
        # instance, served id), from the last tracked inventory.
        self._slices: dict[str, list[tuple[int, int, str]]] = {}
        self._event_set: Any | None = None
        self._initialised = False
        self.watched: frozenset[str] = frozenset()
        self.arms = 0
        self.events_seen = 0

    def track(self, inventory: Inventory) -> None:
        """The GPUs a check found: re-arm when they or the NVML session changed."""
        if not inventory.nvml.ok:
            return  # keep watching what was armed; a blip must not drop the set
        # Events are registered on physical GPUs; a MIG device's fault
        # arrives on its parent, naming its GPU and compute instance.
        uuids = frozenset(gpu.physical_uuid for gpu in inventory.gpus if gpu.error is None)
        slices: dict[str, list[tuple[int, int, str]]] = {}
        for gpu in inventory.gpus:
            if gpu.slice is not None:
                device = gpu.slice.device
                slices.setdefault(gpu.slice.parent_uuid, []).append(
                    (device.gpu_instance, device.compute_instance, gpu.uuid)
                )
        wanted = (inventory.nvml.session, uuids)
        with self._lock:
            self._slices = slices
            if wanted == self._wanted:
                return
            self._wanted = wanted
            self._settled.clear()
        self.poke()

    def wait_armed(self, timeout: float) -> bool:
        """Wait until the last tracked GPU set is registered (or failed to be)."""
        return self._settled.wait(timeout)

    def _arm(self, wanted: tuple[int, frozenset[str]]) -> None:
        lib = self._lib
        # Failures are retried when the GPU set or the NVML session changes
        # (not in a loop); the periodic checks watch the GPUs meanwhile.
        self._armed = wanted
        _, uuids = wanted
        if not uuids:
            self._free()
            self.watched = frozenset()
            return
        if not self._initialised:
            try:
                lib.nvmlInit()
            except Exception as exc:  # noqa: BLE001 - no NVML, nothing to watch yet
                log.warning("XID events not watched: NVML unavailable (%s)", exc)
                return
            self._initialised = True
        try:
            event_set = lib.nvmlEventSetCreate()
        except Exception as exc:  # noqa: BLE001
            log.warning("XID events not watched: %s", exc)
            return
        mask = getattr(lib, "nvmlEventTypeXidCriticalError", XID_CRITICAL) | getattr(
            lib, "nvmlEventTypeDoubleBitEccError", DOUBLE_BIT_ECC
        )
        watched: set[str] = set()
        for uuid in sorted(uuids):
            try:
                handle = lib.nvmlDeviceGetHandleByUUID(uuid)
                lib.nvmlDeviceRegisterEvents(handle, mask, event_set)
            except Exception as exc:  # noqa: BLE001
                log.warning("GPU %s: XID events not available (%s); health checks only", uuid, exc)
                continue
            watched.add(uuid)
        self._free()
        self._event_set = event_set
        self.watched = frozenset(watched)
        self.arms += 1
        log.info("watching XID and ECC events on %d GPUs", len(watched))

    def _free(self) -> None:
        if self._event_set is None:
            return
        try:
            self._lib.nvmlEventSetFree(self._event_set)
        except Exception:
            log.debug("NVML event set free failed", exc_info=True)
        self._event_set = None

    def starting(self) -> None:
        log.info("XID watcher started")

    def step(self) -> float | None:
        # Four times a second on an idle node: no lock or event is touched
        # unless the GPU set changed (`track` replaces `_wanted` whole).
        wanted = self._wanted
        if wanted != self._armed:
            self._arm(wanted)
        if not self._settled.is_set():
            with self._lock:
                if wanted == self._wanted:
                    self._settled.set()
        if self._event_set is None:
            return None  # nothing registered: sleep until the GPU set changes
        try:
            event = self._lib.nvmlEventSetWait_v2(self._event_set, WAIT_MS)
        except Exception as exc:
            if getattr(exc, "value", None) == self._timeout_code:
                return 0.0
            raise
        self._handle(event, getattr(self._lib, "nvmlEventTypeXidCriticalError", XID_CRITICAL))
        return 0.0

    def finished(self) -> None:
        self._free()
        if self._initialised:
            try:
                self._lib.nvmlShutdown()
            except Exception:
                log.debug("nvmlShutdown failed", exc_info=True)

    def _handle(self, event: Any, xid_type: int) -> None:
        try:
            self._dispatch(event, xid_type)
        finally:
            self.events_seen += 1

    def _dispatch(self, event: Any, xid_type: int) -> None:
        try:
            uuid = _text(self._lib.nvmlDeviceGetUUID(event.device))
        except Exception:  # noqa: BLE001 - the GPU may be gone; checks will see it
            log.warning("NVML event for a GPU that no longer answers")
            return
        if int(event.eventType) & xid_type:
            xid = int(event.eventData)
            if xid in self._ignore:
                log.info("GPU %s: XID %d (application error, ignored)", uuid, xid)
                return
            reason = f"XID {xid}"
        else:
            reason = "double-bit ECC error"
        for device in self._faulted(uuid, event):
            log.error("GPU %s: %s; marking it Unhealthy", device, reason)
            self._health.fault(device, reason, self._good_checks)
        self._on_fault()

    def _faulted(self, uuid: str, event: Any) -> list[str]:
        """The served devices an event on GPU `uuid` faults: the GPU itself,
        or its MIG devices: the one whose instances the event names, or all
        of them when it names none (a fault of the whole GPU)."""
        with self._lock:
            slices = self._slices.get(uuid)
        if not slices:
            return [uuid]
        gpu_instance = getattr(event, "gpuInstanceId", NO_INSTANCE)
        compute_instance = getattr(event, "computeInstanceId", NO_INSTANCE)
        named = [
            served
            for gi, ci, served in slices
            if gi == gpu_instance and compute_instance in (ci, NO_INSTANCE)
        ]
        return named or [served for _, _, served in slices]
