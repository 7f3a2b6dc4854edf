"""The custody book: the one owner of every device's custody record, of the
DRA claims that hold devices, of the lock they change under and of the
checkpoint that records them.

Every change goes one way: open a step (`with book.step() as page`), move
some records with the pure transitions of `custody.py`, and leave. What the
step changed is written to the checkpoint once, waiters are woken, and the
served verdicts are judged again where the step said they may have changed
(`page.show()`). A step that must be on disk before its caller goes on
(a take before an init hook runs, a claim before its prepare) commits with
`required=True`: a failed write undoes the step's changes and says why.

No caller holds the book itself; each is given a port with its own verbs
only: takes.py (the device plugin's Allocate), releases.py (what the pod
side says), queue.py (the cleaners), view.py (the pipeline's verdicts), and
the DRA front-end's claim ledger.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from types import MappingProxyType

from devplugin.model import DeviceKind
from devplugin.node.lifecycle import custody
from devplugin.node.lifecycle.checkpoint import Checkpoint, Hold, LifecycleState
from devplugin.node.lifecycle.custody import (
    FREE,
    IN_USE,
    OWING,
    Custody,
    Key,
    Problem,
    Take,
    order,
    problem_in,
)
from devplugin.node.lifecycle.health import Verdict
from devplugin.node.lifecycle.hooks import Started, Tracker

__all__ = ["Book", "Hold", "Page", "unique"]

log = logging.getLogger(__name__)


def unique(keys: Sequence[Key]) -> list[Key]:
    return list(dict.fromkeys(keys))


class Book:
    def __init__(
        self,
        *,
        checkpoint: Checkpoint | None,
        cleans: frozenset[DeviceKind],
        explicit: frozenset[DeviceKind] = frozenset(),
        save_retry: float = 5.0,
        on_change: Callable[[], None] = lambda: None,
        on_save: Callable[[bool], None] = lambda ok: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`cleans`: the kinds with a cleanup hook (a release of one owes a
        cleanup); `explicit`: kinds only claims hold (DRA), named in the
        verdicts; `save_retry`: the pause before a failed write is tried again;
        `on_change`: what is served may have changed (judge again)."""
        self.cleans = cleans
        self._explicit = explicit
        self._checkpoint = checkpoint
        self._save_retry = save_retry
        self._on_change = on_change
        self._on_save = on_save
        self.clock = clock
        self._cond = threading.Condition()
        self._records: dict[Key, Custody] = {}
        self._holds: dict[str, Hold] = {}
        self._releases = 0
        self._stopping = False
        self._loaded = False
        # No trustworthy checkpoint: every device seen is adopted as possibly
        # dirty (in use until its holder is confirmed, else cleaned).
        self.untrusted = False
        self._save_error: str | None = None
        self._save_retry_at = 0.0

    # -- the one write path ------------------------------------------------------------
    @contextmanager
    def step(self) -> Iterator[Page]:
        """One step under the lock; leaving it writes what changed (once),
        wakes waiters and, after the lock is let go, asks for a judgement
        when the step showed a change."""
        with self._cond:
            page = Page(self)
            try:
                yield page
            finally:
                page.commit()
        if page.shown:
            self._on_change()

    def _write(self, changed: Sequence[Key]) -> bool:
        """Under the lock: write the state derived from the records. On
        failure the changed devices are marked unrecorded (an idle one is not
        offered until a write succeeds or it is cleaned) and the write is
        retried later. Whether the write-failure state changed."""
        if self._checkpoint is None:
            return False
        state = custody.state_of(self._records, self._holds)
        before = self._save_error
        try:
            self._checkpoint.save(state)
        except Exception as exc:  # any failure keeps the devices it did not record out
            for key in changed:
                self._set(key, replace(self._get(key), unsaved=True))
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self._save_error = f"{self._checkpoint.path}: {reason or type(exc).__name__}"
            self._save_retry_at = self.clock() + self._save_retry
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

    def _get(self, key: Key) -> Custody:
        return self._records.get(key, FREE)

    def _set(self, key: Key, record: Custody) -> None:
        if record == FREE:
            self._records.pop(key, None)
        else:
            self._records[key] = record

    # -- start and stop ----------------------------------------------------------------
    def load(self, restore: Callable[[Page, LifecycleState], None]) -> bool:
        """Read the checkpoint once and let `restore` apply it in one step.
        Whether this call loaded it (False: loaded before, or none)."""
        if self._loaded:
            return False
        self._loaded = True
        if self._checkpoint is None:
            return False
        saved = self._checkpoint.load()
        with self.step() as page:
            self.untrusted = not saved.trusted
            restore(page, saved)
        return True

    def stop(self) -> None:
        """Every waiter is answered at once; the cleaners' queue ends."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def tracker(self, keys: Sequence[Key]) -> Tracker:
        """Records a hook's process group on these devices while it runs, so
        a restart kills what a killed daemon left running."""

        def track(started: Started | None) -> None:
            process = None if started is None else (started.pgid, started.start_ticks)
            with self.step() as page:
                for key in keys:
                    page.set(key, replace(page.get(key), hook=process))

        return track

    # -- reads (each one snapshot under the lock) ------------------------------------------
    def checkpoint_error(self) -> str | None:
        """Why the last checkpoint write failed; None once one succeeded."""
        with self._cond:
            return self._save_error

    def record(self, key: Key) -> Custody:
        with self._cond:
            return self._get(key)

    def records(self) -> dict[Key, Custody]:
        with self._cond:
            return dict(self._records)

    def holds(self) -> list[Hold]:
        with self._cond:
            return list(self._holds.values())

    def hold(self, uid: str) -> Hold | None:
        with self._cond:
            return self._holds.get(uid)

    def verdicts(self) -> dict[Key, Verdict]:
        """Every device kept out of service, and why."""
        with self._cond:
            found = {key: self._verdict(key, record) for key, record in self._records.items()}
        return {key: verdict for key, verdict in found.items() if verdict is not None}

    def verdict(self, key: Key) -> Verdict | None:
        with self._cond:
            return self._verdict(key, self._get(key))

    def _verdict(self, key: Key, record: Custody) -> Verdict | None:
        source = "the claims list" if key[0] in self._explicit else "PodResources"
        return custody.verdict(record, source=source, save_error=self._save_error)

    def in_use(self, kind: DeviceKind) -> set[str]:
        with self._cond:
            return {d for (k, d), r in self._records.items() if k is kind and r.phase in IN_USE}

    def pending(self) -> dict[Key, int]:
        """Owed cleanups and their failed attempts so far."""
        with self._cond:
            return {key: r.attempts for key, r in self._records.items() if r.phase in OWING}


class Page:
    """What one step may do; it exists only while the step holds the lock."""

    def __init__(self, book: Book) -> None:
        self._book = book
        # Before-values of what changed since the last commit, to undo them.
        self._before: dict[Key, Custody] = {}
        self._held_before: dict[str, Hold | None] = {}
        self._clean: set[Key] = set()
        self._woken = False
        self.shown = False

    @property
    def records(self) -> Mapping[Key, Custody]:
        return MappingProxyType(self._book._records)

    @property
    def cleans(self) -> frozenset[DeviceKind]:
        return self._book.cleans

    @property
    def stopping(self) -> bool:
        return self._book._stopping

    @property
    def save_error(self) -> str | None:
        return self._book._save_error

    def now(self) -> float:
        return self._book.clock()

    def get(self, key: Key) -> Custody:
        return self._book._get(key)

    def set(self, key: Key, record: Custody, *, unrecorded_is_dirty: bool = True) -> None:
        """A change the checkpoint records. Should the write fail, the device
        is not offered until one succeeds, unless `unrecorded_is_dirty` is
        False (it was just cleaned)."""
        self._before.setdefault(key, self._book._get(key))
        if not unrecorded_is_dirty:
            self._clean.add(key)
        self._book._set(key, record)

    def nudge(self, key: Key, record: Custody) -> None:
        """A change not written now: the checkpoint does not show it (when a
        cleanup is due), or need not yet (a take of a kind without a cleanup
        hook: its Allocate writes it)."""
        self._book._set(key, record)
        self._woken = True

    def release(self, key: Key, *, dirty: bool = True) -> bool:
        """Out of use, owed a cleanup when its kind has a hook (and something
        may have touched it). Whether a cleanup is owed."""
        book = self._book
        book._releases += 1
        owes = dirty and key[0] in book.cleans
        self.set(key, custody.released(self.get(key), book._releases, self.now(), owes=owes))
        return owes

    def hold(self, uid: str) -> Hold | None:
        return self._book._holds.get(uid)

    def keep(self, hold: Hold) -> None:
        self._held_before.setdefault(hold.uid, self._book._holds.get(hold.uid))
        self._book._holds[hold.uid] = hold

    def forget(self, uid: str) -> Hold | None:
        found = self._book._holds.pop(uid, None)
        if found is not None:
            self._held_before.setdefault(uid, found)
        return found

    def show(self) -> None:
        """What is served may change: judge again after the step."""
        self.shown = True

    def commit(self, *, required: bool = False, retry: bool = False) -> str | None:
        """Write what changed since the last commit (once) and wake waiters.
        `required`: on a failed write the changes are undone, and why is
        returned. `retry`: write even if nothing changed when the last write
        failed."""
        book = self._book
        changed = list(self._before)
        if changed or self._held_before or (retry and book._save_error is not None):
            marked = [] if required else [key for key in changed if key not in self._clean]
            if book._write(marked):
                self.shown = True
            if required and book._save_error is not None:
                self._undo()
            self._woken |= bool(changed or self._held_before)
        self._before.clear()
        self._held_before.clear()
        self._clean.clear()
        if self._woken:
            book._cond.notify_all()
            self._woken = False
        return None if book._save_error is None else f"checkpoint not written: {book._save_error}"

    def retry_due(self) -> None:
        """Try a failed write again once its pause is over."""
        book = self._book
        if book._save_error is not None and self.now() >= book._save_retry_at:
            self.commit(retry=True)

    def idle_for(self, now: float, waits: list[float]) -> float | None:
        """How long until the earliest of these waits or a write's retry."""
        book = self._book
        if book._save_error is not None:
            waits = [*waits, book._save_retry_at - now]
        return max(0.0, min(waits)) if waits else None

    def _undo(self) -> None:
        book = self._book
        for key, record in self._before.items():
            book._set(key, record)
        for uid, hold in self._held_before.items():
            if hold is None:
                book._holds.pop(uid, None)
            else:
                book._holds[uid] = hold

    def wait(self, timeout: float | None) -> None:
        """Commit, then let other steps run until one wakes this one."""
        self.commit()
        self._book._cond.wait(timeout)

    def await_takeable(
        self,
        keys: Sequence[Key],
        decide: Callable[[Custody], tuple[Take, str]],
        wait_until: float | None,
    ) -> Problem | None:
        """None once every device may be taken; a Problem at once for a
        device that may not be, or when `wait_until` passes while some still
        wait for a cleanup. A device owed a cleanup has it asked for now; one
        whose cleanup ended without making it clean is refused with that
        cleanup's error."""
        asked: dict[Key, int] = {}
        while True:
            now = self.now()
            waiting: list[Key] = []
            for key in sorted(keys, key=order):
                record = self.get(key)
                verdict, why = decide(record)
                if verdict is Take.REFUSE:
                    return Problem("", key[1], f" {why}")
                if verdict is Take.READY:
                    continue
                if key in asked and record.ended > asked[key] and record.phase in OWING:
                    return problem_in(key[1], f"{key[1]}: {record.last_error}")
                if key not in asked:
                    asked[key] = record.ended
                    self.nudge(key, custody.expedited(record, now))
                waiting.append(key)
            if not waiting:
                return None
            first = waiting[0]
            if self.stopping:
                return Problem("", first[1], ": the daemon is stopping", retry=True)
            if wait_until is None or now >= wait_until:
                text = custody.waiting_for(first[1], self.get(first), now)
                return problem_in(first[1], f"{text}; try again", retry=True)
            self.wait(wait_until - now)
