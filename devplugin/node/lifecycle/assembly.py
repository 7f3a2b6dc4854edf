"""Custody of devices, assembled: the book, its ports and the cleaners.

Every device has one custody record (custody.py); the book (book.py) owns
the records, the DRA claims, the lock and the checkpoint, and changes them
only in steps. Around it, one port per caller, each given to that caller
alone by the node core or a front-end:

* `takes` (takes.py): the device plugin's Allocate takes, gives and
  abandons devices;
* `releases` (releases.py): PodResources answers and the pod watch say
  when a device-plugin device is let go;
* `queue` (queue.py): the cleaners take owed cleanups and hand back how
  each attempt ended;
* `view` (view.py): the pipeline reads verdicts and asks for cleanups;
* the DRA front-end builds its claim ledger (frontends/dra/ledger.py) on
  the book.

While a device is owed a cleanup, being cleaned, or unverified, its verdict
is Unhealthy, so the kubelet does not hand it out. This object is also the
loop the runtime starts and stops: loading the checkpoint (a hook a killed
daemon left running is killed first) and running the cleaners.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

from devplugin.loops import Backoff
from devplugin.model import DeviceKind
from devplugin.node.ledger import Ledger
from devplugin.node.lifecycle.book import Book
from devplugin.node.lifecycle.checkpoint import Checkpoint
from devplugin.node.lifecycle.cleaners import Cleaners, Describe
from devplugin.node.lifecycle.custody import order
from devplugin.node.lifecycle.health import HealthTracker
from devplugin.node.lifecycle.hooks import HookRunner, HookSpec, run_hook
from devplugin.node.lifecycle.queue import CleanupQueue
from devplugin.node.lifecycle.releases import PodWitness, ReleaseRule, Releases
from devplugin.node.lifecycle.restore import restore
from devplugin.node.lifecycle.takes import Takes
from devplugin.node.lifecycle.view import CustodyView

# How long stop waits for the cleaners once their running hooks were killed.
STOP_WAIT = 5.0
# Cleanups that may run at once (each on its own device).
CLEANERS = 4


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
    # Kinds whose releases only a claim's end says (DRA), never a poll.
    explicit: frozenset[DeviceKind] = frozenset()


@dataclass(frozen=True)
class Hooks:
    """The cleanup hook of each kind that has one, what runs it, and how a
    device is described to it (from the last scan)."""

    specs: Mapping[DeviceKind, HookSpec]
    describe: Describe
    runner: HookRunner = run_hook


class Lifecycle:
    def __init__(
        self,
        *,
        hooks: Hooks,
        names: Mapping[DeviceKind, str],
        checkpoint: Checkpoint | None,
        ledger: Ledger,
        health: HealthTracker | None = None,
        policy: CleanupPolicy = CleanupPolicy(),
        on_change: Callable[[], None] = lambda: None,
        on_save: Callable[[bool], None] = lambda ok: None,
        clock: Callable[[], float] = time.monotonic,
        witness: PodWitness | None = None,
    ) -> None:
        self._names = dict(names)
        # Set at stop: running hooks are killed, their devices stay owed.
        self.cancel = threading.Event()
        self.book = Book(
            checkpoint=checkpoint,
            cleans=frozenset(hooks.specs),
            explicit=policy.explicit,
            save_retry=policy.retry_initial,
            on_change=on_change,
            on_save=on_save,
            clock=clock,
        )
        self.takes = Takes(
            self.book,
            hooks=hooks.specs,
            names=names,
            cancel=self.cancel,
            named_holders=witness is not None,
        )
        rule = ReleaseRule(policy.confirmations, self._names, witness, policy.explicit)
        self.releases = Releases(self.book, ledger, rule)
        self.queue = CleanupQueue(
            self.book,
            timeouts={kind: spec.timeout for kind, spec in hooks.specs.items()},
            names=names,
            backoff=Backoff(policy.retry_initial, policy.retry_max),
            health=health,
        )
        self.view = CustodyView(self.book)
        self._cleaners = Cleaners(
            self.queue,
            hooks=hooks.specs,
            names=names,
            describe=hooks.describe,
            runner=hooks.runner,
            cancel=self.cancel,
            count=policy.cleaners,
        )

    def load(self) -> None:
        """Read the checkpoint (once); kill the hooks a killed daemon left."""
        if not self.book.load(partial(restore, names=self._names)):
            return
        leftovers = [key for key, record in self.book.records().items() if record.leftover]
        for key in sorted(leftovers, key=order):
            self.queue.end_leftover(key)

    def start(self) -> None:
        """Start the cleaners (loading the checkpoint first if nobody did). The
        runtime starts them after the first scan, so owed cleanups find their
        devices described instead of being pushed back."""
        self.load()
        self._cleaners.start()

    def signal_stop(self) -> None:
        """Stop the cleaners and kill every running hook (their devices stay
        owed); callers waiting for a cleanup are answered at once."""
        self.cancel.set()
        self.book.stop()

    @property
    def join_timeout(self) -> float:
        return STOP_WAIT

    def join(self, timeout: float | None = None) -> None:
        self._cleaners.join(STOP_WAIT if timeout is None else timeout)

    def stop(self) -> None:
        self.signal_stop()
        self.join()
