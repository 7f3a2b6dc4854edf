"""The extender and the kubelet's Topology Manager, over real HTTP against
the API server imitation: a node whose record says its kubelet aligns
(single-numa-node, restricted) is failed for a pod its kubelet would refuse
with TopologyAffinityError, for good where even its empty self would, and
the level a node is scored by is the one inside the NUMA node the kubelet
lets the devices come from. The real kubelet's verdicts on the same cases
are the node tier's (tests/real_node/test_topology_manager.py)."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from devplugin.node.alignment import ContainerAlignment
from devplugin.testing.apiserver import ApiServerImitation
from tests.extender_support import (
    GPU,
    HCA,
    Running,
    call,
    extender,
    inventory,
    pod,
    put_record,
    synced,
)
from tests.waiting import wait_until

__all__ = ["extender"]


def aligning(
    api: ApiServerImitation,
    node: str,
    policy: str,
    scope: str = "container",
    *,
    cpu_policy: str = "none",
    numa_nodes: list[dict[str, int]] | None = None,
) -> None:
    """The node's record, saying its kubelet aligns so (its NUMA nodes 56
    CPUs each unless `numa_nodes` says)."""
    found = api.get("nodedevices", node)
    assert found is not None
    found["status"]["kubelet"] = {"topologyManagerPolicy": policy, "topologyManagerScope": scope,
                                  "cpuManagerPolicy": cpu_policy, "version": "v1.37.2"}  # fmt: skip
    found["status"]["numaNodes"] = numa_nodes or [{"id": 0, "cpus": 56}, {"id": 1, "cpus": 56}]
    api.put("nodedevices", found)


def sees_alignment(running: Running, node: str) -> bool:
    """The extender has the node's record that says its kubelet aligns."""
    found = running[0].records.items().get(node)
    return found is not None and found.parsed.kubelet.aligns


def guaranteed(name: str, asks: dict[str, int], cpus: int) -> dict[str, Any]:
    """A pod of one container asking `asks` and `cpus` whole CPUs, Guaranteed."""
    found = pod(name, [asks])
    found["spec"]["containers"][0]["resources"]["limits"].update(
        {"cpu": str(cpus), "memory": "64Mi"}
    )
    return found


def verdict(running: Running, asks: list[dict[str, int]], node: str) -> dict[str, Any]:
    code, answer = call(running, "filter", {"Pod": pod("p", asks), "NodeNames": [node]})
    assert code == 200
    return dict(answer)


def test_a_node_whose_kubelet_would_refuse_the_pod_is_failed_and_says_why(
    api: ApiServerImitation, tmp_path: Path, extender: Running
) -> None:
    # hgx-h100: four GPU+HCA pairs on each NUMA node. A 2 + 2 pod on each.
    inv = inventory("hgx-h100", tmp_path / "inv")
    held = []
    for name, numa in (("a", 0), ("b", 1)):
        gpus = sorted(g.uuid for g in inv.gpus if g.numa_node == numa)[:2]
        hcas = sorted(h.device_id for h in inv.hcas if h.numa_node == numa)[:2]
        entry = ContainerAlignment(
            "default", name, "c0", tuple(gpus), tuple(hcas), None, None, f"uid-{name}"
        )
        held.append(entry)
        bound = pod(name, [{GPU: 2, HCA: 2}])
        bound["spec"]["nodeName"] = "hgx"
        bound["status"] = {"phase": "Running"}
        api.put("pods", bound)
    put_record(api, "hgx", "hgx-h100", tmp_path, held=held)
    synced(extender, {"hgx"})
    # Without the Topology Manager, 3 + 3 fits (across the NUMA nodes).
    assert verdict(extender, [{GPU: 3, HCA: 3}], "hgx")["NodeNames"] == ["hgx"]
    version = api.get("nodedevices", "hgx")["metadata"]["resourceVersion"]  # type: ignore[index]
    aligning(api, "hgx", "single-numa-node")
    assert wait_until(partial(sees_alignment, extender, "hgx"), timeout=10), version
    split = verdict(extender, [{GPU: 3, HCA: 3}], "hgx")
    # Refused for what the kubelet would say, and unresolvable: by counts it
    # fits, so the scheduler's preemption would reprieve every victim.
    assert "TopologyAffinityError" in split["FailedAndUnresolvableNodes"]["hgx"]
    too_big = verdict(extender, [{GPU: 5, HCA: 1}], "hgx")
    assert "hgx" in too_big["FailedAndUnresolvableNodes"]  # and it never could
    assert verdict(extender, [{GPU: 2, HCA: 2}], "hgx")["NodeNames"] == ["hgx"]
    # Two containers of 2 + 2: apart at container scope, together at pod scope.
    two = [{GPU: 2, HCA: 2}, {GPU: 2, HCA: 2}]
    assert verdict(extender, two, "hgx")["NodeNames"] == ["hgx"]
    aligning(api, "hgx", "single-numa-node", "pod")
    refused_together = partial(verdict, extender, two, "hgx")
    assert wait_until(lambda: "hgx" in refused_together()["FailedAndUnresolvableNodes"], 10)
    # restricted: 3 + 3 across the two NUMA nodes is not preferred (one node
    # would hold it, were it free), so refused too; 2 + 2 on one is fine.
    aligning(api, "hgx", "restricted")

    def refused() -> bool:
        failed = verdict(extender, [{GPU: 3, HCA: 3}], "hgx")["FailedAndUnresolvableNodes"]
        return "TopologyAffinityError" in failed.get("hgx", "")

    assert wait_until(refused, timeout=10), verdict(extender, [{GPU: 3, HCA: 3}], "hgx")
    assert verdict(extender, [{GPU: 2, HCA: 2}], "hgx")["NodeNames"] == ["hgx"]


