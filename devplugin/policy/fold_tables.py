"""The tables the folds read, built once per topology: the objective's terms
turned into weighted rows on the device tree. Pure.

Every term of the objective decomposes over the tree of nested domains
(levels by the deepest shared domain, pair scores by the domain where two
devices part, spread by the free devices left in each domain), so a fold
only adds the rows built here: a class's value for each count taken, a
node's connectivity and spread row after its merge, a partner's value when
first covered at a level. Interchangeable devices (same switch, same
NVLinks) are one class with a count. This module is where those rows are written;
the folds (fold.py and the compiled _foldc.c) add them and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from devplugin.model import DeviceKind
from devplugin.policy.objective import (
    SUPPORT_LEVELS,
    Request,
    Weights,
    cost_partner,
    coverage_mode,
    support_mode,
)
from devplugin.policy.topology import DOMAIN_DEPTH, NVLINK_SCORE, PCIE_SCORE, Topology

try:
    from devplugin.policy import _foldc
except ImportError:  # pragma: no cover - the extension is built by every install here
    _foldc = None  # type: ignore[assignment]

# The compiled fold computes on signed 128-bit integers; it takes a topology
# only when every value a fold can reach stays below 2**NATIVE_BITS (the
# weights grow with the device count: the 96 devices of 64-gpu-bridged need
# 105 bits, and each doubling of the devices adds about 12).
NATIVE_BITS = 126

# Finishing rows (see `KindTables.finish`) up to this long are kept: at
# most this many squared per node, a few hundred KiB for 128 devices.
FINISH_CACHED = 129

# The linked fold carries, through each merge, one table per combination of
# counts of the classes whose NVLinks still leave the merged part; past this
# many combinations meeting in one merge, the bounded search is used instead
# (the two DGX-1 meshes need 256; bridged PCIe trees 4).
LINKED_STATES = 4096


@dataclass(frozen=True)
class TreeShape:
    """The compressed tree the folds walk: a node with one child and no
    classes has the same subtree as that child, so it adds nothing but a
    second copy of the child's spread term. Chains collapse into their
    lowest node, which counts the spread term once per domain in the chain
    (`spread_copies`)."""

    order: tuple[int, ...]  # kept nodes, children before parents
    # Per kept node: its items, (False, child node) or (True, class).
    node_items: tuple[tuple[tuple[bool, int], ...], ...]
    spread_copies: tuple[int, ...]
    node_level: tuple[int, ...]
    # Per class, the nodes from it to the root as bits. A child's index is
    # above its parent's, so the deepest node two paths share is the
    # highest bit they have in common.
    path_bits: tuple[int, ...]
    # Devices (both kinds) under each node.
    under: tuple[int, ...]

    @classmethod
    def of(cls, topology: Topology) -> TreeShape:
        t = topology
        keep = [
            node.index == 0 or len(node.children) != 1 or bool(node.classes) for node in t.nodes
        ]
        copies = [0] * len(t.nodes)

        def lowest(node: int) -> int:
            chain = 0
            while True:
                if 0 < t.nodes[node].depth <= DOMAIN_DEPTH:
                    chain += 1
                if keep[node]:
                    copies[node] += chain
                    return node
                node = t.nodes[node].children[0]

        items: list[tuple[tuple[bool, int], ...]] = [() for _ in t.nodes]
        order: list[int] = []
        for node in t.postorder:
            if not keep[node]:
                continue
            order.append(node)
            items[node] = (
                *((False, lowest(child)) for child in t.nodes[node].children),
                *((True, c) for c in t.nodes[node].classes),
            )
        if 0 < t.nodes[0].depth <= DOMAIN_DEPTH:  # pragma: no cover - the root is no domain
            copies[0] += 1
        under = [0] * len(t.nodes)
        for klass in t.classes:
            for node in t.class_path[klass.index]:
                under[node] += len(klass.devices)
        return cls(
            tuple(order),
            tuple(items),
            tuple(copies),
            tuple(int(node.level) for node in t.nodes),
            tuple(sum(1 << node for node in path) for path in t.class_path),
            tuple(under),
        )


@dataclass(frozen=True)
class FoldNode:
    """One node of the compressed tree as a fold of one kind walks it."""

    node: int
    level: int
    children: tuple[int, ...]  # child nodes (their lowest kept node)
    mine: tuple[int, ...]  # classes of the kind being chosen
    others: tuple[int, ...]  # classes of the other kind (free room, partners)


@dataclass(frozen=True)
class KindTables:
    """What the tree fold reads per request kind.

    GPU pair scores decompose over the tree: a pair parting at node N scores
    cross[N], so the connectivity of a choice is the sum over nodes of
    C(k_N, 2) * (cross[N] - cross[parent]) plus, per class, C(k_c, 2) *
    (internal - cross[its node]), where k is how many were taken below. Each
    node then adds one row after its merge instead of a term per pair of
    counts inside it. A node no pair parts at takes its parent's score, so
    it adds nothing."""

    walk: tuple[FoldNode, ...]  # children before parents
    classes: tuple[int, ...]  # the classes of this kind
    # Per class and cost level (0-5), the value of taking k of it.
    class_values: tuple[tuple[list[int], ...], ...]
    # Per node, the connectivity row added after its merge (None: nothing).
    node_penalty: tuple[list[int] | None, ...]
    # Per node, by free devices below it: the connectivity and spread rows
    # added together after its merge (None per node: nothing to add; per
    # room: not built yet). Filled as rooms are met.
    finish: tuple[list[list[int] | None] | None, ...]


def _walk(
    topology: Topology, shape: TreeShape, kind: DeviceKind
) -> tuple[list[FoldNode], list[int]]:
    """The nodes a fold of `kind` visits, and each kept node's parent."""
    parent = [0] * len(topology.nodes)
    walk: list[FoldNode] = []
    for node in shape.order:
        children: list[int] = []
        mine: list[int] = []
        others: list[int] = []
        for is_class, item in shape.node_items[node]:
            if not is_class:
                parent[item] = node
                children.append(item)
            elif topology.classes[item].kind is kind:
                mine.append(item)
            else:
                others.append(item)
        level = shape.node_level[node]
        walk.append(FoldNode(node, level, tuple(children), tuple(mine), tuple(others)))
    return walk, parent


