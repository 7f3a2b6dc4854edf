"""One custody record per device, and the pure rules that move it.

Every device the custody book knows has one record with an explicit
phase. The book changes records only under its one lock, one whole step
at a time, and only through the functions here, so a rule ("a cleanup
starts only on a device no one holds", "a take of a device owed a cleanup
waits for it") is one check in one place instead of a property of how a
dozen collections happen to be updated together::

    FREE ─take─► TAKING ─given─► HELD ─released─► OWED ─cleaning─► CLEANING ─cleaned─► FREE
      ▲                            │                ▲                  │ failed
      └──────── released (no cleanup hook) ─────────┘  QUARANTINED ◄───┘ (retried later)

    UNVERIFIED: in use before a restart, or first seen without a trustworthy
    checkpoint; HELD once a holder is confirmed, OWED once it is released.

Releases are numbered. A record remembers the number of its last release
and a running cleanup the release it answers for, so a cleanup that began
before a release can never be counted as the cleanup that release owes.
Verdicts (what keeps a device out of service) and the checkpoint's content
are derived from the records; nothing else is kept beside them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace

from devplugin.model import DeviceKind, Health
from devplugin.node.lifecycle.checkpoint import Hold, LifecycleState
from devplugin.node.lifecycle.health import Verdict

Key = tuple[DeviceKind, str]
# (namespace, pod, pod uid when known)
Owner = tuple[str, str, str | None]
# A hook's process group and its leader's start time (see hooks.Started).
Process = tuple[int, int | None]


class Phase(enum.Enum):
    FREE = "free"
    # An Allocate has it: checked clean, its init hook may be running, not yet given.
    TAKING = "taking"
    # A container (device plugin) or claims (DRA) hold it.
    HELD = "held"
    # Released and owed a cleanup that has not started.
    OWED = "owed"
    CLEANING = "cleaning"
    # A cleanup failed; it is tried again after a backoff.
    QUARANTINED = "quarantined"
    # Possibly in use, holder unknown (before a restart, or no checkpoint).
    UNVERIFIED = "unverified"


IN_USE = frozenset({Phase.TAKING, Phase.HELD, Phase.UNVERIFIED})
OWING = frozenset({Phase.OWED, Phase.CLEANING, Phase.QUARANTINED})


# The share of the time left before a caller's deadline that a take may
# spend waiting for cleanups; the rest is for the caller's own init hooks
# and its answer.
WAIT_SHARE = 0.5


def wait_until(now: float, deadline: float | None, otherwise: float) -> float:
    """Until when a take may wait: a share of the time left before the
    caller's deadline, or `otherwise` seconds when it set none."""
    if deadline is None:
        return now + otherwise
    return now + max(0.0, deadline - now) * WAIT_SHARE


def order(key: Key) -> tuple[str, str]:
    """A total order on keys (DeviceKind itself has none)."""
    return key[0].value, key[1]


@dataclass(frozen=True)
class Custody:
    phase: Phase = Phase.FREE
    # DRA: the claims holding it (more than one only for admin access).
    claims: tuple[str, ...] = ()
    # Device plugin: the pod holding it, when the pod watch could tell.
    owner: Owner | None = None
    # The number of its last release, and (CLEANING) the release the running
    # cleanup answers for.
    release: int = 0
    answers: int = 0
    # Cleanups since the last release: failed ones, and ended ones of any outcome.
    attempts: int = 0
    ended: int = 0
    next_at: float = 0.0
    # A take waits for its cleanup: cleaned before devices nobody waits for.
    wanted: bool = False
    last_error: str = ""
    # When the phase began (monotonic), for the messages of those who wait.
    since: float = 0.0
    # Adopted at its first sighting because there was no trustworthy checkpoint.
    adopted: bool = False
    # Device plugin releases: PodResources answers in a row without it; the
    # pod could not be named when it was allocated; a release held back
    # because its pod still runs (logged once).
    missing: int = 0
    unnamed: bool = False
    held_back: bool = False
    # A hook of ours running on it now, and one a previous daemon left running.
    hook: Process | None = None
    leftover: Process | None = None
    # Its last change is not in the checkpoint (a write failed).
    unsaved: bool = False


FREE = Custody()


# -- transitions ---------------------------------------------------------------------


