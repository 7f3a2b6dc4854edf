"""This node's pods, from the API server: list, then watch, kept in memory.

One loop owns the connection: it lists the pods bound to this node
(`fieldSelector=spec.nodeName=<node>`), watches from the list's
resourceVersion, re-lists when the server says the version is Gone (410),
and backs off (wakeably) on any other error. Readers (RPC handlers) only
read the last snapshot or wait on it for a bounded time; they never touch
the network. A pod whose shape is not understood is skipped with one log
line; the others keep flowing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from lightkube import ApiError, Client
from lightkube.generic_resource import create_namespaced_resource

from devplugin.podinfo import PodInfo, parse_pod

log = logging.getLogger(__name__)

# Pods as plain dicts: the shape is checked here, so one odd pod cannot stop
# the decoding of a whole list or watch.
RawPod = create_namespaced_resource("", "v1", "Pod", "pods")


class PodCache:
    """Owns `client`: closing it is how a stop ends a watch blocked on the network."""

    def __init__(
        self,
        client: Client,
        node: str,
        *,
        backoff_initial: float = 0.2,
        backoff_max: float = 10.0,
        server_timeout: int = 60,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._node = node
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._server_timeout = server_timeout
        self._clock = clock
        self._cond = threading.Condition()
        self._pods: Mapping[str, PodInfo] = MappingProxyType({})
        self._waiting: tuple[PodInfo, ...] = ()
        self._version: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._skipped: set[str] = set()
        self._listeners: list[Callable[[], None]] = []
        # True from a successful list until the next error: only then does
        # the absence of a pod mean it is gone.
        self._current = False
        self.synced = threading.Event()
        self.relists = 0
        self.errors = 0

    # -- reads ---------------------------------------------------------------------
    def pods(self) -> Mapping[str, PodInfo]:
        """uid -> pod, as of the last event (an immutable snapshot)."""
        return self._pods

    def waiting(self) -> tuple[PodInfo, ...]:
        """Pods not yet past admission (not started, finished or deleting),
        oldest first: sorted once per change here, not in every RPC."""
        return self._waiting

    def wait_for(self, predicate: Callable[[Mapping[str, PodInfo]], bool], timeout: float) -> bool:
        """Wait at most `timeout` seconds for the cache to satisfy `predicate`."""
        deadline = self._clock() + timeout
        with self._cond:
            while not predicate(self._pods):
                left = deadline - self._clock()
                if left <= 0 or self._stop.is_set():
                    return False
                self._cond.wait(left)
            return True

    @property
    def current(self) -> bool:
        return self._current

    def uid_of(self, namespace: str, pod: str) -> str | None:
        for info in self._pods.values():
            if info.namespace == namespace and info.name == pod:
                return info.uid
        return None

    def ended(self, owner: tuple[str, str, str | None]) -> bool | None:
        """Whether the pod is gone (or replaced by a namesake) or finished; None
        while the cache is not in sync with the API server."""
        if not self._current:
            return None
        namespace, name, uid = owner
        for info in self._pods.values():
            if info.namespace == namespace and info.name == name and uid in (None, info.uid):
                return info.terminal
        return True

    def listen(self, listener: Callable[[], None]) -> None:
        """Call `listener` (on the cache's thread) after every change."""
        self._listeners.append(listener)

    # -- the loop --------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pods", daemon=True)
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
        log.info("pod cache started (pods on node %s)", self._node)
        backoff = 0.0
        while not self._stop.is_set():
            try:
                if self._version is None:
                    self._list()
                backoff = 0.0
                self._watch()
            except ApiError as exc:
                if exc.status.code == 410:
                    log.info("pod watch: resourceVersion %s is gone; listing again", self._version)
                    self._version = None
                    continue
                backoff = self._fail(f"API error {exc.status.code}: {exc.status.message}", backoff)
            except Exception as exc:  # noqa: BLE001 - network, decoding: all mean retry
                if self._stop.is_set():
                    break
                backoff = self._fail(f"{type(exc).__name__}: {exc}", backoff)
        log.info("pod cache stopped")

    def _fail(self, message: str, backoff: float) -> float:
        self.errors += 1
        self._current = False
        backoff = min(self._backoff_max, max(self._backoff_initial, backoff * 2))
        log.warning("pod cache: %s; listing again in %.1fs", message[:300], backoff)
        self._version = None  # after an error, start from a fresh list
        self._stop.wait(backoff)
        return backoff

    def _list(self) -> None:
        listed = self._client.list(RawPod, namespace="*", fields={"spec.nodeName": self._node})
        pods: dict[str, PodInfo] = {}
        for obj in listed:
            parsed = self._parse(_as_dict(obj))
            if parsed is not None:
                pods[parsed.uid] = parsed
        self._version = listed.resourceVersion
        self.relists += 1
        self._current = True
        self._publish(pods)
        self.synced.set()

    def _watch(self) -> None:
        stream = self._client.watch(
            RawPod, namespace="*", fields={"spec.nodeName": self._node},
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
            pods = dict(self._pods)
            if kind == "DELETED":
                pods.pop(parsed.uid, None)
            else:
                pods[parsed.uid] = parsed
            self._publish(pods)

    def _parse(self, data: Mapping[str, Any]) -> PodInfo | None:
        try:
            return parse_pod(data)
        except ValueError as exc:
            found = data.get("metadata")
            meta: Mapping[str, Any] = found if isinstance(found, dict) else {}
            name = f"{meta.get('namespace', '?')}/{meta.get('name', '?')}"
            if name not in self._skipped:
                self._skipped.add(name)
                log.warning("pod %s skipped: %s", name[:200], str(exc)[:200])
            return None

    def _publish(self, pods: dict[str, PodInfo]) -> None:
        waiting = tuple(
            sorted(
                (p for p in pods.values() if not (p.started or p.terminal or p.deleting)),
                key=lambda p: (p.created, p.namespace, p.name),
            )
        )
        with self._cond:
            self._pods = MappingProxyType(pods)
            self._waiting = waiting
            self._cond.notify_all()
        for listener in self._listeners:
            try:
                listener()
            except Exception:
                log.exception("a pod cache listener failed")


def _as_dict(obj: Any) -> dict[str, Any]:
    data = obj.to_dict()
    return data if isinstance(data, dict) else {}