def _kind_tables(
    topology: Topology,
    shape: TreeShape,
    weights: Weights,
    kind: DeviceKind,
    spread: Sequence[object],
    *,
    linked: bool = False,
) -> KindTables:
    """`linked`: GPU pairs parting at a node score its PCIe level only (the
    linked fold adds the NVLinks the tree cannot express where they meet)."""
    t = topology
    gpu = kind is DeviceKind.GPU
    walk, parent = _walk(t, shape, kind)
    # The score of pairs parting at each node; where none part (one child
    # holds every GPU below), the parent's, so the step is zero.
    cross = [0] * len(t.nodes)
    if gpu and linked:
        cross = [PCIE_SCORE[node.level] for node in t.nodes]
    elif gpu:
        for node in reversed(shape.order):  # parents before children
            up = cross[parent[node]] if node else 0
            cross[node] = t.cross_score[node] if t.cross_score[node] else up
    classes = tuple(k.index for k in t.classes if k.kind is kind)
    class_values: list[tuple[list[int], ...]] = [()] * len(t.classes)
    of_kind = [0] * len(t.nodes)
    for c in classes:
        klass = t.classes[c]
        step = klass.internal_score - cross[klass.node] if gpu else 0
        class_values[c] = tuple(
            [
                k * per * weights.total - step * (k * (k - 1) // 2) * weights.connectivity
                for k in range(len(klass.devices) + 1)
            ]
            for per in range(6)
        )
        for node in t.class_path[c]:
            of_kind[node] += len(klass.devices)
    penalty: list[list[int] | None] = [None] * len(t.nodes)
    for node in shape.order:
        step = cross[node] - (cross[parent[node]] if node else 0)
        if step:
            penalty[node] = [
                -step * (k * (k - 1) // 2) * weights.connectivity for k in range(of_kind[node] + 1)
            ]
    finish: list[list[list[int] | None] | None] = [
        [None] * (shape.under[node] + 1) if row is not None or penalty[node] is not None else None
        for node, row in enumerate(spread)
    ]
    return KindTables(tuple(walk), classes, tuple(class_values), tuple(penalty), tuple(finish))


@dataclass
class Inputs:
    """Per-request arrays, indexed by class (per node where named)."""

    cap: list[int]  # candidates per class
    must: list[int]  # must-include devices per class
    cost: list[int]  # level to the partner set per class (cost modes)
    partner: list[int]  # partner devices per class
    other: list[int]  # free devices of the other kind per class

    def per_node(self, topology: Topology) -> tuple[list[int], list[int]]:
        """Free devices (both kinds) per node before the choice, and partners
        per subtree (the tree fold sums these as it goes; the linked fold
        reads them here)."""
        free = [0] * len(topology.nodes)
        targets = [0] * len(topology.nodes)
        for c, path in enumerate(topology.class_path):
            room, pending = self.cap[c] + self.other[c], self.partner[c]
            if room or pending:
                for node in path:
                    free[node] += room
                    targets[node] += pending
        return free, targets


@dataclass(frozen=True)
class Step:
    """One item folded into a node by the linked fold."""

    is_class: bool
    item: int
    # (position in the state so far, position in the item's state, score per
    # pair of chosen devices): the NVLinks this merge closes.
    edges: tuple[tuple[int, int, int], ...]
    # Positions of the joined state (so far + item) still linked outside.
    keep: tuple[int, ...]
    keeps_all: bool


def _links(topology: Topology) -> list[dict[int, int]]:
    """Per GPU class, the NVLink score to each other class it links to."""
    gpus = [k for k in topology.classes if k.kind is DeviceKind.GPU]
    links: list[dict[int, int]] = [{} for _ in topology.classes]
    for a in gpus:
        for b in gpus:
            count = topology.nvlinks(a.devices[0], b.devices[0]) if a is not b else 0
            if count:
                links[a.index][b.index] = NVLINK_SCORE * count
    return links


@dataclass(frozen=True)
class LinkedPlan:
    """How the linked fold walks one topology (built once).

    The tree fold gives each subtree its best value per count. NVLinks that
    the tree cannot express make a subtree's value depend on which linked
    devices it took, so the linked fold keeps a table per count *and* per
    state: the counts taken from each class whose NVLinks reach beyond the
    part merged so far. When a merge brings both ends of a link together,
    the link's score is added and the class drops out of the state. The
    states stay few when the NVLink graph is local to the tree (meshes
    within a node, bridges between neighbouring switches)."""

    steps: tuple[tuple[Step, ...], ...]  # per node
    open_class: tuple[bool, ...]  # per class: linked to another class

    @staticmethod
    def build(topology: Topology, shape: TreeShape) -> LinkedPlan | None:
        """None when some merge would carry more than `LINKED_STATES` states."""
        t = topology
        links = _links(t)
        under: list[frozenset[int]] = [frozenset()] * len(t.nodes)
        opened: list[tuple[int, ...]] = [()] * len(t.nodes)
        steps: list[tuple[Step, ...]] = [()] * len(t.nodes)
        for node in shape.order:
            merged: set[int] = set()
            frontier: list[int] = []
            node_steps: list[Step] = []
            for is_class, item in shape.node_items[node]:
                if is_class and t.classes[item].kind is not DeviceKind.GPU:
                    continue  # never taken by a GPU request: nothing to fold
                if is_class:
                    members: frozenset[int] = frozenset((item,))
                    item_open = [item] if links[item] else []
                else:
                    members, item_open = under[item], list(opened[item])
                joined = frontier + item_open
                combos = 1
                for c in joined:
                    combos *= len(t.classes[c].devices) + 1
                if combos > LINKED_STATES:
                    return None
                edges = tuple(
                    (i, j, links[a][b])
                    for i, a in enumerate(frontier)
                    for j, b in enumerate(item_open)
                    if b in links[a]
                )
                merged |= members
                keep = tuple(i for i, c in enumerate(joined) if not links[c].keys() <= merged)
                frontier = [joined[i] for i in keep]
                node_steps.append(Step(is_class, item, edges, keep, len(keep) == len(joined)))
            under[node], opened[node] = frozenset(merged), tuple(frontier)
            steps[node] = tuple(node_steps)
        return LinkedPlan(tuple(steps), tuple(bool(row) for row in links))


class FoldTables:
    """Everything the folds read for one topology, built once."""

    def __init__(self, topology: Topology) -> None:
        t = topology
        self.topology = t
        self.shape = shape = TreeShape.of(t)
        self.weights = weights = Weights.of(t)
        # Per node, by devices taken below it: the spread term's row (None:
        # the node is no domain).
        self.spread_rows: tuple[list[int] | None, ...] = tuple(
            [j * j * copies * weights.spread for j in range(shape.under[node] + 1)]
            if copies
            else None
            for node, copies in enumerate(shape.spread_copies)
        )
        self.kinds = {
            kind: _kind_tables(t, shape, weights, kind, self.spread_rows) for kind in DeviceKind
        }
        # Per class, its device when it has only one.
        self.alone = tuple(k.devices[0] if len(k.devices) == 1 else None for k in t.classes)
        # NVLink graphs the tree cannot express: the linked fold's plan (None
        # when its states would be too many to carry).
        self.linked = None if t.tree_exact else LinkedPlan.build(t, shape)
        # The GPU tables the linked fold reads (pairs scored by PCIe level).
        self.linked_kind = (
            None
            if self.linked is None
            else _kind_tables(t, shape, weights, DeviceKind.GPU, self.spread_rows, linked=True)
        )

    def finish_row(self, tables: KindTables, node: int, room: int) -> list[int]:
        """What a node adds to taking k below it, for k up to `room`: its
        connectivity term and its spread term with `room` free before."""
        penalty = tables.node_penalty[node]
        spread = self.spread_rows[node]
        count = room + 1 if penalty is None else min(room + 1, len(penalty))
        row = list(penalty[:count]) if penalty is not None else [0] * count
        if spread is not None:
            row = [value - spread[room - k] for k, value in enumerate(row)]
        return row

    @staticmethod
    def prune_above(request: Request, threshold: int) -> int:
        """The cost level above which a class takes nothing: the threshold
        where it bounds the chosen devices' own levels (cost modes), else -1
        (none: coverage and support bound the partners' levels)."""
        return -1 if coverage_mode(request) or support_mode(request) else threshold

    def cover_units(self, request: Request, threshold: int) -> list[int]:
        """Per level, the value of one partner first covered there: HCAs
        second pay its level (infinite past the threshold); HCAs first gain
        reach within the threshold and support within each support level."""
        w = self.weights
        units = [0] * 6
        if coverage_mode(request):
            return [w.inf if level > threshold else level * w.total for level in range(6)]
        if support_mode(request):
            for level in range(1, 6):
                gain = -w.reach if level <= threshold else 0
                for weight, bound in zip(w.support, SUPPORT_LEVELS, strict=True):
                    if level <= bound:
                        gain -= weight
                units[level] = gain
        return units

    def inputs(self, request: Request, candidates: Iterable[str]) -> Inputs:
        """The request counted per class; `cost`: each class's level to the
        nearest partner (cost modes), the level of the deepest domain that
        holds one (the root holds them all)."""
        t = self.topology
        class_of = t.class_of.__getitem__
        nclasses = len(t.classes)
        cap, must, partner, other = ([0] * nclasses for _ in range(4))
        for tally, devices in (
            (cap, candidates),
            (must, request.must_include),
            (partner, request.partner),
            (other, request.other_free),
        ):
            for c in map(class_of, devices):
                tally[c] += 1
        cost = [0] * nclasses
        holding = 0
        for q in set(map(class_of, cost_partner(request))):
            holding |= self.shape.path_bits[q]
        if holding:
            bits, level = self.shape.path_bits, self.shape.node_level
            for c in range(nclasses):
                if cap[c]:
                    cost[c] = level[(bits[c] & holding).bit_length() - 1]
        return Inputs(cap, must, cost, partner, other)

    def lower_bound(self, request: Request, inputs: Inputs) -> int:
        """No worst level under this is feasible."""
        cap, must, cost = inputs.cap, inputs.must, inputs.cost
        classes = self.kinds[request.kind].classes
        if coverage_mode(request):
            # Every partner needs a candidate within the threshold.
            bits, node_level = self.shape.path_bits, self.shape.node_level
            holding = 0
            for c in classes:
                if cap[c]:
                    holding |= bits[c]
            bound = 0
            for q, pending in enumerate(inputs.partner):
                if pending and bits[q] & holding:
                    bound = max(bound, node_level[(bits[q] & holding).bit_length() - 1])
            return bound
        bound = 0
        have = [0] * 6
        for c in classes:
            if cap[c]:
                have[cost[c]] += cap[c]
                if must[c] and cost[c] > bound:
                    bound = cost[c]
        count = 0
        for level, more in enumerate(have):
            count += more
            if count >= request.size:
                return max(bound, level)
        return 5  # pragma: no cover - validate() guarantees capacity

    def native(self, kind: DeviceKind) -> _foldc.Tables | None:
        """The compiled fold's copy of `kind`'s tables, or None where it was
        not built or a fold's values could pass 128 bits."""
        if _foldc is None:
            return None
        t, tables, w = self.topology, self.kinds[kind], self.weights
        # A fold's value is a sum of at most this many terms, each a table
        # entry, the infinity or a partner count times a level's unit; the
        # infinity is larger than any of the others (the weights' bounds
        # cover every component), so it bounds each term's factor.
        terms = 2 * len(t.classes) + 4 * len(t.nodes) + 4
        if (w.inf * (len(t.kind) + 1) * terms).bit_length() > NATIVE_BITS:
            return None
        # Every finishing row a fold can ask for, built here by the one
        # function that composes them (the compiled fold only adds them).
        finish = [
            None if rooms is None else [self.finish_row(tables, node, r) for r in range(len(rooms))]
            for node, rooms in enumerate(tables.finish)
        ]
        return _foldc.Tables(
            len(t.nodes),
            [(n.node, n.level, n.children, n.mine, n.others) for n in tables.walk],
            [values or None for values in tables.class_values],
            finish,
            w.inf,
        )
