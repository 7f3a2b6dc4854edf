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

Kinds handed out through DRA (`explicit`) are not inferred from polls: the
kubelet says when a claim is prepared and unprepared, so a device is in use
exactly while a claim holds it (`begin_claim` .. `end_claim`), and the
claims are kept in the same checkpoint as the devices they hold.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from devplugin.model import DeviceKind, Health
from devplugin.node.ledger import Ledger
from devplugin.node.lifecycle.checkpoint import Checkpoint, ClaimRecord, LifecycleState
from devplugin.node.lifecycle.health import HealthTracker, Verdict
from devplugin.node.lifecycle.hooks import (
    HookDevice,
    HookRunner,
    HookSpec,
    Started,
    Tracker,
    kill_group,
    process_start_ticks,
    run_hook,
)

log = logging.getLogger(__name__)

# How long stop waits for the worker once its running hook was killed.
STOP_WAIT = 5.0

Describe = Callable[[DeviceKind, Sequence[str]], list[HookDevice] | None]

# (namespace, pod, pod uid when known)
Owner = tuple[str, str, str | None]


class PodWitness(Protocol):
    """What the cluster says about a pod (the pod watch); never blocks."""

    def uid_of(self, namespace: str, pod: str) -> str | None:
        """The uid of the pod of that name on this node now, if known."""

    def ended(self, owner: Owner) -> bool | None:
        """Whether the pod is gone or finished; None when the watch cannot tell."""

    def init_claimant(self, resource: str) -> bool | None:
        """Whether a live pod on this node has a (run-once) init container
        asking for `resource`; None when the watch cannot tell."""


@dataclass
class _Job:
    attempts: int = 0
    next_at: float = 0.0
    running: bool = False
    last_error: str = ""


