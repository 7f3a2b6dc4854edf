"""The GPU resource (default `nvidia.com/gpu`): one device per GPU (or MIG
device), id = the UUID. A container gets `/dev/nvidiaN` for each GPU (and a
MIG device's capability nodes), the node-wide nodes `/dev/nvidiactl`,
`/dev/nvidia-uvm` and `/dev/nvidia-uvm-tools` that exist, and
`NVIDIA_VISIBLE_DEVICES=<uuid>,<uuid>`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from devplugin.config import Config
from devplugin.kinds.gpu import GPU
from devplugin.model import (
    CdiCatalog,
    DeviceKind,
    GpuInfo,
    Health,
    Inventory,
    PluginDevice,
)
from devplugin.node.resources import (
    CDI_UNDECLARED,
    Capabilities,
    ContainerAllocation,
    Delivery,
    DeviceNode,
    Exclusive,
    Resource,
    ResourceState,
    char_node,
    check_request,
    merged,
)
from devplugin.node.sharing import SharedResource
from devplugin.policy.cdi import qualified

GPU_VISIBLE_ENV = "NVIDIA_VISIBLE_DEVICES"
# A MIG device is opened through two of these (its GPU and compute instance).
CAPS_DIR = "/dev/nvidia-caps"
# Why a MIG device is not offered when its capability nodes are unknown.
MIG_CAPS_UNREAD = "its nvidia-caps access files are not readable (paths.nvidia_caps_root)"
# The character major the NVIDIA driver registers for /dev/nvidiaN and
# /dev/nvidiactl (NV_MAJOR_DEVICE_NUMBER in its open kernel modules).
NVIDIA_MAJOR = 195


def cap_node(minor: int) -> str:
    return f"{CAPS_DIR}/nvidia-cap{minor}"


@dataclass(frozen=True)
class GpuResource(Exclusive):
    """GPUs found through NVML, one device per GPU, id = UUID."""

    name: str = "nvidia.com/gpu"
    kind: DeviceKind = GPU.kind
    capabilities: Capabilities = Capabilities(preferred_allocation=True)
    delivery: Delivery = Delivery()

    def state(self, inventory: Inventory) -> ResourceState:
        devices = tuple(
            PluginDevice(
                id=gpu.uuid,
                health=Health.UNHEALTHY if reason else Health.HEALTHY,
                numa_node=gpu.numa_node,
                reason=reason,
            )
            for gpu in inventory.gpus
            for reason in [self._problem(gpu, inventory.cdi)]
        )
        allocations = {gpu.uuid: self._allocation(gpu) for gpu in inventory.gpus}
        shared = tuple(char_node(node) for node in inventory.gpu_control_nodes if node.present)
        return ResourceState(
            devices=devices,
            allocations=allocations,
            shared_nodes=shared,
            names={gpu.uuid: gpu.uuid for gpu in inventory.gpus},
        )

    def allocate(self, state: ResourceState, ids: Sequence[str]) -> ContainerAllocation:
        check_request(state, ids)
        return self.delivery.answer(merged(state, ids), ids, envs={GPU_VISIBLE_ENV: ",".join(ids)})

    def cdi_name(self, gpu: GpuInfo) -> str:
        if self.delivery.gpu_names != "index":
            return gpu.uuid
        # NVIDIA's toolkit names a MIG device <GPU index>:<MIG device index>.
        if gpu.slice is not None:
            return f"{gpu.slice.parent_index}:{gpu.slice.device.index}"
        return str(gpu.index)

    def _problem(self, gpu: GpuInfo, catalog: CdiCatalog | None) -> str:
        if gpu.error:
            return f"NVML: {gpu.error}"
        if gpu.slice is not None and not gpu.slice.caps and self.delivery.nodes_only:
            # Fail closed: device nodes alone cannot reach a MIG device
            # without its capability nodes (nothing else would add them).
            return f"{MIG_CAPS_UNREAD} (MIG device {gpu.uuid}, GPU minor {gpu.minor_number})"
        if self.delivery.cdi:
            # Fail closed: a name no spec declares would fail the container.
            name, kind = self.cdi_name(gpu), self.delivery.cdi_kind
            if catalog is None or not catalog.has(kind, name):
                where = ", ".join(catalog.dirs) if catalog is not None else "(not read)"
                return f"{CDI_UNDECLARED} {qualified(kind, name)} (in {where})"
        return ""

    def _allocation(self, gpu: GpuInfo) -> ContainerAllocation:
        path = f"/dev/nvidia{gpu.minor_number}"
        node = DeviceNode(path, path, number=(NVIDIA_MAJOR, gpu.minor_number))
        caps = gpu.slice.caps if gpu.slice is not None else ()
        nodes = (node, *(DeviceNode(cap_node(m), cap_node(m)) for m in caps))
        names = (
            (qualified(self.delivery.cdi_kind, self.cdi_name(gpu)),) if self.delivery.cdi else ()
        )
        return ContainerAllocation(devices=nodes, cdi_devices=names)


def build(config: Config, capabilities: Capabilities) -> Resource:
    gpu, sharing, cdi = config.resources.gpu, config.sharing.gpu, config.cdi
    delivery = Delivery(
        strategy=frozenset(gpu.device_list_strategy),
        cdi_kind=cdi.kind_of(GPU.kind),
        gpu_names=cdi.gpu_device_name,
        plugin="devplugin.gpu",
    )
    resource = GpuResource(name=gpu.name, capabilities=capabilities, delivery=delivery)
    if sharing.replicas <= 1:
        return resource
    return SharedResource(
        resource,
        sharing.replicas,
        policy=sharing.policy,
        refuse_multiple=sharing.refuse_multiple_per_gpu,
        renamed=sharing.resource_name,
    )
