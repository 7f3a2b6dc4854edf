"""A list-then-watch cache of one kind of API object, kept in memory.

One loop owns the connection: it lists (optionally with a field selector),
watches from the list's resourceVersion, lists again when the server says
the version is Gone (410), and backs off (wakeably) on any other error.
Readers only read the last snapshot or wait on it for a bounded time; they
never touch the network.

It never trusts a watch blindly. The server ends every watch after
`server_timeout` seconds and it is opened again, so a live connection
answers at least that often; the client's transport gives each watch a
read deadline a little past that (`cluster/client.py`). A connection that
goes silent without a FIN or RST (an API server VM that died, a load
balancer failing over) therefore ends in a read error, and the cache lists
again. Until a list succeeds, or whenever nothing (a list, an event, an
answer from the server) has arrived within `bound` seconds, the cache is
not `current`, and says so once in the log; readers fall back to what they
do without the API.

An object that `parse` refuses, whatever is wrong with it, is skipped with
one log line per name; the others keep flowing.

An event costs O(1): the object is put into (or taken out of) the map in
place, under the lock, and subclasses update what they derive for that one
key (`changed`). Hot readers look keys up (`get`); `items()` hands out an
immutable copy, made at most once per change, for the rare reader that
walks everything.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Generic, TypeVar

from lightkube import ApiError, Client

from devplugin.cluster.client import Heartbeat
from devplugin.config import KubernetesConfig
from devplugin.loops import Backoff, FailureLog, ThreadLoop

log = logging.getLogger(__name__)

T = TypeVar("T")
# data -> (key, value); raises when the object is not understood.
Parse = Callable[[Mapping[str, Any]], tuple[str, T]]


# Objects per list page (the API server's `limit`).
LIST_CHUNK = 500


class Incomplete(ValueError):
    """Raised by a parser for an object that is not filled in yet (a record
    created before its first status write): skipped without a log line."""


# Skipped names remembered (for the one log line each) at most.
SKIPPED_NAMES = 1024


@dataclass(frozen=True)
class WatchTiming:
    """The timing every watch cache takes together: its retry backoff, how
    long the server keeps a watch open, and how late past that a live
    watch may still be heard from."""

    backoff_initial: float = 0.2
    backoff_max: float = 10.0
    server_timeout: float = 30.0
    read_margin: float = 5.0

    @classmethod
    def of(cls, kube: KubernetesConfig) -> WatchTiming:
        return cls(
            backoff_max=kube.watch_backoff_max_seconds,
            server_timeout=kube.watch_timeout_seconds,
            read_margin=kube.request_timeout_seconds,
        )


DEFAULT_TIMING = WatchTiming()


class WatchCache(ThreadLoop, Generic[T]):
    """Owns `client`: closing it is how a stop ends a watch blocked on the network."""

    def __init__(
        self,
        client: Client,
        resource: Any,
        parse: Parse[T],
        *,
        name: str,
        namespaced: bool,
        fields: Mapping[str, str] | None = None,
        labels: Mapping[str, Any] | None = None,
        namespace: str = "*",
        timing: WatchTiming = DEFAULT_TIMING,
        heartbeat: Heartbeat | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # A watch blocked on the network ends at its read deadline; the
        # thread is a daemon, so a stop never waits for it long.
        backoff = Backoff(timing.backoff_initial, max(timing.backoff_max, timing.backoff_initial))
        super().__init__(
            name, backoff=backoff, join_timeout=0.5, failing=f"{name} cache: not current"
        )
        self._client = client
        self._resource = resource
        self._parse_object = parse
        self._namespaced = namespaced
        self._fields = dict(fields) if fields else None
        self._labels = dict(labels) if labels else None
        self._namespace = namespace
        self._server_timeout = max(1, math.ceil(timing.server_timeout))
        # Nothing from a live watch for longer than this means it is dead.
        self.bound = self._server_timeout + timing.read_margin
        self._heartbeat = heartbeat
        self._clock = clock
        self._cond = threading.Condition()
        self._items: dict[str, T] = {}
        # The copy `items()` last handed out; None once a change made it old.
        self._snapshot: Mapping[str, T] | None = MappingProxyType({})
        self._version: str | None = None
        self._skipped: set[str] = set()
        # Object name -> the key its last accepted version was kept under.
        self._key_by_name: dict[str, str] = {}
        self._refused = False
        self._listeners: list[Callable[[], None]] = []
        self._failures = FailureLog(log)
        self._key_listeners: list[Callable[[str, T | None, T | None], None]] = []
        # True from a successful list until the next error.
        self._listed = False
        # When the last list, event or server answer arrived.
        self._alive_at = -math.inf
        # When the cache stopped being current (logged once), until a list.
        self._down_since: float | None = None
        self._random = random.Random()
        self.synced = threading.Event()
        self.relists = 0
        self.errors = 0
        self.skipped = 0

    # -- reads ---------------------------------------------------------------------
    def items(self) -> Mapping[str, T]:
        """key -> value, as of the last event (an immutable snapshot; a copy
        after each change, so hot paths use `get`)."""
        snapshot = self._snapshot
        if snapshot is None:
            with self._cond:
                snapshot = self._snapshot
                if snapshot is None:
                    snapshot = self._snapshot = MappingProxyType(dict(self._items))
        return snapshot

    def get(self, key: str) -> T | None:
        """One object by key (O(1), no copy)."""
        return self._items.get(key)

    def getter(self) -> Callable[[str], T | None]:
        """`get` bound to the map as it is now: a loop over thousands of
        keys saves a call per key (a relist after this is not seen)."""
        return self._items.get

    def __len__(self) -> int:
        return len(self._items)

    def age(self) -> float:
        """Seconds since the last sign of life from the server (inf before any)."""
        heard = self._alive_at
        if self._heartbeat is not None:
            heard = max(heard, self._heartbeat.at)
        return max(0.0, self._clock() - heard)

    @property
    def current(self) -> bool:
        """Whether the cache may be trusted now: listed since the last error,
        and heard from within `bound` seconds."""
        if not self._listed:
            return False
        age = self.age()
        if age <= self.bound:
            return True
        if self._down_since is None:
            self._down_since = self._clock()
            log.warning(
                "%s cache: nothing from the API server for %.0fs; not current", self.name, age
            )
        return False

    def wait_for(self, predicate: Callable[[Mapping[str, T]], bool], timeout: float) -> bool:
        """Wait at most `timeout` seconds for the cache to satisfy `predicate`."""
        deadline = self._clock() + timeout
        with self._cond:
            while not predicate(self._items):
                left = deadline - self._clock()
                if left <= 0 or self._stop.is_set():
                    return False
                self._cond.wait(left)
            return True

    def listen(self, listener: Callable[[], None]) -> None:
        """Call `listener` (on the cache's thread) after every change."""
        self._listeners.append(listener)

    def listen_keys(self, listener: Callable[[str, T | None, T | None], None]) -> None:
        """Call `listener(key, before, after)` (on the cache's thread) after
        the map holds each change: a reader that notes a change before it
        reads the map can then never keep an answer older than its note."""
        self._key_listeners.append(listener)

    # -- the loop --------------------------------------------------------------------
    def signal_stop(self) -> None:
        super().signal_stop()
        with self._cond:
            self._cond.notify_all()
        try:
            self._client.close()
        except Exception:
            log.debug("closing the API client failed", exc_info=True)

    def starting(self) -> None:
        log.info("%s cache started", self.name)

    def step(self) -> float:
        try:
            if self._version is None:
                self._list()  # an undecodable list is an error: backoff, not current
            try:
                self._watch()
            except ValueError as exc:
                # An event the client cannot even decode (no real API server
                # sends one): the cache is still right up to it. Skip it by
                # listing again; stay current meanwhile.
                self.skipped += 1
                log.warning(
                    "%s watch: an event could not be decoded (%s); listing again",
                    self.name,
                    str(exc)[:200],
                )
                self._version = None
        except ApiError as exc:
            if exc.status.code != 410:
                raise
            log.info("%s watch: version %s is gone; listing again", self.name, self._version)
            self._version = None
        return 0.0

    def failed(self, exc: Exception) -> None:
        self.errors += 1
        self._listed = False
        if self._down_since is None:
            self._down_since = self._clock()
        self._version = None  # after an error, start from a fresh list

    def spread(self, pause: float) -> float:
        # Jitter: a fleet of daemons must not come back in lock step.
        return pause * (0.5 + self._random.random() / 2)

    def recovered(self) -> None:
        log.info("%s cache: listed again", self.name)

    def _list(self) -> None:
        # In pages: a fleet's list decoded whole (100,000 pods, 5,000
        # ResourceSlices) left hundreds of MiB of heap behind it.
        listed = self._client.list(self._resource, chunk_size=LIST_CHUNK, **self._scope())
        items: dict[str, T] = {}
        keys: dict[str, str] = {}
        for obj in listed:
            parsed = self._parse(obj)
            if parsed is not None:
                items[parsed[0]] = parsed[1]
                keys[_name_of(obj)] = parsed[0]
        self._version = listed.resourceVersion
        self.relists += 1
        previous = self._items
        differ = []
        for key in set(previous) | set(items):
            before, after = previous.get(key), items.get(key)
            if before != after:
                self._safely(self.changed, key, before, after)
                differ.append((key, before, after))
        self._listed = True
        self._alive()
        self._key_by_name = keys
        with self._cond:
            self._items = items
            self._snapshot = None
            self._cond.notify_all()
        for change in differ:
            self._told_keys(*change)
        self._tell()
        self.synced.set()

    def _watch(self) -> None:
        stream = self._client.watch(
            self._resource,
            **self._scope(),
            resource_version=self._version,
            server_timeout=self._server_timeout,
        )
        for kind, obj in stream:
            if self._stop.is_set():
                return
            self._alive()
            version = _version_of(obj)
            if version:
                self._version = version
            if kind == "BOOKMARK":
                continue
            parsed = self._parse(obj)
            name = _name_of(obj)
            value: T | None
            if parsed is None:
                # A refused new version takes the old one's place as nothing:
                # what it said before must not go on steering.
                refused_key = self._key_by_name.get(name) if self._refused else None
                if refused_key is None or refused_key not in self._items:
                    continue
                key, value, event = refused_key, None, "DELETED"
            else:
                (key, value), event = parsed, kind
            if event == "DELETED":
                self._key_by_name.pop(name, None)
            else:
                self._key_by_name[name] = key
            before = self._items.get(key)
            after = None if event == "DELETED" else value
            if before == after:
                continue
            self._safely(self.changed, key, before, after)
            with self._cond:
                if after is None:
                    self._items.pop(key, None)
                else:
                    self._items[key] = after
                self._snapshot = None
                self._cond.notify_all()
            self._told_keys(key, before, after)
            self._tell()

    def _alive(self) -> None:
        self._alive_at = self._clock()
        if self._listed and self._down_since is not None:
            log.info(
                "%s cache current again (after %.1fs)", self.name, self._alive_at - self._down_since
            )
            self._down_since = None

    def _scope(self) -> dict[str, Any]:
        scope: dict[str, Any] = {}
        if self._namespaced:
            scope["namespace"] = self._namespace
        if self._fields:
            scope["fields"] = self._fields
        if self._labels:
            scope["labels"] = self._labels
        return scope

    def _parse(self, obj: Any) -> tuple[str, T] | None:
        self._refused = False
        try:
            data = _as_dict(obj)
            return self._parse_object(data)
        except Incomplete:
            return None
        except Exception as exc:  # noqa: BLE001 - whatever is wrong with one object
            self._refused = True
            self.skipped += 1
            name = _name_of(obj)
            if name not in self._skipped:
                if len(self._skipped) >= SKIPPED_NAMES:
                    self._skipped.clear()
                self._skipped.add(name)
                log.warning(
                    "%s %s skipped: %s: %s",
                    self.name,
                    name[:200],
                    type(exc).__name__,
                    str(exc)[:200],
                )
            return None

    def _tell(self) -> None:
        for listener in self._listeners:
            self._safely(listener)

    def _told_keys(self, key: str, before: T | None, after: T | None) -> None:
        for listener in self._key_listeners:
            self._safely(listener, key, before, after)

    def _safely(self, call: Callable[..., None], *args: Any) -> None:
        try:
            call(*args)
        except Exception:  # noqa: BLE001 - logged (once) by FailureLog
            self._failures.failed(call, "a %s cache listener failed", self.name)

    # -- for subclasses ----------------------------------------------------------------
    def changed(self, key: str, before: T | None, after: T | None) -> None:
        """One object changed (None: absent), before the map holds the change:
        whoever waits on the cache then sees what subclasses derived from it.
        Called on the cache's thread only; O(1) work here keeps events O(1)."""


def _as_dict(obj: Any) -> dict[str, Any]:
    data = obj.to_dict() if hasattr(obj, "to_dict") else obj
    if not isinstance(data, dict):
        raise ValueError(f"not an object: {type(data).__name__}")
    return data


def _meta(obj: Any) -> Mapping[str, Any]:
    try:
        meta = _as_dict(obj).get("metadata")
    except Exception:  # noqa: BLE001 - a name for the log line only
        return {}
    return meta if isinstance(meta, dict) else {}


def _name_of(obj: Any) -> str:
    meta = _meta(obj)
    return f"{meta.get('namespace', '-')}/{meta.get('name', '?')}"


def _version_of(obj: Any) -> str | None:
    version = _meta(obj).get("resourceVersion")
    return str(version) if isinstance(version, str | int) and version != "" else None
