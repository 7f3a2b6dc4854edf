"""The DRA front-end's port on the node's custody book: the claims it
prepared and the devices each one holds.

A prepare begins a claim in one step (`begin`: refuse a device another
holder has, wait within the caller's deadline for the cleanups its devices
owe, then take them all and record the claim, not yet completed, before any
hook runs), completes it once its answers are known, and an unprepare or a
rollback ends it (`end`: its devices released, each with a cleanup hook
owed a cleanup, in the same write that forgets the claim). After a start
without a trustworthy checkpoint, claims the API server lists are adopted
and every device no claim holds is released to be cleaned.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Sequence
from dataclasses import replace

from devplugin.frontends.dra.claim_record import ClaimRecord
from devplugin.model import DeviceKind
from devplugin.node.lifecycle import custody
from devplugin.node.lifecycle.book import Book, Page
from devplugin.node.lifecycle.custody import Key, Phase, Problem, order
from devplugin.node.lifecycle.hooks import Tracker

log = logging.getLogger(__name__)


class ClaimLedger:
    def __init__(
        self, book: Book, *, names: dict[DeviceKind, str], cancel: threading.Event
    ) -> None:
        self._book = book
        self._names = names
        self.cancel = cancel

    @property
    def untrusted(self) -> bool:
        """No trustworthy checkpoint was found: what held what is unknown."""
        return self._book.untrusted

    def cleans(self, kind: DeviceKind) -> bool:
        return kind in self._book.cleans

    def tracker(self, kind: DeviceKind, ids: Sequence[str]) -> Tracker:
        return self._book.tracker([(kind, device) for device in ids])

    def claims(self) -> list[ClaimRecord]:
        return [hold for hold in self._book.holds() if isinstance(hold, ClaimRecord)]

    def claim(self, uid: str) -> ClaimRecord | None:
        hold = self._book.hold(uid)
        return hold if isinstance(hold, ClaimRecord) else None

    def claimed_by(self, kind: DeviceKind, device: str) -> str | None:
        """The uid of the claim holding this device, if one does."""
        record = self._book.record((kind, device))
        return record.claims[0] if record.phase is Phase.HELD and record.claims else None

    def begin(self, claim: ClaimRecord, *, wait_until: float | None = None) -> Problem | None:
        """A prepare starts. A Problem, and nothing changed, when it cannot."""
        keys = claim.held()
        with self._book.step() as page:
            problem = page.await_takeable(
                keys, lambda record: custody.for_claim(record, claim.uid), wait_until
            )
            if problem is not None:
                return problem
            previous = page.hold(claim.uid)
            now = page.now()
            page.keep(claim)
            for key in keys:
                page.set(key, custody.held_by(page.get(key), (claim.uid,), now))
            # Unrecorded, it must not go on: a crash would forget these devices.
            error = page.commit(required=True)
            if error is not None:
                return Problem(error)
            # The same claim begun again with other devices lets those go.
            for key in previous.held() if previous is not None else []:
                if key not in keys and _end_hold(page, key, claim.uid):
                    page.show()
        return None

    def complete(self, claim: ClaimRecord) -> str | None:
        """A prepare succeeded: recorded as completed, with its answers."""
        with self._book.step() as page:
            page.keep(replace(claim, completed=True))
            return page.commit(required=True)

    def end(self, uid: str, *, dirty: bool = True) -> ClaimRecord | None:
        """A claim is unprepared (or a prepare rolled back). `dirty` False:
        nothing ran on its devices since they were taken clean. Returns the
        claim, if known."""
        with self._book.step() as page:
            claim = page.forget(uid)
            if claim is None:
                return None
            page.show()
            for key in claim.held():
                if _end_hold(page, key, uid, dirty=dirty):
                    log.info(
                        "%s: %s released by claim %s; cleanup scheduled",
                        self._names.get(key[0], key[0].value),
                        key[1],
                        uid,
                    )
        return claim if isinstance(claim, ClaimRecord) else None

    def adopt(self, claim: ClaimRecord) -> None:
        """After a start without a trustworthy checkpoint: a claim the API
        server says holds devices of this node is taken as prepared."""
        with self._book.step() as page:
            if page.hold(claim.uid) is not None:
                return
            page.keep(claim)
            page.show()
            now = page.now()
            for key in claim.held():
                record = page.get(key)
                if record.phase is Phase.CLEANING:
                    log.warning(
                        "%s: %s is being cleaned but claim %s holds it",
                        self._names.get(key[0], key[0].value),
                        key[1],
                        claim.uid,
                    )
                    continue
                holders = record.claims if record.phase is Phase.HELD else ()
                page.set(key, custody.held_by(record, (*holders, claim.uid), now))

    def release_unclaimed(self, kinds: Collection[DeviceKind]) -> int:
        """After the claims were adopted: every device of these kinds still
        unverified is held by no claim, so it is released and cleaned.
        Returns how many were."""
        with self._book.step() as page:
            released = sorted(
                (
                    key
                    for key, record in page.records.items()
                    if key[0] in kinds and record.phase is Phase.UNVERIFIED
                ),
                key=order,
            )
            for key in released:
                page.release(key)
            if released:
                page.show()
        return len(released)


def _end_hold(page: Page, key: Key, uid: str, *, dirty: bool = True) -> bool:
    """Claim `uid` no longer holds the device; another claim naming it
    (admin access) keeps it. Whether a cleanup is now owed."""
    record = page.get(key)
    if record.phase is not Phase.HELD or uid not in record.claims:
        return False
    rest = tuple(other for other in record.claims if other != uid)
    if rest:
        page.set(key, replace(record, claims=rest))
        return False
    return page.release(key, dirty=dirty)
