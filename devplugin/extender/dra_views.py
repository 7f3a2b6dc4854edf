"""The extender's view of DRA: claims, slices and classes, per node.

Three watches (ResourceClaims, ResourceSlices, DeviceClasses) keep what
the scheduler's allocator reads. Each event does O(size of the object)
work: a slice marks its node's devices to be read again, a claim whose
allocation changed marks the nodes of the pools it holds devices in, a
class marks everything. A node's devices and the devices held there are
rebuilt on the first request after such a mark; a prediction (the
allocator's walk for one set of claim specs) is kept per node until the
node is marked, so a call for a pod whose claims were seen before costs a
lookup per node. Nothing here touches the network.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from devplugin.cluster.client import Heartbeat
from devplugin.cluster.watch import WatchCache, WatchTiming
from devplugin.extender.answers import ChangeLog
from devplugin.policy.dra_predict import NodeDevices, Prediction, Selectors, Unpredictable, predict
from devplugin.policy.dra_walk import PoolSlice, gather, pool_slice
from devplugin.policy.free_counts import recounted
from devplugin.wire.resources import DeviceClass, ResourceClaim, ResourceSlice

T = TypeVar("T")

# Predictions kept at most (node x claim specs); past it they are dropped
# and made again on use.
MAX_PREDICTIONS = 200_000
# A claim spec larger than this (serialized) is not predicted.
MAX_SPEC = 64 << 10


@dataclass(frozen=True)
class Claim:
    namespace: str
    name: str
    # The spec as one canonical string (a key for predictions) and parsed.
    spec_key: str
    spec: Mapping[str, Any]
    held: tuple[tuple[str, str, str], ...]  # (driver, pool, device) of its allocation
    allocated: bool


def parse_claim(data: Mapping[str, Any]) -> tuple[str, Claim]:
    meta = data.get("metadata") or {}
    namespace, name = meta.get("namespace"), meta.get("name")
    if not isinstance(namespace, str) or not isinstance(name, str) or not name:
        raise ValueError("a ResourceClaim without a namespace or name")
    spec = data.get("spec") or {}
    key = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    if len(key) > MAX_SPEC:
        raise ValueError(f"spec larger than {MAX_SPEC} bytes")
    allocation = (data.get("status") or {}).get("allocation")
    # A result with admin access holds nothing: the scheduler does not count
    # it as allocated (dynamicresources/allocateddevices.go).
    held = tuple(
        (str(r["driver"]), str(r["pool"]), str(r["device"]))
        for r in ((allocation or {}).get("devices") or {}).get("results") or []
        if not r.get("adminAccess")
    )
    return f"{namespace}/{name}", Claim(namespace, name, key, spec, held, allocation is not None)


def parse_slice(data: Mapping[str, Any]) -> tuple[str, PoolSlice]:
    """Kept parsed, not as sent: at 5,000 nodes the raw objects were most of
    the extender's memory."""
    name = (data.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("a ResourceSlice without a name")
    try:
        return name, pool_slice(data)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a ResourceSlice: {exc}") from exc


def parse_class(data: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    name = (data.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("a DeviceClass without a name")
    return name, {"metadata": {"name": name}, "spec": dict(data.get("spec") or {})}


class _Node:
    """One node: its slices, and what was derived from them."""

    def __init__(self) -> None:
        self.slices: dict[str, PoolSlice] = {}
        self.devices: NodeDevices | None = None
        # What allocated claims hold among `devices` (built with them).
        self.used: list[tuple[str, str, str]] = []
        self.predictions: dict[str, Prediction | None] = {}


class DraViews:
    """Fed by the three caches' change hooks (their threads); read by the
    extender's calls (theirs). One lock guards the indexes; a walk runs
    outside it on what it read."""

    def __init__(self, *, device_taints: bool) -> None:
        self.device_taints = device_taints
        self._lock = threading.Lock()
        self._nodes: dict[str, _Node] = {}
        self._pool_nodes: dict[tuple[str, str], set[str]] = {}
        self._held: dict[tuple[str, str], dict[str, int]] = {}  # (driver, pool) -> device -> claims
        self._classes: dict[str, dict[str, Any]] = {}
        self._selectors = Selectors()
        self._kept = 0
        self.walks = 0
        # Nodes whose predictions were dropped, for answers kept across calls.
        self.changes = ChangeLog()

    # -- events (cache threads) -----------------------------------------------------
    def slice_changed(self, key: str, before: PoolSlice | None, after: PoolSlice | None) -> None:
        with self._lock:
            for item, add in ((before, False), (after, True)):
                if item is None or not item.node:
                    continue
                node = self._nodes.setdefault(item.node, _Node())
                if add:
                    node.slices[key] = item
                    self._pool_nodes.setdefault((item.driver, item.pool), set()).add(item.node)
                else:
                    node.slices.pop(key, None)
                    self._forget_pool(item)
                self._mark(item.node)

    def _forget_pool(self, item: PoolSlice) -> None:
        pool = (item.driver, item.pool)
        node = self._nodes.get(item.node)
        still = node is not None and any((s.driver, s.pool) == pool for s in node.slices.values())
        if not still:
            nodes = self._pool_nodes.get(pool)
            if nodes is not None:
                nodes.discard(item.node)
                if not nodes:
                    del self._pool_nodes[pool]

    def claim_changed(self, key: str, before: Claim | None, after: Claim | None) -> None:
        old = before.held if before is not None else ()
        new = after.held if after is not None else ()
        if old == new:
            return
        with self._lock:
            for held, step in ((old, -1), (new, 1)):
                for driver, pool, device in held:
                    counts = self._held.setdefault((driver, pool), {})
                    counts[device] = counts.get(device, 0) + step
                    if counts[device] <= 0:
                        del counts[device]
                    for node in self._pool_nodes.get((driver, pool), ()):
                        # Its devices too: their free counts are recounted.
                        self._mark(node)

    def class_changed(
        self, key: str, before: dict[str, Any] | None, after: dict[str, Any] | None
    ) -> None:
        with self._lock:
            if after is None:
                self._classes.pop(key, None)
            else:
                self._classes[key] = after
            for name in self._nodes:
                self._mark(name, devices=False)
            self.changes.changed_everything()

    def _mark(self, name: str, *, devices: bool = True) -> None:
        node = self._nodes[name]
        if devices:
            node.devices = None
        self._kept -= len(node.predictions)
        node.predictions = {}
        self.changes.changed(name)

    # -- reads (calls) ------------------------------------------------------------------
    def predictions(
        self, names: Sequence[str], claims: Sequence[Claim]
    ) -> dict[str, Prediction | None]:
        """What the allocator picks on each node for these (unallocated)
        claims; None where the extender cannot tell. Those kept are read
        under one lock hold, the others walked one by one."""
        key = "\n".join(claim.spec_key for claim in claims)
        found: dict[str, Prediction | None] = {}
        missing: list[str] = []
        with self._lock:
            nodes = self._nodes
            for name in names:
                node = nodes.get(name)
                if node is not None and key in node.predictions:
                    found[name] = node.predictions[key]
                else:
                    missing.append(name)
        for name in missing:
            found[name] = self._predict(name, claims, key)
        return {name: found[name] for name in names}

    def _predict(self, node_name: str, claims: Sequence[Claim], key: str) -> Prediction | None:
        with self._lock:
            node = self._nodes.get(node_name)
            if node is None:
                node = self._nodes[node_name] = _Node()
            if key in node.predictions:
                return node.predictions[key]
            if node.devices is None:
                ordered = sorted(node.slices.values(), key=lambda item: item.name)
                gathered = gather(ordered)
                # A claim change marks the node's devices too, so what its
                # claims hold is read once per rebuild.
                node.used = [
                    (driver, pool, device)
                    for driver, pool in {(d.driver, d.pool) for d in gathered}
                    for device in self._held.get((driver, pool), {})
                ]
                # The gate's counts as the claims seen here leave them: the
                # driver republishes only after it sees the allocation.
                node.devices = NodeDevices(recounted(gathered, frozenset(node.used)))
            devices, used = node.devices, node.used
            classes = dict(self._classes)
            predictions = node.predictions
        try:
            prediction: Prediction | None = predict(
                devices,
                [claim.spec for claim in claims],
                classes,
                used,
                self._selectors,
                device_taints=self.device_taints,
            )
        except Unpredictable:
            prediction = None
        with self._lock:
            self.walks += 1
            # Kept only if the node was not marked meanwhile.
            if self._nodes.get(node_name) is node and node.predictions is predictions:
                if self._kept >= MAX_PREDICTIONS:
                    for other in self._nodes.values():
                        other.predictions = {}
                    self._kept = 0
                    predictions = node.predictions = {}
                predictions[key] = prediction
                self._kept += 1
        return prediction


def pod_claims(pod: Mapping[str, Any], claims: WatchCache[Claim]) -> list[Claim] | None:
    """The pod's claims that still need an allocation, in the pod's order
    (the order the scheduler allocates them in); None when one is not known
    yet (not created, or not in the cache): nothing can be told then. An
    empty list: the pod asks for nothing through claims."""
    meta = pod.get("metadata") or {}
    namespace = meta.get("namespace") or "default"
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    generated = {
        entry.get("name"): entry.get("resourceClaimName")
        for entry in status.get("resourceClaimStatuses") or []
        if isinstance(entry, Mapping)
    }
    found: list[Claim] = []
    for entry in spec.get("resourceClaims") or []:
        if not isinstance(entry, Mapping):
            return None
        name = entry.get("resourceClaimName") or generated.get(entry.get("name"))
        if not isinstance(name, str) or not name:
            return None
        claim = claims.get(f"{namespace}/{name}")
        if claim is None:
            return None
        if not claim.allocated:
            found.append(claim)
    return found


class _Telling(WatchCache[T]):
    """A cache that tells the views each change, on its own thread."""

    def __init__(
        self, told: Callable[[str, T | None, T | None], None], *args: Any, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._told = told

    def changed(self, key: str, before: T | None, after: T | None) -> None:
        self._told(key, before, after)


@dataclass(frozen=True)
class DraCaches:
    claims: WatchCache[Claim]
    slices: WatchCache[PoolSlice]
    classes: WatchCache[dict[str, Any]]

    def all(self) -> list[WatchCache[Any]]:
        return [self.claims, self.slices, self.classes]


def dra_caches(
    views: DraViews,
    clients: Sequence[Any],
    timing: WatchTiming,
    heartbeats: Sequence[Heartbeat | None] = (None, None, None),
) -> DraCaches:
    """The three watches, each on its own client (`clients`: three)."""
    kinds: list[tuple[Any, Any, Any, str, bool]] = [
        (views.claim_changed, ResourceClaim, parse_claim, "resourceclaims", True),
        (views.slice_changed, ResourceSlice, parse_slice, "resourceslices", False),
        (views.class_changed, DeviceClass, parse_class, "deviceclasses", False),
    ]
    caches = [
        _Telling(
            told,
            client,
            resource,
            parse,
            name=name,
            namespaced=namespaced,
            timing=timing,
            heartbeat=heartbeat,
        )
        for (told, resource, parse, name, namespaced), client, heartbeat in zip(
            kinds, clients, heartbeats, strict=True
        )
    ]
    return DraCaches(caches[0], caches[1], caches[2])
