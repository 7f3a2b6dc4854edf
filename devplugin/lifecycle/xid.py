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

log = logging.getLogger(__name__)

# Event type bits and the timeout code, as nvml.h defines them.
XID_CRITICAL = 0x8
DOUBLE_BIT_ECC = 0x2
TIMEOUT = 10
WAIT_MS = 500


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace").rstrip("\x00")
    return str(value)


class XidWatcher:
    """One thread waiting on an NVML event set for every GPU."""

    def __init__(
        self,
        lib: Any,
        *,
        ignore: Iterable[int],
        on_fault: Callable[[str, str], None],
    ) -> None:
        self._lib = lib
        self._ignore = frozenset(ignore)
        self._on_fault = on_fault
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self.watched: set[str] = set()
        self.events_seen = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="xid", daemon=True)
        self._thread.start()
        self._ready.wait(5)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _register(self) -> Any | None:
        lib = self._lib
        try:
            lib.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - no NVML, nothing to watch
            log.info("XID events not watched: NVML unavailable (%s)", exc)
            return None
        try:
            event_set = lib.nvmlEventSetCreate()
            count = int(lib.nvmlDeviceGetCount())
        except Exception as exc:  # noqa: BLE001
            log.warning("XID events not watched: %s", exc)
            lib.nvmlShutdown()
            return None
        mask = getattr(lib, "nvmlEventTypeXidCriticalError", XID_CRITICAL) | getattr(
            lib, "nvmlEventTypeDoubleBitEccError", DOUBLE_BIT_ECC
        )
        for index in range(count):
            try:
                handle = lib.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(lib.nvmlDeviceGetUUID(handle))
                lib.nvmlDeviceRegisterEvents(handle, mask, event_set)
            except Exception as exc:  # noqa: BLE001
                log.warning("GPU %d: XID events not available (%s); health checks only", index, exc)
                continue
            self.watched.add(uuid)
        log.info("watching XID and ECC events on %d GPUs", len(self.watched))
        return event_set

    def _run(self) -> None:
        event_set = self._register()
        self._ready.set()
        if event_set is None:
            return
        lib = self._lib
        timeout_code = getattr(lib, "NVML_ERROR_TIMEOUT", TIMEOUT)
        xid_type = getattr(lib, "nvmlEventTypeXidCriticalError", XID_CRITICAL)
        try:
            while not self._stop.is_set():
                try:
                    event = lib.nvmlEventSetWait_v2(event_set, WAIT_MS)
                except Exception as exc:  # noqa: BLE001
                    if getattr(exc, "value", None) == timeout_code:
                        continue
                    log.warning("NVML event wait failed (%s); health checks continue", exc)
                    self._stop.wait(1.0)
                    continue
                self._handle(event, xid_type)
        finally:
            try:
                lib.nvmlEventSetFree(event_set)
                lib.nvmlShutdown()
            except Exception:
                log.debug("NVML event set cleanup failed", exc_info=True)

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
        log.error("GPU %s: %s; marking it Unhealthy", uuid, reason)
        self._on_fault(uuid, reason)
