"""The extender's per-node placement views: work per event, not per request.

A NodeDevices record is parsed on the record cache's thread, in time linear
in its devices (`parse_record`); the part that costs more than linear, the
topology and its allocator, is built only when a node's layout (its
devices, PCIe paths and NVLinks) is new, and for a large layout on a
builder thread of its own, so one big record never holds up the others.
Health and holder changes, the common ones, reuse the layout.

A node's view is the record's node with the holders the pod watch saw end
given back and the pods bound there that the record does not show yet
placed first. It is built on the first request after the record, the
node's pods or its layout changed, and answers each pod shape once
(lazily); later requests read it. Nothing here touches the network.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from devplugin.kinds.registry import ANCHOR, PARTNER
from devplugin.loops import FailureLog, ThreadLoop
from devplugin.model import DeviceKind
from devplugin.policy.allocator import Allocator
from devplugin.policy.node_record import ParsedRecord
from devplugin.policy.node_record import parse_record as read_record
from devplugin.policy.node_state import NodeState, Outcome
from devplugin.policy.placement import check, place
from devplugin.policy.pod_request import Requirement, Shape, shape_of
from devplugin.policy.podinfo import PodInfo
from devplugin.policy.topology import Topology

log = logging.getLogger(__name__)

# A record describing more than this is refused (the CRD's own limit on
# status.devices); so is one with more allocations than MAX_ALLOCATIONS.
MAX_DEVICES = 1024
MAX_ALLOCATIONS = 4096
# Layouts up to this many devices are built inline on the record cache's
# thread (about a millisecond for a 16-device node); larger ones go to the
# builder, and the node counts as having no record until theirs is ready.
INLINE_DEVICES = 128
# Pod shapes answered per view at most (the oldest answers are dropped).
SHAPES_PER_VIEW = 32
# Outcomes shared by nodes of one layout with the same free devices (a
# fleet's empty nodes, its full ones): one placement answers them all.
SHARED_OUTCOMES = 4096
# A filter's reason is cut to this many characters.
MAX_REASON = 256
# Distinct pod shapes numbered at most (the oldest numbers are forgotten).
MAX_SHAPES = 4096


@dataclass(frozen=True)
class Layout:
    """What placement needs that changes only with the node's hardware."""

    key: tuple[Any, ...]
    topology: Topology
    allocator: Allocator


def parse_record(record: Mapping[str, Any]) -> ParsedRecord:
    """ValueError when the record is not one, or larger than the limits (one
    log line from the cache; the node then counts as having no record)."""
    status = record.get("status")
    if isinstance(status, dict):
        devices, allocations = status.get("devices"), status.get("allocations")
        if isinstance(devices, list) and len(devices) > MAX_DEVICES:
            raise ValueError(f"{len(devices)} devices; at most {MAX_DEVICES} are read")
        if isinstance(allocations, list) and len(allocations) > MAX_ALLOCATIONS:
            raise ValueError(f"{len(allocations)} allocations; at most {MAX_ALLOCATIONS} are read")
    return read_record(record, canonical=True)


