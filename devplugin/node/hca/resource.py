"""The HCA resource (default `rdma/hca`): one device per RDMA function, id =
the PCI address of the HCA's function (`0000:1b:00.0`). A container gets
each HCA's `uverbsN`, every `umadN` and `issmN` of its ports, and
`/dev/infiniband/rdma_cm` where it is loaded, all `rw`, and
`NCCL_IB_HCA==mlx5_0,mlx5_1` (the leading `=` makes NCCL match the names
exactly, so `mlx5_1` does not also select `mlx5_10`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from devplugin.config import Config
from devplugin.kinds.hca import HCA
from devplugin.model import (
    DeviceKind,
    HcaInfo,
    Health,
    Inventory,
    PluginDevice,
)
from devplugin.node.resources import (
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
from devplugin.policy.cdi import SpecError, qualified, sanitize_device_name

ACTIVE_STATE = 4  # "4: ACTIVE"
LINK_UP_PHYS_STATE = 5  # "5: LinkUp"


def hca_health(hca: HcaInfo, *, numbered: bool = False) -> tuple[Health, str]:
    """Healthy when every port is ACTIVE/LinkUp and every device node of its
    own exists (`numbered`: with its device number known, which a CDI spec
    needs); rdma_cm is optional in every strategy."""
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
    missing = [node.path for node in hca.own_devices if not node.present]
    if missing:
        problems.append(f"missing device nodes: {', '.join(missing)}")
    if numbered:
        unknown = [node.path for node in hca.own_devices if node.number is None]
        if unknown:
            problems.append(f"no device number in sysfs for {', '.join(unknown)}")
        try:
            sanitize_device_name(hca.name)
        except SpecError as exc:
            problems.append(str(exc))
    if problems:
        return Health.UNHEALTHY, "; ".join(problems)
    return Health.HEALTHY, ""


@dataclass(frozen=True)
class HcaResource(Exclusive):
    """RDMA HCAs from sysfs, one device per PCI function, id = PCI address."""

    name: str = "rdma/hca"
    env_var: str = "NCCL_IB_HCA"
    kind: DeviceKind = HCA.kind
    capabilities: Capabilities = Capabilities(preferred_allocation=True)
    delivery: Delivery = Delivery()

    def state(self, inventory: Inventory) -> ResourceState:
        devices: list[PluginDevice] = []
        allocations: dict[str, ContainerAllocation] = {}
        rdma_cm: list[DeviceNode] = []
        for hca in inventory.hcas:
            health, reason = hca_health(hca, numbered=self.delivery.cdi)
            devices.append(PluginDevice(hca.device_id, health, hca.numa_node, reason))
            own = [hca.uverbs] if hca.uverbs is not None else []
            own.extend(hca.umads)
            own.extend(hca.issms)
            allocations[hca.device_id] = ContainerAllocation(
                devices=tuple(char_node(node) for node in own if node.present),
                cdi_devices=(qualified(self.delivery.cdi_kind, hca_cdi_name(hca)),)
                if self.delivery.cdi and health is Health.HEALTHY
                else (),
            )
            if hca.rdma_cm.present and not rdma_cm:
                rdma_cm.append(char_node(hca.rdma_cm))
        return ResourceState(
            devices=tuple(devices),
            allocations=allocations,
            shared_nodes=tuple(rdma_cm),
            names={hca.device_id: hca.name for hca in inventory.hcas},
        )

    def allocate(self, state: ResourceState, ids: Sequence[str]) -> ContainerAllocation:
        check_request(state, ids)
        names = [state.names[device_id] for device_id in ids]
        # The chosen HCAs' names: no CDI spec can carry which were chosen.
        return self.delivery.answer(
            merged(state, ids), ids, envs={}, always={self.env_var: "=" + ",".join(names)}
        )


def hca_cdi_name(hca: HcaInfo) -> str:
    """The HCA's CDI device name: its ibdev name, made valid (`mlx5_0` is)."""
    return sanitize_device_name(hca.name)


def build(config: Config, capabilities: Capabilities) -> Resource:
    hca, sharing, cdi = config.resources.hca, config.sharing.hca, config.cdi
    delivery = Delivery(
        strategy=frozenset(hca.device_list_strategy),
        cdi_kind=cdi.kind_of(HCA.kind),
        plugin="devplugin.hca",
    )
    resource = HcaResource(
        name=hca.name, env_var=hca.env_var, capabilities=capabilities, delivery=delivery
    )
    if sharing.units <= 1:
        return resource
    return SharedResource(resource, sharing.units, policy=sharing.policy)
