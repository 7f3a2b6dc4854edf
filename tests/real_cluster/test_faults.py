"""Faults of the control plane with the daemons, the extender and the real
kube-scheduler running: the API server restarted (etcd compacted while it
was down, so no watch can resume where it was: every one must list again)
and the scheduler restarted with pods pending.

After the API server comes back: the extender is ready again, every watch
cache of the extender and of the daemons has listed again, no record lost
anything (what a daemon learnt while the API server was away, a GPU's XID,
is in its record), and changes flow through every watch (a deleted pod's
devices are placed again; a pod the XID leaves no room for stays pending
with the extender's reason).

After the scheduler comes back: the pods created while it was away are all
placed through the extender, one after another at the best level free
anywhere when its turn came (a reference written here, from the devices the
earlier ones got, in the order the scheduler placed them)."""

from __future__ import annotations

import operator
from collections.abc import Iterator
from contextlib import ExitStack
from functools import partial
from typing import Any

import pytest

from devplugin.testing.churn import free_now
from devplugin.testing.controlplane import ControlPlane
from devplugin.testing.extender_proc import ready
from devplugin.testing.promtext import samples
from devplugin.testing.scheduler import call_extender, pending_pod
from tests.real_cluster.cluster_support import (
    SCHEDULER_NAME,
    chart_nodes,
    extender_metrics,
    verb_calls,
)
from tests.real_cluster.levels import best_level, level_of
from tests.real_cluster.nodes import GPU, HCA, delete_pod, eventually

pytestmark = pytest.mark.cluster

XID_FATAL = 79  # fallen off the bus: the GPU is taken out of service
# How late the extender's watches hear what the scheduler's hear, where a
# test says so (a busy extender's pod watch over a cluster's pods).
LAG = 0.5


def _pod(name: str, shape: tuple[int, int], node: str | None = None, bind: bool = False) -> Any:
    gpus, hcas = shape
    limits = {GPU: str(gpus), HCA: str(hcas)}
    container = {"name": "main", "image": "tier/none",
                 "resources": {"limits": limits, "requests": limits}}  # fmt: skip
    spec: dict[str, Any] = {"schedulerName": SCHEDULER_NAME, "containers": [container]}
    if node is not None and bind:
        spec["nodeName"] = node
    elif node is not None:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default"}, "spec": spec}  # fmt: skip


class Faults:
    """Two HGX nodes with their daemons and kubelet stand-ins, the extender
    as the chart runs it, and the real scheduler with the chart's profile."""

    def __init__(self, plane: ControlPlane, stack: ExitStack, prefix: str, lag: float) -> None:
        self.plane = plane
        found = chart_nodes(plane, stack, prefix, 2, lag)
        self.nodes, self.kubelets = found.nodes, found.kubelets
        self.url, self.config = found.url, found.config

    def create(self, pod: dict[str, Any]) -> str:
        self.plane.request("POST", "/api/v1/namespaces/default/pods", pod)
        return str(pod["metadata"]["name"])

    def running(self, name: str, timeout: float = 60) -> None:
        admitted = partial(operator.contains, self.kubelets.admitted, name)
        assert eventually(admitted, timeout=timeout), (
            self.kubelets.refused.get(name),
            self.why(name),
        )

    def why(self, name: str) -> str:
        pod = self.plane.request("GET", f"/api/v1/namespaces/default/pods/{name}")
        conditions = (pod.get("status") or {}).get("conditions") or []
        return "; ".join(str(c.get("message")) for c in conditions)

    def record(self, node: str) -> dict[str, Any]:
        found = self.plane.request("GET", f"/apis/devplugin.io/v1alpha1/nodedevices/{node}")
        status: dict[str, Any] = found.get("status") or {}
        return status

    def settled(self) -> bool:
        """Every record shows exactly the pods its node's kubelet holds."""
        for node in self.nodes:
            shown = {a["pod"] for a in self.record(node).get("allocations", [])}
            if shown != set(self.kubelets.held(node)):
                return False
        return True

    def extender_knows(self) -> bool:
        """Whether the extender's view counts every device the kubelets
        hold (its watches may trail): a probe asking one GPU more than a
        node has free is failed there."""
        for node, sim in self.nodes.items():
            more = len(free_now(sim.kubelet, GPU)) + 1
            probe = pending_pod(f"probe-{node}", {GPU: more, HCA: 1})
            answer = call_extender(self.url, "filter", {"Pod": probe, "NodeNames": [node]})
            if node in (answer.get("NodeNames") or []):
                return False
        return True

    def lists(self) -> dict[str, float]:
        """Full lists made so far by each watch cache: the extender's (its
        metric) and each daemon's pod watch."""
        found = {
            f"extender/{labels['cache']}": value
            for labels, value in samples(extender_metrics(self.url), "devplugin_watch_lists")
        }
        for node, sim in self.nodes.items():
            for cache in (sim.daemon.pods, sim.daemon.cluster.node_watch):
                assert cache is not None
                found[f"{node}/{cache.name}"] = float(cache.relists)
        return found