def test_a_pod_bound_but_not_in_the_record_yet_is_placed_ahead_where_its_cpus_are(
    api: ApiServerImitation, tmp_path: Path, extender: Running
) -> None:
    # The real kubelet tier's case: single-numa-node with the static CPU
    # manager, one whole CPU free and it on NUMA node 1. NUMA node 0 has two
    # pairs free, node 1 one. A Guaranteed 1 + 1 + 1 CPU pod is bound but
    # its daemon has not recorded it yet: the kubelet gives it node 1's pair
    # (where its CPU is), so a 2 + 2 pod still fits on node 0.
    inv = inventory("hgx-h100", tmp_path / "inv")
    by_numa = {
        numa: (sorted(g.uuid for g in inv.gpus if g.numa_node == numa),
               sorted(h.device_id for h in inv.hcas if h.numa_node == numa))
        for numa in (0, 1)
    }  # fmt: skip
    (g0, h0), (g1, h1) = by_numa[0], by_numa[1]
    held = [
        ContainerAlignment("default", "a", "c0", (g0[0], g0[3]), (h0[0], h0[3]),
                           None, None, "uid-a"),
        ContainerAlignment("default", "b", "c0", (g1[0], g1[1], g1[3]), (h1[0], h1[1], h1[3]),
                           None, None, "uid-b"),
    ]  # fmt: skip
    for name, asks in (("a", {GPU: 2, HCA: 2}), ("b", {GPU: 3, HCA: 3})):
        holder = pod(name, [asks])
        holder["spec"]["nodeName"] = "hgx"
        holder["status"] = {"phase": "Running"}
        api.put("pods", holder)
    put_record(api, "hgx", "hgx-h100", tmp_path, held=held)
    one_cpu_free_on_1 = [{"id": 0, "cpus": 1, "freeCpus": 0}, {"id": 1, "cpus": 1, "freeCpus": 1}]
    aligning(api, "hgx", "single-numa-node", cpu_policy="static", numa_nodes=one_cpu_free_on_1)
    assert wait_until(partial(sees_alignment, extender, "hgx"), timeout=10)
    asks = [{GPU: 2, HCA: 2}]
    assert verdict(extender, asks, "hgx")["NodeNames"] == ["hgx"]
    cpu_pod = guaranteed("cpu", {GPU: 1, HCA: 1}, 1)
    cpu_pod["spec"]["nodeName"] = "hgx"
    api.put("pods", cpu_pod)
    assert wait_until(lambda: "uid-cpu" in extender[0].pods.pods(), timeout=10)
    answer = verdict(extender, asks, "hgx")
    assert answer["NodeNames"] == ["hgx"], answer
    # Placed ahead, it took the node's one free CPU: a second such pod is failed.
    again = guaranteed("cpu-2", {GPU: 1, HCA: 1}, 1)
    code, second = call(extender, "filter", {"Pod": again, "NodeNames": ["hgx"]})
    assert code == 200
    assert second["NodeNames"] == [], second
