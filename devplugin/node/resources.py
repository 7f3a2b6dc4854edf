"""What each extended resource serves: its device list and what a container gets.

Pure functions of an `Inventory`; no gRPC here. The server turns a
`ContainerAllocation` into the kubelet's AllocateResponse. What every
resource shares is here; each kind's own resource is in its node folder
(node/gpu/resource.py, node/hca/resource.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from devplugin.model import (
    IDS_SHOWN,
    CharDevice,
    DeviceKind,
    Health,
    Inventory,
    PluginDevice,
    Refused,
    shown,
    shown_ids,
)
from devplugin.policy.cdi import annotation_key

# How the reason of a GPU no CDI spec names begins.
CDI_UNDECLARED = "no CDI spec declares"

# The topology-aware choice of physical devices: (candidates, must include,
# count) -> ids. Resources call it from `choose`.
Pick = Callable[[frozenset[str], frozenset[str], int], Sequence[str]]


@dataclass(frozen=True)
class DeviceNode:
    container_path: str
    host_path: str
    permissions: str = "rw"
    # (major, minor) where the daemon knows them: a CDI spec then names the
    # node whole, and no runtime has to find it on the host at injection.
    number: tuple[int, int] | None = None


@dataclass(frozen=True)
class ContainerAllocation:
    """Everything one container receives for one resource."""

    envs: Mapping[str, str] = field(default_factory=dict)
    devices: tuple[DeviceNode, ...] = ()
    # Fully qualified CDI device names (cdi-cri) and annotations (cdi-annotations).
    cdi_devices: tuple[str, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=dict)


ENVVAR, DEVICE_NODES, CDI_CRI, CDI_ANNOTATIONS = (
    "envvar", "device-nodes", "cdi-cri", "cdi-annotations",
)  # fmt: skip


@dataclass(frozen=True)
class Delivery:
    """How a container is told about its devices (`device_list_strategy`):
    the variable, the device specs, CDI names in the answer's CDI field, and
    CDI names in `cdi.k8s.io/<plugin>_<id>` annotations. CDI names are
    `cdi_kind=<name>`; a GPU is named by its NVML index or its UUID."""

    strategy: frozenset[str] = frozenset({ENVVAR, DEVICE_NODES})
    cdi_kind: str = ""
    gpu_names: str = "index"
    # The annotation key's plugin part (by convention vendor.device-type).
    plugin: str = "devplugin"

    @property
    def cdi(self) -> bool:
        return bool(self.strategy & {CDI_CRI, CDI_ANNOTATIONS})

    @property
    def nodes_only(self) -> bool:
        """Device specs are all a container gets: no variable for NVIDIA's
        runtime to act on, no CDI name."""
        return DEVICE_NODES in self.strategy and not self.cdi and ENVVAR not in self.strategy

    def answer(
        self,
        merged: ContainerAllocation,
        ids: Sequence[str],
        *,
        envs: Mapping[str, str],
        always: Mapping[str, str] | None = None,
    ) -> ContainerAllocation:
        """One container's answer from its devices' merged nodes and CDI
        names, per strategy (`always`: variables set whatever it is)."""
        names = merged.cdi_devices
        annotations: dict[str, str] = {}
        if CDI_ANNOTATIONS in self.strategy:
            annotations[annotation_key(self.plugin, ids)] = ",".join(names)
        return ContainerAllocation(
            envs={**(envs if ENVVAR in self.strategy else {}), **(always or {})},
            devices=merged.devices if DEVICE_NODES in self.strategy else (),
            cdi_devices=names if CDI_CRI in self.strategy else (),
            annotations=annotations,
        )


@dataclass(frozen=True)
class Capabilities:
    """What a resource implements; the plugin options are derived from it."""

    preferred_allocation: bool = False
    pre_start: bool = False


@dataclass(frozen=True)
class ResourceState:
    """What one resource serves at one moment; replaced whole on every change."""

    devices: tuple[PluginDevice, ...]
    allocations: Mapping[str, ContainerAllocation]
    # Added once per container whatever its devices (rdma_cm, nvidiactl, ...).
    shared_nodes: tuple[DeviceNode, ...] = ()
    # Device id -> the name tools know it by (HCA: mlx5_0; GPU: its UUID).
    names: Mapping[str, str] = field(default_factory=dict)
    # Shared resources: the physical devices' state behind the replicas.
    backing: ResourceState | None = None

    def healthy_ids(self) -> frozenset[str]:
        return frozenset(d.id for d in self.devices if d.health is Health.HEALTHY)

    def only(self, ids: Collection[str]) -> ResourceState:
        """The part of this state that serves these device ids (the mixed MIG
        strategy serves one kind's devices through several resources)."""
        return dataclasses.replace(
            self,
            devices=tuple(d for d in self.devices if d.id in ids),
            allocations={k: v for k, v in self.allocations.items() if k in ids},
            names={k: v for k, v in self.names.items() if k in ids},
        )

    def device(self, device_id: str) -> PluginDevice | None:
        for device in self.devices:
            if device.id == device_id:
                return device
        return None


class Resource(Protocol):
    """One extended resource served by its own DevicePlugin server."""

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> DeviceKind: ...

    @property
    def capabilities(self) -> Capabilities: ...

    def state(self, inventory: Inventory) -> ResourceState:
        """The physical devices, with their health on the hardware alone."""
        ...

    def serve(self, state: ResourceState) -> ResourceState:
        """What the kubelet sees for a judged physical state (replicas, if shared)."""
        ...

    @property
    def reuse_proves_release(self) -> bool:
        """Whether an Allocate of a device proves its previous holder released
        it (true unless several containers may share the device)."""
        ...

    def physical(self, ids: Sequence[str]) -> list[str]:
        """The physical devices behind served ids."""
        ...

    def validate(self, state: ResourceState, ids: Sequence[str]) -> None:
        """Refuse a malformed request (unknown or duplicate ids) before any side
        effect; health is checked by `allocate`."""
        ...

    def allocate(self, state: ResourceState, ids: Sequence[str]) -> ContainerAllocation: ...

    def choose(
        self, available: Collection[str], must: Collection[str], size: int, pick: Pick
    ) -> list[str]:
        """The served ids to prefer for one container."""
        ...


def check_ids(state: ResourceState, ids: Sequence[str]) -> None:
    """Reject empty, duplicate and unknown ids, naming them all."""
    if not ids:
        raise Refused("no device ids in the container request", invalid_argument=True)
    seen: set[str] = set()
    duplicates: list[str] = []
    for device_id in ids:
        if device_id in seen and device_id not in duplicates:
            duplicates.append(device_id)
        seen.add(device_id)
    known = {device.id: device for device in state.devices}
    unknown = [device_id for device_id in dict.fromkeys(ids) if device_id not in known]
    problems: list[str] = []
    if unknown:
        problems.append(f"unknown device ids: {shown_ids(unknown)}")
    if duplicates:
        problems.append(f"duplicate device ids: {shown_ids(duplicates)}")
    if problems:
        raise Refused("; ".join(problems), invalid_argument=True)


def check_request(state: ResourceState, ids: Sequence[str]) -> None:
    """Reject empty, duplicate, unknown and unhealthy ids, naming them all."""
    check_ids(state, ids)
    known = {device.id: device for device in state.devices}
    unhealthy = [
        f"{device_id} ({known[device_id].reason or 'unhealthy'})"
        for device_id in dict.fromkeys(ids)
        if known[device_id].health is not Health.HEALTHY
    ]
    if unhealthy:
        listed = ", ".join(shown(entry, 200) for entry in unhealthy[:IDS_SHOWN])
        more = f" and {len(unhealthy) - IDS_SHOWN} more" if len(unhealthy) > IDS_SHOWN else ""
        raise Refused(f"unhealthy device ids: {listed}{more}", invalid_argument=False)


def merge_allocations(
    first: ContainerAllocation, second: ContainerAllocation
) -> ContainerAllocation:
    """Both allocations in one container: every node and name once, all
    variables and annotations."""
    return ContainerAllocation(
        envs={**first.envs, **second.envs},
        devices=tuple(dict.fromkeys((*first.devices, *second.devices))),
        cdi_devices=tuple(dict.fromkeys((*first.cdi_devices, *second.cdi_devices))),
        annotations={**first.annotations, **second.annotations},
    )


def merged(state: ResourceState, ids: Sequence[str]) -> ContainerAllocation:
    """The devices' nodes (and the node-wide ones) and CDI names, each once."""
    nodes: list[DeviceNode] = []
    names: list[str] = []
    for device_id in ids:
        nodes.extend(state.allocations[device_id].devices)
        names.extend(state.allocations[device_id].cdi_devices)
    nodes.extend(state.shared_nodes)
    return ContainerAllocation(
        devices=tuple(dict.fromkeys(nodes)), cdi_devices=tuple(dict.fromkeys(names))
    )


def char_node(char: CharDevice) -> DeviceNode:
    return DeviceNode(container_path=char.path, host_path=char.path, number=char.number)


class Exclusive:
    """What every resource whose served ids are its physical devices shares:
    one container per device, so an Allocate proves the last holder left."""

    reuse_proves_release = True

    def serve(self, state: ResourceState) -> ResourceState:
        return state

    def physical(self, ids: Sequence[str]) -> list[str]:
        return list(ids)

    def validate(self, state: ResourceState, ids: Sequence[str]) -> None:
        check_ids(state, ids)

    def choose(
        self, available: Collection[str], must: Collection[str], size: int, pick: Pick
    ) -> list[str]:
        return list(pick(frozenset(available), frozenset(must), size))
