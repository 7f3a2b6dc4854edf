"""Keeps this node's ResourceSlices equal to what it has to offer.

One pool, named after the node, holding as many slices as the per-slice
limit needs; each slice is owned by the Node (so it goes when the Node
goes), names the node in `spec.nodeName`, and carries the pool's
generation and slice count. A watch on the node's slices (field selector
`spec.nodeName`) is the publisher's view of what the API server holds: a
slice the kubelet wiped at its start, or anyone changed, is an event that
makes the publisher compare again. It writes only when what it wants
differs from what is there (what the server fills in, a taint's
`timeAdded`, is no difference), and then
bumps the pool's generation in every slice. There is no periodic rewrite.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightkube import ApiError, Client

from devplugin.cluster.objects import as_dict, node_owner
from devplugin.cluster.watch import DEFAULT_TIMING, WatchCache, WatchTiming
from devplugin.loops import Backoff, ThreadLoop
from devplugin.node.metrics import Metrics
from devplugin.wire.resources import ResourceSlice
from devplugin.wire.resourceslice import API_VERSION

log = logging.getLogger(__name__)

# The generic class's signature wants an ObjectMeta; it takes a plain dict.
_SLICE: Any = ResourceSlice

# How long a sync waits for the watch to show its own writes.
ECHO_WAIT = 5.0

# What to publish: the device entries of each slice, in order.
Desired = Callable[[], Sequence[Sequence[Mapping[str, Any]]]]


def parse_slice(data: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    name = data.get("metadata", {}).get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("a ResourceSlice without a name")
    return name, dict(data)


def slice_cache(
    client: Client, node: str, timing: WatchTiming = DEFAULT_TIMING
) -> WatchCache[dict[str, Any]]:
    return WatchCache(
        client,
        ResourceSlice,
        parse_slice,
        name="resourceslices",
        namespaced=False,
        fields={"spec.nodeName": node},
        timing=timing,
    )


# Fields the API server fills in on a device: no difference from what was written.
SERVER_FILLED = {"taints": ("timeAdded",)}


def comparable(devices: Any) -> Any:
    """Device entries without what the server fills in, to compare with
    what the publisher wants (a key the publisher dropped still differs)."""
    if not isinstance(devices, list):
        return devices
    plain = []
    for device in devices:
        if not isinstance(device, Mapping):
            plain.append(device)
            continue
        entry = dict(device)
        for key, fields in SERVER_FILLED.items():
            if isinstance(entry.get(key), list):
                entry[key] = [
                    {k: v for k, v in item.items() if k not in fields}
                    if isinstance(item, Mapping)
                    else item
                    for item in entry[key]
                ]
        plain.append(entry)
    return plain


def generate_name(index: int, driver: str, node: str) -> str:
    # Slices sort by name in pool order; the server adds a random suffix.
    return f"{index:05x}-{driver}-{node}-"[:200]


class SlicePublisher(ThreadLoop):
    def __init__(
        self,
        writer: Client,
        slices: WatchCache[dict[str, Any]],
        *,
        driver: str,
        node: str,
        desired: Desired,
        backoff_max: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        metrics: Metrics | None = None,
    ) -> None:
        # A write gives up at its request timeout: a stop never waits on it long.
        super().__init__(
            "slices",
            backoff=Backoff(0.2, backoff_max),
            join_timeout=0.5,
            failing="ResourceSlices not written",
        )
        self._client = writer
        self._metrics = metrics
        self._slices = slices
        self.driver = driver
        self.node = node
        self._desired = desired
        self._clock = clock
        self._owner: dict[str, Any] | None = None
        self._syncing = False
        # What each write stored: name -> (resourceVersion, spec). A slice
        # still at that version is compared as written, whatever the server
        # made of the text (a canonical quantity, a filled-in default).
        self._written: dict[str, tuple[str, dict[str, Any]]] = {}
        self.writes = 0
        self.syncs = 0
        slices.listen(self.poke)

    @property
    def pool(self) -> str:
        return self.node

    def start(self) -> None:
        self._slices.start()
        super().start()

    def signal_stop(self) -> None:
        super().signal_stop()
        self._slices.signal_stop()

    def join(self, timeout: float | None = None) -> None:
        self._slices.join(timeout)
        super().join(timeout)

    def current(self) -> bool:
        """The slices say what the node has: the view is current, the last
        sync succeeded, and none is running or asked for."""
        return (
            self._slices.current
            and self.failing is None
            and not self._syncing
            and not self._wake.is_set()
        )

    def starting(self) -> None:
        log.info("ResourceSlices of driver %s, pool %s: publishing", self.driver, self.pool)

    def begin(self) -> None:
        # Syncing before the pokes are taken: current() is never true while
        # a change is waiting to be compared.
        self._syncing = True
        super().begin()

    def step(self) -> float | None:
        if not self._slices.synced.wait(0.5):
            return 0.0
        if self.sync_once() and self._metrics is not None:
            self._metrics.slice_writes.labels("ok").inc()
        self._syncing = False
        return None

    def failed(self, exc: Exception) -> None:
        self._syncing = False
        if self._metrics is not None:
            self._metrics.slice_writes.labels("error").inc()
        self._wake.set()  # compare again after the backoff

    def recovered(self) -> None:
        log.info("ResourceSlices written again")

    def ours(self) -> list[dict[str, Any]]:
        """This driver's slices of this pool, in pool order (by name)."""
        found = [
            item
            for item in self._slices.items().values()
            if item.get("spec", {}).get("driver") == self.driver
            and item.get("spec", {}).get("pool", {}).get("name") == self.pool
        ]
        return sorted(found, key=lambda item: str(item["metadata"]["name"]))

    def sync_once(self) -> bool:
        """Write what differs; whether anything was written."""
        self.syncs += 1
        chunks = [list(chunk) for chunk in self._desired()]
        existing = [self._as_written(item) for item in self.ours()]
        generations = [_generation(item) for item in existing]
        if (
            len(existing) == len(chunks)
            and len(set(generations)) == 1
            and all(
                _count(item) == len(chunks)
                and comparable(item.get("spec", {}).get("devices", [])) == comparable(chunk)
                for item, chunk in zip(existing, chunks, strict=True)
            )
        ):
            return False
        generation = next_generation(generations)
        # What the view must show before the next comparison: each written
        # slice at a version other than the one it replaced (None: created),
        # each deleted one gone.
        echo: dict[str, str | None] = {}
        gone: list[str] = []
        # Obsolete slices go first, so the pool never claims more than it holds.
        for item in existing[len(chunks) :]:
            self._delete(item)
            gone.append(str(item["metadata"]["name"]))
        owner = self._node_owner()
        for index, chunk in enumerate(chunks):
            before = existing[index] if index < len(existing) else None
            name = self._put(index, chunk, generation, len(chunks), before=before, owner=owner)
            if name is not None:
                echo[name] = before["metadata"].get("resourceVersion") if before else None
        self._await_echo(echo, gone)
        self.writes += 1
        log.info(
            "ResourceSlices of pool %s: generation %d, %d slices, %d devices",
            self.pool,
            generation,
            len(chunks),
            sum(len(chunk) for chunk in chunks),
        )
        return True

    def _await_echo(self, echo: Mapping[str, str | None], gone: Sequence[str]) -> None:
        """Wait (boundedly) until the watch shows this sync's own writes.
        Compared against a view that has not caught up, a slice just created
        would look missing and be created twice: two slices of one pool
        naming the same devices, under one generation."""

        def caught_up(items: Mapping[str, dict[str, Any]]) -> bool:
            for name, replaced in echo.items():
                item = items.get(name)
                if item is None or item["metadata"].get("resourceVersion") == replaced:
                    return False
            return not any(name in items for name in gone)

        if not self._slices.wait_for(caught_up, ECHO_WAIT):
            log.debug(
                "ResourceSlices: the watch did not show this node's writes within %ss", ECHO_WAIT
            )

    def _as_written(self, item: dict[str, Any]) -> dict[str, Any]:
        """The slice as this publisher wrote it, if nobody changed it since."""
        metadata = item.get("metadata", {})
        written = self._written.get(str(metadata.get("name")))
        if written is None or written[0] != metadata.get("resourceVersion"):
            return item
        return {**item, "spec": written[1]}

    def _remember(self, stored: Any, body: Any) -> str | None:
        """Keep what a write stored; the slice's name."""
        data, sent = as_dict(stored), as_dict(body)
        metadata = data.get("metadata") or {}
        name, version = metadata.get("name"), metadata.get("resourceVersion")
        if not isinstance(name, str):
            return None
        if isinstance(version, str):
            self._written[name] = (version, sent.get("spec") or {})
        return name

    def _body(
        self,
        index: int,
        chunk: list[Any],
        generation: int,
        count: int,
        *,
        before: Mapping[str, Any] | None,
        owner: dict[str, Any] | None,
    ) -> Any:
        metadata: dict[str, Any] = {}
        if before is not None:
            metadata["name"] = before["metadata"]["name"]
            metadata["resourceVersion"] = before["metadata"].get("resourceVersion")
        else:
            metadata["generateName"] = generate_name(index, self.driver, self.node)
        if owner is not None:
            metadata["ownerReferences"] = [owner]
        spec = {
            "driver": self.driver,
            "nodeName": self.node,
            "pool": {"name": self.pool, "generation": generation, "resourceSliceCount": count},
            "devices": chunk,
        }
        return _SLICE(apiVersion=API_VERSION, kind="ResourceSlice", metadata=metadata, spec=spec)

    def _put(
        self,
        index: int,
        chunk: list[Any],
        generation: int,
        count: int,
        *,
        before: Mapping[str, Any] | None,
        owner: dict[str, Any] | None,
    ) -> str | None:
        """Create or replace one slice; its name."""
        body = self._body(index, chunk, generation, count, before=before, owner=owner)
        if before is None:
            return self._remember(self._client.create(body), body)
        try:
            return self._remember(self._client.replace(body), body)
        except ApiError as exc:
            if exc.status.code != 404:
                raise  # a conflict: the watch brings the newer one, and we compare again
            fresh = self._body(index, chunk, generation, count, before=None, owner=owner)
            return self._remember(self._client.create(fresh), fresh)

    def _delete(self, item: Mapping[str, Any]) -> None:
        self._written.pop(str(item["metadata"]["name"]), None)
        try:
            self._client.delete(ResourceSlice, item["metadata"]["name"])
        except ApiError as exc:
            if exc.status.code != 404:
                raise

    def _node_owner(self) -> dict[str, Any] | None:
        if self._owner is None:
            self._owner = node_owner(self._client, self.node, controller=True, what="slices")
        return self._owner


# A pool's generation is an int64 in the API: the server refuses more.
GENERATION_MAX = 2**63 - 1


def next_generation(generations: list[int]) -> int:
    """One past the newest generation found, back to 1 past the int64 limit
    (every slice of the pool is rewritten with it, so the pool is whole at
    generation 1 once the writes land; a server never accepts 2^63)."""
    newest = max(generations, default=0)
    return newest + 1 if 0 <= newest < GENERATION_MAX else 1


def _generation(item: Mapping[str, Any]) -> int:
    value = item.get("spec", {}).get("pool", {}).get("generation", 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _count(item: Mapping[str, Any]) -> int:
    value = item.get("spec", {}).get("pool", {}).get("resourceSliceCount", 0)
    return value if isinstance(value, int) else 0