class Layouts(ThreadLoop):
    """Each node's current layout, built once per distinct layout: records
    name GPUs canonically, so the nodes of one model share one. Large ones
    are built on the loop's thread, started with the first of them."""

    def __init__(self, on_ready: Callable[[str], None] = lambda node: None) -> None:
        super().__init__("layouts", failing="a node's topology could not be built")
        self._failures = FailureLog(log)
        self._lock = threading.Lock()
        self._by_node: dict[str, Layout] = {}
        self._shared: weakref.WeakValueDictionary[tuple[Any, ...], Layout] = (
            weakref.WeakValueDictionary()
        )
        self._wanted: dict[str, tuple[Any, ...]] = {}
        self._queue: queue.SimpleQueue[tuple[str, ParsedRecord] | None] = queue.SimpleQueue()
        self._on_ready = [on_ready]
        self.built = 0

    def listen(self, on_ready: Callable[[str], None]) -> None:
        """Call `on_ready(node)` (on the builder's thread) when a layout
        built there is in place for `node`."""
        self._on_ready.append(on_ready)

    def get(self, node: str, key: tuple[Any, ...]) -> Layout | None:
        layout = self._by_node.get(node)
        return layout if layout is not None and layout.key == key else None

    def want(self, record: ParsedRecord) -> ParsedRecord:
        """Make sure the record's layout is (or will be) built: on this thread
        when small, else on the builder's. Returns the record to keep: its
        devices dropped (the layout has them) and its key the shared one."""
        found = self.get(record.name, record.layout_key)
        if found is None:
            with self._lock:
                found = self._shared.get(record.layout_key)
                if found is not None:
                    self._by_node[record.name] = found
        if found is not None:
            return _slim(record, found.key)
        if len(record.gpus) + len(record.hcas) <= INLINE_DEVICES:
            layout = _build(record)
            self._store(record.name, layout)
            return _slim(record, layout.key)
        with self._lock:
            if self._wanted.get(record.name) == record.layout_key:
                return _slim(record, record.layout_key)
            self._wanted[record.name] = record.layout_key
            if self.thread is None:
                self.start()
        self._queue.put((record.name, record))
        return _slim(record, record.layout_key)

    def signal_stop(self) -> None:
        super().signal_stop()
        self._queue.put(None)

    def _store(self, node: str, layout: Layout) -> None:
        with self._lock:
            self._by_node[node] = layout
            self._shared[layout.key] = layout
            self.built += 1

    def run(self) -> None:
        # A queue worker: each wanted layout built once, the newest only.
        while True:
            item = self._queue.get()
            if item is None:
                return
            node, record = item
            with self._lock:
                if self._wanted.get(node) != record.layout_key:
                    continue  # superseded by a newer layout
            try:
                layout = _build(record)
            except Exception:  # noqa: BLE001 - logged (once) by FailureLog
                self._failures.failed(node, "node %s: its topology could not be built", node)
                continue
            self._failures.ok(node)
            with self._lock:
                if self._wanted.get(node) != record.layout_key:
                    continue
                del self._wanted[node]
            self._store(node, layout)
            for listener in self._on_ready:
                listener(node)


def _slim(record: ParsedRecord, key: tuple[Any, ...]) -> ParsedRecord:
    return replace(record, layout_key=key, gpus=(), hcas=())


def _build(record: ParsedRecord) -> Layout:
    topology = Topology(record.gpus, record.hcas)
    return Layout(record.layout_key, topology, Allocator(topology))


@dataclass
class _View:
    record: object
    generation: int
    layout: Layout
    node: NodeState
    pending: frozenset[str]  # uids of the pods placed ahead
    # Keyed by the shape's number (NodeViews.shape_id): an int hashes for
    # free, a Shape hashes its tuples at every lookup.
    outcomes: dict[int, Outcome] = field(default_factory=dict)
    empty: dict[int, Outcome] = field(default_factory=dict)
    # Per (shape number, required level, required): the filter's message,
    # and whether the failure is for good (kept while the view is).
    failures: dict[tuple[int, int, bool], tuple[str, bool]] = field(default_factory=dict)


