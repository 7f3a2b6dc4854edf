"""Connection levels between GPUs and HCAs, and the domain tree behind them.

Levels are named as `nvidia-smi topo -m` names them. Every device gets four
nested domain keys from its sysfs PCI path, coarse to fine:

    NUMA node  >  host bridge  >  root port  >  switch

Two devices are PIX when they share a switch (they hang off downstream ports
of one switch, or off one root port), PXB when they share only the root port
(more switches in the way), PHB when they share only the host bridge, NODE
when they share only the NUMA node, and SYS otherwise. Because the keys are
nested, the levels form a tree (an ultrametric): the level between two
devices is decided by the deepest domain they share. The allocator relies on
that to search exactly without enumerating subsets.

One `Topology` is built per inventory and shared by the allocator, the
`topo` command and the alignment report; per-request work is lookups.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from devplugin.model import DeviceKind, GpuInfo, HcaInfo, Inventory, PciFunction


class Level(enum.IntEnum):
    """PCIe distance, best first. The values are the allocator's costs."""

    PIX = 1  # at most one PCIe switch between the two
    PXB = 2  # several bridges, but no host bridge
    PHB = 3  # through one host bridge (same root complex)
    NODE = 4  # different host bridges in one NUMA node
    SYS = 5  # across NUMA nodes (or position unknown)


# The GPU-GPU connectivity the allocator maximises: per pair, 100 per NVLink
# plus a score by PCIe level (at most 50: no locality outweighs one link).
NVLINK_SCORE = 100
PCIE_SCORE = {Level.PIX: 50, Level.PXB: 40, Level.PHB: 30, Level.NODE: 20, Level.SYS: 10}

# The level between devices that differ first at domain depth d (0 = NUMA).
_LEVEL_AT_DEPTH = (Level.SYS, Level.NODE, Level.PHB, Level.PXB)
DOMAIN_DEPTH = 4


@dataclass(frozen=True)
class Placement:
    """A device's nested domain keys: NUMA, host bridge, root port, switch."""

    keys: tuple[Hashable, Hashable, Hashable, Hashable]


def placement_of(function: PciFunction | None, unplaced_id: str) -> Placement:
    """Domain keys from a PCI path; a device with no known path gets keys of
    its own, so it is SYS to everything.

    An unknown NUMA node (-1 in sysfs, typical of single-node machines) is
    one shared key: unknown-to-unknown is the same node, unknown-to-known is
    a different one.
    """
    if function is None:
        own = ("unplaced", unplaced_id)
        return Placement((own, (own,), (own,), (own,)))
    numa = function.numa_node if function.numa_node is not None else -1
    chain = function.path.chain
    host = (numa, function.path.root)
    port = (host, chain[0])
    # Devices on downstream ports of one switch share everything above those
    # ports; a device directly behind a root port has the root port alone.
    switch = (port, chain[:-2] if len(chain) >= 3 else chain[:-1])
    return Placement((numa, host, port, switch))


def level_between(a: Placement, b: Placement) -> Level:
    for depth, level in enumerate(_LEVEL_AT_DEPTH):
        if a.keys[depth] != b.keys[depth]:
            return level
    return Level.PIX


def pci_level(a: PciFunction | None, b: PciFunction | None) -> Level:
    """The level between two PCI functions (None: position unknown, SYS)."""
    if a is None or b is None:
        return Level.SYS
    return level_between(placement_of(a, ""), placement_of(b, ""))


@dataclass(frozen=True)
class Link:
    """The connection between two devices: a PCIe level and NVLinks (GPU pairs)."""

    level: Level
    nvlinks: int = 0

    @property
    def label(self) -> str:
        return f"NV{self.nvlinks}" if self.nvlinks else self.level.name

    @property
    def score(self) -> int:
        """GPU pair connectivity: 100 per NVLink plus the PCIe locality score, so
        a link never trades for locality but locality decides among equal
        links (all pairs NV18 under NVSwitch: the pair on one socket wins)."""
        return NVLINK_SCORE * self.nvlinks + PCIE_SCORE[self.level]


@dataclass(frozen=True)
class DomainNode:
    """A node of the domain tree. Depth 0 is the whole system, 1 a NUMA node,
    2 a host bridge, 3 a root port, 4 a switch (whose children are classes)."""

    index: int
    depth: int
    parent: int | None
    children: tuple[int, ...]
    classes: tuple[int, ...]

    @property
    def level(self) -> Level:
        """The level between devices below different children of this node."""
        return _LEVEL_AT_DEPTH[self.depth] if self.depth < DOMAIN_DEPTH else Level.PIX


