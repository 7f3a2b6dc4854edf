"""The NVMe kind's node side (tests only): one device per drive, id = PCI
address; a container is told which drives it got."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from devplugin.model import DeviceKind, Health, Inventory, PluginDevice
from devplugin.node.resources import (
    Capabilities,
    ContainerAllocation,
    Exclusive,
    ResourceState,
    check_request,
)
from tests.third_kind.nvme import NvmeKind

ENV = "DEVPLUGIN_NVME_DRIVES"


@dataclass(frozen=True)
class NvmeResource(Exclusive):
    wing: NvmeKind
    name: str = "devplugin.io/nvme"
    capabilities: Capabilities = Capabilities()

    @property
    def kind(self) -> DeviceKind:
        return self.wing.kind

    def state(self, inventory: Inventory) -> ResourceState:
        drives = self.wing.devices(inventory)
        devices = tuple(
            PluginDevice(self.wing.device_id(d), Health.HEALTHY, d.numa_node) for d in drives
        )
        allocations = {self.wing.device_id(d): ContainerAllocation() for d in drives}
        return ResourceState(devices=devices, allocations=allocations)

    def allocate(self, state: ResourceState, ids: Sequence[str]) -> ContainerAllocation:
        check_request(state, ids)
        return ContainerAllocation(envs={ENV: ",".join(ids)})
