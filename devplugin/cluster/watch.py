"""A list-then-watch cache of one kind of API object, kept in memory.

One loop owns the connection: it lists (optionally with a field selector),
watches from the list's resourceVersion, lists again when the server says
the version is Gone (410), and backs off (wakeably) on any other error.
Readers only read the last snapshot or wait on it for a bounded time; they
never touch the network. An object that `parse` refuses (ValueError) is
skipped with one log line per name; the others keep flowing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Generic, TypeVar

from lightkube import ApiError, Client

log = logging.getLogger(__name__)

T = TypeVar("T")
# data -> (key, value); ValueError when the object is not understood.
Parse = Callable[[Mapping[str, Any]], tuple[str, T]]


class WatchCache(Generic[T]):
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
        backoff_initial: float = 0.2,
        backoff_max: float = 10.0,
        server_timeout: int = 60,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._resource = resource
        self._parse_object = parse
        self._name = name
        self._namespaced = namespaced
        self._fields = dict(fields) if fields else None
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._server_timeout = server_timeout
        self._clock = clock
        self._cond = threading.Condition()
        self._items: Mapping[str, T] = MappingProxyType({})
        self._version: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._skipped: set[str] = set()
        self._listeners: list[Callable[[], None]] = []
        # True from a successful list until the next error: only then does
        # the absence of an object mean it is gone.
        self._current = False
        self.synced = threading.Event()
        self.relists = 0
        self.errors = 0

    # -- reads ---------------------------------------------------------------------
    def items(self) -> Mapping[str, T]:
        """key -> value, as of the last event (an immutable snapshot)."""
        return self._items

    @property
    def current(self) -> bool:
        return self._current

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

    # -- the loop --------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def signal_stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        try:
            self._client.close()
        except Exception:
            log.debug("closing the API client failed", exc_info=True)

    def join(self, timeout: float) -> None:
        # A watch blocked on the network ends at its server timeout; the
        # thread is a daemon, so a stop never waits for it beyond `timeout`.
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        log.info("%s cache started", self._name)
        backoff = 0.0
        while not self._stop.is_set():
            try:
                if self._version is None:
                    self._list()
                backoff = 0.0
                self._watch()
            except ApiError as exc:
                if exc.status.code == 410:
                    log.info(
                        "%s watch: version %s is gone; listing again", self._name, self._version
                    )
                    self._version = None
                    continue
                backoff = self._fail(f"API error {exc.status.code}: {exc.status.message}", backoff)
            except Exception as exc:  # noqa: BLE001 - network, decoding: all mean retry
                if self._stop.is_set():
                    break
                backoff = self._fail(f"{type(exc).__name__}: {exc}", backoff)
        log.info("%s cache stopped", self._name)

    def _fail(self, message: str, backoff: float) -> float:
        self.errors += 1
        self._current = False
        backoff = min(self._backoff_max, max(self._backoff_initial, backoff * 2))
        log.warning("%s cache: %s; listing again in %.1fs", self._name, message[:300], backoff)
        self._version = None  # after an error, start from a fresh list
        self._stop.wait(backoff)
        return backoff

    def _list(self) -> None:
        listed = self._client.list(self._resource, **self._scope())
        items: dict[str, T] = {}
        for obj in listed:
            parsed = self._parse(_as_dict(obj))
            if parsed is not None:
                items[parsed[0]] = parsed[1]
        self._version = listed.resourceVersion
        self.relists += 1
        self._current = True
        self._publish(items)
        self.synced.set()

    def _watch(self) -> None:
        stream = self._client.watch(
            self._resource, **self._scope(),
            resource_version=self._version, server_timeout=self._server_timeout,
        )  # fmt: skip
        for kind, obj in stream:
            if self._stop.is_set():
                return
            data = _as_dict(obj)
            meta = data.get("metadata")
            if isinstance(meta, dict) and meta.get("resourceVersion"):
                self._version = str(meta["resourceVersion"])
            parsed = self._parse(data)
            if parsed is None:
                continue
            items = dict(self._items)
            if kind == "DELETED":
                items.pop(parsed[0], None)
            else:
                items[parsed[0]] = parsed[1]
            self._publish(items)

    def _scope(self) -> dict[str, Any]:
        scope: dict[str, Any] = {}
        if self._namespaced:
            scope["namespace"] = "*"
        if self._fields:
            scope["fields"] = self._fields
        return scope

    def _parse(self, data: Mapping[str, Any]) -> tuple[str, T] | None:
        try:
            return self._parse_object(data)
        except ValueError as exc:
            found = data.get("metadata")
            meta: Mapping[str, Any] = found if isinstance(found, dict) else {}
            name = f"{meta.get('namespace', '-')}/{meta.get('name', '?')}"
            if name not in self._skipped:
                self._skipped.add(name)
                log.warning("%s %s skipped: %s", self._name, name[:200], str(exc)[:200])
            return None

    def _publish(self, items: dict[str, T]) -> None:
        self.published(items)
        with self._cond:
            self._items = MappingProxyType(items)
            self._cond.notify_all()
        for listener in self._listeners:
            try:
                listener()
            except Exception:
                log.exception("a %s cache listener failed", self._name)

    def published(self, items: Mapping[str, T]) -> None:
        """Subclasses derive what their readers need, once per change (before
        the snapshot is swapped in)."""


def _as_dict(obj: Any) -> dict[str, Any]:
    data = obj.to_dict() if hasattr(obj, "to_dict") else obj
    return data if isinstance(data, dict) else {}
