"""Per-node answers kept across the extender's calls.

At 5,000 nodes a call that looks every node up in the placement views
still does a dozen dictionary lookups and function calls per node: tens of
milliseconds in Python before the answer is encoded. Yet between two calls
for the same kind of pod almost no node changes. So each kind of question
(a pod shape and its requirement, or a set of claim specs) keeps a table:
node -> the answer's parts, valid as of a mark in a change log. The caches'
events write the names of the nodes they touch into the log (after the
cache holds the change); a call drops the table's entries for the nodes
named since its mark, works out only the nodes it lacks, and reads the
rest. An answer whose node's record goes stale with time, not with an
event (a Lease not renewed), carries its expiry and is dropped when that
passes.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Generic, TypeVar

V = TypeVar("V", bound=Hashable)

# Node names the log remembers; a table whose mark is further back than
# this starts over (one full call).
LOG_LENGTH = 1 << 16
# Tables (kinds of question) kept at most; the least recently asked goes.
MAX_TABLES = 32


class ChangeLog:
    """Which nodes changed, in order. Writers call `changed` after the state
    readers read holds the change; readers take `mark` before they read."""

    def __init__(self, length: int = LOG_LENGTH) -> None:
        self._lock = threading.Lock()
        self._names: deque[str] = deque(maxlen=length)
        self._seq = 0
        # A change that touched every node (a DeviceClass): marks before it
        # cannot be caught up with.
        self._everything_at = 0

    @property
    def mark(self) -> int:
        return self._seq

    def changed(self, name: str) -> None:
        with self._lock:
            self._names.append(name)
            self._seq += 1

    def changed_everything(self) -> None:
        with self._lock:
            self._seq += 1
            self._everything_at = self._seq

    def since(self, mark: int) -> set[str] | None:
        """The nodes named after `mark`; None when that is more than the log
        remembers (or everything changed since)."""
        with self._lock:
            behind = self._seq - mark
            if behind == 0:
                return set()
            if mark < self._everything_at or behind > len(self._names):
                return None
            return set(itertools.islice(self._names, len(self._names) - behind, None))


class _Table(Generic[V]):
    def __init__(self, mark: int) -> None:
        self.lock = threading.Lock()
        self.mark = mark
        self.values: dict[str, V] = {}
        self.expiry: dict[str, float] = {}
        self.soonest = math.inf
        # One object per distinct answer: thousands of nodes share a few.
        self.interned: dict[V, V] = {}


# Per name: the answer, and the monotonic time it stops being true without
# an event (math.inf: only an event changes it).
Compute = Callable[[Sequence[str]], Mapping[str, tuple[V, float]]]


class Answers(Generic[V]):
    """Kept answers per question key, caught up through `log`."""

    def __init__(
        self,
        log: ChangeLog,
        clock: Callable[[], float] = time.monotonic,
        tables: int = MAX_TABLES,
    ) -> None:
        self.log = log
        self._clock = clock
        self._limit = tables
        self._lock = threading.Lock()
        self._tables: OrderedDict[Hashable, _Table[V]] = OrderedDict()

    def read(
        self,
        key: Hashable,
        names: Sequence[str],
        compute: Compute[V],
        *,
        partial: bool = False,
    ) -> tuple[dict[str, V], int]:
        """Every name's answer (a copy: the caller may keep it), and how
        many were kept from before. `compute` is given the names the table
        lacks; with `partial` it may answer only some of them (a deadline),
        and the others are left out."""
        with self._lock:
            table = self._tables.get(key)
            if table is None:
                table = self._tables[key] = _Table(self.log.mark)
                while len(self._tables) > self._limit:
                    self._tables.popitem(last=False)
            else:
                self._tables.move_to_end(key)
        with table.lock:
            mark = self.log.mark
            self._catch_up(table, mark)
            values = table.values
            # In C: a loop over 5,000 names in Python was most of a call.
            asked = set(names)
            missing = list(asked.difference(values))
            kept = len(asked) - len(missing)
            if missing:
                self._fill(table, compute(missing))
            table.mark = mark
            # Only the names asked (the table may hold ten times as many).
            if partial:
                found = {name: values[name] for name in names if name in values}
            else:
                found = dict(zip(names, map(values.__getitem__, names), strict=True))
        return found, kept

    def _catch_up(self, table: _Table[V], mark: int) -> None:
        if table.mark != mark:
            changed = self.log.since(table.mark)
            if changed is None:
                table.values.clear()
                table.expiry.clear()
                table.soonest = math.inf
                table.interned.clear()
            else:
                for name in changed:
                    table.values.pop(name, None)
                    table.expiry.pop(name, None)
        now = self._clock()
        if now >= table.soonest:
            gone = [name for name, at in table.expiry.items() if at <= now]
            for name in gone:
                table.values.pop(name, None)
                del table.expiry[name]
            table.soonest = min(table.expiry.values(), default=math.inf)

    def _fill(self, table: _Table[V], computed: Mapping[str, tuple[V, float]]) -> None:
        interned = table.interned
        if len(interned) > 4 * len(table.values) + 64:
            interned.clear()  # answers no node gives any more
        for name, (value, until) in computed.items():
            table.values[name] = interned.setdefault(value, value)
            if until < math.inf:
                table.expiry[name] = until
                table.soonest = min(table.soonest, until)
