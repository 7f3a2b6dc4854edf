"""Cleaning devices after their containers, and knowing which are in use.

The only reliable signal a device plugin has that a device was released is
the kubelet's PodResources API. The manager keeps the set of devices in use
(Allocate adds to it; each poll says which are still held) and, when a device
has been absent from `confirmations` polls in a row, owes it a cleanup.
While a cleanup is owed or running the device is Unhealthy, so the kubelet
does not hand it out; success makes it Healthy; failure keeps it out
(quarantined) and retries with exponential backoff.

A device the kubelet allocates again before a poll noticed its release is
cleaned inline, in that Allocate, before the new container gets it: the
kubelet only allocates free devices, so the allocation itself proves the
release.

The sets are written to a checkpoint on every change. After a restart,
devices that were in use stay Unhealthy until a poll says whether they are
still in use (then Healthy, not cleaned) or released (then cleaned first).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from devplugin.ledger import Ledger
from devplugin.lifecycle.checkpoint import Checkpoint, LifecycleState
from devplugin.lifecycle.health import HealthTracker, Verdict
from devplugin.lifecycle.hooks import HookDevice, HookResult, HookSpec, run_hook
from devplugin.model import DeviceKind, Health

log = logging.getLogger(__name__)

Describe = Callable[[DeviceKind, Sequence[str]], list[HookDevice] | None]
HookRunner = Callable[[HookSpec, str, str, Sequence[HookDevice]], HookResult]


@dataclass
class _Job:
    attempts: int = 0
    next_at: float = 0.0
    running: bool = False
    last_error: str = ""


class CleanupManager:
    def __init__(
        self,
        *,
        hooks: Mapping[DeviceKind, HookSpec],
        resource_names: Mapping[DeviceKind, str],
        describe: Describe,
        checkpoint: Checkpoint | None,
        ledger: Ledger,
        health: HealthTracker | None = None,
        confirmations: int = 2,
        retry_initial: float = 5.0,
        retry_max: float = 300.0,
        on_change: Callable[[], None] = lambda: None,
        runner: HookRunner = run_hook,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._hooks = dict(hooks)
        self._names = dict(resource_names)
        self._describe = describe
        self._checkpoint = checkpoint
        self._confirmations = confirmations
        self._retry_initial = retry_initial
        self._retry_max = retry_max
        self._on_change = on_change
        self._ledger = ledger
        self._health = health
        self._runner = runner
        self._clock = clock
        self._cond = threading.Condition()
        self._assigned: dict[DeviceKind, set[str]] = {kind: set() for kind in DeviceKind}
        self._unverified: set[tuple[DeviceKind, str]] = set()
        self._missing: dict[tuple[DeviceKind, str], int] = {}
        self._jobs: dict[tuple[DeviceKind, str], _Job] = {}
        self._stop = False
        self._loaded = False
        self._thread: threading.Thread | None = None
        self.runs = 0

    # -- lifecycle -------------------------------------------------------------
    def load(self) -> None:
        """Read the checkpoint (once): devices in use before a restart stay
        Unhealthy until a poll says where they are; owed cleanups stay owed."""
        if self._loaded:
            return
        self._loaded = True
        if self._checkpoint is not None:
            saved = self._checkpoint.load()
            with self._cond:
                for kind in DeviceKind:
                    self._assigned[kind] = set(saved.assigned[kind])
                    for device in saved.assigned[kind]:
                        if kind in self._hooks:
                            self._unverified.add((kind, device))
                    for device in saved.pending[kind]:
                        if kind in self._hooks:
                            self._jobs[(kind, device)] = _Job()
            if any(saved.assigned.values()) or any(saved.pending.values()):
                log.info(
                    "checkpoint: %d devices were in use, %d cleanups owed",
                    sum(len(ids) for ids in saved.assigned.values()),
                    sum(len(ids) for ids in saved.pending.values()),
                )

    def start(self) -> None:
        """Start the worker (loading the checkpoint first if nobody did). The
        runtime starts it after the first scan, so owed cleanups find their
        devices described instead of being pushed back."""
        self.load()
        self._thread = threading.Thread(target=self._work, name="cleanup", daemon=True)
        self._thread.start()

    def signal_stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the worker; by default as long as a running hook may take."""
        if timeout is None:
            timeout = max((s.timeout for s in self._hooks.values()), default=0) + 5
        if self._thread is not None:
            self._thread.join(timeout)

    def stop(self) -> None:
        self.signal_stop()
        self.join()

    # -- inputs ----------------------------------------------------------------
    def allocated(self, kind: DeviceKind, ids: Sequence[str]) -> None:
        with self._cond:
            self._assigned[kind].update(ids)
            for device in ids:
                self._missing.pop((kind, device), None)
                self._unverified.discard((kind, device))
            self._save_locked()

    def observe(self) -> None:
        """The ledger has a new PodResources answer: count each in-use device
        it no longer shows as taken; enough misses in a row are a release."""
        changed = False
        taken = {kind: self._ledger.taken(kind) for kind in DeviceKind}
        with self._cond:
            for kind in DeviceKind:
                effective = taken[kind]
                for device in effective:
                    self._missing.pop((kind, device), None)
                    if (kind, device) in self._unverified:
                        self._unverified.discard((kind, device))
                        changed = True
                self._assigned[kind] |= effective
                for device in sorted(self._assigned[kind] - effective):
                    key = (kind, device)
                    self._missing[key] = self._missing.get(key, 0) + 1
                    if self._missing[key] < self._confirmations:
                        continue
                    del self._missing[key]
                    self._assigned[kind].discard(device)
                    self._unverified.discard(key)
                    changed = True
                    if kind in self._hooks and key not in self._jobs:
                        log.info("%s: %s released; cleanup scheduled", self._names[kind], device)
                        self._jobs[key] = _Job()
            if changed:
                self._save_locked()
                self._cond.notify_all()
        if changed:
            self._on_change()

    def request_cleanup(self, kind: DeviceKind, device: str) -> None:
        """Schedule a cleanup for an idle device (after_cleanup recovery)."""
        if kind not in self._hooks:
            return
        with self._cond:
            key = (kind, device)
            if key in self._jobs or device in self._assigned[kind]:
                return
            self._jobs[key] = _Job()
            self._save_locked()
            self._cond.notify_all()
        self._on_change()

    def prepare(
        self, kind: DeviceKind, ids: Sequence[str], *, reuse_proves_release: bool = True
    ) -> str | None:
        """Before Allocate hands these devices out: wait for a running cleanup,
        or clean inline any device still believed dirty. An error text when a
        device could not be made clean.

        `reuse_proves_release` is False for shared devices: another replica
        of a device being allocated says nothing about the first holder."""
        spec = self._hooks.get(kind)
        if spec is None:
            return None
        for device in ids:
            key = (kind, device)
            with self._cond:
                job = self._jobs.get(key)
                if job is not None and job.running:
                    self._cond.wait_for(partial(self._idle, key), timeout=spec.timeout + 5)
                    job = self._jobs.get(key)
                    if job is not None and job.running:
                        return f"cleanup of {device} is still running"
                if job is None and (not reuse_proves_release or device not in self._assigned[kind]):
                    continue  # clean, or (shared) possibly still in use
                job = self._jobs.setdefault(key, _Job())
                job.running = True
            error = self._run(kind, device, job, spec, inline=True)
            if error is not None:
                return error
        return None

    def _idle(self, key: tuple[DeviceKind, str]) -> bool:
        job = self._jobs.get(key)
        return job is None or not job.running

    # -- queries -----------------------------------------------------------------
    def verdict(self, kind: DeviceKind, device: str) -> Verdict | None:
        with self._cond:
            job = self._jobs.get((kind, device))
            if job is not None:
                if job.running:
                    return Verdict(Health.UNHEALTHY, "cleanup running")
                if job.attempts:
                    return Verdict(
                        Health.UNHEALTHY,
                        f"quarantined: cleanup failed {job.attempts} time(s), retrying "
                        f"({job.last_error})",
                    )
                return Verdict(Health.UNHEALTHY, "cleanup pending")
            if (kind, device) in self._unverified:
                return Verdict(Health.UNHEALTHY, "in use before restart; awaiting PodResources")
        return None

    def cleans(self, kind: DeviceKind) -> bool:
        """Whether devices of this kind have a cleanup hook."""
        return kind in self._hooks

    def verdicts(self) -> dict[tuple[DeviceKind, str], Verdict]:
        """Every device this manager keeps out of service, and why (one snapshot)."""
        with self._cond:
            keys = set(self._jobs) | self._unverified
        found: dict[tuple[DeviceKind, str], Verdict] = {}
        for kind, device in keys:
            verdict = self.verdict(kind, device)
            if verdict is not None:
                found[(kind, device)] = verdict
        return found

    def in_use(self, kind: DeviceKind) -> set[str]:
        with self._cond:
            return set(self._assigned[kind])

    def pending(self) -> dict[tuple[DeviceKind, str], int]:
        """Owed cleanups and their failed attempts so far."""
        with self._cond:
            return {key: job.attempts for key, job in self._jobs.items()}

    # -- the worker --------------------------------------------------------------
    def _work(self) -> None:
        log.info("cleanup worker started")
        while True:
            with self._cond:
                picked = None
                while picked is None and not self._stop:
                    now = self._clock()
                    due = [
                        (job.next_at, key)
                        for key, job in self._jobs.items()
                        if not job.running and job.next_at <= now
                    ]
                    if due:
                        picked = min(due, key=lambda item: item[0])[1]
                        break
                    upcoming = [job.next_at for job in self._jobs.values() if not job.running]
                    self._cond.wait(min(upcoming) - now if upcoming else None)
                if self._stop:
                    break
                assert picked is not None
                job = self._jobs[picked]
                job.running = True
            kind, device = picked
            try:
                self._on_change()
                self._run(kind, device, job, self._hooks[kind], inline=False)
            except Exception:
                log.exception("cleanup of %s failed unexpectedly; will retry", device)
                with self._cond:
                    job.running = False
                    job.attempts += 1
                    job.next_at = self._clock() + self._retry_max
        log.info("cleanup worker stopped")

    def _run(
        self, kind: DeviceKind, device: str, job: _Job, spec: HookSpec, *, inline: bool
    ) -> str | None:
        """Run one cleanup attempt for a job already marked running."""
        name = self._names[kind]
        devices = self._describe(kind, [device])
        if devices is None:
            with self._cond:
                job.running = False
                job.next_at = self._clock() + self._retry_initial
                self._cond.notify_all()
            return f"{device} is not present; cannot clean it"
        result = self._runner(spec, "cleanup", name, devices)
        self.runs += 1
        with self._cond:
            job.running = False
            if result.ok:
                self._jobs.pop((kind, device), None)
                self._assigned[kind].discard(device)
                self._missing.pop((kind, device), None)
                self._unverified.discard((kind, device))
            else:
                job.attempts += 1
                delay = min(self._retry_max, self._retry_initial * 2 ** (job.attempts - 1))
                job.next_at = self._clock() + delay
                job.last_error = result.describe("cleanup", spec.timeout)
            self._save_locked()
            self._cond.notify_all()
        if result.ok:
            log.info(
                "%s: cleanup of %s succeeded in %.2fs%s",
                name,
                device,
                result.duration,
                " (inline, before Allocate)" if inline else "",
            )
            if self._health is not None:
                self._health.cleaned(device)
            self._on_change()
            return None
        log.warning(
            "%s: %s stays out of service: %s (attempt %d)",
            name,
            device,
            job.last_error,
            job.attempts,
        )
        self._on_change()
        return f"{device}: {job.last_error}"

    def _save_locked(self) -> None:
        if self._checkpoint is None:
            return
        state = LifecycleState()
        for kind in DeviceKind:
            state.assigned[kind] = set(self._assigned[kind])
        for kind, device in self._jobs:
            state.pending[kind].add(device)
        try:
            self._checkpoint.save(state)
        except OSError as exc:
            log.error("cannot write checkpoint %s: %s", self._checkpoint.path, exc)
