"""What each extended resource serves: its device list and what a container gets.

Pure functions of an `Inventory`; no gRPC here. The server turns a
`ContainerAllocation` into the kubelet's AllocateResponse.

GPU resource (default `nvidia.com/gpu`)
    Device id: the GPU UUID. A container gets `/dev/nvidiaN` for each GPU,
    the node-wide nodes `/dev/nvidiactl`, `/dev/nvidia-uvm` and
    `/dev/nvidia-uvm-tools` that exist, and
    `NVIDIA_VISIBLE_DEVICES=<uuid>,<uuid>`.

HCA resource (default `rdma/hca`)
    Device id: the PCI address of the HCA's function (`0000:1b:00.0`). A
    container gets each HCA's `uverbsN`, every `umadN` and `issmN` of its
    ports, and `/dev/infiniband/rdma_cm`, all `rw`, and
    `NCCL_IB_HCA==mlx5_0,mlx5_1` (the leading `=` makes NCCL match the
    names exactly, so `mlx5_1` does not also select `mlx5_10`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from devplugin.model import (
    IDS_SHOWN,
    CharDevice,
    DeviceKind,
    GpuInfo,
    HcaInfo,
    Health,
    Inventory,
    PluginDevice,
    Refused,
    shown,
    shown_ids,
)

GPU_VISIBLE_ENV = "NVIDIA_VISIBLE_DEVICES"

# The topology-aware choice of physical devices: (candidates, must include,
# count) -> ids. Resources call it from `choose`.
Pick = Callable[[frozenset[str], frozenset[str], int], Sequence[str]]
ACTIVE_STATE = 4  # "4: ACTIVE"
LINK_UP_PHYS_STATE = 5  # "5: LinkUp"


@dataclass(frozen=True)
class DeviceNode:
    container_path: str
    host_path: str
    permissions: str = "rw"


@dataclass(frozen=True)
class ContainerAllocation:
    """Everything one container receives for one resource."""

    envs: Mapping[str, str] = field(default_factory=dict)
    devices: tuple[DeviceNode, ...] = ()


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
        self, available: Sequence[str], must: Sequence[str], size: int, pick: Pick
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
    """Both allocations in one container: every node once, all variables."""
    return ContainerAllocation(
        envs={**first.envs, **second.envs},
        devices=tuple(dict.fromkeys((*first.devices, *second.devices))),
    )


def _merge(
    state: ResourceState, ids: Sequence[str], envs: Mapping[str, str]
) -> ContainerAllocation:
    nodes: list[DeviceNode] = []
    for device_id in ids:
        nodes.extend(state.allocations[device_id].devices)
    nodes.extend(state.shared_nodes)
    unique = tuple(dict.fromkeys(nodes))
    return ContainerAllocation(envs=dict(envs), devices=unique)


def _node(char: CharDevice) -> DeviceNode:
    return DeviceNode(container_path=char.path, host_path=char.path)


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
        self, available: Sequence[str], must: Sequence[str], size: int, pick: Pick
    ) -> list[str]:
        return list(pick(frozenset(available), frozenset(must), size))


@dataclass(frozen=True)
class GpuResource(Exclusive):
    """GPUs found through NVML, one device per GPU, id = UUID."""

    name: str = "nvidia.com/gpu"
    kind: DeviceKind = DeviceKind.GPU
    capabilities: Capabilities = Capabilities(preferred_allocation=True)

    def state(self, inventory: Inventory) -> ResourceState:
        devices = tuple(
            PluginDevice(
                id=gpu.uuid,
                health=Health.UNHEALTHY if gpu.error else Health.HEALTHY,
                numa_node=gpu.numa_node,
                reason=f"NVML: {gpu.error}" if gpu.error else "",
            )
            for gpu in inventory.gpus
        )
        allocations = {gpu.uuid: _gpu_allocation(gpu) for gpu in inventory.gpus}
        shared = tuple(_node(node) for node in inventory.gpu_control_nodes if node.present)
        return ResourceState(
            devices=devices,
            allocations=allocations,
            shared_nodes=shared,
            names={gpu.uuid: gpu.uuid for gpu in inventory.gpus},
        )

    def allocate(self, state: ResourceState, ids: Sequence[str]) -> ContainerAllocation:
        check_request(state, ids)
        return _merge(state, ids, {GPU_VISIBLE_ENV: ",".join(ids)})


def _gpu_allocation(gpu: GpuInfo) -> ContainerAllocation:
    path = f"/dev/nvidia{gpu.minor_number}"
    return ContainerAllocation(devices=(DeviceNode(path, path),))


def hca_health(hca: HcaInfo) -> tuple[Health, str]:
    """Healthy when every port is ACTIVE/LinkUp and every device node exists."""
    if hca.error:
        return Health.UNHEALTHY, hca.error
    problems: list[str] = []
    if not hca.ports:
        problems.append("no ports")
    for port in hca.ports:
        if port.state_code != ACTIVE_STATE or port.phys_state_code != LINK_UP_PHYS_STATE:
            problems.append(f"port {port.number} is {port.state or '?'} / {port.phys_state or '?'}")
    if hca.uverbs is None:
        problems.append("no uverbs device")
    missing = [node.path for node in hca.char_devices if not node.present]
    if missing:
        problems.append(f"missing device nodes: {', '.join(missing)}")
    if problems:
        return Health.UNHEALTHY, "; ".join(problems)
    return Health.HEALTHY, ""


@dataclass(frozen=True)
class HcaResource(Exclusive):
    """RDMA HCAs from sysfs, one device per PCI function, id = PCI address."""

    name: str = "rdma/hca"
    env_var: str = "NCCL_IB_HCA"
    kind: DeviceKind = DeviceKind.HCA
    capabilities: Capabilities = Capabilities(preferred_allocation=True)

    def state(self, inventory: Inventory) -> ResourceState:
        devices: list[PluginDevice] = []
        allocations: dict[str, ContainerAllocation] = {}
        rdma_cm: list[DeviceNode] = []
        for hca in inventory.hcas:
            health, reason = hca_health(hca)
            devices.append(PluginDevice(hca.device_id, health, hca.numa_node, reason))
            own = [hca.uverbs] if hca.uverbs is not None else []
            own.extend(hca.umads)
            own.extend(hca.issms)
            allocations[hca.device_id] = ContainerAllocation(
                devices=tuple(_node(node) for node in own if node.present),
            )
            if hca.rdma_cm.present and not rdma_cm:
                rdma_cm.append(_node(hca.rdma_cm))
        return ResourceState(
            devices=tuple(devices),
            allocations=allocations,
            shared_nodes=tuple(rdma_cm),
            names={hca.device_id: hca.name for hca in inventory.hcas},
        )

    def allocate(self, state: ResourceState, ids: Sequence[str]) -> ContainerAllocation:
        check_request(state, ids)
        names = [state.names[device_id] for device_id in ids]
        return _merge(state, ids, {self.env_var: "=" + ",".join(names)})