@dataclass
class _NodeDraft:
    depth: int
    parent: int | None
    children: list[int] = field(default_factory=list)
    classes: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class DeviceClass:
    """Devices of one kind that are interchangeable for every objective term:
    same switch, and (GPUs) the same NVLinks to everything else with a
    uniform count among themselves."""

    index: int
    kind: DeviceKind
    devices: tuple[str, ...]
    node: int
    internal_score: int


class Topology:
    """Pairwise links between every GPU and HCA of an inventory, plus the
    domain tree and device classes the allocator searches over.

    Devices are keyed by the ids served to the kubelet: GPU UUIDs and HCA
    ids (PCI addresses).
    """

    def __init__(self, gpus: Iterable[GpuInfo], hcas: Iterable[HcaInfo]) -> None:
        self.gpus: tuple[GpuInfo, ...] = tuple(gpus)
        self.hcas: tuple[HcaInfo, ...] = tuple(hcas)
        self.kind: dict[str, DeviceKind] = {gpu.uuid: DeviceKind.GPU for gpu in self.gpus}
        self.kind.update({hca.device_id: DeviceKind.HCA for hca in self.hcas})
        self.placement: dict[str, Placement] = {
            gpu.uuid: placement_of(gpu.pci, gpu.uuid) for gpu in self.gpus
        }
        self.placement.update(
            {hca.device_id: placement_of(hca.pci, hca.device_id) for hca in self.hcas}
        )
        self._numa = {gpu.uuid: gpu.numa_node for gpu in self.gpus}
        self._numa.update({hca.device_id: hca.numa_node for hca in self.hcas})
        uuid_by_index = {gpu.index: gpu.uuid for gpu in self.gpus}
        self._nvlinks: dict[tuple[str, str], int] = {}
        for gpu in self.gpus:
            for peer_index, count in gpu.nvlink_peers:
                peer = uuid_by_index.get(peer_index)
                if peer is not None and count > 0:
                    self._nvlinks[(gpu.uuid, peer)] = count
                    self._nvlinks[(peer, gpu.uuid)] = count
        self._id_sets = {kind: frozenset(self.ids(kind)) for kind in DeviceKind}
        self._build_tree()

    @classmethod
    def from_inventory(cls, inventory: Inventory) -> Topology:
        return cls(inventory.gpus, inventory.hcas)

    # -- pairwise ------------------------------------------------------------
    def level(self, first: str, second: str) -> Level:
        return level_between(self.placement[first], self.placement[second])

    def nvlinks(self, first: str, second: str) -> int:
        return self._nvlinks.get((first, second), 0)

    def link(self, first: str, second: str) -> Link:
        """The link between two distinct devices (KeyError for unknown ids)."""
        return Link(self.level(first, second), self.nvlinks(first, second))

    def score(self, first: str, second: str) -> int:
        return self.link(first, second).score

    def numa_node(self, device_id: str) -> int | None:
        return self._numa.get(device_id)

    def ids(self, kind: DeviceKind) -> list[str]:
        return [device_id for device_id, k in self.kind.items() if k is kind]

    def id_set(self, kind: DeviceKind) -> frozenset[str]:
        return self._id_sets[kind]

    # -- domain tree ---------------------------------------------------------
    def _build_tree(self) -> None:
        drafts = [_NodeDraft(depth=0, parent=None)]
        index_of: dict[Hashable, int] = {}
        switch_members: dict[int, list[str]] = {}
        for device_id, placement in self.placement.items():
            parent = 0
            for depth, key in enumerate(placement.keys, start=1):
                node = index_of.get(key)
                if node is None:
                    node = len(drafts)
                    index_of[key] = node
                    drafts.append(_NodeDraft(depth=depth, parent=parent))
                    drafts[parent].children.append(node)
                parent = node
            switch_members.setdefault(parent, []).append(device_id)
        classes: list[DeviceClass] = []
        for switch, members in switch_members.items():
            for kind, group, internal in self._split_classes(members):
                klass = DeviceClass(len(classes), kind, tuple(sorted(group)), switch, internal)
                classes.append(klass)
                drafts[switch].classes.append(klass.index)
        self.nodes: tuple[DomainNode, ...] = tuple(
            DomainNode(i, d.depth, d.parent, tuple(d.children), tuple(d.classes))
            for i, d in enumerate(drafts)
        )
        self.classes: tuple[DeviceClass, ...] = tuple(classes)
        self.class_of: dict[str, int] = {
            device: klass.index for klass in self.classes for device in klass.devices
        }
        # Ancestors of each class's switch node, deepest first, root last.
        self.class_path: tuple[tuple[int, ...], ...] = tuple(
            self._path(klass.node) for klass in self.classes
        )
        # Children before parents: the order the allocator folds the tree in.
        order: list[int] = []
        stack = [0]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(self.nodes[node].children)
        self.postorder: tuple[int, ...] = tuple(reversed(order))
        self.cross_score, self.tree_exact = self._cross_scores()

    def _path(self, node: int) -> tuple[int, ...]:
        path: list[int] = []
        current: int | None = node
        while current is not None:
            path.append(current)
            current = self.nodes[current].parent
        return tuple(path)

    def _split_classes(self, members: list[str]) -> list[tuple[DeviceKind, list[str], int]]:
        """Interchangeable groups within one switch.

        HCAs of one switch are interchangeable. GPUs are grouped by NVLink:
        the connected components of the NVLink graph inside the switch, each
        kept whole when it is a clique of one link count and its members see
        the same NVLinks outside it; otherwise its GPUs stand alone (and the
        allocator adds the NVLinks the tree cannot express itself). GPUs with
        no NVLink inside the switch form one class per pattern of NVLinks
        outside it (on a PCIe-only node: one class per switch).
        """
        hcas = [m for m in members if self.kind[m] is DeviceKind.HCA]
        gpus = sorted(m for m in members if self.kind[m] is DeviceKind.GPU)
        groups: list[tuple[DeviceKind, list[str], int]] = []
        if hcas:
            groups.append((DeviceKind.HCA, hcas, 0))
        seen: set[str] = set()
        outside = [g.uuid for g in self.gpus]
        alone: dict[tuple[int, ...], list[str]] = {}
        inside = set(gpus)
        for gpu in gpus:
            if gpu in seen:
                continue
            component = [gpu]
            seen.add(gpu)
            frontier = [gpu]
            while frontier:
                current = frontier.pop()
                for other in gpus:
                    if other not in seen and self.nvlinks(current, other):
                        seen.add(other)
                        component.append(other)
                        frontier.append(other)
            scores = {self.score(a, b) for i, a in enumerate(component) for b in component[i + 1 :]}
            external = {
                tuple(self.nvlinks(member, x) for x in outside if x not in component)
                for member in component
            }
            if len(component) == 1:
                # Alone in its component: no NVLink to any GPU of this switch.
                links = tuple(self.nvlinks(gpu, x) for x in outside if x not in inside)
                alone.setdefault(links, []).append(gpu)
            elif len(scores) <= 1 and len(external) == 1:
                groups.append((DeviceKind.GPU, component, scores.pop()))
            else:
                groups.extend(
                    (DeviceKind.GPU, [member], PCIE_SCORE[Level.PIX]) for member in component
                )
        # GPUs with no NVLink inside the switch and the same NVLinks outside
        # are interchangeable: every pair among them is plain PIX. One class
        # for them keeps PCIe-only switches (four or eight GPUs each) to one
        # fold item instead of one per GPU.
        groups.extend(
            (DeviceKind.GPU, members, PCIE_SCORE[Level.PIX]) for members in alone.values()
        )
        return groups

    def _cross_scores(self) -> tuple[tuple[int, ...], bool]:
        """The GPU pair score across children of each node, and whether the
        tree expresses every GPU pair score (one score per node)."""
        found: dict[int, set[int]] = {}
        gpu_classes = [k for k in self.classes if k.kind is DeviceKind.GPU]
        for i, a in enumerate(gpu_classes):
            path_a = self.class_path[a.index]
            for b in gpu_classes[i + 1 :]:
                path_b = set(self.class_path[b.index])
                lca = next(node for node in path_a if node in path_b)
                score = self.score(a.devices[0], b.devices[0])
                found.setdefault(lca, set()).add(score)
        exact = all(len(scores) == 1 for scores in found.values())
        cross = tuple(min(found[node]) if node in found else 0 for node in range(len(self.nodes)))
        return cross, exact
