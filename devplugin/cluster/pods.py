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

Each event updates the indexes for that pod alone (its name, its node's
list, the waiting set), so a cluster-wide cache of tens of thousands of
pods pays per event what one pod costs. With `keep`, only the pods it
returns are held (the extender keeps pods with device requests, trimmed to
the fields placement reads).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from functools import partial
from types import MappingProxyType
from typing import Any

from lightkube import Client
from lightkube.generic_resource import create_namespaced_resource

from devplugin.cluster.client import Heartbeat
from devplugin.cluster.watch import DEFAULT_TIMING, Incomplete, WatchCache, WatchTiming
from devplugin.policy.podinfo import PodInfo, parse_pod

# Pods as plain dicts: the shape is checked here, so one odd pod cannot stop
# the decoding of a whole list or watch.
RawPod = create_namespaced_resource("", "v1", "Pod", "pods")


# Ended pods' uids remembered at most (the extender checks records against them).
ENDED_LIMIT = 65536


def pod_entry(data: Mapping[str, Any]) -> tuple[str, PodInfo]:
    pod = parse_pod(data)
    return pod.uid, pod


Keep = Callable[[PodInfo], PodInfo | None]


def _kept(keep: Keep, data: Mapping[str, Any]) -> tuple[str, PodInfo]:
    pod = keep(parse_pod(data))
    if pod is None:
        raise Incomplete("not kept")  # skipped silently: nothing here needs it
    return pod.uid, pod


def _order(pod: PodInfo) -> tuple[str, str, str]:
    return (pod.created, pod.namespace, pod.name)


