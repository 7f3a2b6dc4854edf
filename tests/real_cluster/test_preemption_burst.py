"""Preemptors back to back through the real kube-scheduler, the chart's
profile and the extender's preempt verb, on a nearly full cluster of real
daemons whose kubelet stand-ins end evicted pods within milliseconds.

The scheduler evicts the victims the extender chose, nominates the node and
retries the preemptor as soon as its own cache sees them end. The
extender's watches trail the scheduler's (here by LAG, through a proxy),
so it must count those victims as gone for the preemptor and the devices
it planned as taken for other pods; otherwise it fails the preemptor's own
nominated node and the scheduler preempts a second time.

Judged by a reference written here, from the pods each preemptor evicted
(the scheduler's Preempted events name the preemptor): each preemptor gets
the best level any eviction of the pods left gives, and evicts exactly the
fewest of them that reach the level it got (every subset of its node's
low-priority pods tried); and the preempt verb is called once per
preemptor.

Two rounds of one preemptor per node, all of a round created at once; the
second round starts once the records show the first. The victims have the
default termination grace, as workloads do: the stand-ins end them at once,
but the scheduler sees them terminating first, as with a real kubelet."""

from __future__ import annotations

import contextlib
import itertools
import operator
import random
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest

from devplugin.policy.topology import Topology
from devplugin.testing.churn import free_now
from devplugin.testing.controlplane import ApiFailure, ControlPlane
from devplugin.testing.scheduler import call_extender, pending_pod
from tests.real_cluster.cluster_support import (
    SCHEDULER_NAME,
    chart_nodes,
    preempt_answers,
    verb_calls,
)
from tests.real_cluster.levels import best_level, level_of
from tests.real_cluster.nodes import GPU, HCA, eventually
from tests.real_cluster.stand_ins import Admitted

pytestmark = pytest.mark.cluster

# What fills the nodes (priority 100) and what preempts (priority 1000):
# per node, the first round's preemptor and the second's.
FILL_SHAPES = [(1, 0), (0, 1), (2, 0), (0, 2), (1, 1), (2, 1), (1, 2), (3, 1)]
PREEMPTORS = [((2, 2), (2, 1)), ((4, 2), (1, 2)), ((2, 1), (2, 2)), ((1, 2), (3, 1))]
LOW, HIGH = 100, 1000
PROBE = 500
# How late the extender's watches hear what the scheduler's hear (a busy
# extender's pod watch over a cluster's pods trails by this much and more).
LAG = 0.5


def _pod(name: str, node: str, shape: tuple[int, int], priority: str, *, bind: bool) -> Any:
    gpus, hcas = shape
    limits = {k: str(v) for k, v in ((GPU, gpus), (HCA, hcas)) if v}
    container = {"name": "main", "image": "tier/none",
                 "resources": {"limits": limits, "requests": limits}}  # fmt: skip
    spec: dict[str, Any] = {"schedulerName": SCHEDULER_NAME, "priorityClassName": priority,
                            "containers": [container]}  # fmt: skip
    if bind:
        spec["nodeName"] = node  # placed by hand: only the preemptors meet the scheduler
    else:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default"}, "spec": spec}  # fmt: skip


# -- the reference ---------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    preemptor: str
    shape: tuple[int, int]
    victims: frozenset[str]
    got: Admitted


def judge_order(
    topology: Topology,
    lows: dict[str, Admitted],
    free: tuple[frozenset[str], frozenset[str]],
    steps: Sequence[Step],
) -> list[str]:
    """What is wrong with the node's preemptions taken in this order ([]:
    nothing): each preemptor's level must be the best any eviction of the
    pods left gives, its victims the fewest reaching its level."""
    wrong: list[str] = []
    left = dict(lows)
    free_g, free_h = free
    for step in steps:
        if not step.victims <= set(left):
            return [f"{step.preemptor} evicted pods that were gone already: {sorted(step.victims)}"]
        freed_g = free_g | frozenset().union(*(left[v].gpus for v in step.victims))
        freed_h = free_h | frozenset().union(*(left[v].hcas for v in step.victims))
        if not (step.got.gpus <= freed_g and step.got.hcas <= freed_h):
            return [f"{step.preemptor} holds devices its evictions did not free"]
        got = level_of(topology, step.got)
        reach: dict[int, int] = {}  # level -> fewest victims reaching it
        for size in range(len(left) + 1):
            for chosen in itertools.combinations(sorted(left), size):
                g = free_g | frozenset().union(*(left[c].gpus for c in chosen))
                h = free_h | frozenset().union(*(left[c].hcas for c in chosen))
                level = best_level(topology, g, h, step.shape)
                if level is not None:
                    reach.setdefault(level, size)
        best = min(reach)
        fewest = min(size for level, size in reach.items() if level <= got)
        if got != best:
            wrong.append(f"{step.preemptor} got level {got}; an eviction gives {best}")
        if len(step.victims) != fewest:
            wrong.append(
                f"{step.preemptor} evicted {len(step.victims)} for level {got}; {fewest} reach it"
            )
        for victim in step.victims:
            del left[victim]
        free_g, free_h = freed_g - step.got.gpus, freed_h - step.got.hcas
    return wrong


