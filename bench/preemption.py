"""Preemption: the scheduler's count-only victims against the extender's.

The live cluster's four layouts (HGX-like, DGX-A100-like, a PCIe server
with two NICs, an asymmetric node), two of each, are filled with
low-priority pods of mixed shapes (priorities 0, 100 and 200), each on the
devices its daemon picks, until nothing more fits. Then a stream of
priority-1000 pods (8+8, 4+4, 4+2, 2+2, 1+1) arrives, each needing
preemption. The same fill and stream run twice, each run keeping its own
cluster as its choices leave it:

* count-only: kube-scheduler's default preemption alone
  (defaultpreemption/default_preemption.go SelectVictimsOnNode: every
  lower-priority pod removed, the pod checked to fit by counts, then the
  others given back highest priority first while it still fits; the node
  chosen by preemption.go pickOneNodeForPreemption: lowest highest-victim
  priority, lowest sum, fewest victims, then the first node);
* extender: the same scheduler with the extender's verb, which it asks
  only about its candidates, the nodes where its count-only dry run found
  victims (a node where the pod fits by counts has every victim reprieved
  and is never sent, as the cluster tier shows with the real scheduler):
  on each the victims policy/preemption.py chooses, only nodes at the best
  level with the fewest victims kept (extender/victims.py), then the
  scheduler's same pick among them.

The victims end, and the preemptor's daemon places it on what is free.
For each preemptor, the reference tries every subset of the lower-priority
pods of every node in the scheduler's candidate set: the best level
eviction can give there, and the fewest victims that reach it. Goal: through the extender, 100% of
preemptors at that level with that many victims.
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from bench.cluster import node_records
from bench.preempt_scale import preempt_scale_bench
from devplugin.model import DeviceKind
from devplugin.policy.allocator import Allocator
from devplugin.policy.node_state import NodeState
from devplugin.policy.placement import place
from devplugin.policy.pod_request import Shape
from devplugin.policy.preemption import Candidate, Eviction, choose_victims, exhaustive, freed

LAYOUTS = ["hgx-h100", "dgx-a100", "pcie-server", "asymmetric"]
PER_LAYOUT = 2
FILL_SHAPES = [(1, 1), (2, 1), (2, 2), (4, 2), (1, 0), (4, 4), (3, 1)]
PREEMPTORS = [(8, 8), (4, 4), (4, 2), (2, 2), (1, 1)]
PRIORITIES = [0, 100, 200]
URGENT = 1000
ROUNDS = 4  # the five preemptor shapes, this many times
SEEDS = [1, 2, 3]


@dataclass
class Node:
    state: NodeState
    allocator: Allocator
    pods: list[Candidate]


@dataclass
class Tally:
    preemptors: int = 0
    best_level: int = 0  # at the best level eviction could give anywhere
    fewest: int = 0  # ... and with the fewest victims for it
    victims: int = 0
    unplaced: int = 0

    def share(self, part: int) -> float:
        return part / self.preemptors if self.preemptors else 1.0


def _shape(gpus: int, hcas: int) -> Shape:
    return Shape(((gpus, hcas),), gpus, hcas)


def _take(node: Node, shape: Shape, uid: str, priority: int) -> bool:
    """The daemon places the pod on what is free; False if it does not fit."""
    outcome = place(node.state, shape, node.allocator)
    if not outcome.fits or outcome.free_after is None:
        return False
    taken = outcome.taken(node.state.free)
    node.state = replace(node.state, free=outcome.free_after)
    node.pods.append(Candidate(uid, priority, taken))
    return True


def _evict(node: Node, victims: tuple[Candidate, ...]) -> None:
    node.state = freed(node.state, victims)
    gone = {v.uid for v in victims}
    node.pods = [p for p in node.pods if p.uid not in gone]


def cluster(base: Path, seed: int) -> dict[str, Node]:
    """Two nodes of each layout, filled with low-priority pods."""
    rng = random.Random(seed)
    nodes: dict[str, Node] = {}
    for _, state in node_records(base, [(layout, PER_LAYOUT) for layout in LAYOUTS]):
        nodes[state.name] = Node(state, Allocator(state.topology), [])
    misses = 0
    count = 0
    while misses < 40:
        gpus, hcas = rng.choice(FILL_SHAPES)
        node = nodes[rng.choice(sorted(nodes))]
        if _take(node, _shape(gpus, hcas), f"low-{count}", rng.choice(PRIORITIES)):
            count += 1
            misses = 0
        else:
            misses += 1
    return nodes


def _lower(node: Node) -> list[Candidate]:
    return [p for p in node.pods if p.priority < URGENT]


def count_only(node: Node, shape: Shape) -> tuple[Candidate, ...] | None:
    """SelectVictimsOnNode by counts: all lower pods out, then back highest
    priority first while the pod still fits by counts."""
    lower = _lower(node)
    topology = node.state.topology
    free_g = len(node.state.free[DeviceKind.GPU])
    free_h = len(node.state.free[DeviceKind.HCA])

    def counts(pods: list[Candidate]) -> tuple[int, int]:
        held = frozenset().union(*(p.devices for p in pods)) if pods else frozenset()
        gpus = len(held & topology.id_set(DeviceKind.GPU))
        return gpus, len(held) - gpus

    gpus, hcas = counts(lower)
    if free_g + gpus < shape.gpus or free_h + hcas < shape.hcas:
        return None
    victims: list[Candidate] = []
    kept_g, kept_h = 0, 0
    for pod in sorted(lower, key=lambda p: -p.priority):
        g, h = counts([pod])
        if free_g + gpus - kept_g - g >= shape.gpus and free_h + hcas - kept_h - h >= shape.hcas:
            kept_g, kept_h = kept_g + g, kept_h + h  # reprieved
        else:
            victims.append(pod)
    return tuple(sorted(victims, key=lambda p: -p.priority)) if victims else None


def pick(candidates: dict[str, tuple[Candidate, ...]]) -> str:
    """pickOneNodeForPreemption without PDBs or start times: lowest highest
    victim priority, lowest sum, fewest victims, the first node."""
    return min(
        sorted(candidates),
        key=lambda n: (
            max(v.priority for v in candidates[n]),
            sum(v.priority for v in candidates[n]),
            len(candidates[n]),
        ),
    )


def extender_victims(nodes: dict[str, Node], shape: Shape) -> dict[str, tuple[Candidate, ...]]:
    """The verb's answer over the nodes the scheduler sends it: its
    count-only candidates only."""
    found: dict[str, Eviction] = {}
    for name in candidates(nodes, shape):
        node = nodes[name]
        eviction = choose_victims(node.state, shape, node.allocator, _lower(node))
        if eviction is not None and eviction.victims:
            found[name] = eviction
    if not found:
        return {}
    best = min((_level(e), len(e.victims)) for e in found.values())
    return {n: e.victims for n, e in found.items() if (_level(e), len(e.victims)) == best}


def _level(eviction: Eviction) -> int:
    return int(eviction.level) if eviction.level is not None else 0


def run(
    nodes: dict[str, Node],
    victims_of: Callable[[dict[str, Node], Shape], dict[str, tuple[Candidate, ...]]],
) -> Tally:
    tally = Tally()
    for index in range(ROUNDS * len(PREEMPTORS)):
        gpus, hcas = PREEMPTORS[index % len(PREEMPTORS)]
        shape = _shape(gpus, hcas)
        # The scheduler preempts only on its count-only candidates.
        reference = {
            name: exhaustive(nodes[name].state, shape, nodes[name].allocator, _lower(nodes[name]))
            for name in candidates(nodes, shape)
        }
        reachable = [r for r in reference.values() if r is not None]
        if not reachable or any(r[1] == 0 for r in reachable):
            continue  # no eviction helps, or none is needed: not a preemption
        level = min(r[0] for r in reachable)
        fewest = min(r[1] for r in reachable if r[0] == level)
        tally.preemptors += 1
        proposed = victims_of(nodes, shape)
        if not proposed:
            tally.unplaced += 1
            continue
        chosen = pick(proposed)
        node = nodes[chosen]
        _evict(node, proposed[chosen])
        outcome = place(node.state, shape, node.allocator)
        got = int(outcome.worst) if outcome.worst is not None else 0
        if not _take(node, shape, f"urgent-{index}", URGENT):
            tally.unplaced += 1
            continue
        tally.victims += len(proposed[chosen])
        if got == level:
            tally.best_level += 1
            tally.fewest += len(proposed[chosen]) == fewest
    return tally


def candidates(nodes: dict[str, Node], shape: Shape) -> list[str]:
    """The nodes kube-scheduler's dry run keeps (preemption.go
    DryRunPreemption): those where the pod does not fit as the node is and
    the count-only selection leaves at least one victim."""
    return sorted(_count_only_all(nodes, shape))


def _count_only_all(nodes: dict[str, Node], shape: Shape) -> dict[str, tuple[Candidate, ...]]:
    found: dict[str, tuple[Candidate, ...]] = {}
    for name, node in nodes.items():
        if place(node.state, shape, node.allocator).fits:
            continue  # the pod fits there: nothing to preempt (not filled enough)
        victims = count_only(node, shape)
        if victims:
            found[name] = victims
    return found


def preemption_bench(quick: bool = False) -> bool:
    seeds = SEEDS[:1] if quick else SEEDS
    print(
        f"Preemption: {len(LAYOUTS) * PER_LAYOUT} nodes ({', '.join(LAYOUTS)}, {PER_LAYOUT} each) "
        f"filled with pods of priority {'/'.join(map(str, PRIORITIES))}, then "
        f"{ROUNDS * len(PREEMPTORS)} priority-{URGENT} pods "
        f"({', '.join(f'{g}+{h}' for g, h in PREEMPTORS)}) per seed"
    )
    columns = ("preemptors", "best level", "and fewest")
    header = " ".join(f"{c:>10}" for c in columns)
    print(f"{'seed':>4} {'victims by':<11} {header} {'victims':>8} {'unplaced':>8}")
    totals = {"count-only": Tally(), "extender": Tally()}
    with tempfile.TemporaryDirectory(prefix="dppre-") as scratch:
        for seed in seeds:
            for label, victims_of in (
                ("count-only", _count_only_all),
                ("extender", extender_victims),
            ):
                tally = run(cluster(Path(scratch) / f"{seed}-{label}", seed), victims_of)
                total = totals[label]
                for part in ("preemptors", "best_level", "fewest", "victims", "unplaced"):
                    setattr(total, part, getattr(total, part) + getattr(tally, part))
                print(
                    f"{seed:>4} {label:<11} {tally.preemptors:>10} "
                    f"{tally.share(tally.best_level):>10.1%} {tally.share(tally.fewest):>10.1%} "
                    f"{tally.victims:>8} {tally.unplaced:>8}"
                )
    ours = totals["extender"]
    met = ours.preemptors > 0 and ours.fewest == ours.preemptors
    print(
        f"== preemption: through the extender {ours.share(ours.fewest):.1%} of preemptors at the "
        f"best level eviction gives anywhere with the fewest victims (goal 100%), count-only "
        f"{totals['count-only'].share(totals['count-only'].fewest):.1%}: "
        + ("met" if met else "NOT met")
    )
    met &= preempt_scale_bench(quick=quick)
    return met or quick


if __name__ == "__main__":
    import sys

    sys.exit(0 if preemption_bench("--quick" in sys.argv) else 1)