class NodeViews:
    """Placement answers per node and pod shape, rebuilt per change."""

    def __init__(
        self,
        layouts: Layouts,
        *,
        on_node: Callable[[str], tuple[PodInfo, ...]],
        generation: Callable[[str], int],
        has_ended: Callable[[str, str | None, str, str], bool],
        gpu: str,
        hca: str,
    ) -> None:
        self._layouts = layouts
        self._on_node = on_node
        self._generation = generation
        self._has_ended = has_ended
        self._gpu, self._hca = gpu, hca
        self._views: dict[str, _View] = {}
        self._shared: dict[tuple[Any, ...], Outcome] = {}
        self._shared_lock = threading.Lock()
        self.placements = 0  # place() calls made for outcomes (not shared)
        self._shape_ids: dict[Shape, int] = {}
        self._next_shape = 0
        self.builds = 0

    def shape_id(self, shape: Shape) -> int:
        """A number per distinct shape, never reused (the oldest shapes are
        forgotten past MAX_SHAPES; a view's answers for them are then never
        read again and age out of it)."""
        found = self._shape_ids.get(shape)
        if found is None:
            if len(self._shape_ids) >= MAX_SHAPES:
                self._shape_ids.pop(next(iter(self._shape_ids)))
            found = self._shape_ids[shape] = self._next_shape
            self._next_shape += 1
        return found

    def outcomes(
        self,
        names: Iterable[str],
        fresh: Callable[[str], Any],
        shape: Shape,
        asking: str,
        *,
        seen: dict[str, Any] | None = None,
    ) -> tuple[dict[str, Outcome | None], int]:
        """`outcome` on many nodes: per name its outcome (None where `fresh`
        gives no record: one with a `parsed` ParsedRecord, whose identity is
        its token), and how many were answered before. The loop the
        extender's calls spend their time in: a node whose view is current
        and has the answer costs a few lookups. `seen`, when given, gets each
        node's record as `fresh` gave it."""
        key = self.shape_id(shape)
        views = self._views
        generations = self._generation
        found: dict[str, Outcome | None] = {}
        hits = 0
        for name in names:
            record = fresh(name)
            if seen is not None:
                seen[name] = record
            if record is None:
                found[name] = None
                continue
            view = views.get(name)
            if (
                view is not None
                and view.record is record
                and view.generation == generations(name)
                and asking not in view.pending
            ):
                answer = view.outcomes.get(key)
                if answer is not None:
                    found[name] = answer
                    hits += 1
                    continue
            found[name], hit = self.outcome(record.parsed, record, shape, asking)
            hits += hit
        return found, hits

    def outcome(
        self, record: ParsedRecord, token: object, shape: Shape, asking: str
    ) -> tuple[Outcome | None, bool]:
        """The pod's outcome on the node (None while the node's layout is
        being built), and whether it was answered before. `token` is the
        record's identity (a new record object means a new record); `asking`
        is the uid of the pod being scheduled."""
        view = self._view(record, token)
        if view is None:
            return None, False
        if asking in view.pending:
            # The pod itself is bound there already (a retry): place the
            # others without it; not kept, it is rare.
            return self._compute(record, view.layout, shape, exclude=asking), False
        key = self.shape_id(shape)
        found = view.outcomes.get(key)
        if found is not None:
            return found, True
        outcome, hit = self._placed(view, shape, key)
        _keep(view.outcomes, key, outcome)
        return outcome, hit

    def _placed(self, view: _View, shape: Shape, key: int) -> tuple[Outcome, bool]:
        """The pod placed on the view's node, or the answer a node of the
        same layout with the same free devices got (placement reads only
        those: the levels, counts and spread it reports are the same)."""
        node = view.node
        free = node.free
        # Placement reads the free devices, and for shared ones their replicas held.
        used = tuple(sorted(node.used.items())) if node.replicas else ()
        # And what its kubelet aligns, with the exclusive CPUs left.
        aligns = (node.kubelet, node.machine, node.cpus) if node.kubelet.aligns else ()
        shared = (view.layout.key, free[ANCHOR], free[PARTNER], used, aligns, key)
        with self._shared_lock:
            found = self._shared.get(shared)
        if found is not None:
            return found, True
        found = _bare(place(view.node, shape, view.layout.allocator))
        with self._shared_lock:
            self.placements += 1
            if len(self._shared) >= SHARED_OUTCOMES:
                self._shared.pop(next(iter(self._shared)))
            self._shared[shared] = found
        return found, False

    def failures(
        self,
        failing: Mapping[str, str],
        records: Mapping[str, Any],
        shape: Shape,
        requirement: Requirement,
        asking: str,
    ) -> dict[str, tuple[str, bool]]:
        """For each node the pod fails (name -> reason): the filter's message,
        and whether the failure is for good (the node with nothing held
        fails the pod too), kept per view. `records`: each node's fresh
        record as `outcomes` saw it."""
        # Plain values: an enum member hashes through a Python call.
        level = int(requirement.level) if requirement.level is not None else 0
        key = (self.shape_id(shape), level, requirement.required)
        views = self._views
        generations = self._generation
        found: dict[str, tuple[str, bool]] = {}
        for name, reason in failing.items():
            record = records.get(name)
            view = views.get(name)
            current = (
                record is not None
                and view is not None
                and view.record is record
                and view.generation == generations(name)
                and asking not in view.pending
            )
            if current:
                assert view is not None
                answer = view.failures.get(key)
                if answer is not None:
                    found[name] = answer
                    continue
            never = False
            if record is not None:
                empty = self.empty_outcome(record.parsed, record, shape)
                never = empty is not None and check(empty, requirement) is not None
            answer = (f"devplugin: {reason}"[:MAX_REASON], never)
            found[name] = answer
            if current:
                assert view is not None
                if len(view.failures) >= SHAPES_PER_VIEW:
                    view.failures.pop(next(iter(view.failures)))
                view.failures[key] = answer
        return found

    def state(
        self, record: ParsedRecord, token: object
    ) -> tuple[NodeState, Allocator, frozenset[str]] | None:
        """The node as placement sees it (ended holders back, pods bound
        there and not in the record yet placed), its allocator, and the uids
        of those placed pods; None while its layout is being built."""
        view = self._view(record, token)
        if view is None:
            return None
        return view.node, view.layout.allocator, view.pending

    def state_for(
        self, record: ParsedRecord, token: object, asking: str
    ) -> tuple[NodeState, Allocator, frozenset[str]] | None:
        """`state` as the pod `asking` sees it: where it is bound there
        already (a retry), placed without itself (not kept: it is rare)."""
        found = self.state(record, token)
        if found is None or asking not in found[2]:
            return found
        view = self._views[record.name]
        node, pending = self._effective(record, view.layout, exclude=asking)
        return node, view.layout.allocator, pending

    def empty_outcome(self, record: ParsedRecord, token: object, shape: Shape) -> Outcome | None:
        """The pod on the node with nothing held."""
        view = self._view(record, token)
        if view is None:
            return None
        key = self.shape_id(shape)
        found = view.empty.get(key)
        if found is None:
            everything = {kind: view.layout.topology.id_set(kind) for kind in DeviceKind}
            empty = replace(view.node, free=everything)
            found = _bare(place(empty, shape, view.layout.allocator))
            _keep(view.empty, key, found)
        return found

    def _view(self, record: ParsedRecord, token: object) -> _View | None:
        name = record.name
        generation = self._generation(name)
        view = self._views.get(name)
        if view is not None and view.record is token and view.generation == generation:
            return view
        layout = self._layouts.get(name, record.layout_key)
        if layout is None:
            return None
        node, pending = self._effective(record, layout, exclude=None)
        empty = (
            view.empty
            if view is not None and view.record is token and view.layout is layout
            else {}
        )
        fresh = _View(token, generation, layout, node, pending, empty=empty)
        self._views[name] = fresh
        self.builds += 1
        return fresh

    def _effective(
        self, record: ParsedRecord, layout: Layout, exclude: str | None
    ) -> tuple[NodeState, frozenset[str]]:
        node = record.node(layout.topology)
        # The pod watch beats the record: a holder it saw end holds nothing.
        ended = tuple(
            h
            for h in record.holdings
            if h.pod and self._has_ended(record.name, h.uid, h.namespace, h.pod)
        )
        if ended:
            node = node.without(ended)
        live = [h for h in record.holdings if h not in ended]
        uids = {h.uid for h in live if h.uid is not None}
        names = {(h.namespace, h.pod) for h in live if h.uid is None}
        placed: list[str] = []
        for other in self._on_node(record.name):
            if other.uid == exclude or other.uid in uids or (other.namespace, other.name) in names:
                continue
            shape = shape_of(other, self._gpu, self._hca)
            if not shape.wants_devices:
                continue
            # Bound here, not in the record yet: placed first, as its daemon will.
            ahead = place(node, shape, layout.allocator)
            placed.append(other.uid)
            if ahead.fits:
                node = node.after(ahead)
        return node, frozenset(placed)

    def _compute(self, record: ParsedRecord, layout: Layout, shape: Shape, exclude: str) -> Outcome:
        node, _ = self._effective(record, layout, exclude=exclude)
        return place(node, shape, layout.allocator)


def _keep(answers: dict[int, Outcome], key: int, outcome: Outcome) -> None:
    if len(answers) >= SHAPES_PER_VIEW:
        answers.pop(next(iter(answers)))
    answers[key] = outcome


def _bare(outcome: Outcome) -> Outcome:
    """What a kept outcome needs (its level, rank and reason): the devices
    it would take are dropped, thousands of nodes share a few outcomes."""
    return replace(outcome, free_after=None, used_after=None, chosen=frozenset())