# -- the cluster -----------------------------------------------------------------


class Burst:
    def __init__(self, plane: ControlPlane, stack: ExitStack) -> None:
        self.plane = plane
        prefix = f"burst{plane.bins.minor[1]}"
        found = chart_nodes(plane, stack, prefix, len(PREEMPTORS), LAG)
        self.nodes, self.kubelets, self.url = found.nodes, found.kubelets, found.url

    def topology(self, node: str) -> Topology:
        return self.nodes[node].daemon.core.coordinator.topology

    def fill(self, node: str, rng: random.Random) -> None:
        """Low-priority pods bound by hand until at most two devices are free."""
        sim = self.nodes[node]
        for index in itertools.count():
            free_g, free_h = len(free_now(sim.kubelet, GPU)), len(free_now(sim.kubelet, HCA))
            if free_g + free_h <= 2:
                return
            fitting = [s for s in FILL_SHAPES if s[0] <= free_g and s[1] <= free_h]
            shape = rng.choice(fitting)
            name = f"{node}-low-{index}"
            self.plane.request(
                "POST",
                "/api/v1/namespaces/default/pods",
                _pod(name, node, shape, "burst-low", bind=True),
            )
            admitted = partial(operator.contains, self.kubelets.admitted, name)
            assert eventually(admitted, timeout=20), self.kubelets.refused.get(name, "no answer")

    def settled(self) -> bool:
        """Every node's record shows exactly the pods its kubelet holds (the
        extender then judges from what the daemons did, not from its own
        guess at where pods just bound went)."""
        items = self.plane.request("GET", "/apis/devplugin.io/v1alpha1/nodedevices")["items"]
        shown = {
            i["metadata"]["name"]: {
                a["pod"] for a in (i.get("status") or {}).get("allocations", [])
            }
            for i in items
        }
        return all(shown.get(node) == set(self.kubelets.held(node)) for node in self.nodes)

    def extender_knows(self, round_: int) -> bool:
        """Whether the extender's view shows every low-priority holder the
        kubelets hold (its watches trail by LAG): asked as a preemptor of
        priority PROBE, too low to claim room from the real preemptors,
        that needs every device of each node but the preemptors' (so every
        low-priority holder must go)."""
        for node, sim in self.nodes.items():
            held = self.kubelets.held(node).values()
            lows = {a.uid for a in held if a.priority == LOW}
            highs = [a for a in held if a.priority != LOW]
            gpus = len(sim.node.gpus) - sum(len(a.gpus) for a in highs)
            hcas = len(sim.node.hcas) - sum(len(a.hcas) for a in highs)
            probe = pending_pod(f"probe-{round_}-{node}", {GPU: gpus, HCA: hcas})
            # Above the earlier rounds' probes, whose answered rooms hold
            # against pods of their priority and below.
            probe["spec"]["priority"] = PROBE + round_
            proposal = {node: {"Pods": [{"UID": uid} for uid in lows], "NumPDBViolations": 0}}
            body = {"Pod": probe, "NodeNameToMetaVictims": proposal}
            told = call_extender(self.url, "preempt", body)["NodeNameToMetaVictims"]
            if {v["UID"] for v in told.get(node, {}).get("Pods", [])} != lows:
                return False
        return True

    def state(self) -> dict[str, tuple[dict[str, Admitted], tuple[frozenset[str], frozenset[str]]]]:
        """Per node: the low-priority pods there, and the free devices."""
        found = {}
        for node, sim in self.nodes.items():
            lows = {n: a for n, a in self.kubelets.held(node).items() if a.priority == LOW}
            free = frozenset(free_now(sim.kubelet, GPU)), frozenset(free_now(sim.kubelet, HCA))
            found[node] = (lows, free)
        return found

    def launch(self, wanted: dict[str, tuple[str, tuple[int, int]]]) -> None:
        """The preemptors created back to back; returns once all run."""
        for name, (node, shape) in wanted.items():
            body = _pod(name, node, shape, "burst-high", bind=False)
            self.plane.request("POST", "/api/v1/namespaces/default/pods", body)
        assert eventually(lambda: set(wanted) <= set(self.kubelets.admitted), timeout=120), (
            self.kubelets.refused,
            {name: self.why(name) for name in set(wanted) - set(self.kubelets.admitted)},
        )

    def why(self, name: str) -> str:
        pod = self.plane.request("GET", f"/api/v1/namespaces/default/pods/{name}")
        conditions = (pod.get("status") or {}).get("conditions") or []
        return "; ".join(str(c.get("message")) for c in conditions)

    def preempted_by(self) -> dict[str, set[str]]:
        """Preemptor uid -> the pods the scheduler evicted for it (its
        Preempted events: `Preempted by pod <uid> on node <node>`)."""
        found: dict[str, set[str]] = {}
        events = self.plane.request("GET", "/api/v1/namespaces/default/events")["items"]
        for event in events:
            words = str(event.get("message") or "").split()
            if event.get("reason") == "Preempted" and words[:3] == ["Preempted", "by", "pod"]:
                found.setdefault(words[3], set()).add(event["involvedObject"]["name"])
        return found

    def judge(
        self,
        before: dict[str, tuple[dict[str, Admitted], tuple[frozenset[str], frozenset[str]]]],
        asked: dict[str, tuple[str, tuple[int, int]]],
    ) -> tuple[list[str], list[str], int]:
        """(what is wrong, what each got, how many evicted) for the
        preemptors `asked` (name -> node, shape) run on the state `before`."""
        victims = self.preempted_by()
        failures: list[str] = []
        report: list[str] = []
        evicting = 0
        for name, (node, shape) in asked.items():
            got = self.kubelets.admitted[name]
            assert got.node == node
            chosen = frozenset(victims.get(got.uid, set()))
            evicting += bool(chosen)
            level = level_of(self.topology(node), got)
            report.append(f"{name} {shape}: {len(chosen)} evicted, level {level}")
            lows, free = before[node]
            failures.extend(
                judge_order(self.topology(node), lows, free, [Step(name, shape, chosen, got)])
            )
        return failures, report, evicting