def _faults(plane: ControlPlane, request: pytest.FixtureRequest, lag: float) -> Iterator[Faults]:
    prefix = f"flt{plane.bins.minor[1]}{request.node.name[5:8]}"
    with ExitStack() as stack:
        yield Faults(plane, stack, prefix, lag)


@pytest.fixture
def faults(installed: ControlPlane, request: pytest.FixtureRequest) -> Iterator[Faults]:
    yield from _faults(installed, request, 0.0)


@pytest.fixture
def lagging(installed: ControlPlane, request: pytest.FixtureRequest) -> Iterator[Faults]:
    """`faults` with the extender's watches trailing the scheduler's by LAG."""
    yield from _faults(installed, request, LAG)


@pytest.mark.timeout(300)
def test_after_an_api_server_restart_every_watch_lists_again_and_nothing_is_lost(
    faults: Faults,
) -> None:
    plane = faults.plane
    first, second = faults.nodes
    part = faults.create(_pod("part", (4, 4), first))
    whole = faults.create(_pod("whole", (8, 8), second))
    for name in (part, whole):
        faults.running(name)
    assert eventually(faults.settled, timeout=30), "the records never showed the pods"
    assert eventually(lambda: ready(faults.url), timeout=30)
    before = faults.lists()
    assert before, "no watch cache counted"
    assert all(count >= 1 for count in before.values()), before
    sim = faults.nodes[first]
    spare = sorted(free_now(sim.kubelet, GPU))[0]
    index = next(i for i, gpu in enumerate(sim.node.gpus) if gpu.uuid == spare)

    def while_down() -> None:
        # No watch can resume from a version handed out before; and the
        # node learns something only its record can tell the cluster.
        plane.compact_etcd()
        assert sim.nvml.inject_xid(index, XID_FATAL) == 1
        servicer = sim.daemon.servicer(GPU)

        def out() -> bool:
            device = servicer.state.device(spare)
            return device is not None and device.health.value == "Unhealthy"

        assert eventually(out, timeout=10)

    plane.restart_apiserver(while_down=while_down)
    # The extender ready again (every cache current), every watch listed again.
    assert eventually(lambda: ready(faults.url), timeout=60), "the extender never got ready"
    rose = partial(lambda old: all(faults.lists().get(k, 0) > v for k, v in old.items()), before)
    assert eventually(rose, timeout=60), (before, faults.lists())
    # Nothing lost: both records hold their pods, and the XID the daemon saw
    # while the API server was away reached its record.
    assert eventually(faults.settled, timeout=30)
    devices = {d["id"]: d for d in faults.record(first)["devices"]}
    assert eventually(
        lambda: (
            {d["id"]: d for d in faults.record(first)["devices"]}[spare]["health"] == "Unhealthy"
        ),
        timeout=30,
    ), devices[spare]
    # Changes flow: the whole node's pod deleted, a pod asking a whole node
    # goes there; one asking what the XID left too few of stays pending,
    # turned down by the extender (the Node's own counts still fit it).
    filters = verb_calls(faults.url, "filter", "ok")
    delete_pod(plane, whole)
    again = faults.create(_pod("again", (8, 8)))
    faults.running(again)
    assert faults.kubelets.admitted[again].node == second
    crowded = faults.create(_pod("crowded", (4, 4), first))
    assert eventually(lambda: "devplugin" in faults.why(crowded), timeout=30), faults.why(crowded)
    assert crowded not in faults.kubelets.admitted
    assert verb_calls(faults.url, "filter", "ok") > filters
    assert not faults.kubelets.refused, faults.kubelets.refused
    print(
        f"{plane.bins.version}: lists before {sorted(before.items())}, after "
        f"{sorted(faults.lists().items())}; {crowded}: {faults.why(crowded)}"
    )


