"""Sharing: each physical device advertised as several replicas.

GPU time-slicing serves every GPU as N replicas (`<uuid>::<n>`), optionally
under another resource name; shared HCAs serve every HCA as M units
(`<pci address>::<n>`) for pods that only need verbs access. A replica gives
the container the same device nodes and variables as its physical device.

Which physical devices back a request is still decided by the allocator,
so the topology objective holds for them: with the `distributed` policy one
replica per physical device as long as possible (spread over GPUs), with
`packed` as few physical devices as possible, partly used ones first.
Health, cleanup and alignment all work on physical devices; a physical
device is released when no container holds any of its replicas.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from devplugin.model import DeviceKind, Inventory, Refused, shown_ids
from devplugin.node.resources import (
    Capabilities,
    ContainerAllocation,
    Pick,
    Resource,
    ResourceState,
    check_ids,
    check_request,
)

SEPARATOR = "::"


def replica_id(physical: str, index: int) -> str:
    return f"{physical}{SEPARATOR}{index}"


def physical_of(device_id: str) -> str:
    """The physical device behind an id (an id without `::` is physical)."""
    return device_id.split(SEPARATOR, 1)[0]


def physical_ids(ids: Sequence[str]) -> list[str]:
    """Physical devices behind some ids, each once, in first-seen order."""
    return list(dict.fromkeys(physical_of(device_id) for device_id in ids))


@dataclass(frozen=True)
class SharedResource:
    """Serves `inner`'s devices as `replicas` replicas each."""

    inner: Resource
    replicas: int
    policy: str = "distributed"
    refuse_multiple: bool = False
    renamed: str = ""

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    @property
    def name(self) -> str:
        return self.renamed or self.inner.name

    @property
    def kind(self) -> DeviceKind:
        return self.inner.kind

    @property
    def reuse_proves_release(self) -> bool:
        # Another replica of a device being allocated says nothing about
        # whether the device's other holders are done with it.
        return False

    def state(self, inventory: Inventory) -> ResourceState:
        return self.inner.state(inventory)

    def serve(self, state: ResourceState) -> ResourceState:
        devices = tuple(
            replace(device, id=replica_id(device.id, index))
            for device in state.devices
            for index in range(self.replicas)
        )
        return replace(state, devices=devices, backing=state)

    def physical(self, ids: Sequence[str]) -> list[str]:
        return physical_ids(ids)

    def validate(self, state: ResourceState, ids: Sequence[str]) -> None:
        check_ids(state, ids)
        physical = physical_ids(ids)
        if self.refuse_multiple and len(physical) < len(ids):
            shared = sorted({p for p in physical if sum(physical_of(i) == p for i in ids) > 1})
            raise Refused(
                f"several replicas of one device requested ({shown_ids(shared)}); "
                "this node gives at most one replica per device to a container",
                invalid_argument=True,
            )

    def allocate(self, state: ResourceState, ids: Sequence[str]) -> ContainerAllocation:
        self.validate(state, ids)
        check_request(state, ids)
        assert state.backing is not None
        return self.inner.allocate(state.backing, physical_ids(ids))

    def choose(
        self, available: Collection[str], must: Collection[str], size: int, pick: Pick
    ) -> list[str]:
        """The replicas for one container; `pick` chooses physical devices
        (the topology-aware allocator)."""
        if size < 1:
            raise Refused(f"allocation size must be at least 1, got {size}", invalid_argument=True)
        missing = [device_id for device_id in must if device_id not in set(available)]
        if missing:
            raise Refused(
                f"must-include device ids not available: {shown_ids(missing)}",
                invalid_argument=False,
            )
        free: dict[str, list[str]] = {}
        for device_id in dict.fromkeys([*must, *available]):
            free.setdefault(physical_of(device_id), []).append(device_id)
        for replicas in free.values():
            replicas.sort(
                key=lambda r: (
                    r not in must,
                    int(r.rsplit(SEPARATOR, 1)[-1]) if SEPARATOR in r else 0,
                )
            )
        must_physical = frozenset(physical_of(device_id) for device_id in must)
        total = sum(len(replicas) for replicas in free.values())
        if size > total:
            raise Refused(
                f"requested {size} replicas, only {total} available", invalid_argument=False
            )
        if self.refuse_multiple:
            if len(must_physical) < len(set(must)):
                raise Refused(
                    "must-include names several replicas of one device", invalid_argument=True
                )
            if size > len(free):
                raise Refused(
                    f"requested {size} replicas but only {len(free)} devices have one free, "
                    "and this node gives at most one replica per device",
                    invalid_argument=False,
                )
        if self.policy == "packed":
            chosen = self._packed(free, must_physical, size, pick)
        else:
            chosen = list(
                pick(frozenset(free), must_physical, max(min(size, len(free)), len(must_physical)))
            )
        return _fill(free, chosen, must, size, packed=self.policy == "packed")

    def _packed(
        self, free: dict[str, list[str]], must: frozenset[str], size: int, pick: Pick
    ) -> list[str]:
        counts = sorted((len(replicas) for replicas in free.values()), reverse=True)
        needed, covered = 0, 0
        while covered < size:
            covered += counts[needed]
            needed += 1
        for count in range(max(needed, len(must)), len(free) + 1):
            chosen = list(pick(frozenset(free), must, count))
            if sum(len(free[p]) for p in chosen) >= size:
                return chosen
        return list(free)  # pragma: no cover - the full set always has room


def _fill(
    free: dict[str, list[str]], chosen: list[str], must: Collection[str], size: int, *, packed: bool
) -> list[str]:
    """Replica ids from the chosen physical devices, must-include first.

    Packed takes whole devices in turn, partly used (fewest free) first;
    distributed always takes from the device holding the fewest of this
    container's replicas so far, chosen devices before the others.
    """
    picked: list[str] = list(must)
    taken = set(picked)
    held = Counter(physical_of(device_id) for device_id in picked)
    if packed:
        order = sorted(chosen, key=lambda p: len(free[p]))
    else:
        order = list(chosen) + [p for p in free if p not in chosen]
    rank = {physical: index for index, physical in enumerate(order)}
    while len(picked) < size:
        spare = {p: [r for r in free[p] if r not in taken] for p in order}
        usable = [p for p in order if spare[p]]
        physical = usable[0] if packed else min(usable, key=lambda p: (held[p], rank[p]))
        replica = spare[physical][0]
        picked.append(replica)
        taken.add(replica)
        held[physical] += 1
    return picked