@pytest.fixture
def burst(installed: ControlPlane) -> Iterator[Burst]:
    plane = installed
    for name, value in (("burst-low", LOW), ("burst-high", HIGH)):
        with contextlib.suppress(ApiFailure):
            plane.request("POST", "/apis/scheduling.k8s.io/v1/priorityclasses", {
                "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                "metadata": {"name": name}, "value": value})  # fmt: skip
    with ExitStack() as stack:
        yield Burst(plane, stack)


@pytest.mark.timeout(600)
def test_preemptors_back_to_back_each_evict_the_fewest_once(burst: Burst) -> None:
    rng = random.Random(11)
    for node in burst.nodes:
        burst.fill(node, rng)
    lines: list[str] = []
    for round_ in (0, 1):
        # The round starts from what the daemons did, as the extender sees it.
        assert eventually(burst.settled, timeout=30), "the records never showed the pods"
        seen = partial(burst.extender_knows, round_)
        assert eventually(seen, timeout=30), "the extender never saw the records"
        before = burst.state()
        calls = verb_calls(burst.url, "preempt")
        victims_told = preempt_answers(burst.url, "victims")
        filters = verb_calls(burst.url, "filter", "ok")
        asked = {
            f"{node}-high-{round_}": (node, shapes[round_])
            for node, shapes in zip(burst.nodes, PREEMPTORS, strict=True)
        }
        burst.launch(asked)
        failures, report, evicting = burst.judge(before, asked)
        calls = verb_calls(burst.url, "preempt") - calls
        lines.append(f"round {round_}: {'; '.join(report)}; preempt calls {calls}")
        assert not failures, "\n".join([*failures, *lines])
        # The extender answered the scheduler's filters and, once per
        # preemptor that evicted, its preempt verb, with victims each time.
        assert verb_calls(burst.url, "filter", "ok") > filters
        assert calls == evicting, lines
        assert preempt_answers(burst.url, "victims") - victims_told == evicting
        if round_ == 0:
            assert evicting == len(burst.nodes)  # each needs more than the two devices free
    print(f"{burst.plane.bins.version}: " + " | ".join(lines))
