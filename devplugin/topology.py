"""Connection levels between GPUs and HCAs, as `nvidia-smi topo -m` names them.

Levels come from the PCIe ancestry found in sysfs and NVLink counts from
NVML. One `Topology` object is built per inventory and shared by everything
that needs levels (the `topo` command, the allocator, metrics), so the
per-request work is a dictionary lookup.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from devplugin.model import GpuInfo, HcaInfo, Inventory, PciFunction


class Level(enum.IntEnum):
    """PCIe distance, best first. The values are the allocator's costs."""

    PIX = 1  # at most one PCIe switch between the two
    PXB = 2  # several bridges, but no host bridge
    PHB = 3  # through one host bridge (same root complex)
    NODE = 4  # different host bridges in one NUMA node
    SYS = 5  # across NUMA nodes (or position unknown)


def pci_level(a: PciFunction | None, b: PciFunction | None) -> Level:
    """The level between two PCI functions.

    With `d` the deepest bridge both sit under, the pair is PIX when each
    side is at most one bridge below `d` (the downstream ports of one switch,
    or one port), PXB when either side is deeper (more switches in the way),
    and PHB when they share no bridge but share the host bridge. Different
    host bridges are NODE within one NUMA node and SYS across nodes; when a
    NUMA node is unknown (-1 in sysfs, typical of single-node machines) the
    two are taken to be in the same node.
    """
    if a is None or b is None:
        return Level.SYS
    if a.path.root != b.path.root:
        known = a.numa_node is not None and b.numa_node is not None
        return Level.SYS if known and a.numa_node != b.numa_node else Level.NODE
    chain_a, chain_b = a.path.chain, b.path.chain
    common = 0
    for x, y in zip(chain_a, chain_b, strict=False):
        if x != y:
            break
        common += 1
    if common == 0:
        return Level.PHB
    if common == len(chain_a) or common == len(chain_b):
        # One is an ancestor of the other (a bridge and something below it).
        below = max(len(chain_a), len(chain_b)) - common
        return Level.PIX if below <= 1 else Level.PXB
    # chain[common - 1] is the shared bridge; count hops below it per side,
    # not counting the endpoint itself.
    hops_a = len(chain_a) - common - 1
    hops_b = len(chain_b) - common - 1
    return Level.PIX if hops_a <= 1 and hops_b <= 1 else Level.PXB


@dataclass(frozen=True)
class Link:
    """The connection between two devices: a PCIe level and NVLinks (GPU pairs)."""

    level: Level
    nvlinks: int = 0

    @property
    def label(self) -> str:
        return f"NV{self.nvlinks}" if self.nvlinks else self.level.name


class Topology:
    """Precomputed pairwise links between every GPU and HCA of an inventory.

    Devices are keyed by the ids served to the kubelet: GPU UUIDs and HCA
    ids (PCI addresses).
    """

    def __init__(self, gpus: Iterable[GpuInfo], hcas: Iterable[HcaInfo]) -> None:
        self.gpus: tuple[GpuInfo, ...] = tuple(gpus)
        self.hcas: tuple[HcaInfo, ...] = tuple(hcas)
        functions: dict[str, PciFunction | None] = {}
        for gpu in self.gpus:
            functions[gpu.uuid] = gpu.pci
        for hca in self.hcas:
            functions[hca.device_id] = hca.pci
        self._numa = {gpu.uuid: gpu.numa_node for gpu in self.gpus}
        self._numa.update({hca.device_id: hca.numa_node for hca in self.hcas})
        index_by_uuid = {gpu.index: gpu.uuid for gpu in self.gpus}
        self._links: dict[tuple[str, str], Link] = {}
        ids = list(functions)
        for i, first in enumerate(ids):
            for second in ids[i + 1 :]:
                link = Link(pci_level(functions[first], functions[second]))
                self._links[(first, second)] = link
                self._links[(second, first)] = link
        for gpu in self.gpus:
            for peer_index, count in gpu.nvlink_peers:
                peer = index_by_uuid.get(peer_index)
                if peer is not None and count > 0:
                    pci = self._links[(gpu.uuid, peer)].level
                    self._links[(gpu.uuid, peer)] = Link(pci, count)
                    self._links[(peer, gpu.uuid)] = Link(pci, count)

    @classmethod
    def from_inventory(cls, inventory: Inventory) -> Topology:
        return cls(inventory.gpus, inventory.hcas)

    def link(self, first: str, second: str) -> Link:
        """The link between two distinct devices (KeyError for unknown ids)."""
        return self._links[(first, second)]

    def level(self, first: str, second: str) -> Level:
        return self._links[(first, second)].level

    def numa_node(self, device_id: str) -> int | None:
        return self._numa.get(device_id)
