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
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

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


class _Call(Generic[T]):
    def __init__(self, fn: Callable[[], T]) -> None:
        self.fn = fn
        # Held until the worker is done: a bare lock is the cheapest wait
        # there is (an Event is a Condition over one), and checks make
        # dozens of calls each.
        self._done = threading.Lock()
        self._done.acquire()
        self.value: T | None = None
        self.error: BaseException | None = None

    def wait(self, timeout: float) -> bool:
        """Whether the call ended within `timeout`."""
        return self._done.acquire(timeout=timeout)

    def finish(self) -> None:
        """The worker's, once its key is free again."""
        self._done.release()

    def run(self) -> None:
        """Call fn; `finish` is the worker's to call, once its key is free again."""
        try:
            self.value = self.fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller as is
            self.error = exc


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
        self._inbox: queue.SimpleQueue[tuple[str, _Call[object]] | None] = queue.SimpleQueue()
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
        limit = self.timeout if timeout is None else timeout
        call: _Call[T] = _Call(fn)
        with self._lock:
            if self._closed:
                raise RuntimeError("deadlines closed")
            since = self._busy.get(key)
            if since is not None:
                raise Stuck(key, since, limit)
            started = self._clock()
            self._busy[key] = started
            if self._idle == 0:
                self._spawn_locked()
            else:
                self._idle -= 1
        self._inbox.put((key, call))  # type: ignore[arg-type]
        if not call.wait(limit):
            log.warning("%s: hardware read has not returned after %gs; abandoned", key, limit)
            raise Stuck(key, started, limit)
        if call.error is not None:
            raise call.error
        return call.value  # type: ignore[return-value]

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
            key, call = item
            call.run()
            # The key is free and this worker idle before the caller wakes: a
            # caller that reads the same key again at once must find it so
            # (else its next read is refused as stuck, and a new worker made).
            with self._lock:
                since = self._busy.pop(key, None)
                late = since is not None and self._clock() - since > self.timeout
                self._idle += 1
            call.finish()
            if late:
                log.info("%s: a read abandoned earlier has returned", key)
