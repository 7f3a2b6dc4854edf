"""Cluster placement: the default scheduler's choice of node against the extender's.

A cluster of mixed nodes (HGX-like, PCIe servers with two NICs, asymmetric
ones), each described by the NodeDevices record its daemon would write,
receives a seeded stream of single-container pods of mixed shapes that
arrive and leave. The same stream (a departure of a pod one placer could
not place is a no-op for it) is placed twice:

* default: among the nodes that fit by counts, the least allocated (the
  NodeResourcesFit LeastAllocated score over GPUs and HCAs), ties at random;
* extender: the extender's own decision functions (filter, then the rank
  score), as `devplugin extender` answers the kube-scheduler.

Either way the node's daemon then chooses the devices (the same exact
allocator the daemon runs, pod-aware). Records are always fresh here, so
the extender never sees a stale one (counted anyway).
"""

from __future__ import annotations

import random
import statistics
import tempfile
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from devplugin.cluster.record import Registration, build_status
from devplugin.model import DeviceKind, Health, PluginDevice
from devplugin.node.deadline import Deadlines
from devplugin.node.discovery import Discoverer, NvmlGpuSource, Roots
from devplugin.node.resources import ResourceState
from devplugin.policy.allocator import Allocator
from devplugin.policy.node_record import node_from_record
from devplugin.policy.node_state import NodeState, Outcome
from devplugin.policy.placement import place, scores
from devplugin.policy.pod_request import Shape
from devplugin.policy.topology import Level
from devplugin.testing.fake_nvml import FakeNvml
from devplugin.testing.layouts import LAYOUTS
from devplugin.testing.node import build_node

# (layout, how many) for the 16-node cluster.
MIX = [("hgx-h100", 6), ("pcie-server", 6), ("asymmetric", 4)]
SHAPES = [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4), (8, 8), (8, 4), (1, 0), (3, 1)]
WEIGHTS = [6, 5, 4, 3, 3, 2, 1, 2, 2]


@dataclass
class Tally:
    containers: int = 0  # GPU+HCA containers placed
    ideal: int = 0  # at the best level any node of the cluster gives that shape empty
    best_free: int = 0  # at the best level free anywhere in the cluster at that moment
    pix: int = 0
    unschedulable: int = 0  # no node fits, although the cluster had the devices by count
    big_arrived: int = 0  # 8-GPU pods
    big_placed: int = 0
    stale: int = 0
    levels: Counter[str] = field(default_factory=Counter)

    def share(self, part: int) -> float:
        return part / self.containers if self.containers else 1.0


def node_records(
    base: Path, mix: list[tuple[str, int]] | None = None
) -> list[tuple[str, NodeState]]:
    found: list[tuple[str, NodeState]] = []
    for layout, count in mix or MIX:
        built = build_node(LAYOUTS[layout](), base / layout)
        deadlines = Deadlines(5)
        source = NvmlGpuSource(FakeNvml.from_file(built.fixture), deadlines)
        discoverer = Discoverer(Roots(built.sysfs_root, built.dev_root), source, deadlines)
        try:
            inventory = discoverer.scan(full=True)
        finally:
            discoverer.close()
        states = {
            DeviceKind.GPU: ResourceState(
                tuple(PluginDevice(g.uuid, Health.HEALTHY) for g in inventory.gpus), {}
            ),
            DeviceKind.HCA: ResourceState(
                tuple(PluginDevice(h.device_id, Health.HEALTHY) for h in inventory.hcas), {}
            ),
        }
        status = build_status(inventory, states, [], Registration(True, "registered"))
        for index in range(count):
            name = f"{layout}-{index}"
            record = {"metadata": {"name": name}, "status": status}
            found.append((layout, replace(node_from_record(record), name=name)))
    return found


# ("arrive", pod id, (GPUs, HCAs)) or ("leave", pod id, (0, 0))
Event = tuple[str, int, tuple[int, int]]


def stream(seed: int, events: int) -> list[Event]:
    """The same arrivals and departures for both placers (a departure of a pod
    that could not be placed is a no-op)."""
    rng = random.Random(seed)
    found: list[Event] = []
    present: list[int] = []
    for pod in range(events):
        if present and rng.random() < 0.45:
            found.append(("leave", present.pop(rng.randrange(len(present))), (0, 0)))
        else:
            found.append(("arrive", pod, rng.choices(SHAPES, WEIGHTS)[0]))
            present.append(pod)
    return found