def _by_id(key: tuple[DeviceKind, str]) -> tuple[str, str]:
    return key[0].value, key[1]


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
        on_save: Callable[[bool], None] = lambda ok: None,
        runner: HookRunner = run_hook,
        clock: Callable[[], float] = time.monotonic,
        witness: PodWitness | None = None,
        explicit: Collection[DeviceKind] = (),
    ) -> None:
        self._hooks = dict(hooks)
        # Kinds whose releases only end_claim says (DRA), never a poll.
        self._explicit = frozenset(explicit)
        self._claims: dict[str, ClaimRecord] = {}
        self._claimed: dict[tuple[DeviceKind, str], str] = {}
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
        self._on_save = on_save
        # Set at stop: running hooks are killed, their devices stay owed.
        self._cancel = threading.Event()
        # No trustworthy checkpoint: every device seen is adopted as possibly
        # dirty (in use until PodResources says otherwise, then cleaned).
        self._untrusted = False
        self._adopted: set[tuple[DeviceKind, str]] = set()
        # Hooks running now, and hooks a previous daemon left running.
        self._running: dict[tuple[DeviceKind, str], tuple[int, int | None]] = {}
        self._leftovers: dict[tuple[DeviceKind, str], tuple[int, int | None]] = {}
        # Devices whose last change is not in the checkpoint (a write failed).
        self._unsaved: set[tuple[DeviceKind, str]] = set()
        self._save_error: str | None = None
        # With the pod watch, PodResources no longer showing a device is not
        # enough: its pod must also be gone or finished (PodResources can
        # answer empty for a while; a finished init container's devices
        # belong to the pod until it ends, as the kubelet keeps them).
        self._witness = witness
        self._owners: dict[tuple[DeviceKind, str], Owner] = {}
        self._held_back: set[tuple[DeviceKind, str]] = set()
        # Allocated while the pod watch could not name the pod (it lagged the
        # kubelet). PodResources never lists a finished init container, so
        # its absence there proves nothing while some live pod on this node
        # has an init container asking for the resource.
        self._unnamed: set[tuple[DeviceKind, str]] = set()
        self.runs = 0

    # -- lifecycle -------------------------------------------------------------
    def load(self) -> None:
        """Read the checkpoint (once): devices in use before a restart stay
        Unhealthy until a poll says where they are; owed cleanups stay owed;
        hooks a killed daemon left running are killed (and waited for) first."""
        if self._loaded:
            return
        self._loaded = True
        if self._checkpoint is None:
            return
        saved = self._checkpoint.load()
        if not saved.trusted and self._hooks:
            log.warning(
                "lifecycle state unknown: every %s device not held by a running container "
                "is cleaned before it is offered",
                " and ".join(self._names[kind] for kind in self._hooks),
            )
        with self._cond:
            self._untrusted = not saved.trusted
            for claim in saved.claims.values():
                self._remember_claim_locked(claim)
            for kind in DeviceKind:
                self._assigned[kind] = set(saved.assigned[kind])
                for device in saved.assigned[kind]:
                    # A claim's device is known to be in use until its unprepare.
                    if kind in self._hooks and (kind, device) not in self._claimed:
                        self._unverified.add((kind, device))
                for device in saved.pending[kind]:
                    if kind in self._hooks:
                        self._jobs[(kind, device)] = _Job()
            for (kind, device), process in saved.running.items():
                self._leftovers[(kind, device)] = process
                # Whatever the hook was doing, the device's state is unknown.
                if kind in self._hooks:
                    self._jobs.setdefault((kind, device), _Job())
        if any(saved.assigned.values()) or any(saved.pending.values()):
            log.info(
                "checkpoint: %d devices were in use, %d cleanups owed",
                sum(len(ids) for ids in saved.assigned.values()),
                sum(len(ids) for ids in saved.pending.values()),
            )
        for key in list(self._leftovers):
            self._end_leftover(key)

    def _end_leftover(self, key: tuple[DeviceKind, str]) -> bool:
        """Kill a hook a previous daemon left running; whether none is left."""
        with self._cond:
            process = self._leftovers.get(key)
        if process is None:
            return True
        pgid, ticks = process
        alive = ticks is None or process_start_ticks(pgid) == ticks
        if alive:
            log.warning(
                "%s: a hook for %s from before the restart is still running "
                "(process group %d); killing it",
                self._names.get(key[0], key[0].value), key[1], pgid,
            )  # fmt: skip
            if not kill_group(pgid):
                return False
        with self._cond:
            self._leftovers.pop(key, None)
            self._save_locked({key})
        return True

    def present(self, kind: DeviceKind, ids: Sequence[str]) -> None:
        """The devices a scan found. Without a trustworthy checkpoint, each one
        seen for the first time is treated as in use by an unknown container:
        Unhealthy until PodResources says, then kept (held) or cleaned."""
        if not self._untrusted or kind not in self._hooks:
            return
        with self._cond:
            new = [d for d in ids if (kind, d) not in self._adopted]
            for device in new:
                self._adopted.add((kind, device))
                if device in self._assigned[kind] or (kind, device) in self._jobs:
                    continue
                self._assigned[kind].add(device)
                self._unverified.add((kind, device))
            if new:
                self._save_locked({(kind, d) for d in new})

    def start(self) -> None:
        """Start the worker (loading the checkpoint first if nobody did). The
        runtime starts it after the first scan, so owed cleanups find their
        devices described instead of being pushed back."""
        self.load()
        self._thread = threading.Thread(target=self._work, name="cleanup", daemon=True)
        self._thread.start()

    def signal_stop(self) -> None:
        """Stop the worker and kill every running hook (their devices stay owed)."""
        self._cancel.set()
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def join(self, timeout: float = STOP_WAIT) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def checkpoint_error(self) -> str | None:
        """Why the last checkpoint write failed; None once one succeeded."""
        with self._cond:
            return self._save_error

    def tracker(self, kind: DeviceKind, ids: Sequence[str]) -> Tracker:
        """Records a hook's process group in the checkpoint while it runs."""
        keys = {(kind, device) for device in ids}

        def track(started: Started | None) -> None:
            with self._cond:
                for key in keys:
                    if started is None:
                        self._running.pop(key, None)
                    else:
                        self._running[key] = (started.pgid, started.start_ticks)
                self._save_locked(keys)

        return track

    @property
    def cancel(self) -> threading.Event:
        return self._cancel

    def stop(self) -> None:
        self.signal_stop()
        self.join()

    # -- inputs ----------------------------------------------------------------
    def allocated(self, kind: DeviceKind, ids: Sequence[str], owner: Owner | None = None) -> None:
        """An Allocate gave these devices to a container of `owner`'s pod (when
        the pod cache could tell)."""
        if self._witness is None:
            owner = None
        with self._cond:
            self._assigned[kind].update(ids)
            for device in ids:
                self._missing.pop((kind, device), None)
                self._unverified.discard((kind, device))
                # A new holder: the pod being admitted when the pod cache
                # can tell, else PodResources will say.
                if owner is not None:
                    self._owners[(kind, device)] = owner
                    self._unnamed.discard((kind, device))
                else:
                    self._owners.pop((kind, device), None)
                    if self._witness is not None:
                        self._unnamed.add((kind, device))
                self._held_back.discard((kind, device))
            self._save_locked({(kind, device) for device in ids})

    def observe(self) -> None:
        """The ledger has a new PodResources answer: count each in-use device
        it no longer shows as taken; enough misses in a row are a release
        (with the pod watch, once the holder's pod has also ended)."""
        self._settle(count=True)

    def reconsider(self) -> None:
        """The pod watch changed: devices held back only because their pod was
        still running may be released now."""
        if self._witness is not None:
            self._settle(count=False)

    def _settle(self, *, count: bool) -> None:
        changed = False
        touched: set[tuple[DeviceKind, str]] = set()
        taken = {kind: self._ledger.in_use(kind) for kind in DeviceKind}
        owners = self._holders() if count else {}
        with self._cond:
            self._owners.update(owners)
            self._unnamed -= owners.keys()
            for kind in DeviceKind:
                if kind in self._explicit:
                    continue  # claims say when these are released
                effective = taken[kind]
                if count:
                    for device in effective:
                        self._missing.pop((kind, device), None)
                        self._held_back.discard((kind, device))
                        if (kind, device) in self._unverified:
                            self._unverified.discard((kind, device))
                            changed = True
                    self._assigned[kind] |= effective
                for device in sorted(self._assigned[kind] - effective):
                    key = (kind, device)
                    if count:
                        self._missing[key] = self._missing.get(key, 0) + 1
                    if self._missing.get(key, 0) < self._confirmations:
                        continue
                    if not self._pod_ended_locked(key):
                        continue
                    del self._missing[key]
                    self._assigned[kind].discard(device)
                    self._unverified.discard(key)
                    self._owners.pop(key, None)
                    self._unnamed.discard(key)
                    self._held_back.discard(key)
                    changed = True
                    touched.add(key)
                    if kind in self._hooks and key not in self._jobs:
                        log.info("%s: %s released; cleanup scheduled", self._names[kind], device)
                        self._jobs[key] = _Job()
            if changed or self._save_error is not None:
                # A failed write is retried at every poll until one succeeds.
                changed |= self._save_locked(touched)
                self._cond.notify_all()
        if changed:
            self._on_change()

    def _holders(self) -> dict[tuple[DeviceKind, str], Owner]:
        """Who holds each device per the last PodResources answer (pods named
        with the uid the watch knows now, so a namesake later is told apart)."""
        if self._witness is None:
            return {}
        found: dict[tuple[DeviceKind, str], Owner] = {}
        uids: dict[tuple[str, str], str | None] = {}
        for (namespace, pod, _), kinds in self._ledger.holdings().containers.items():
            if (namespace, pod) not in uids:
                uids[(namespace, pod)] = self._witness.uid_of(namespace, pod)
            for kind, devices in kinds.items():
                for device in devices:
                    found[(kind, device)] = (namespace, pod, uids[(namespace, pod)])
        return found

    def _pod_ended_locked(self, key: tuple[DeviceKind, str]) -> bool:
        """Whether a device PodResources no longer shows may be released."""
        owner = self._owners.get(key)
        if self._witness is None:
            return True  # no pod watch: PodResources decides
        if owner is None:
            if key not in self._unnamed:
                return True  # never seen held by a named pod: PodResources decides
            claimed = self._witness.init_claimant(self._names.get(key[0], key[0].value))
            if claimed is False:
                return True
            if key not in self._held_back:
                self._held_back.add(key)
                log.info(
                    "%s: %s not listed by PodResources; its pod was not known when it was "
                    "allocated and %s; not released",
                    self._names.get(key[0], key[0].value), key[1],
                    "a running pod's init container asks for this resource"
                    if claimed else "the pod watch is down",
                )  # fmt: skip
            return False
        ended = self._witness.ended(owner)
        if ended:
            return True
        if key not in self._held_back:
            self._held_back.add(key)
            log.info(
                "%s: %s not listed by PodResources, but pod %s/%s %s; not released",
                self._names.get(key[0], key[0].value), key[1], owner[0], owner[1],
                "is still running" if ended is False else "cannot be checked (pod watch down)",
            )  # fmt: skip
        return False

    # -- DRA claims ------------------------------------------------------------
    @property
    def untrusted(self) -> bool:
        """No trustworthy checkpoint was found: what held what is unknown."""
        return self._untrusted

    def claims(self) -> list[ClaimRecord]:
        with self._cond:
            return list(self._claims.values())

    def claim(self, uid: str) -> ClaimRecord | None:
        with self._cond:
            return self._claims.get(uid)

    def claimed_by(self, kind: DeviceKind, device: str) -> str | None:
        """The uid of the claim holding this device, if one does."""
        with self._cond:
            return self._claimed.get((kind, device))

    def begin_claim(self, claim: ClaimRecord) -> str | None:
        """A prepare starts: the claim (not completed) and its devices are in
        use, recorded before any hook runs. An error text, and nothing
        changed, when a device is another claim's or the write failed."""
        keys = {(device.kind, device.id) for device in claim.devices}
        with self._cond:
            for key in sorted(keys, key=_by_id):
                holder = self._claimed.get(key)
                if holder is not None and holder != claim.uid:
                    return f"{key[1]} is prepared for claim {holder}"
            before = self._claims.get(claim.uid)
            if before is not None:
                self._forget_claim_locked(before)
            self._hold_locked(claim)
            if self._write_claims_locked(keys):
                return None
            # Unrecorded, it must not go on: a crash would forget these devices.
            self._forget_claim_locked(claim)
            for kind, device in keys:
                self._assigned[kind].discard(device)
            if before is not None:
                self._remember_claim_locked(before)
            return f"checkpoint not written: {self._save_error}"

    def complete_claim(self, claim: ClaimRecord) -> str | None:
        """A prepare succeeded: recorded as completed, with its answers."""
        done = ClaimRecord(claim.uid, claim.namespace, claim.name, claim.devices, completed=True)
        with self._cond:
            self._claims[claim.uid] = done
            if self._write_claims_locked(set()):
                return None
            self._claims[claim.uid] = claim
            return f"checkpoint not written: {self._save_error}"

    def end_claim(self, uid: str) -> ClaimRecord | None:
        """A claim is unprepared (or a failed prepare rolled back): its devices
        are released and each one with a cleanup hook is owed a cleanup, in
        the same write that forgets the claim. Returns the claim, if known."""
        with self._cond:
            claim = self._claims.get(uid)
            if claim is None:
                return None
            self._forget_claim_locked(claim)
            keys = {(device.kind, device.id) for device in claim.devices}
            for kind, device in sorted(keys, key=_by_id):
                if self._claimed.get((kind, device)) is not None:
                    continue  # also named by another claim (admin access)
                if self._release_locked((kind, device)):
                    log.info("%s: %s released by claim %s; cleanup scheduled",
                             self._names.get(kind, kind.value), device, uid)  # fmt: skip
            self._write_claims_locked(keys)
            self._cond.notify_all()
        self._on_change()
        return claim

    def adopt_claim(self, claim: ClaimRecord) -> None:
        """After a start without a trustworthy checkpoint: a claim the API
        server says holds devices of this node is taken as prepared."""
        keys = {(device.kind, device.id) for device in claim.devices}
        with self._cond:
            if claim.uid in self._claims:
                return
            self._hold_locked(claim)
            self._write_claims_locked(keys)
        self._on_change()

    def release_unclaimed(self, kinds: Collection[DeviceKind]) -> int:
        """After the claims were adopted: every device of these kinds still
        unverified is held by no claim, so it is released and cleaned.
        Returns how many were."""
        released: set[tuple[DeviceKind, str]] = set()
        with self._cond:
            for key in sorted(self._unverified, key=_by_id):
                kind = key[0]
                if kind not in kinds or key in self._claimed:
                    continue
                self._release_locked(key)
                released.add(key)
            if released:
                self._write_claims_locked(released)
                self._cond.notify_all()
        if released:
            self._on_change()
        return len(released)

    def _hold_locked(self, claim: ClaimRecord) -> None:
        """The claim is known, and its devices are in use by it."""
        self._remember_claim_locked(claim)
        for device in claim.devices:
            self._assigned[device.kind].add(device.id)
            self._unverified.discard((device.kind, device.id))

    def _release_locked(self, key: tuple[DeviceKind, str]) -> bool:
        """A DRA device no claim holds any more: out of use, and owed a
        cleanup when its kind has a hook. Whether a cleanup was newly owed."""
        kind, device = key
        self._assigned[kind].discard(device)
        self._unverified.discard(key)
        if kind not in self._hooks or key in self._jobs:
            return False
        self._jobs[key] = _Job()
        return True

    def _remember_claim_locked(self, claim: ClaimRecord) -> None:
        self._claims[claim.uid] = claim
        for device in claim.devices:
            self._claimed.setdefault((device.kind, device.id), claim.uid)

    def _forget_claim_locked(self, claim: ClaimRecord) -> None:
        self._claims.pop(claim.uid, None)
        for device in claim.devices:
            key = (device.kind, device.id)
            if self._claimed.get(key) == claim.uid:
                del self._claimed[key]
                # Another claim naming it (admin access) keeps it.
                for other in self._claims.values():
                    if any((d.kind, d.id) == key for d in other.devices):
                        self._claimed[key] = other.uid
                        break

    def _write_claims_locked(self, keys: set[tuple[DeviceKind, str]]) -> bool:
        """Save; whether the write succeeded (a manager without a checkpoint
        keeps claims in memory only)."""
        self._save_locked(keys)
        return self._save_error is None

    def request_cleanup(self, kind: DeviceKind, device: str) -> None:
        """Schedule a cleanup for an idle device (after_cleanup recovery)."""
        if kind not in self._hooks:
            return
        with self._cond:
            key = (kind, device)
            if key in self._jobs or device in self._assigned[kind]:
                return
            self._jobs[key] = _Job()
            self._save_locked({key})
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
            key = (kind, device)
            job = self._jobs.get(key)
            if key in self._leftovers:
                return Verdict(Health.UNHEALTHY, "a hook from before the restart is still running")
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
            if key in self._unverified:
                source = "the claims list" if kind in self._explicit else "PodResources"
                if (kind, device) in self._adopted:
                    return Verdict(
                        Health.UNHEALTHY, f"no trustworthy checkpoint; awaiting {source}"
                    )
                return Verdict(Health.UNHEALTHY, f"in use before restart; awaiting {source}")
            if key in self._unsaved and device not in self._assigned[kind]:
                return Verdict(
                    Health.UNHEALTHY,
                    f"release not recorded: checkpoint write failed ({self._save_error})",
                )
        return None

    def cleans(self, kind: DeviceKind) -> bool:
        """Whether devices of this kind have a cleanup hook."""
        return kind in self._hooks

    def verdicts(self) -> dict[tuple[DeviceKind, str], Verdict]:
        """Every device this manager keeps out of service, and why (one snapshot)."""
        with self._cond:
            keys = (
                set(self._jobs) | self._unverified | self._unsaved | set(self._leftovers)
            )  # fmt: skip
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
        if not self._end_leftover((kind, device)):
            with self._cond:
                job.running = False
                job.next_at = self._clock() + self._retry_initial
                self._cond.notify_all()
            return f"a hook on {device} from before the restart could not be killed"
        if devices is None:
            with self._cond:
                job.running = False
                job.next_at = self._clock() + self._retry_initial
                self._cond.notify_all()
            return f"{device} is not present; cannot clean it"
        result = self._runner(
            spec, "cleanup", name, devices,
            track=self.tracker(kind, [device]), cancel=self._cancel,
        )  # fmt: skip
        self.runs += 1
        if result.cancelled:
            with self._cond:
                job.running = False
                self._save_locked({(kind, device)})
                self._cond.notify_all()
            log.info("%s: cleanup of %s stopped for shutdown; still owed", name, device)
            return f"{device}: {result.describe('cleanup', spec.timeout)}"
        with self._cond:
            job.running = False
            if result.ok:
                self._jobs.pop((kind, device), None)
                self._assigned[kind].discard(device)
                self._missing.pop((kind, device), None)
                self._unverified.discard((kind, device))
                self._owners.pop((kind, device), None)
                self._unnamed.discard((kind, device))
                # Clean now, whatever the checkpoint says about it.
                self._unsaved.discard((kind, device))
            else:
                job.attempts += 1
                delay = min(self._retry_max, self._retry_initial * 2 ** (job.attempts - 1))
                job.next_at = self._clock() + delay
                job.last_error = result.describe("cleanup", spec.timeout)
            self._save_locked({(kind, device)} if not result.ok else set())
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

    def _save_locked(self, changed: set[tuple[DeviceKind, str]] | None = None) -> bool:
        """Write the state; on failure remember which devices changed unrecorded
        (an idle one is not offered until a write succeeds or it is cleaned).
        Returns whether the write-failure state changed."""
        if self._checkpoint is None:
            return False
        state = LifecycleState()
        for kind in DeviceKind:
            state.assigned[kind] = set(self._assigned[kind])
        for kind, device in self._jobs:
            state.pending[kind].add(device)
        state.running = {**self._leftovers, **self._running}
        state.claims = dict(self._claims)
        before = self._save_error
        try:
            self._checkpoint.save(state)
        except OSError as exc:
            self._unsaved |= changed or set()
            self._save_error = f"{self._checkpoint.path}: {exc.strerror or exc}"
            if before is None:
                log.error("cannot write checkpoint %s", self._save_error)
            self._on_save(False)
            return before is None
        self._unsaved.clear()
        self._save_error = None
        if before is not None:
            log.info("checkpoint %s written again", self._checkpoint.path)
        self._on_save(True)
        return before is not None
