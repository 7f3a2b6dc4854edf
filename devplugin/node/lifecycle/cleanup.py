"""Custody of devices: who holds each one, what it owes, and cleaning it.

Every device has one custody record (`custody.py`) and every change to any
record is one step under this manager's one lock, checked against the
record's phase. Four pieces work around the records:

* takes and releases. A DRA prepare takes a claim's devices in one step
  (`begin_claim`) and an unprepare releases them (`end_claim`); an Allocate
  takes a container's devices (`take`, then `allocated`). A take of a device
  that another holder has is refused in the step that would take it; a take
  of a device owed a cleanup asks for that cleanup now and waits for it, but
  never past the caller's deadline: it answers with a retryable error naming
  the device and the cleanup. The kubelet only allocates devices it believes
  free, so an Allocate of a device still held proves its release: it is
  released in that step and cleaned before it is taken.
* releases from the pod side (`releases.py`): PodResources answers and the
  pod watch say when a device-plugin device is let go.
* the cleaners (`cleaners.py`): a few threads that run the cleanup hook of
  released devices, one device at a time each, only on devices nobody
  holds (this book hands them out). A cleanup counts for a release only if
  it started after it. A failed one quarantines the device and is retried
  with exponential backoff; one that a take waits for runs first.
* the checkpoint: written on every change, derived from the records in a
  stable order. After a restart, devices that were in use stay out until
  their holder is confirmed (then held, not cleaned) or released (then
  cleaned first); owed cleanups stay owed; hooks a killed daemon left
  running are killed first. A write that fails keeps every device whose
  change it did not record out of service and is retried until one succeeds.

While a device is owed a cleanup, being cleaned, or unverified, its verdict
is Unhealthy, so the kubelet does not hand it out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from devplugin.model import DeviceKind
from devplugin.node.ledger import Ledger
from devplugin.node.lifecycle import custody
from devplugin.node.lifecycle.checkpoint import Checkpoint, ClaimRecord
from devplugin.node.lifecycle.cleaners import Attempt, Cleaners, Describe
from devplugin.node.lifecycle.custody import (
    FREE,
    IN_USE,
    OWING,
    Custody,
    Key,
    Owner,
    Phase,
    Take,
    order,
)
from devplugin.node.lifecycle.health import HealthTracker, Verdict
from devplugin.node.lifecycle.hooks import (
    HookRunner,
    HookSpec,
    Started,
    Tracker,
    kill_group,
    process_start_ticks,
    run_hook,
)
from devplugin.node.lifecycle.releases import PodWitness, ReleaseRule

__all__ = ["CleanupManager", "Owner", "PodWitness", "Problem"]

log = logging.getLogger(__name__)

# How long stop waits for the cleaners once their running hooks were killed.
STOP_WAIT = 5.0
# Cleanups that may run at once (each on its own device).
CLEANERS = 4


@dataclass(frozen=True)
class Problem:
    """Why a take did not happen: `before` + the device + `after`, so a
    caller can name the device its own way. `retry`: a cleanup still has to
    finish; asking again later may succeed."""

    before: str
    device: str = ""
    after: str = ""
    retry: bool = False

    def __str__(self) -> str:
        return self.named(self.device)

    def named(self, name: str) -> str:
        return f"{self.before}{name}{self.after}"


def _problem(device: str, text: str, *, retry: bool = False) -> Problem:
    """A Problem from a text that names `device` (its first mention)."""
    before, found, after = text.partition(device)
    if not found:
        return Problem(text, retry=retry)
    return Problem(before, device, after, retry=retry)


@dataclass(frozen=True)
class CleanupPolicy:
    """How releases are judged and cleanups paced."""

    # Polls that must agree a device is free before its release counts.
    confirmations: int = 2
    # Pauses between failed cleanups of one device: the first, the most.
    retry_initial: float = 5.0
    retry_max: float = 300.0
    # Cleanups that may run at once (each on its own device).
    cleaners: int = CLEANERS
    # Kinds whose releases only end_claim says (DRA), never a poll.
    explicit: frozenset[DeviceKind] = frozenset()


DEFAULT_POLICY = CleanupPolicy()


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
        policy: CleanupPolicy = DEFAULT_POLICY,
        on_change: Callable[[], None] = lambda: None,
        on_save: Callable[[bool], None] = lambda ok: None,
        runner: HookRunner = run_hook,
        clock: Callable[[], float] = time.monotonic,
        witness: PodWitness | None = None,
    ) -> None:
        self._hooks = dict(hooks)
        self._explicit = policy.explicit
        self._names = dict(resource_names)
        self._checkpoint = checkpoint
        self._retry_initial = policy.retry_initial
        self._retry_max = policy.retry_max
        self._on_change = on_change
        self._on_save = on_save
        self._ledger = ledger
        self._health = health
        self._clock = clock
        self._witness = witness
        self._rule = ReleaseRule(policy.confirmations, self._names, witness, self._explicit)
        # The one lock: every record and claim changes under it, in one step.
        self._cond = threading.Condition()
        self._records: dict[Key, Custody] = {}
        self._claims: dict[str, ClaimRecord] = {}
        self._releases = 0
        self._stop = False
        self._loaded = False
        # Set at stop: running hooks are killed, their devices stay owed.
        self._cancel = threading.Event()
        self._cleaners = Cleaners(
            self,
            hooks=self._hooks,
            names=self._names,
            describe=describe,
            runner=runner,
            cancel=self._cancel,
            count=policy.cleaners,
        )
        # No trustworthy checkpoint: every device seen is adopted as possibly
        # dirty (in use until its holder is confirmed, else cleaned).
        self._untrusted = False
        self._save_error: str | None = None
        self._save_retry_at = 0.0
        self.runs = 0

    # -- records -------------------------------------------------------------------
    def _get(self, key: Key) -> Custody:
        return self._records.get(key, FREE)

    def _set(self, key: Key, record: Custody) -> None:
        if record == FREE:
            self._records.pop(key, None)
        else:
            self._records[key] = record

    def _release_locked(self, key: Key, *, dirty: bool = True) -> bool:
        """Out of use, owed a cleanup when its kind has a hook (and something
        may have touched it). Whether a cleanup is owed."""
        self._releases += 1
        owes = dirty and key[0] in self._hooks
        self._set(key, custody.released(self._get(key), self._releases, self._clock(), owes=owes))
        return owes

    def _name(self, kind: DeviceKind) -> str:
        return self._names.get(kind, kind.value)

    # -- lifecycle ---------------------------------------------------------------------
    def load(self) -> None:
        """Read the checkpoint (once): devices in use before a restart stay
        out until their holder is confirmed; owed cleanups stay owed; hooks a
        killed daemon left running are killed (and waited for) first."""
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
        now = self._clock()
        with self._cond:
            self._untrusted = not saved.trusted
            for claim in saved.claims.values():
                self._claims[claim.uid] = claim
                for key in _keys(claim):
                    record = self._get(key)
                    self._set(key, custody.held_by(record, (*record.claims, claim.uid), now))
            for kind in DeviceKind:
                for device in saved.assigned[kind]:
                    key = (kind, device)
                    if self._get(key).phase is Phase.HELD:
                        continue  # a claim's device is in use until its unprepare
                    if kind in self._hooks:
                        self._set(key, custody.unverified(self._get(key), now, adopted=False))
                    else:
                        self._set(key, custody.held_by(self._get(key), (), now))
                for device in saved.pending[kind]:
                    key = (kind, device)
                    # In use and owed at once (an older daemon's file): the
                    # holder decides; its release owes the cleanup again.
                    if kind in self._hooks and self._get(key).phase is Phase.FREE:
                        self._release_locked(key)
            for key, process in saved.running.items():
                record = replace(self._get(key), leftover=process)
                self._set(key, record)
                # Whatever the hook was doing, an idle device's state is unknown.
                if key[0] in self._hooks and record.phase is Phase.FREE:
                    self._release_locked(key)
        if any(saved.assigned.values()) or any(saved.pending.values()):
            log.info(
                "checkpoint: %d devices were in use, %d cleanups owed",
                sum(len(ids) for ids in saved.assigned.values()),
                sum(len(ids) for ids in saved.pending.values()),
            )
        for key in sorted(saved.running, key=order):
            self._end_leftover(key)

    def _end_leftover(self, key: Key) -> bool:
        """Kill a hook a previous daemon left running; whether none is left."""
        with self._cond:
            process = self._get(key).leftover
        if process is None:
            return True
        pgid, ticks = process
        alive = ticks is None or process_start_ticks(pgid) == ticks
        if alive:
            log.warning(
                "%s: a hook for %s from before the restart is still running "
                "(process group %d); killing it",
                self._name(key[0]),
                key[1],
                pgid,
            )
            if not kill_group(pgid):
                return False
        with self._cond:
            self._set(key, replace(self._get(key), leftover=None))
            self._save_locked({key})
            self._cond.notify_all()
        return True

    def present(self, kind: DeviceKind, ids: Sequence[str]) -> None:
        """The devices a scan found. Without a trustworthy checkpoint, each one
        seen for the first time is treated as in use by an unknown holder:
        out of service until that is confirmed (held) or not (cleaned)."""
        if not self._untrusted or kind not in self._hooks:
            return
        now = self._clock()
        with self._cond:
            new = [(kind, d) for d in ids if not self._get((kind, d)).adopted]
            for key in new:
                record = replace(self._get(key), adopted=True)
                if record.phase is Phase.FREE:
                    record = custody.unverified(record, now, adopted=True)
                self._set(key, record)
            if new:
                self._save_locked(set(new))

    def start(self) -> None:
        """Start the cleaners (loading the checkpoint first if nobody did). The
        runtime starts them after the first scan, so owed cleanups find their
        devices described instead of being pushed back."""
        self.load()
        self._cleaners.start()

    def signal_stop(self) -> None:
        """Stop the cleaners and kill every running hook (their devices stay
        owed); callers waiting for a cleanup are answered at once."""
        self._cancel.set()
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    @property
    def join_timeout(self) -> float:
        return STOP_WAIT

    def join(self, timeout: float | None = None) -> None:
        self._cleaners.join(STOP_WAIT if timeout is None else timeout)

    def stop(self) -> None:
        self.signal_stop()
        self.join()

    @property
    def cancel(self) -> threading.Event:
        return self._cancel

    def checkpoint_error(self) -> str | None:
        """Why the last checkpoint write failed; None once one succeeded."""
        with self._cond:
            return self._save_error

    def tracker(self, kind: DeviceKind, ids: Sequence[str]) -> Tracker:
        """Records a hook's process group in the checkpoint while it runs."""
        keys = {(kind, device) for device in ids}

        def track(started: Started | None) -> None:
            process = None if started is None else (started.pgid, started.start_ticks)
            with self._cond:
                for key in keys:
                    self._set(key, replace(self._get(key), hook=process))
                self._save_locked(keys)
                self._cond.notify_all()

        return track

    # -- the device-plugin side: takes, allocations, releases seen in polls ---------------
    def take(
        self,
        kind: DeviceKind,
        ids: Sequence[str],
        *,
        shared: bool = False,
        wait_until: float | None = None,
    ) -> Problem | None:
        """Before an Allocate hands these devices out: release any the kubelet
        proves released by allocating them, wait (until `wait_until`) for the
        cleanups they owe, then take them all in one step.

        `shared`: the device is served as replicas; allocating one says
        nothing of the others' holders, and a held one may be joined."""
        keys = _unique((kind, device) for device in ids)
        released: list[Key] = []
        with self._cond:
            for key in keys:
                if custody.reuse_releases(self._get(key), shared=shared):
                    if self._release_locked(key):
                        log.info(
                            "%s: %s allocated again before its release was seen; "
                            "cleaned before it is given",
                            self._name(kind),
                            key[1],
                        )
                    released.append(key)
            if released:
                self._save_locked(set(released))
                self._cond.notify_all()
            problem = self._await_locked(
                keys, lambda record: custody.for_container(record, shared=shared), wait_until
            )
            if problem is None:
                now = self._clock()
                taken = {key: self._get(key) for key in keys if self._get(key).phase is Phase.FREE}
                for key, record in taken.items():
                    self._set(key, custody.taking(record, now))
                # Only a kind with a cleanup hook needs the take on disk
                # before its init runs: a restart cleans what it finds taken.
                if kind in self._hooks:
                    self._save_locked(set(keys))
                    if self._save_error is not None:
                        # Unrecorded, a crash would forget they were handed
                        # out and offer them uncleaned: not taken.
                        for key, record in taken.items():
                            self._set(key, record)
                        problem = Problem(f"checkpoint not written: {self._save_error}")
        if released:
            self._on_change()
        return problem

    def allocated(self, kind: DeviceKind, ids: Sequence[str], owner: Owner | None = None) -> None:
        """An Allocate gave these devices to a container of `owner`'s pod (when
        the pod cache could tell)."""
        if self._witness is None:
            owner = None
        keys = _unique((kind, device) for device in ids)
        now = self._clock()
        with self._cond:
            for key in keys:
                record = self._get(key)
                if record.phase in OWING:
                    # Unreachable through take; loud if it ever is.
                    log.error("%s: %s given while %s", self._name(kind), key[1], record.phase.value)
                    continue
                # A new holder: the pod being admitted when the pod cache can
                # tell, else PodResources will say.
                unnamed = owner is None and self._witness is not None
                self._set(key, custody.given(record, owner, unnamed=unnamed, now=now))
            self._save_locked(set(keys))
            self._cond.notify_all()

    def abandon(self, kind: DeviceKind, ids: Sequence[str], *, dirty: bool) -> None:
        """An Allocate that took these devices failed before giving them.
        `dirty`: its init hook ran (even in part), so they are cleaned first."""
        keys = _unique((kind, device) for device in ids)
        owed = False
        with self._cond:
            for key in keys:
                if self._get(key).phase is Phase.TAKING:
                    owed |= self._release_locked(key, dirty=dirty)
            self._save_locked(set(keys))
            self._cond.notify_all()
        if owed:
            self._on_change()

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
        taken = {kind: self._ledger.in_use(kind) for kind in DeviceKind}
        owners = self._holders() if count else {}
        with self._cond:
            settled = self._rule.settle(self._records, taken, owners, count=count)
            for key, record in settled.changed.items():
                self._set(key, record)
            for key in settled.released:
                if self._release_locked(key):
                    log.info("%s: %s released; cleanup scheduled", self._name(key[0]), key[1])
            changed = settled.visible
            if changed or self._save_error is not None:
                # A failed write is retried at every poll until one succeeds.
                changed |= self._save_locked(set(settled.released))
                self._cond.notify_all()
        if changed:
            self._on_change()

    def _holders(self) -> dict[Key, Owner]:
        """Who holds each device per the last PodResources answer (pods named
        with the uid the watch knows now, so a namesake later is told apart)."""
        if self._witness is None:
            return {}
        found: dict[Key, Owner] = {}
        uids: dict[tuple[str, str], str | None] = {}
        for (namespace, pod, _), kinds in self._ledger.holdings().containers.items():
            if (namespace, pod) not in uids:
                uids[(namespace, pod)] = self._witness.uid_of(namespace, pod)
            for kind, devices in kinds.items():
                for device in devices:
                    found[(kind, device)] = (namespace, pod, uids[(namespace, pod)])
        return found

    # -- DRA claims ----------------------------------------------------------------------
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
            record = self._get((kind, device))
            return record.claims[0] if record.phase is Phase.HELD and record.claims else None

    def begin_claim(self, claim: ClaimRecord, *, wait_until: float | None = None) -> Problem | None:
        """A prepare starts: in one step, refuse a device another holder has,
        wait (until `wait_until`) for the cleanups its devices owe, then take
        them all and record the claim (not completed) before any hook runs.
        A Problem, and nothing changed, when it cannot."""
        keys = _keys(claim)
        with self._cond:
            problem = self._await_locked(
                keys, lambda record: custody.for_claim(record, claim.uid), wait_until
            )
            if problem is not None:
                return problem
            before = {key: self._get(key) for key in keys}
            previous = self._claims.get(claim.uid)
            now = self._clock()
            self._claims[claim.uid] = claim
            for key in keys:
                self._set(key, custody.held_by(self._get(key), (claim.uid,), now))
            self._save_locked(set(keys))
            if self._save_error is None:
                # The same claim begun again with other devices lets those go.
                dropped = [k for k in (_keys(previous) if previous else []) if k not in before]
                for key in dropped:
                    self._end_hold_locked(key, claim.uid)
                if dropped:
                    self._save_locked(set(dropped))
                self._cond.notify_all()
                return None
            # Unrecorded, it must not go on: a crash would forget these devices.
            for key, record in before.items():
                self._set(key, record)
            if previous is not None:
                self._claims[claim.uid] = previous
            else:
                del self._claims[claim.uid]
            return Problem(f"checkpoint not written: {self._save_error}")

    def complete_claim(self, claim: ClaimRecord) -> str | None:
        """A prepare succeeded: recorded as completed, with its answers."""
        done = replace(claim, completed=True)
        with self._cond:
            self._claims[claim.uid] = done
            self._save_locked(set())
            if self._save_error is None:
                return None
            self._claims[claim.uid] = claim
            return f"checkpoint not written: {self._save_error}"

    def end_claim(self, uid: str, *, dirty: bool = True) -> ClaimRecord | None:
        """A claim is unprepared (or a prepare rolled back): its devices are
        released, each one with a cleanup hook owed a cleanup, in the same
        write that forgets the claim. `dirty` False: nothing ran on them since
        they were taken clean. Returns the claim, if known."""
        with self._cond:
            claim = self._claims.pop(uid, None)
            if claim is None:
                return None
            keys = _keys(claim)
            for key in keys:
                if self._end_hold_locked(key, uid, dirty=dirty):
                    log.info(
                        "%s: %s released by claim %s; cleanup scheduled",
                        self._name(key[0]),
                        key[1],
                        uid,
                    )
            self._save_locked(set(keys))
            self._cond.notify_all()
        self._on_change()
        return claim

    def _end_hold_locked(self, key: Key, uid: str, *, dirty: bool = True) -> bool:
        """Claim `uid` no longer holds the device; another claim naming it
        (admin access) keeps it. Whether a cleanup is now owed."""
        record = self._get(key)
        if record.phase is not Phase.HELD or uid not in record.claims:
            return False
        rest = tuple(other for other in record.claims if other != uid)
        if rest:
            self._set(key, replace(record, claims=rest))
            return False
        return self._release_locked(key, dirty=dirty)

    def adopt_claim(self, claim: ClaimRecord) -> None:
        """After a start without a trustworthy checkpoint: a claim the API
        server says holds devices of this node is taken as prepared."""
        keys = _keys(claim)
        now = self._clock()
        with self._cond:
            if claim.uid in self._claims:
                return
            self._claims[claim.uid] = claim
            for key in keys:
                record = self._get(key)
                if record.phase is Phase.CLEANING:
                    log.warning(
                        "%s: %s is being cleaned but claim %s holds it",
                        self._name(key[0]),
                        key[1],
                        claim.uid,
                    )
                    continue
                holders = record.claims if record.phase is Phase.HELD else ()
                self._set(key, custody.held_by(record, (*holders, claim.uid), now))
            self._save_locked(set(keys))
            self._cond.notify_all()
        self._on_change()

    def release_unclaimed(self, kinds: Collection[DeviceKind]) -> int:
        """After the claims were adopted: every device of these kinds still
        unverified is held by no claim, so it is released and cleaned.
        Returns how many were."""
        with self._cond:
            released = sorted(
                (
                    key
                    for key, record in self._records.items()
                    if key[0] in kinds and record.phase is Phase.UNVERIFIED
                ),
                key=order,
            )
            for key in released:
                self._release_locked(key)
            if released:
                self._save_locked(set(released))
                self._cond.notify_all()
        if released:
            self._on_change()
        return len(released)

    def request_cleanup(self, kind: DeviceKind, device: str) -> None:
        """Schedule a cleanup for an idle device (after_cleanup recovery)."""
        if kind not in self._hooks:
            return
        key = (kind, device)
        with self._cond:
            if self._get(key).phase is not Phase.FREE:
                return
            self._release_locked(key)
            self._save_locked({key})
            self._cond.notify_all()
        self._on_change()

    # -- waiting for cleanups ------------------------------------------------------------
    def _await_locked(
        self,
        keys: Sequence[Key],
        decide: Callable[[Custody], tuple[Take, str]],
        wait_until: float | None,
    ) -> Problem | None:
        """Under the lock: None once every device may be taken; a Problem at
        once for a device that may not be, or when `wait_until` passes while
        some still wait for a cleanup. A device owed a cleanup has it asked
        for now; one whose cleanup ended without making it clean is refused
        with that cleanup's error."""
        asked: dict[Key, int] = {}
        while True:
            now = self._clock()
            waiting: list[Key] = []
            for key in sorted(keys, key=order):
                record = self._get(key)
                verdict, why = decide(record)
                if verdict is Take.REFUSE:
                    return Problem("", key[1], f" {why}")
                if verdict is Take.READY:
                    continue
                if key in asked and record.ended > asked[key] and record.phase in OWING:
                    return _problem(key[1], f"{key[1]}: {record.last_error}")
                if key not in asked:
                    asked[key] = record.ended
                    self._set(key, custody.expedited(record, now))
                    self._cond.notify_all()
                waiting.append(key)
            if not waiting:
                return None
            first = waiting[0]
            if self._stop:
                return Problem("", first[1], ": the daemon is stopping", retry=True)
            if wait_until is None or now >= wait_until:
                text = custody.waiting_for(first[1], self._get(first), now)
                return _problem(first[1], f"{text}; try again", retry=True)
            self._cond.wait(wait_until - now)

    # -- queries -------------------------------------------------------------------------
    def verdict(self, kind: DeviceKind, device: str) -> Verdict | None:
        with self._cond:
            return self._verdict_locked((kind, device), self._get((kind, device)))

    def _verdict_locked(self, key: Key, record: Custody) -> Verdict | None:
        source = "the claims list" if key[0] in self._explicit else "PodResources"
        return custody.verdict(record, source=source, save_error=self._save_error)

    def cleans(self, kind: DeviceKind) -> bool:
        """Whether devices of this kind have a cleanup hook."""
        return kind in self._hooks

    def cleanup_timeout(self, kind: DeviceKind) -> float:
        """How long one cleanup of this kind may run (0 without a hook)."""
        spec = self._hooks.get(kind)
        return spec.timeout if spec is not None else 0.0

    def verdicts(self) -> dict[Key, Verdict]:
        """Every device this manager keeps out of service, and why (one snapshot)."""
        found: dict[Key, Verdict] = {}
        with self._cond:
            for key, record in self._records.items():
                verdict = self._verdict_locked(key, record)
                if verdict is not None:
                    found[key] = verdict
        return found

    def in_use(self, kind: DeviceKind) -> set[str]:
        with self._cond:
            return {d for (k, d), r in self._records.items() if k is kind and r.phase in IN_USE}

    def pending(self) -> dict[Key, int]:
        """Owed cleanups and their failed attempts so far."""
        with self._cond:
            return {key: r.attempts for key, r in self._records.items() if r.phase in OWING}

    def custody(self) -> dict[Key, Custody]:
        """Every record (a snapshot)."""
        with self._cond:
            return dict(self._records)

    # -- the cleaners' side (cleaners.Book) --------------------------------------------------
    def next_cleanup(self) -> Key | None:
        """Wait for the next device due a cleanup and mark it CLEANING; None
        at stop. A failed checkpoint write is retried here too while nothing
        else changes."""
        with self._cond:
            key = None
            while not self._stop:
                now = self._clock()
                if self._save_error is not None and now >= self._save_retry_at:
                    self._save_locked(set())
                key = self._due_locked(now)
                if key is not None:
                    break
                self._cond.wait(self._idle_locked(now))
            if key is None:
                return None
            self._set(key, custody.cleaning(self._get(key), self._clock()))
            self._cond.notify_all()
        self._on_change()
        return key

    def _due_locked(self, now: float) -> Key | None:
        """The device due a cleanup longest, if any."""
        due = [
            (custody.urgency(r), order(k), k)
            for k, r in self._records.items()
            if custody.due(r, now)
        ]
        return min(due, key=lambda item: item[:2])[2] if due else None

    def _idle_locked(self, now: float) -> float | None:
        """How long until a cleanup or a checkpoint retry is due (None: none is)."""
        waits = [r.next_at - now for r in self._records.values() if custody.queued(r)]
        if self._save_error is not None:
            waits.append(self._save_retry_at - now)
        return max(0.0, min(waits)) if waits else None

    def end_leftover(self, key: Key) -> bool:
        return self._end_leftover(key)

    def cleanup_ended(self, key: Key, attempt: Attempt) -> None:
        """Apply one attempt's outcome to its CLEANING device."""
        kind, device = key
        name = self._names[kind]
        result = attempt.result
        with self._cond:
            now = self._clock()
            record = self._get(key)
            if result is None:
                delay = self._retry_max if attempt.internal else self._retry_initial
                if attempt.internal:
                    record = custody.failed(record, now, attempt.problem, delay)
                else:
                    record = custody.put_back(record, now, attempt.problem, delay)
            else:
                self.runs += 1
                if result.cancelled:
                    record = custody.put_back(record, now, record.last_error, 0.0)
                elif result.ok:
                    record = custody.cleaned(record, now)
                else:
                    delay = min(self._retry_max, self._retry_initial * 2**record.attempts)
                    error = result.describe("cleanup", self._hooks[kind].timeout)
                    record = custody.failed(record, now, error, delay)
            self._set(key, record)
            self._save_locked(set() if record.phase is Phase.FREE else {key})
            self._cond.notify_all()
        if result is None:
            pass  # the cleaner or the put-back said why
        elif result.cancelled:
            log.info("%s: cleanup of %s stopped for shutdown; still owed", name, device)
        elif record.phase is Phase.FREE:
            log.info("%s: cleanup of %s succeeded in %.2fs", name, device, result.duration)
            if self._health is not None:
                self._health.cleaned(device)
        else:
            log.warning(
                "%s: %s stays out of service: %s (attempt %d)",
                name,
                device,
                record.last_error,
                record.attempts,
            )
        self._on_change()

    # -- the checkpoint ------------------------------------------------------------------
    def _save_locked(self, changed: set[Key]) -> bool:
        """Write the state derived from the records; on failure mark which
        devices changed unrecorded (an idle one is not offered until a write
        succeeds or it is cleaned) and retry later. Returns whether the
        write-failure state changed."""
        if self._checkpoint is None:
            return False
        state = custody.state_of(self._records, self._claims)
        before = self._save_error
        try:
            self._checkpoint.save(state)
        except Exception as exc:  # any failure keeps the devices it did not record out
            for key in changed:
                self._set(key, replace(self._get(key), unsaved=True))
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self._save_error = f"{self._checkpoint.path}: {reason or type(exc).__name__}"
            self._save_retry_at = self._clock() + self._retry_initial
            if before is None:
                if isinstance(exc, OSError):
                    log.error("cannot write checkpoint %s", self._save_error)
                else:
                    log.exception("cannot write checkpoint %s", self._save_error)
            self._on_save(False)
            return before is None
        for key, record in list(self._records.items()):
            if record.unsaved:
                self._set(key, replace(record, unsaved=False))
        self._save_error = None
        if before is not None:
            log.info("checkpoint %s written again", self._checkpoint.path)
        self._on_save(True)
        return before is not None


def _unique(keys: Iterable[Key]) -> list[Key]:
    return list(dict.fromkeys(keys))


def _keys(claim: ClaimRecord) -> list[Key]:
    """The devices the claim holds: those given with admin access are only
    looked at, and stay in their holder's custody."""
    return _unique((device.kind, device.id) for device in claim.devices if not device.admin)