class PodCache(WatchCache[PodInfo]):
    """The pods on one node (`node`), or on every node (`node=None`)."""

    def __init__(
        self,
        client: Client,
        node: str | None,
        *,
        timing: WatchTiming = DEFAULT_TIMING,
        heartbeat: Heartbeat | None = None,
        clock: Callable[[], float] = time.monotonic,
        keep: Keep | None = None,
    ) -> None:
        parse = partial(_kept, keep) if keep is not None else pod_entry
        super().__init__(
            client,
            RawPod,
            parse,
            name="pods",
            namespaced=True,
            fields={"spec.nodeName": node} if node else None,
            timing=timing,
            heartbeat=heartbeat,
            clock=clock,
        )
        self._ended_listeners: list[Callable[[PodInfo], None]] = []
        self._started_listeners: list[Callable[[PodInfo], None]] = []
        self._ended: OrderedDict[str, PodInfo] = OrderedDict()
        self._ended_names: dict[tuple[str, str], str] = {}
        # (node, namespace, name) -> uid of the last pod of that name that ended there.
        self._ended_on: dict[tuple[str, str, str], str] = {}
        # Pods not past admission, by uid; `waiting()` sorts them once per change.
        self._waiting: dict[str, PodInfo] = {}
        self._waiting_sorted: tuple[PodInfo, ...] | None = ()
        # Live (not finished) pods per node, oldest first: one node's tuple is
        # rebuilt when one of its pods changes.
        self._by_node: dict[str, tuple[PodInfo, ...]] = {}
        # Per (namespace, name): the pods of that name by uid, newest last.
        self._named: dict[tuple[str, str], dict[str, PodInfo]] = {}
        # Bumped for a node whenever its pods change (readers key memos on it).
        self._node_generation: dict[str, int] = {}
        # Pods waiting on a node the scheduler nominated (status.nominatedNodeName,
        # not bound yet), per node: replaced whole on each change they see.
        self._nominated: Mapping[str, tuple[PodInfo, ...]] = MappingProxyType({})

    def pods(self) -> Mapping[str, PodInfo]:
        """uid -> pod, as of the last event (an immutable snapshot)."""
        return self.items()

    def waiting(self) -> tuple[PodInfo, ...]:
        """Pods not yet past admission (not started, finished or deleting),
        oldest first: sorted at most once per change, not in every RPC."""
        found = self._waiting_sorted
        if found is None:
            with self._cond:
                found = self._waiting_sorted
                if found is None:
                    found = tuple(sorted(self._waiting.values(), key=_order))
                    self._waiting_sorted = found
        return found

    def generation(self, node: str) -> int:
        """A number that changes whenever a pod on `node` changes."""
        return self._node_generation.get(node, 0)

    def _by_name(self, namespace: str, name: str) -> PodInfo | None:
        same = self._named.get((namespace, name))
        if not same:
            return None
        return next(reversed(same.values()))

    def on_node(self, node: str) -> tuple[PodInfo, ...]:
        """The pods bound to `node` and not finished, oldest first (indexed
        once per change, so a caller asking for many nodes pays per node)."""
        return self._by_node.get(node, ())

    def nominated(self) -> Mapping[str, tuple[PodInfo, ...]]:
        """Node -> the pods nominated there and not bound yet (nor ending),
        oldest first: an immutable snapshot."""
        return self._nominated

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
            live = self._by_name(namespace, name)
            if live is not None:
                return live.terminal
            return (namespace, name) in self._ended_names
        if uid in self._ended:
            return True
        pod = self.get(uid)
        return pod is not None and pod.terminal

    def ended_on(self, node: str, uid: str | None, namespace: str = "", name: str = "") -> bool:
        """Whether a holder in `node`'s record belongs to a pod the watch saw
        end there. Only pods bound to that node count: a namesake elsewhere
        is another pod (and its events touch only its own node)."""
        if uid is not None:
            ended = self._ended.get(uid)
            if ended is not None:
                return ended.node == node
            pod = self.get(uid)
            return pod is not None and pod.terminal and pod.node == node
        same = self._named.get((namespace, name)) or {}
        if any(pod.node == node and not pod.terminal for pod in same.values()):
            return False
        return (node, namespace, name) in self._ended_on

    def changed(self, key: str, before: PodInfo | None, after: PodInfo | None) -> None:
        self._index(key, before, after)
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
        if pod.node:
            self._ended_on[(pod.node, pod.namespace, pod.name)] = pod.uid
        while len(self._ended) > ENDED_LIMIT:
            _, gone = self._ended.popitem(last=False)
            if self._ended_names.get((gone.namespace, gone.name)) == gone.uid:
                del self._ended_names[(gone.namespace, gone.name)]
            where = (gone.node, gone.namespace, gone.name)
            if self._ended_on.get(where) == gone.uid:
                del self._ended_on[where]

    def _index(self, uid: str, before: PodInfo | None, after: PodInfo | None) -> None:
        """Move one pod's entries in the indexes (on the cache's thread; the
        per-node tuples are replaced whole, so readers never see one half-built)."""
        with self._cond:
            if before is not None:
                same = self._named.get((before.namespace, before.name))
                if same is not None:
                    same.pop(uid, None)
                    if not same:
                        del self._named[(before.namespace, before.name)]
            if after is not None:
                self._named.setdefault((after.namespace, after.name), {})[uid] = after
            waiting = after is not None and not (after.started or after.terminal or after.deleting)
            if waiting and after is not None:
                self._waiting[uid] = after
                self._waiting_sorted = None
            elif self._waiting.pop(uid, None) is not None:
                self._waiting_sorted = None
            if any(p is not None and p.nominated for p in (before, after)):
                self._renominate(uid, before, after)
            for node in {p.node for p in (before, after) if p is not None and p.node}:
                pods = [p for p in self._by_node.get(node, ()) if p.uid != uid]
                if after is not None and after.node == node and not after.terminal:
                    pods.append(after)
                    pods.sort(key=_order)
                if pods:
                    self._by_node[node] = tuple(pods)
                else:
                    self._by_node.pop(node, None)
                self._node_generation[node] = self._node_generation.get(node, 0) + 1

    def _renominate(self, uid: str, before: PodInfo | None, after: PodInfo | None) -> None:
        """Move one pod's entry among the nominated (the cache's lock held)."""
        found = dict(self._nominated)
        if before is not None and before.nominated:
            kept = tuple(p for p in found.get(before.nominated, ()) if p.uid != uid)
            if kept:
                found[before.nominated] = kept
            else:
                found.pop(before.nominated, None)
        waiting = after is not None and not (after.node or after.terminal or after.deleting)
        if after is not None and after.nominated and waiting:
            there = [p for p in found.get(after.nominated, ()) if p.uid != uid]
            there.append(after)
            there.sort(key=_order)
            found[after.nominated] = tuple(there)
        self._nominated = MappingProxyType(found)

    def uid_of(self, namespace: str, pod: str) -> str | None:
        info = self._by_name(namespace, pod)
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
            for pod in self.items().values()
        )

    def ended(self, owner: tuple[str, str, str | None]) -> bool | None:
        """Whether the pod is gone (or replaced by a namesake) or finished; None
        while the cache is not in sync with the API server."""
        if not self.current:
            return None
        namespace, name, uid = owner
        info = self._by_name(namespace, name)
        if info is None or uid not in (None, info.uid):
            return True  # gone, or replaced by a namesake
        return info.terminal