# What the first node holds, bound by hand before the scheduler goes: it is
# left with two GPU+HCA pairs on one switch each, and two GPUs and two HCAs
# whose partners are taken (the rest pair at NODE or SYS), and ranks first
# for a 1 + 1 pod (the fuller node). The second node is empty. Then five
# 1 + 1 pods wait: the first two belong on the first node's pairs, the
# others on the second node; an extender that ranked them on what it last
# heard (the first ones not bound yet) would send a third to the first node.
FIRST_NODE = [(1, 3), (3, 1)]
PENDING = [(1, 1)] * 5


def placed_in_order(plane: ControlPlane, names: set[str]) -> list[str]:
    """The pods among `names` in the order the scheduler placed them (its
    Scheduled events, timed to the microsecond)."""
    events = plane.request("GET", "/apis/events.k8s.io/v1/namespaces/default/events")["items"]
    times = {
        e["regarding"]["name"]: e.get("eventTime") or e["metadata"]["creationTimestamp"]
        for e in events
        if e.get("reason") == "Scheduled" and e["regarding"]["name"] in names
    }
    assert set(times) == names, names - set(times)
    return sorted(names, key=times.__getitem__)


@pytest.mark.timeout(300)
def test_pods_pending_while_the_scheduler_restarts_are_each_placed_at_the_best_level(
    lagging: Faults,
) -> None:
    faults = lagging
    plane = faults.plane
    crowded, empty = faults.nodes
    for index, shape in enumerate(FIRST_NODE):
        faults.running(faults.create(_pod(f"{crowded}-fill-{index}", shape, crowded, bind=True)))
    filled = faults.nodes[crowded]
    layout = filled.daemon.core.coordinator.topology
    left = free_now(filled.kubelet, GPU), free_now(filled.kubelet, HCA)
    pairs = [(g, h) for g in left[0] for h in left[1] if int(layout.level(g, h)) == 1]
    assert len(pairs) == 2, pairs  # the instance meant (the daemon chose the fill's devices)
    assert eventually(faults.settled, timeout=30)
    assert eventually(faults.extender_knows, timeout=30)
    probe = pending_pod("probe-first", {GPU: 1, HCA: 1})
    scores = call_extender(faults.url, "prioritize", {"Pod": probe, "NodeNames": [crowded, empty]})
    assert max(scores, key=lambda e: e["Score"])["Host"] == crowded, scores
    plane.stop_scheduler()
    names = {
        faults.create(_pod(f"waits-{index}", shape)): shape for index, shape in enumerate(PENDING)
    }
    free = {
        node: (frozenset(free_now(sim.kubelet, GPU)), frozenset(free_now(sim.kubelet, HCA)))
        for node, sim in faults.nodes.items()
    }
    assert not set(names) & set(faults.kubelets.admitted)  # nobody places them meanwhile
    filters = verb_calls(faults.url, "filter", "ok")
    plane.start_scheduler(faults.config)
    for name in names:
        faults.running(name)
    assert verb_calls(faults.url, "filter", "ok") >= filters + len(names)
    wrong: list[str] = []
    report: list[str] = []
    for name in placed_in_order(plane, set(names)):
        got = faults.kubelets.admitted[name]
        topology = {n: s.daemon.core.coordinator.topology for n, s in faults.nodes.items()}
        options = {
            node: best_level(topology[node], gpus, hcas, names[name])
            for node, (gpus, hcas) in free.items()
        }
        best = min(level for level in options.values() if level is not None)
        level = level_of(topology[got.node], got)
        report.append(f"{name} {names[name]} on {got.node}: level {level}, best {best}")
        if level != best:
            wrong.append(report[-1])
        gpus, hcas = free[got.node]
        free[got.node] = gpus - got.gpus, hcas - got.hcas
    assert not wrong, "\n".join(report)
    print(f"{plane.bins.version}: " + "; ".join(report))
