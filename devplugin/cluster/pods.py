"""This node's pods, from the API server: list, then watch, kept in memory.

The pods bound to this node (`fieldSelector=spec.nodeName=<node>`), through
the generic list/watch loop (`watch.py`): readers (RPC handlers) only read
the last snapshot or wait on it for a bounded time; they never touch the
network. A pod whose shape is not understood is skipped with one log line.

A pod that ends (deleted, gone between two lists, or Succeeded/Failed; a
namesake with another uid is another pod) is told to `on_ended` listeners
on the cache's thread before the snapshot without it is swapped in, so a
reader that waited for a later pod sees everything derived from the end.
The uids of recently ended pods are kept (bounded) for `has_ended`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from lightkube import Client
from lightkube.generic_resource import create_namespaced_resource

from devplugin.cluster.client import Heartbeat
from devplugin.cluster.watch import WatchCache
from devplugin.podinfo import PodInfo, parse_pod

# Pods as plain dicts: the shape is checked here, so one odd pod cannot stop
# the decoding of a whole list or watch.
RawPod = create_namespaced_resource("", "v1", "Pod", "pods")


# Ended pods' uids remembered at most (the extender checks records against them).
ENDED_LIMIT = 65536


def pod_entry(data: Mapping[str, Any]) -> tuple[str, PodInfo]:
    pod = parse_pod(data)
    return pod.uid, pod


class PodCache(WatchCache[PodInfo]):
    """The pods on one node (`node`), or on every node (`node=None`)."""

    def __init__(
        self,
        client: Client,
        node: str | None,
        *,
        backoff_initial: float = 0.2,
        backoff_max: float = 10.0,
        server_timeout: float = 30.0,
        read_margin: float = 5.0,
        heartbeat: Heartbeat | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            client, RawPod, pod_entry, name="pods", namespaced=True,
            fields={"spec.nodeName": node} if node else None,
            backoff_initial=backoff_initial, backoff_max=backoff_max,
            server_timeout=server_timeout, read_margin=read_margin, heartbeat=heartbeat,
            clock=clock,
        )  # fmt: skip
        self._ended_listeners: list[Callable[[PodInfo], None]] = []
        self._started_listeners: list[Callable[[PodInfo], None]] = []
        self._ended: OrderedDict[str, PodInfo] = OrderedDict()
        self._ended_names: dict[tuple[str, str], str] = {}
        self._waiting: tuple[PodInfo, ...] = ()
        self._by_node: Mapping[str, tuple[PodInfo, ...]] = {}
        self._by_name: Mapping[tuple[str, str], PodInfo] = {}

    def pods(self) -> Mapping[str, PodInfo]:
        """uid -> pod, as of the last event (an immutable snapshot)."""
        return self.items()

    def waiting(self) -> tuple[PodInfo, ...]:
        """Pods not yet past admission (not started, finished or deleting),
        oldest first: sorted once per change here, not in every RPC."""
        return self._waiting

    def on_node(self, node: str) -> tuple[PodInfo, ...]:
        """The pods bound to `node` and not finished, oldest first (indexed
        once per change, so a caller asking for many nodes pays per node)."""
        return self._by_node.get(node, ())

    def on_ended(self, listener: Callable[[PodInfo], None]) -> None:
        """Call `listener` with each pod that ends (on the cache's thread)."""
        self._ended_listeners.append(listener)

    def on_started(self, listener: Callable[[PodInfo], None]) -> None:
        """Call `listener` with each pod first seen not finished (on the cache's thread)."""
        self._started_listeners.append(listener)

    def has_ended(self, uid: str | None, namespace: str = "", name: str = "") -> bool:
        """Whether the watch saw this pod end (deleted, gone, or finished);
        recent ends only (bounded). Without a uid, by name: a pod of that name
        ended and no pod of that name is live now."""
        if uid is None:
            live = self._by_name.get((namespace, name))
            if live is not None:
                return live.terminal
            return (namespace, name) in self._ended_names
        if uid in self._ended:
            return True
        pod = self.items().get(uid)
        return pod is not None and pod.terminal

    def changed(self, key: str, before: PodInfo | None, after: PodInfo | None) -> None:
        ended = None
        if before is not None and after is None:
            if not before.terminal:
                ended = before
            self._remember_end(before)
        elif after is not None and after.terminal and (before is None or not before.terminal):
            ended = after
            self._remember_end(after)
        if ended is not None:
            for listener in self._ended_listeners:
                listener(ended)
        if before is None and after is not None and not after.terminal:
            for listener in self._started_listeners:
                listener(after)

    def _remember_end(self, pod: PodInfo) -> None:
        self._ended[pod.uid] = pod
        self._ended.move_to_end(pod.uid)
        self._ended_names[(pod.namespace, pod.name)] = pod.uid
        while len(self._ended) > ENDED_LIMIT:
            _, gone = self._ended.popitem(last=False)
            if self._ended_names.get((gone.namespace, gone.name)) == gone.uid:
                del self._ended_names[(gone.namespace, gone.name)]

    def published(self, items: Mapping[str, PodInfo]) -> None:
        self._by_name = {(p.namespace, p.name): p for p in items.values()}
        by_node: dict[str, list[PodInfo]] = {}
        for pod in items.values():
            if pod.node and not pod.terminal:
                by_node.setdefault(pod.node, []).append(pod)
        self._by_node = {
            node: tuple(sorted(pods, key=lambda p: (p.created, p.namespace, p.name)))
            for node, pods in by_node.items()
        }
        self._waiting = tuple(
            sorted(
                (p for p in items.values() if not (p.started or p.terminal or p.deleting)),
                key=lambda p: (p.created, p.namespace, p.name),
            )
        )

    def uid_of(self, namespace: str, pod: str) -> str | None:
        info = self._by_name.get((namespace, pod))
        return info.uid if info is not None else None

    def init_claimant(self, resource: str) -> bool | None:
        """Whether a live pod here has a run-once init container asking for
        `resource` (its devices stay the pod's, unlisted by PodResources);
        None while the cache is not in sync with the API server."""
        if not self.current:
            return None
        return any(
            not pod.terminal
            and any(c.requests.get(resource) and not c.sidecar for c in pod.init_containers)
            for pod in self._by_name.values()
        )

    def ended(self, owner: tuple[str, str, str | None]) -> bool | None:
        """Whether the pod is gone (or replaced by a namesake) or finished; None
        while the cache is not in sync with the API server."""
        if not self.current:
            return None
        namespace, name, uid = owner
        info = self._by_name.get((namespace, name))
        if info is None or uid not in (None, info.uid):
            return True  # gone, or replaced by a namesake
        return info.terminal
