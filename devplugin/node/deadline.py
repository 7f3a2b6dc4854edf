"""Hardware reads with a deadline, so a wedged device cannot stall its caller.

A call into NVML for a GPU that fell off the bus, or a read of a sysfs
attribute whose driver hangs, can block forever; Python cannot interrupt it.
So each read runs on a worker thread and the caller waits at most `timeout`
seconds. A call that has not returned is abandoned, not killed: its worker
stays blocked, and until it returns every later call for the same key (one
key per device, or per system-wide source) fails at once with `Stuck`,
without occupying another thread.

Workers are a small shared pool, not a thread per key: a node with 64 GPUs
idles on the same few threads as one with 8. A worker is added only when
every worker is busy (some read is wedged), so a wedged read never delays
the others, and the pool never holds more threads than keys with a call in
flight plus POOL idle ones. Workers are daemon threads: a blocked one never
keeps the process from exiting.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class Stuck(Exception):
    """A read for `key` did not return within its deadline."""

    def __init__(self, key: str, since: float, timeout: float) -> None:
        super().__init__(key)
        self.key = key
        self.since = since
        self.timeout = timeout

    def __str__(self) -> str:
        return f"no answer within {self.timeout:g}s"


class _Batch:
    """Reads of several keys run one after another on one worker, so a
    check's dozen reads wake a worker and its caller once, not a dozen
    times. The caller watches the read in progress: one past the deadline
    is abandoned (`cut`) and the reads after it go on elsewhere."""

    def __init__(self, calls: list[tuple[str, Callable[[], object]]]) -> None:
        self.calls = calls
        self.results: list[object] = [None] * len(calls)
        self.lock = threading.Lock()
        self.next = 0  # the next read to start
        self.current: tuple[int, float] | None = None  # (read, since) in progress
        self.cut = False
        self._done = threading.Lock()
        self._done.acquire()

    def take(self, clock: Callable[[], float]) -> int | None:
        """The worker's: the next read to run, or None when none is left."""
        with self.lock:
            if self.cut or self.next >= len(self.calls):
                self.current = None
                return None
            index, self.next = self.next, self.next + 1
            self.current = (index, clock())
            return index

    def wait(self, timeout: float) -> bool:
        return self._done.acquire(timeout=max(0.0, timeout))

    def finish(self) -> None:
        self._done.release()


# Idle workers kept; more are started only while all are busy.
POOL = 2
# A worker above POOL that has had nothing to do this long exits.
IDLE_EXIT = 30.0


class Deadlines:
    """Keyed calls with a timeout, on a small pool of worker threads."""

    def __init__(self, timeout: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self._clock = clock
        self._lock = threading.Lock()
        self._inbox: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        # key -> when its call in flight started (a key has at most one).
        self._busy: dict[str, float] = {}
        self._workers = 0
        self._idle = 0
        self._closed = False

    @property
    def threads(self) -> int:
        """Worker threads alive now."""
        return self._workers

    def call(self, key: str, fn: Callable[[], T], timeout: float | None = None) -> T:
        """`fn()` on a worker; raises Stuck when it does not return in time
        (or when an earlier call on `key` still has not), else what fn raised."""
        (outcome,) = self.call_all([(key, fn)], timeout)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def call_all(
        self, calls: Sequence[tuple[str, Callable[[], T]]], timeout: float | None = None
    ) -> list[T | BaseException]:
        """Each `fn()` in order on one worker, each within `timeout` of its
        start: per read, its value or what it raised (Stuck for a key still
        busy, or a read past its deadline, whose successors then run on
        another worker)."""
        limit = self.timeout if timeout is None else timeout
        results: list[T | BaseException] = [Stuck(key, 0.0, limit) for key, _ in calls]
        pending: list[int] = []
        with self._lock:
            if self._closed:
                raise RuntimeError("deadlines closed")
            for index, (key, _) in enumerate(calls):
                since = self._busy.get(key)
                if since is not None:
                    results[index] = Stuck(key, since, limit)
                else:
                    # Taken, not begun: the worker stamps it when it begins,
                    # so a long queue is never taken for a wedged read.
                    self._busy[key] = math.inf
                    pending.append(index)
            if not pending:
                return results
            if self._idle == 0:
                self._spawn_locked()
            else:
                self._idle -= 1
        batch = _Batch([(calls[i][0], calls[i][1]) for i in pending])
        self._inbox.put(batch)
        while not batch.wait(self._left(batch, limit)):
            with batch.lock:
                current = batch.current
                if current is None or self._clock() - current[1] < limit:
                    continue
                batch.cut = True
                rest = list(range(batch.next, len(batch.calls)))
                batch.next = len(batch.calls)
            index, since = current
            key = batch.calls[index][0]
            log.warning("%s: hardware read has not returned after %gs; abandoned", key, limit)
            results[pending[index]] = Stuck(key, since, limit)
            # The reads not begun: marked busy for this batch, handed on.
            with self._lock:
                for later in rest:
                    self._busy.pop(batch.calls[later][0], None)
            again = self.call_all([batch.calls[later] for later in rest], limit)
            for later, outcome in zip(rest, again, strict=True):
                results[pending[later]] = outcome  # type: ignore[assignment]
            for done in range(index):
                results[pending[done]] = batch.results[done]  # type: ignore[assignment]
            return results
        for done, outcome in enumerate(batch.results):
            results[pending[done]] = outcome  # type: ignore[assignment]
        return results

    def _left(self, batch: _Batch, limit: float) -> float:
        """How long the read in progress may still take."""
        with batch.lock:
            current = batch.current
        since = current[1] if current is not None else self._clock()
        return since + limit - self._clock()

    def stuck(self) -> dict[str, float]:
        """Keys whose last call has been running longer than the timeout -> since."""
        now = self._clock()
        with self._lock:
            return {key: since for key, since in self._busy.items() if now - since >= self.timeout}

    def close(self) -> None:
        """Ask every idle worker to exit; blocked ones exit when their call returns."""
        with self._lock:
            self._closed = True
            workers = self._workers
        for _ in range(workers):
            self._inbox.put(None)

    def _spawn_locked(self) -> None:
        self._workers += 1
        threading.Thread(target=self._serve, name="hw-read", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                item = self._inbox.get(timeout=IDLE_EXIT)
            except queue.Empty:
                with self._lock:
                    if self._idle > POOL:
                        self._idle -= 1
                        self._workers -= 1
                        return
                continue
            if item is None:
                with self._lock:
                    self._workers -= 1
                return
            self._run_batch(item)

    def _run_batch(self, batch: _Batch) -> None:
        while (index := batch.take(self._clock)) is not None:
            key, fn = batch.calls[index]
            with self._lock:
                self._busy[key] = self._clock()
            try:
                batch.results[index] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller as is
                batch.results[index] = exc
            with self._lock:
                since = self._busy.pop(key, None)
                late = since is not None and self._clock() - since > self.timeout
            if late:
                log.info("%s: a read abandoned earlier has returned", key)
        # Every key free and this worker idle before the caller wakes: a
        # caller that reads the same key again at once must find it so (else
        # its next read is refused as stuck, and a new worker made).
        with self._lock:
            self._idle += 1
        batch.finish()
