"""Hardware reads with a deadline, so a wedged device cannot stall its caller.

A call into NVML for a GPU that fell off the bus, or a read of a sysfs
attribute whose driver hangs, can block forever; Python cannot interrupt it.
So each read runs on a worker thread of its own key (one key per device, or
per system-wide source) and the caller waits at most `timeout` seconds. A
call that has not returned is abandoned, not killed: its worker stays
blocked, and until it returns every later call for that key fails at once
with `Stuck`, without starting another thread. The number of threads is
therefore bounded by the number of keys, whatever the hardware does.

Workers are daemon threads: a blocked one never keeps the process from
exiting.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
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
        self.done = threading.Event()
        self.value: T | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller as is
            self.error = exc
        finally:
            self.done.set()


@dataclass
class _Worker:
    key: str
    inbox: queue.SimpleQueue[_Call[object] | None]
    busy_since: float | None = None


class Deadlines:
    """Keyed calls with a timeout; one worker thread per key, created lazily."""

    def __init__(self, timeout: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self._clock = clock
        self._lock = threading.Lock()
        self._workers: dict[str, _Worker] = {}
        self._closed = False

    def call(self, key: str, fn: Callable[[], T], timeout: float | None = None) -> T:
        """`fn()` on `key`'s worker; raises Stuck when it does not return in time
        (or when an earlier call on `key` still has not), else what fn raised."""
        limit = self.timeout if timeout is None else timeout
        with self._lock:
            if self._closed:
                raise RuntimeError("deadlines closed")
            worker = self._workers.get(key)
            if worker is not None and worker.busy_since is not None:
                raise Stuck(key, worker.busy_since, limit)
            if worker is None:
                worker = self._spawn(key)
            started = self._clock()
            worker.busy_since = started
        call: _Call[T] = _Call(fn)
        worker.inbox.put(call)  # type: ignore[arg-type]
        if not call.done.wait(limit):
            log.warning("%s: hardware read has not returned after %gs; abandoned", key, limit)
            raise Stuck(key, started, limit)
        if call.error is not None:
            raise call.error
        return call.value  # type: ignore[return-value]

    def stuck(self) -> dict[str, float]:
        """Keys whose last call has been running longer than the timeout -> since."""
        now = self._clock()
        with self._lock:
            return {
                key: worker.busy_since
                for key, worker in self._workers.items()
                if worker.busy_since is not None and now - worker.busy_since >= self.timeout
            }

    def close(self) -> None:
        """Ask every idle worker to exit; blocked ones exit when their call returns."""
        with self._lock:
            self._closed = True
            workers = list(self._workers.values())
            self._workers.clear()
        for worker in workers:
            worker.inbox.put(None)

    def _spawn(self, key: str) -> _Worker:
        worker = _Worker(key, queue.SimpleQueue())
        self._workers[key] = worker
        threading.Thread(
            target=self._serve, args=(worker,), name=f"read-{key}", daemon=True
        ).start()
        return worker

    def _serve(self, worker: _Worker) -> None:
        while True:
            call = worker.inbox.get()
            if call is None:
                return
            call.run()
            with self._lock:
                late = worker.busy_since is not None and (
                    self._clock() - worker.busy_since > self.timeout
                )
                worker.busy_since = None
            if late:
                log.info("%s: a read abandoned earlier has returned", worker.key)
