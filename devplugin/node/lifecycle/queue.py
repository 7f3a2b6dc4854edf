"""The cleaners' port on the custody book: the queue of owed cleanups.

A cleaner asks for the next device due a cleanup (marked CLEANING in the
same step, so no two cleaners and no take can have it) and hands back how
the attempt ended; this port alone decides what that means for the record
(clean and free, quarantined with a backoff, or still owed). A hook a
killed daemon left running on a device is killed before anything else is
run on it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace

from devplugin.loops import Backoff
from devplugin.model import DeviceKind
from devplugin.node.lifecycle import custody
from devplugin.node.lifecycle.book import Book, Page
from devplugin.node.lifecycle.cleaners import Attempt
from devplugin.node.lifecycle.custody import Key, Phase, order
from devplugin.node.lifecycle.health import HealthTracker
from devplugin.node.lifecycle.hooks import Tracker, kill_group, process_start_ticks

log = logging.getLogger(__name__)


class CleanupQueue:
    def __init__(
        self,
        book: Book,
        *,
        timeouts: Mapping[DeviceKind, float],
        names: Mapping[DeviceKind, str],
        backoff: Backoff,
        health: HealthTracker | None = None,
    ) -> None:
        """`timeouts`: each cleaning kind's hook timeout (for its messages)."""
        self._book = book
        self._timeouts = dict(timeouts)
        self._names = dict(names)
        self._backoff = backoff
        self._health = health
        self.runs = 0

    def tracker(self, key: Key) -> Tracker:
        return self._book.tracker([key])

    def next_cleanup(self) -> Key | None:
        """Wait for the next device due a cleanup and mark it CLEANING; None
        at stop. A failed checkpoint write is retried here too while nothing
        else changes."""
        with self._book.step() as page:
            key = None
            while not page.stopping:
                page.retry_due()
                now = page.now()
                key = _due(page, now)
                if key is not None:
                    break
                waits = [r.next_at - now for r in page.records.values() if custody.queued(r)]
                page.wait(page.idle_for(now, waits))
            if key is None:
                return None
            page.set(key, custody.cleaning(page.get(key), page.now()))
            page.show()
        return key

    def end_leftover(self, key: Key) -> bool:
        """Kill a hook a previous daemon left running; whether none is left."""
        process = self._book.record(key).leftover
        if process is None:
            return True
        pgid, ticks = process
        if ticks is None or process_start_ticks(pgid) == ticks:
            log.warning(
                "%s: a hook for %s from before the restart is still running "
                "(process group %d); killing it",
                self._names.get(key[0], key[0].value),
                key[1],
                pgid,
            )
            if not kill_group(pgid):
                return False
        with self._book.step() as page:
            page.set(key, replace(page.get(key), leftover=None))
        return True

    def cleanup_ended(self, key: Key, attempt: Attempt) -> None:
        """Apply one attempt's outcome to its CLEANING device."""
        kind, device = key
        name = self._names.get(kind, kind.value)
        result = attempt.result
        with self._book.step() as page:
            timeout = self._timeouts.get(kind, 0.0)
            record = _outcome(page.get(key), attempt, page.now(), self._backoff, timeout)
            # A device cleaned is clean whether or not the write succeeds.
            page.set(key, record, unrecorded_is_dirty=record.phase is not Phase.FREE)
            page.show()
        if result is None:
            return  # the cleaner or the put-back said why
        self.runs += 1
        if result.cancelled:
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


def _due(page: Page, now: float) -> Key | None:
    """The device due a cleanup longest, if any."""
    due = [
        (custody.urgency(r), order(k), k) for k, r in page.records.items() if custody.due(r, now)
    ]
    return min(due, key=lambda item: item[:2])[2] if due else None


def _outcome(
    record: custody.Custody,
    attempt: Attempt,
    now: float,
    backoff: Backoff,
    timeout: float,
) -> custody.Custody:
    """The record after one attempt on it."""
    result = attempt.result
    if result is None:
        if attempt.internal:
            return custody.failed(record, now, attempt.problem, backoff.most)
        return custody.put_back(record, now, attempt.problem, backoff.first)
    if result.cancelled:
        return custody.put_back(record, now, record.last_error, 0.0)
    if result.ok:
        return custody.cleaned(record, now)
    error = result.describe("cleanup", timeout)
    return custody.failed(record, now, error, backoff.nth(record.attempts))