def released(record: Custody, number: int, now: float, *, owes: bool) -> Custody:
    """Out of use: owed a cleanup (the kind has a hook) or free."""
    return replace(
        record,
        phase=Phase.OWED if owes else Phase.FREE,
        claims=(),
        owner=None,
        release=number,
        answers=0,
        attempts=0,
        ended=0,
        next_at=0.0,
        wanted=False,
        last_error="",
        since=now,
        missing=0,
        unnamed=False,
        held_back=False,
    )


def taking(record: Custody, now: float) -> Custody:
    return replace(record, phase=Phase.TAKING, since=now, missing=0, held_back=False)


def given(record: Custody, owner: Owner | None, *, unnamed: bool, now: float) -> Custody:
    """Device plugin: an Allocate gave it to a container of `owner`'s pod."""
    return replace(
        record,
        phase=Phase.HELD,
        claims=(),
        owner=owner,
        unnamed=unnamed,
        missing=0,
        held_back=False,
        since=now if record.phase is not Phase.HELD else record.since,
    )


def held_by(record: Custody, claims: tuple[str, ...], now: float) -> Custody:
    """DRA: these claims hold it."""
    return replace(record, phase=Phase.HELD, claims=claims, owner=None, since=now)


def unverified(record: Custody, now: float, *, adopted: bool) -> Custody:
    return replace(record, phase=Phase.UNVERIFIED, adopted=adopted, since=now)


def cleaning(record: Custody, now: float) -> Custody:
    """A cleanup starts; it answers for the last release."""
    return replace(record, phase=Phase.CLEANING, answers=record.release, since=now, wanted=False)


def cleaned(record: Custody, now: float) -> Custody:
    """A cleanup succeeded. It counts only for the release it started after."""
    if record.phase is not Phase.CLEANING or record.answers != record.release:
        return _waiting(record, now, record.last_error)
    return replace(
        record,
        phase=Phase.FREE,
        answers=0,
        attempts=0,
        ended=0,
        next_at=0.0,
        last_error="",
        since=now,
        owner=None,
        missing=0,
        unnamed=False,
        held_back=False,
        unsaved=False,
    )


def failed(record: Custody, now: float, error: str, delay: float) -> Custody:
    return replace(
        record,
        phase=Phase.QUARANTINED,
        attempts=record.attempts + 1,
        ended=record.ended + 1,
        next_at=now + delay,
        last_error=error,
        since=now,
    )


def put_back(record: Custody, now: float, error: str, delay: float) -> Custody:
    """A cleanup that could not run, or was stopped at shutdown: still owed,
    no attempt counted."""
    return replace(_waiting(record, now, error), ended=record.ended + 1, next_at=now + delay)


def _waiting(record: Custody, now: float, error: str) -> Custody:
    phase = Phase.QUARANTINED if record.attempts else Phase.OWED
    return replace(record, phase=phase, answers=0, last_error=error, since=now)


def expedited(record: Custody, now: float) -> Custody:
    """Someone waits for it: its cleanup is due now, backoff or not, and
    before those of devices nobody waits for."""
    if record.phase in (Phase.OWED, Phase.QUARANTINED):
        return replace(record, next_at=min(record.next_at, now), wanted=True)
    return record


def urgency(record: Custody) -> tuple[bool, float]:
    """Which due cleanup runs first (smallest): wanted ones, then the longest due."""
    return not record.wanted, record.next_at


def queued(record: Custody) -> bool:
    """Owed a cleanup that no one runs yet (due now or after its backoff)."""
    return record.phase in (Phase.OWED, Phase.QUARANTINED) and record.hook is None


def due(record: Custody, now: float) -> bool:
    return queued(record) and record.next_at <= now


# -- takes ---------------------------------------------------------------------------


class Take(enum.Enum):
    READY = "ready"
    WAIT = "wait"
    REFUSE = "refuse"


def reuse_releases(record: Custody, *, shared: bool) -> bool:
    """Device plugin: the kubelet allocates only devices it considers free,
    so allocating one still believed held proves its holder let it go
    (never for a shared device: another replica says nothing of the first)."""
    return not shared and record.phase in (Phase.HELD, Phase.UNVERIFIED)


def for_container(record: Custody, *, shared: bool) -> tuple[Take, str]:
    """Whether an Allocate may take the device now."""
    phase = record.phase
    if phase is Phase.FREE:
        return Take.READY, ""
    if phase in (Phase.HELD, Phase.UNVERIFIED):
        if shared:
            return Take.READY, ""
        return Take.REFUSE, "it was given to another container meanwhile"
    if phase is Phase.TAKING:
        # Another Allocate of it is in flight (a shared device may join it).
        return (Take.READY, "") if shared else (Take.WAIT, "")
    return Take.WAIT, ""


