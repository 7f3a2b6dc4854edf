"""This node's pods, from the API server: list, then watch, kept in memory.

The pods bound to this node (`fieldSelector=spec.nodeName=<node>`), through
the generic list/watch loop (`watch.py`): readers (RPC handlers) only read
the last snapshot or wait on it for a bounded time; they never touch the
network. A pod whose shape is not understood is skipped with one log line.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from lightkube import Client
from lightkube.generic_resource import create_namespaced_resource

from devplugin.cluster.watch import WatchCache
from devplugin.podinfo import PodInfo, parse_pod

# Pods as plain dicts: the shape is checked here, so one odd pod cannot stop
# the decoding of a whole list or watch.
RawPod = create_namespaced_resource("", "v1", "Pod", "pods")


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
        server_timeout: int = 60,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            client, RawPod, pod_entry, name="pods", namespaced=True,
            fields={"spec.nodeName": node} if node else None,
            backoff_initial=backoff_initial, backoff_max=backoff_max,
            server_timeout=server_timeout, clock=clock,
        )  # fmt: skip
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
