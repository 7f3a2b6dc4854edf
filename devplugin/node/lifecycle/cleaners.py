"""The cleaners: a few threads that run the cleanup hooks of released devices.

Each cleaner asks the cleanup queue (queue.py, the cleaners' port on the
custody book) for the next device due a cleanup (marked CLEANING in the
same step, so no two cleaners and no take can have it), runs one attempt
and hands the outcome back; the queue alone decides what the outcome means
for the record. Several devices are cleaned
at once (a pod's eight GPUs need not wait for each other's GPU reset), one
device never twice at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from devplugin.loops import FailureLog, ThreadLoop
from devplugin.model import DeviceKind
from devplugin.node.lifecycle.custody import Key
from devplugin.node.lifecycle.hooks import HookDevice, HookResult, HookRunner, HookSpec, Tracker

log = logging.getLogger(__name__)

Describe = Callable[[DeviceKind, Sequence[str]], list[HookDevice] | None]


@dataclass(frozen=True)
class Attempt:
    """How one cleanup attempt ended: the hook's result, or why it did not run."""

    result: HookResult | None = None
    # Set when the hook did not run (the device is gone, a hook from
    # before a restart could not be killed, an internal error).
    problem: str = ""
    # The problem is a bug, not a state of the device.
    internal: bool = False


class Queue(Protocol):
    """What the cleaners need of the cleanup queue."""

    def next_cleanup(self) -> Key | None:
        """Wait for a device due a cleanup and mark it CLEANING; None at stop."""

    def end_leftover(self, key: Key) -> bool:
        """Kill a hook a previous daemon left on the device; whether none is left."""

    def tracker(self, key: Key) -> Tracker:
        """Records a hook's process group in the checkpoint while it runs."""

    def cleanup_ended(self, key: Key, attempt: Attempt) -> None:
        """The attempt on a CLEANING device is over."""


class Cleaners:
    def __init__(
        self,
        queue: Queue,
        *,
        hooks: Mapping[DeviceKind, HookSpec],
        names: Mapping[DeviceKind, str],
        describe: Describe,
        runner: HookRunner,
        cancel: threading.Event,
        count: int,
    ) -> None:
        self._queue = queue
        self._hooks = dict(hooks)
        self._names = dict(names)
        self._describe = describe
        self._runner = runner
        self._cancel = cancel
        self._failures = FailureLog(log)
        self._cleaners = [_Cleaner(f"cleanup-{n}", self) for n in range(max(1, count))]

    def start(self) -> None:
        for cleaner in self._cleaners:
            cleaner.start()

    def join(self, timeout: float) -> None:
        """Wait for every cleaner (the queue answers None at stop), `timeout` in all."""
        deadline = time.monotonic() + timeout
        for cleaner in self._cleaners:
            cleaner.join(max(0.0, deadline - time.monotonic()))

    def work(self) -> None:
        """One cleaner's life: attempts until the queue says stop."""
        while (key := self._queue.next_cleanup()) is not None:
            try:
                attempt = self._attempt(key)
            except Exception:  # noqa: BLE001 - logged (once) by FailureLog
                self._failures.failed(key, "cleanup of %s failed unexpectedly; will retry", key[1])
                attempt = Attempt(problem="internal error", internal=True)
            else:
                self._failures.ok(key)
            self._queue.cleanup_ended(key, attempt)

    def _attempt(self, key: Key) -> Attempt:
        kind, device = key
        devices = self._describe(kind, [device])
        if not self._queue.end_leftover(key):
            return Attempt(
                problem=f"a hook on {device} from before the restart could not be killed"
            )
        if devices is None:
            return Attempt(problem=f"{device} is not present; cannot clean it")
        result = self._runner(
            self._hooks[kind],
            "cleanup",
            self._names[kind],
            devices,
            track=self._queue.tracker(key),
            cancel=self._cancel,
        )
        return Attempt(result)


class _Cleaner(ThreadLoop):
    """One cleaner thread; its stop is the queue's (next_cleanup answers None)."""

    def __init__(self, name: str, pool: Cleaners) -> None:
        super().__init__(name)
        self._pool = pool

    def run(self) -> None:
        self._pool.work()