def run(seed: int, nodes: list[tuple[str, NodeState]], *, extender: bool, events: int) -> Tally:
    pick = random.Random(seed + 1000)  # the default scheduler's tie-break
    allocators = {node.name: Allocator(node.topology) for _, node in nodes}
    state = {node.name: node for _, node in nodes}
    empty: dict[str, NodeState] = dict(state)
    ideal_cache: dict[tuple[int, int], Level | None] = {}
    live: dict[int, tuple[str, frozenset[str]]] = {}
    tally = Tally()
    for what, pod, (gpus, hcas) in stream(seed, events):
        if what == "leave":
            if pod not in live:
                continue
            name, devices = live.pop(pod)
            node = state[name]
            free = {kind: node.free[kind] | (devices & node.topology.id_set(kind))
                    for kind in DeviceKind}  # fmt: skip
            state[name] = replace(node, free=free)
            continue
        shape = Shape(((gpus, hcas),), gpus, hcas)
        big = gpus == 8
        tally.big_arrived += big
        outcomes: dict[str, Outcome] = {}
        for name, node in state.items():
            outcome = place(node, shape, allocators[name])
            if outcome.fits:
                outcomes[name] = outcome
        if not outcomes:
            free_g = sum(len(n.free[DeviceKind.GPU]) for n in state.values())
            free_h = sum(len(n.free[DeviceKind.HCA]) for n in state.values())
            tally.unschedulable += free_g >= gpus and free_h >= hcas
            continue
        if extender:
            ranked = scores(dict(outcomes))
            top = max(ranked.values())
            chosen = min(name for name, score in ranked.items() if score == top)
        else:
            room = {name: least_allocated(state[name], gpus, hcas) for name in outcomes}
            best_score = max(room.values())
            tied = sorted(n for n in outcomes if room[n] == best_score)
            chosen = pick.choice(tied)
        outcome = outcomes[chosen]
        assert outcome.free_after is not None
        node = state[chosen]
        taken = outcome.taken(node.free)
        state[chosen] = replace(node, free=outcome.free_after)
        live[pod] = (chosen, taken)
        tally.big_placed += big
        if gpus and hcas and outcome.worst is not None:
            tally.containers += 1
            tally.levels[outcome.worst.name] += 1
            best_now = min(o.worst for o in outcomes.values() if o.worst is not None)
            if (gpus, hcas) not in ideal_cache:
                found = [place(n, shape, allocators[k]) for k, n in empty.items()]
                levels = [o.worst for o in found if o.fits and o.worst is not None]
                ideal_cache[(gpus, hcas)] = min(levels) if levels else None
            tally.ideal += outcome.worst == ideal_cache[(gpus, hcas)]
            tally.best_free += outcome.worst == best_now
            tally.pix += outcome.worst is Level.PIX
    return tally


def least_allocated(node: NodeState, gpus: int, hcas: int) -> float:
    """The default scheduler's NodeResourcesFit LeastAllocated score over
    the two extended resources: the mean free fraction after the pod."""
    parts = []
    for kind, want in ((DeviceKind.GPU, gpus), (DeviceKind.HCA, hcas)):
        total = node.total[kind]
        if total:
            parts.append((len(node.free[kind]) - want) / total)
    return statistics.mean(parts) if parts else 0.0


def cluster_bench(seeds: int = 3, events: int = 300) -> bool:
    """Print the comparison; True when the extender meets its goals on every seed."""
    with tempfile.TemporaryDirectory(prefix="dpcl-") as base:
        nodes = node_records(Path(base))
    print(
        f"Cluster placement: {len(nodes)} nodes "
        f"({', '.join(f'{count} {layout}' for layout, count in MIX)}), "
        f"{events} events per seed (arrivals and departures), single-container pods"
    )
    print(
        f"{'seed':>4} {'placer':9} {'GPU+HCA':>7} {'ideal':>7} {'best-free':>9} {'PIX':>7} "
        f"{'unsched':>7} {'8-GPU':>7} {'stale':>5}"
    )
    ok = True
    for seed in range(seeds):
        default = run(seed, nodes, extender=False, events=events)
        ours = run(seed, nodes, extender=True, events=events)
        for label, tally in (("default", default), ("extender", ours)):
            print(
                f"{seed:>4} {label:9} {tally.containers:>7} {tally.share(tally.ideal):>7.1%} "
                f"{tally.share(tally.best_free):>9.1%} {tally.share(tally.pix):>7.1%} "
                f"{tally.unschedulable:>7} {tally.big_placed:>3}/{tally.big_arrived:<3} "
                f"{tally.stale:>5}"
            )
        ok &= ours.best_free + ours.stale == ours.containers
        ok &= ours.share(ours.ideal) > default.share(default.ideal)
    print(
        "== cluster: extender gives the best level free anywhere to every GPU+HCA container "
        f"and a higher ideal share than the default on every seed: {'met' if ok else 'MISSED'}"
    )
    return ok
