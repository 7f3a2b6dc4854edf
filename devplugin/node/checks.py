"""The check loop: the only place hardware is read while the daemon runs.

A light check (ports, device nodes, NVML per GPU) every `interval`, a full
rescan of the PCI tree every `rescan` seconds or at once on a hotplug event,
and a re-judgement without a scan whenever an event changed a verdict.
Between checks, the port watch reads only the HCAs' port states every
`port_interval` (sysfs has no event for them, and the light check's other
reads cost far more); a change starts a light check at once, so a port
going down reaches the kubelet within about `port_interval`.
Every read runs under the discoverer's deadlines, so a wedged GPU or a
blocking sysfs file costs one check at most `read_timeout` and leaves that
device Unhealthy; the rest of the node keeps being checked and served.

Staleness: a check is complete when every read returned. If no check has
been complete for `stale_after` seconds (a read still wedged, or the loop
itself stalled), `healthy()` says so and `/healthz` fails, so the kubelet's
liveness probe restarts the daemon.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from devplugin.loops import Backoff, ThreadLoop
from devplugin.model import Inventory
from devplugin.node.discovery import Discoverer
from devplugin.node.discovery.sysfs import PortStates, port_states_of
from devplugin.node.metrics import Metrics
from devplugin.node.pipeline import Pipeline

log = logging.getLogger(__name__)


class Requests:
    """What events ask of the check loop; created before the parts that ask.

    Setting a flag and an event never blocks, so any thread may call these
    (an XID watcher, the cleanup worker, the udev watcher, an RPC handler)."""

    def __init__(self) -> None:
        self.wake = threading.Event()
        self.full = False
        self.judge = False

    def rescan(self) -> None:
        """A full rescan soon (hotplug)."""
        self.full = True
        self.wake.set()

    def rejudge(self) -> None:
        """Re-decide health without scanning (an XID, a cleanup state change)."""
        self.judge = True
        self.wake.set()


class CheckLoop(ThreadLoop):
    def __init__(
        self,
        discoverer: Discoverer,
        pipeline: Pipeline,
        *,
        requests: Requests | None = None,
        interval: float,
        rescan: float,
        stale_after: float,
        on_scan: Callable[[Inventory], None] = lambda inventory: None,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        port_interval: float | None = None,
    ) -> None:
        # A failed check keeps the previous device lists and is tried again
        # after a pause, not at once in a tight loop.
        self.requests = requests if requests is not None else Requests()
        # The events that ask for a check are this loop's pokes.
        super().__init__(
            "checks",
            backoff=Backoff(min(1.0, interval), interval),
            failing="health check failed; keeping the previous device lists",
            wake=self.requests.wake,
        )
        self._discoverer = discoverer
        self._port_interval = port_interval
        # The port states the newest check or port read saw (both take the
        # scan lock, so the newest to finish is the newest read).
        self._ports: PortStates | None = None
        self._pipeline = pipeline
        self._interval = interval
        self._rescan = rescan
        self._stale_after = stale_after
        self._on_scan = on_scan
        self._metrics = metrics
        self._clock = clock
        never = float("inf")
        self._port_every = port_interval or never
        self._next_check = self._next_full = self._next_ports = never
        self._last_complete = clock()
        self._scan_lock = threading.Lock()
        self.checks = 0  # completed scans, for observers

    # -- one check ---------------------------------------------------------------
    def check(self, *, full: bool = True) -> Inventory:
        """Scan with deadlines, hand the snapshot to the pipeline."""
        with self._scan_lock:
            inventory = self._discoverer.scan(full=full)
            stuck = self._discoverer.deadlines.stuck()
            now = self._clock()
            if not stuck and not self._discoverer.incomplete:
                self._last_complete = now
            if self._metrics is not None:
                self._metrics.stuck_reads.set(len(stuck))
                self._metrics.check_age.set(now - self._last_complete)
            self._pipeline.ingest(inventory)
            self._on_scan(inventory)
            self._ports = port_states_of(inventory.hcas)
            self.checks += 1
            return inventory

    def ports_changed(self) -> bool:
        """Read the port states; whether they differ from the newest seen.
        Under the scan lock: a scan that began before this read ends before
        it, so its older states can never be taken for the newest."""
        with self._scan_lock:
            found = self._discoverer.port_states()
            if found is None or found == self._ports:
                return False
            changed = self._ports is not None
            self._ports = found
            return changed

    def healthy(self) -> tuple[bool, str]:
        """False once no check has read every device for `stale_after` seconds."""
        now = self._clock()
        age = now - self._last_complete
        if age <= self._stale_after:
            return True, ""
        stuck = self._discoverer.deadlines.stuck()
        if stuck:
            detail = ", ".join(
                f"{key} for {now - since:.0f}s" for key, since in sorted(stuck.items())
            )
            return False, f"health checks incomplete for {age:.0f}s: no answer from {detail}"
        unread = self._discoverer.incomplete
        if unread:
            return False, (
                f"health checks incomplete for {age:.0f}s: out of file descriptors "
                f"reading {', '.join(unread[:5])}"
            )
        return False, f"no health check completed for {age:.0f}s"

    # -- the loop ----------------------------------------------------------------
    def starting(self) -> None:
        log.info(
            "check loop started (health every %.1fs, HCA ports every %s, full rescan every %.1fs)",
            self._interval,
            f"{self._port_interval:.1f}s" if self._port_interval else "check",
            self._rescan,
        )
        now = self._clock()
        self._next_check = now + self._interval
        self._next_full = now + self._rescan
        self._next_ports = now + self._port_every

    def step(self) -> float:
        """What is due or asked for, then the seconds until the next due."""
        requests = self.requests
        full, requests.full = requests.full, False
        judge, requests.judge = requests.judge, False
        now = self._clock()
        due_ports = now >= self._next_ports
        if due_ports and not full and now < self._next_full and now < self._next_check:
            self._next_ports = now + self._port_every
            if self.ports_changed():
                log.debug("an HCA port changed state; checking now")
                self._next_check = now
        if full or now >= self._next_full:
            self.check(full=True)
            self._next_full = now + self._rescan
            self._next_check = now + self._interval
            self._next_ports = now + self._port_every
        elif now >= self._next_check:
            self.check(full=False)
            self._next_check = now + self._interval
            self._next_ports = now + self._port_every
        elif judge:
            self._pipeline.rejudge()
        wake_at = min(self._next_check, self._next_full, self._next_ports)
        return max(0.0, wake_at - self._clock())