def for_claim(record: Custody, uid: str) -> tuple[Take, str]:
    """Whether claim `uid` may take the device now."""
    phase = record.phase
    if phase is Phase.FREE or (phase is Phase.HELD and record.claims == (uid,)):
        return Take.READY, ""
    if phase is Phase.HELD:
        others = [claim for claim in record.claims if claim != uid]
        return Take.REFUSE, f"is prepared for claim {others[0] if others else '?'}"
    if phase is Phase.UNVERIFIED:
        return Take.REFUSE, "was in use before the restart; awaiting the claims list"
    if phase is Phase.TAKING:
        return Take.REFUSE, "is being allocated to a container"
    return Take.WAIT, ""


def waiting_for(device: str, record: Custody, now: float) -> str:
    """What a take of this device waits for, in words."""
    if record.phase is Phase.CLEANING:
        return f"the cleanup of {device} has been running for {now - record.since:.1f}s"
    if record.phase is Phase.QUARANTINED:
        return (
            f"the cleanup of {device} failed {record.attempts} time(s) and is retried "
            f"({record.last_error})"
        )
    if record.phase is Phase.OWED:
        return f"the cleanup of {device} has not started yet"
    return f"{device} is being allocated by another call"


# -- what is derived from the records ----------------------------------------------------


def verdict(record: Custody, *, source: str, save_error: str | None) -> Verdict | None:
    """Why the device is kept out of service, if it is. `source` says what
    confirms a holder (PodResources, the claims list)."""
    if record.leftover is not None:
        return Verdict(Health.UNHEALTHY, "a hook from before the restart is still running")
    phase = record.phase
    if phase is Phase.CLEANING:
        return Verdict(Health.UNHEALTHY, "cleanup running")
    if phase is Phase.QUARANTINED:
        return Verdict(
            Health.UNHEALTHY,
            f"quarantined: cleanup failed {record.attempts} time(s), retrying "
            f"({record.last_error})",
        )
    if phase is Phase.OWED:
        return Verdict(Health.UNHEALTHY, "cleanup pending")
    if phase is Phase.UNVERIFIED:
        if record.adopted:
            return Verdict(Health.UNHEALTHY, f"no trustworthy checkpoint; awaiting {source}")
        return Verdict(Health.UNHEALTHY, f"in use before restart; awaiting {source}")
    if record.unsaved and phase is Phase.FREE:
        return Verdict(
            Health.UNHEALTHY, f"release not recorded: checkpoint write failed ({save_error})"
        )
    return None


def state_of(records: Mapping[Key, Custody], claims: Mapping[str, Hold]) -> LifecycleState:
    """What the checkpoint says of these records."""
    state = LifecycleState()
    for (kind, device), record in records.items():
        if record.phase in IN_USE:
            state.assigned[kind].add(device)
        elif record.phase in OWING:
            state.pending[kind].add(device)
        process = record.hook or record.leftover
        if process is not None:
            state.running[(kind, device)] = process
    state.claims = dict(claims)
    return state


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


def problem_in(device: str, text: str, *, retry: bool = False) -> Problem:
    """A Problem from a text that names `device` (its first mention)."""
    before, found, after = text.partition(device)
    if not found:
        return Problem(text, retry=retry)
    return Problem(before, device, after, retry=retry)


@dataclass(frozen=True)
class Census:
    """How many devices of each kind are in each phase but FREE (free
    devices have no record), and how long the longest-waiting device owing
    a cleanup has been in its phase (what an operator alerts on:
    quarantined devices, cleanups that never end)."""

    phases: Mapping[tuple[DeviceKind, Phase], int]
    oldest_owing: Mapping[DeviceKind, float]


def census(records: Mapping[Key, Custody], kinds: frozenset[DeviceKind], now: float) -> Census:
    """Every phase of every kind counted (zero included, so a series never
    vanishes when its last device leaves the phase)."""
    phases: dict[tuple[DeviceKind, Phase], int] = {
        (kind, phase): 0 for kind in kinds for phase in Phase if phase is not Phase.FREE
    }
    oldest = dict.fromkeys(kinds, 0.0)
    for (kind, _), record in records.items():
        if kind not in oldest or record.phase is Phase.FREE:
            continue
        phases[(kind, record.phase)] += 1
        if record.phase in OWING:
            oldest[kind] = max(oldest[kind], now - record.since)
    return Census(phases, oldest)
