"""Preemption at fleet size: one /scheduler/preempt answer over 5,000 nodes.

The extender's preempt verb (extender/preemption.py) over 5,000 64-GPU
nodes (8 HCAs each), every GPU held by a one-GPU pod of priority 0, asked
for an 8-GPU + 4-HCA pod of priority 1000 with all 5,000 nodes proposed
(the scheduler proposes at most max(10% of nodes, 100); this is the worst
any body can ask). Two fleets:

* alike: every node the same (one model, full): one search answers all;
* varied: every node with its own free GPUs and pod priorities, so no two
  searches are shared and the call's deadline decides how many nodes are
  searched; the answer is the best found so far, the metric counts the
  nodes left.

Then the same verb on 1,000 time-sliced nodes (8 GPUs, 4 replicas each,
every replica held; a 4-replica + 2-HCA preemptor) and 1,000 mixed-MIG
nodes (four GPUs cut into four 1g.10gb devices each, four whole; every
device held; a 2 x 1g.10gb + 1-HCA preemptor): victims are counted in
replicas and MIG devices, never in whole GPUs.

Goal: every call answers within 2 s.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from devplugin.extender.answers import ChangeLog
from devplugin.extender.liveness import Record
from devplugin.extender.metrics import ExtenderMetrics
from devplugin.extender.preemption import PreemptVerb
from devplugin.extender.verdicts import Verdicts
from devplugin.extender.victims import candidates
from devplugin.extender.views import Layouts, NodeViews, parse_record
from devplugin.policy.pod_request import shape_of
from devplugin.policy.podinfo import PodInfo, parse_pod
from devplugin.policy.preemption import exhaustive
from devplugin.testing.records import gpu_id, hgx_record

GPU, HCA = "nvidia.com/gpu", "rdma/hca"
NODES, GPUS, HCAS = 5000, 64, 8
GOAL_S = 2.0


@dataclass
class Fleet:
    records: dict[str, Record]
    pods: dict[str, tuple[PodInfo, ...]]


class _Live:
    """What the verb reads of liveness: every record fresh."""

    def __init__(self, records: Mapping[str, Record]) -> None:
        self._records = records

    def fresh(self, until: dict[str, float] | None = None) -> Callable[[str], Record | None]:
        return self._records.get


def _pod(name: str, node: str, requests: dict[str, int], priority: int) -> PodInfo:
    return parse_pod(
        {
            "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
            "spec": {
                "nodeName": node,
                "priority": priority,
                "containers": [
                    {"name": "c", "resources": {"limits": {k: str(v) for k, v in requests.items()}}}
                ],
            },
            "status": {"phase": "Running"},
        }
    )


def fleet(layouts: Layouts, count: int, varied: bool, seed: int = 1) -> Fleet:
    rng = random.Random(seed)
    records: dict[str, Record] = {}
    pods: dict[str, tuple[PodInfo, ...]] = {}
    for n in range(count):
        name = f"node-{n:05d}"
        free = set(rng.sample(range(GPUS), rng.randint(0, 3))) if varied else set()
        held = [
            (f"{name}-p{i}", f"uid-{name}-p{i}", [gpu_id(i)]) for i in range(GPUS) if i not in free
        ]
        raw = hgx_record(name, gpus=GPUS, hcas=HCAS, per_switch=8, held=held)
        records[name] = Record(layouts.want(parse_record(raw)), "1", None)
        pods[name] = tuple(
            _pod(pod, name, {GPU: 1}, rng.choice([0, 100, 200]) if varied else 0)
            for pod, _, _ in held
        )
    return Fleet(records, pods)


MIG = "nvidia.com/mig-1g.10gb"
KINDS_NODES = 1000


def _shared(
    name: str, gpus: int = 8, replicas: int = 4
) -> tuple[dict[str, Any], list[tuple[str, dict[str, int]]]]:
    """A node time-sliced `replicas` ways, every replica held by a pod."""
    held = [
        (f"{name}-r{i}-{k}", f"uid-{name}-r{i}-{k}", [gpu_id(i)])
        for i in range(gpus)
        for k in range(replicas)
    ]
    raw = hgx_record(name, gpus=gpus, hcas=gpus, held=held)
    for entry in raw["status"]["devices"]:
        if entry["kind"] == "gpu":
            entry.update(resource=GPU, replicas=replicas)
    return raw, [(pod, {GPU: 1}) for pod, _, _ in held]


def _mig(
    name: str, gpus: int = 8, cut: int = 4, slices: int = 4
) -> tuple[dict[str, Any], list[tuple[str, dict[str, int]]]]:
    """A node whose first `cut` GPUs are cut into `slices` 1g.10gb MIG
    devices each, every device (MIG or whole) held by a pod."""
    raw = hgx_record(name, gpus=gpus, hcas=gpus)
    parents = {gpu_id(i) for i in range(cut)}
    devices: list[dict[str, Any]] = []
    for entry in raw["status"]["devices"]:
        if entry["kind"] == "gpu" and entry["id"] in parents:
            slice_ = {"parentUUID": entry["id"], "profile": "1g.10gb"}
            devices.extend(
                {
                    **entry,
                    "id": f"MIG-{entry['id']}-{k}",
                    "nvlinkPeers": [],
                    "resource": MIG,
                    "mig": slice_,
                }
                for k in range(slices)
            )
            continue
        if entry["kind"] == "gpu":
            entry["resource"] = GPU
            entry["nvlinkPeers"] = [p for p in entry["nvlinkPeers"] if p["id"] not in parents]
        devices.append(entry)
    raw["status"]["devices"] = devices
    pods: list[tuple[str, dict[str, int]]] = []
    allocations = []
    for index, entry in enumerate(devices):
        if entry["kind"] != "gpu":
            continue
        pod = f"{name}-d{index}"
        allocations.append({
            "namespace": "default", "pod": pod, "container": "c", "devices": [entry["id"]],
            "worstLevel": "", "podUID": f"uid-{pod}",
        })  # fmt: skip
        pods.append((pod, {MIG if "mig" in entry else GPU: 1}))
    raw["status"]["allocations"] = allocations
    return raw, pods


def exact_on_kinds() -> bool:
    """On a small time-sliced node and a small MIG node (few enough pods
    for every subset to be tried), the verb's victims against the
    reference: the best level eviction gives, with the fewest victims."""
    met = True
    cases = [
        ("shared", _shared("s", gpus=4, replicas=2), {GPU: 3, HCA: 2}),
        ("mig", _mig("m", gpus=4, cut=2, slices=2), {MIG: 3, HCA: 1}),
        ("mig-whole", _mig("w", gpus=4, cut=2, slices=2), {GPU: 2, HCA: 2}),
    ]
    for label, (raw, held), wanted in cases:
        layouts = Layouts()
        record = Record(layouts.want(parse_record(raw)), "1", None)
        name = record.parsed.name
        pods = tuple(_pod(pod, name, requests, 0) for pod, requests in held)
        built = Fleet({name: record}, {name: pods})
        verb = _verb(layouts, built, ExtenderMetrics())
        chosen = verb.preempt(_args(built, wanted))["NodeNameToMetaVictims"]
        view = verb.views.state(record.parsed, record)
        assert view is not None
        found, _ = candidates(view[0], pods, 1000, ())
        shape = shape_of(_pod("urgent", "", wanted, 1000), GPU, HCA)
        reference = exhaustive(view[0], shape, view[1], found)
        got = len(chosen[name]["Pods"]) if name in chosen else None
        ok = reference is not None and got == reference[1]
        met &= ok
        print(
            f"  {label:<10} {len(found):>3} pods: reference {reference[1] if reference else '-'} "
            f"victims at level {reference[0] if reference else '-'}, the verb {got}"
            + ("" if ok else "  <- differs")
        )
    return met


def kinds_fleet(layouts: Layouts, count: int, kind: str) -> Fleet:
    records: dict[str, Record] = {}
    pods: dict[str, tuple[PodInfo, ...]] = {}
    for n in range(count):
        name = f"{kind}-{n:05d}"
        raw, held = (_shared if kind == "shared" else _mig)(name)
        records[name] = Record(layouts.want(parse_record(raw)), "1", None)
        pods[name] = tuple(_pod(pod, name, requests, 0) for pod, requests in held)
    return Fleet(records, pods)


def _verb(layouts: Layouts, fleet: Fleet, metrics: ExtenderMetrics) -> PreemptVerb:
    views = NodeViews(
        layouts,
        on_node=lambda node: fleet.pods.get(node, ()),
        generation=lambda node: 0,
        has_ended=lambda node, uid, namespace, name: False,
        gpu=GPU,
        hca=HCA,
    )
    live = _Live(fleet.records)

    def on_node(node: str) -> tuple[PodInfo, ...]:
        return fleet.pods.get(node, ())

    verdicts = Verdicts(
        views,
        live,  # type: ignore[arg-type]
        on_node,
        lambda uid: None,
        ChangeLog(),
        names=(GPU, HCA),
    )
    return PreemptVerb(
        verdicts,
        live,  # type: ignore[arg-type]
        on_node,
        None,
        metrics,
        names=(GPU, HCA),
    )


def _args(fleet: Fleet, requests: dict[str, int]) -> dict[str, Any]:
    preemptor = {
        "metadata": {"name": "urgent", "namespace": "default", "uid": "uid-urgent"},
        "spec": {"priority": 1000, "containers": [
            {"name": "c", "resources": {"limits": {k: str(v) for k, v in requests.items()}}}]},
    }  # fmt: skip
    proposed = {
        node: {"Pods": [{"UID": p.uid} for p in pods], "NumPDBViolations": 0}
        for node, pods in fleet.pods.items()
    }
    return {"Pod": preemptor, "NodeNameToMetaVictims": proposed}


def _left(metrics: ExtenderMetrics, why: str) -> float:
    value = metrics.registry.get_sample_value(
        "devplugin_extender_preempt_unproven_total", {"why": why}
    )
    return value or 0.0


def _call(name: str, count: int) -> tuple[bool, str]:
    layouts = Layouts()
    if name in ("alike", "varied"):
        built = fleet(layouts, count, name == "varied")
        wanted = {GPU: 8, HCA: 4}
    else:
        built = kinds_fleet(layouts, count, name)
        wanted = {GPU: 4, HCA: 2} if name == "shared" else {MIG: 2, HCA: 1}
    metrics = ExtenderMetrics()
    verb = _verb(layouts, built, metrics)
    args = _args(built, wanted)
    # As the serving extender does every 10 s (cli.py refreeze_heap): what
    # survived is frozen, so the cycle collector does not walk the caches.
    gc.collect()
    gc.freeze()
    try:
        started = time.perf_counter()
        answer = verb.preempt(args)
        took = time.perf_counter() - started
    finally:
        gc.unfreeze()
    chosen = answer["NodeNameToMetaVictims"]
    victims = {len(v["Pods"]) for v in chosen.values()}
    left = _left(metrics, "deadline")
    budget = _left(metrics, "budget")
    line = (
        f"{name:<8} {count:>6} {took:>7.2f}s {len(chosen):>7} {sorted(victims)!s:>8} "
        f"{left:>9.0f} {budget:>8.0f}"
    )
    return took < GOAL_S and bool(chosen), line


def preempt_scale_bench(quick: bool = False) -> bool:
    count = 20 if quick else NODES
    print(f"Preempt at fleet size: {GPUS}-GPU nodes full of one-GPU pods, an 8 GPU + 4 HCA")
    print("preemptor, every node proposed (one call, in process)")
    print(
        f"{'fleet':<8} {'nodes':>6} {'answer':>8} {'chosen':>7} {'victims':>8} "
        f"{'unsearched':>9} {'unproven':>8}"
    )
    met = True
    for name in ("alike", "varied", "shared", "mig"):
        ok, line = _call(name, count if name in ("alike", "varied") else min(count, KINDS_NODES))
        met &= ok
        print(line)
    print("Exact on small shared and MIG nodes (every subset tried as the reference):")
    met &= exact_on_kinds()
    print(
        f"== preempt at {count:,} nodes answers within {GOAL_S:.0f} s, exact on shared and MIG "
        "nodes: " + ("met" if met else "NOT met")
    )
    return met
