"""One shape for every long-running loop of the daemon and the extender.

A loop owns one thread and one stop signal, says when it starts and stops,
and survives its own failures: an exception out of a step is logged once
per distinct message, answered with a growing pause, and the loop goes on.
`Daemon` holds its parts as `Loop`s, starts them in order and stops them
in reverse, each join bounded by the loop's own `join_timeout`.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol


class Loop(Protocol):
    """What a supervisor needs of a part that runs on its own."""

    @property
    def join_timeout(self) -> float: ...

    def start(self) -> None: ...

    def signal_stop(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...


@dataclass(frozen=True)
class Backoff:
    """Pauses after failures: the first, then doubling up to the most."""

    first: float = 1.0
    most: float = 30.0

    def after(self, last: float) -> float:
        """The pause after a failure that followed a pause of `last` (0 for
        the first failure of a run)."""
        return min(self.most, max(self.first, last * 2))

    def nth(self, failures: int) -> float:
        """The pause after `failures` failures in a row before this one."""
        return min(self.most, self.first * 2.0 ** min(failures, 64))


def failure_text(exc: BaseException) -> str:
    """An exception in one bounded line: what a loop logs and compares."""
    return f"{type(exc).__name__}: {exc}"[:300]


class FailureLog:
    """An unexpected exception logged once, with its traceback, per place
    and message: a loop that meets the same failure again (a retried
    cleanup, a listener failing at every event) logs it at debug only."""

    def __init__(self, logger: logging.Logger) -> None:
        self._log = logger
        self._lock = threading.Lock()
        self._last: dict[Hashable, str] = {}

    def failed(self, where: Hashable, message: str, *args: object) -> None:
        """Call from an except block: `message % args`, with the exception."""
        exc = sys.exc_info()[1]
        text = failure_text(exc) if exc is not None else ""
        with self._lock:
            again = self._last.get(where) == text
            self._last[where] = text
        if again:
            self._log.debug(message + " (again: %s)", *args, text)
        else:
            self._log.exception(message, *args)

    def ok(self, where: Hashable) -> None:
        """`where` worked: its next failure is logged in full again."""
        with self._lock:
            self._last.pop(where, None)


class ThreadLoop:
    """A loop on a thread of its own.

    Subclasses write `step()`, which does one round and returns how long to
    wait before the next; `poke()` ends that wait early, `signal_stop()`
    ends it for good. A step that raises is retried after `backoff` (pokes
    do not shorten it: a failing server is not hammered). A loop whose work
    is not a series of rounds (a queue worker, a blocking reader) overrides
    `run()` instead and keeps the same start, stop and join."""

    def __init__(
        self,
        name: str,
        *,
        backoff: Backoff | None = None,
        join_timeout: float = 10.0,
        failing: str | None = None,
        wake: threading.Event | None = None,
    ) -> None:
        self.name = name
        self._backoff = backoff or Backoff()
        self._join_timeout = join_timeout
        # What the warning says a failed step did not do ("Lease not renewed").
        self._failing_text = failing or f"{name} loop step failed"
        self._stop = threading.Event()
        # What pokes it; a loop may share one its callers already set.
        self._wake = wake if wake is not None else threading.Event()
        self._thread: threading.Thread | None = None
        self._failing: str | None = None
        self._log = logging.getLogger(type(self).__module__)

    # -- the Loop protocol ---------------------------------------------------
    @property
    def join_timeout(self) -> float:
        return self._join_timeout

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        self._thread.start()

    def signal_stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def join(self, timeout: float | None = None) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._join_timeout if timeout is None else timeout)

    def stop(self) -> None:
        self.signal_stop()
        self.join()

    # -- what subclasses use ---------------------------------------------------
    def poke(self) -> None:
        """Something the loop looks at may have changed: the next round now."""
        self._wake.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def sleep(self, seconds: float) -> bool:
        """Wait, waking only for a stop; True when stopping."""
        return self._stop.wait(seconds)

    def starting(self) -> None:
        """Logged or done once on the loop's thread before the first round."""
        self._log.info("%s loop started", self.name)

    def begin(self) -> None:
        """Just before a round: pokes until now are answered by it."""
        self._wake.clear()

    def step(self) -> float | None:
        """One round; the seconds until the next (None: until poked)."""
        raise NotImplementedError

    def failed(self, exc: Exception) -> None:
        """After a step raised: forget what the failure made doubtful."""

    def finished(self) -> None:
        """On the loop's thread after its last round: give back what it held."""

    def spread(self, pause: float) -> float:
        """The pause actually waited (a fleet's loops spread theirs)."""
        return pause

    def recovered(self) -> None:
        """The first good step after failures."""
        self._log.info("%s: working again", self.name)

    @property
    def failing(self) -> str | None:
        """Why the last round failed, or None when it did not."""
        return self._failing

    def run(self) -> None:
        """Rounds of `step` until stopped, failures logged once and paced."""
        pause = 0.0
        while not self._stop.is_set():
            self.begin()
            try:
                wait = self.step()
            except Exception as exc:  # noqa: BLE001 - a loop outlives its failures
                if self._stop.is_set():
                    break  # what a stop interrupts (a closed connection) is no failure
                pause = self._backoff.after(pause)
                message = failure_text(exc)
                if message != self._failing:
                    self._log.warning("%s (%s); retrying", self._failing_text, message)
                    self._failing = message
                self.failed(exc)
                self._stop.wait(self.spread(pause))
                continue
            pause = 0.0
            if self._failing is not None:
                self._failing = None
                self.recovered()
            if wait is None:
                self._wake.wait()
            elif wait > 0:
                self._wake.wait(wait)

    def _main(self) -> None:
        self.starting()
        try:
            self.run()
        except Exception:  # noqa: BLE001 - the loop is over; logged once
            # Logged here once; not raised on to the thread's hook, which
            # would print it a second time. /healthz sees the thread gone.
            self._log.exception("%s loop ended by an error", self.name)
        finally:
            self.finished()
            self._log.info("%s loop stopped", self.name)
