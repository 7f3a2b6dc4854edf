"""What a long-lived extender kept must never differ from a fresh
computation over the same caches: cases that once made them differ."""

from __future__ import annotations

from pathlib import Path

from devplugin.node.alignment import ContainerAlignment
from devplugin.policy.mig import profile_resource
from devplugin.policy.topology import Level
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.layouts import hgx_h100_mig
from tests.extender_support import (
    GPU,
    HCA,
    Running,
    asking,
    extender,
    inventory,
    pod,
    put_record,
    record,
    stamp,
    synced,
    twin,
    verbs_agree,
)
from tests.waiting import wait_until

__all__ = ["extender"]


def test_a_bound_pods_retry_does_not_tell_other_pods_its_node_is_free(
    api: ApiServerImitation, tmp_path: Path, extender: Running
) -> None:
    put_record(api, "n", "hgx-h100", tmp_path)
    bound = pod("first", [{GPU: 8, HCA: 8}])
    bound["spec"]["nodeName"] = "n"
    api.put("pods", bound)
    synced(extender, {"n"})
    assert wait_until(lambda: extender[0].pods.get("uid-first") is not None, timeout=10)
    # The retry first: placed on its own node without itself, it passes there.
    retry = {"Pod": bound, "NodeNames": ["n"]}
    assert verbs_agree(extender, "filter", retry)["NodeNames"] == ["n"]
    # Then a pod of the same shape: the first holds everything there.
    other = {"Pod": pod("second", [{GPU: 8, HCA: 8}]), "NodeNames": ["n"]}
    result = verbs_agree(extender, "filter", other)
    assert result["NodeNames"] == []
    scores = verbs_agree(extender, "prioritize", other)
    assert b'"Score":0' in scores


def test_a_holder_known_by_name_is_matched_only_with_pods_on_its_own_node(
    api: ApiServerImitation, tmp_path: Path, extender: Running
) -> None:
    inv = inventory("hgx-h100", tmp_path / "inv")
    gpus, hcas = [g.uuid for g in inv.gpus], [h.device_id for h in inv.hcas]
    # Node a's record: a container of default/x holds everything, no uid yet.
    held = [ContainerAlignment("default", "x", "c0", tuple(gpus), tuple(hcas), Level.PIX, 8)]
    put_record(api, "a", "hgx-h100", tmp_path, held=held)
    # A pod of that name lives on node b.
    namesake = pod("x", [{GPU: 1, HCA: 1}])
    namesake["spec"]["nodeName"] = "b"
    namesake["status"]["phase"] = "Running"
    api.put("pods", namesake)
    synced(extender, {"a"})
    assert wait_until(lambda: extender[0].pods.get("uid-x") is not None, timeout=10)
    args = {"Pod": pod("next", [{GPU: 2, HCA: 2}]), "NodeNames": ["a"]}
    assert verbs_agree(extender, "filter", args)["NodeNames"] == []
    # The namesake on b ends: nothing says a's holder did.
    api.remove("pods", "x", "default")
    assert wait_until(lambda: extender[0].pods.get("uid-x") is None, timeout=10)
    assert verbs_agree(extender, "filter", args)["NodeNames"] == []
    # A pod of that name ending on a itself does free it.
    mine = pod("x", [{GPU: 8, HCA: 8}])
    mine["metadata"]["uid"] = "uid-x-on-a"
    mine["spec"]["nodeName"] = "a"
    mine["status"]["phase"] = "Running"
    api.put("pods", mine)
    assert wait_until(lambda: extender[0].pods.get("uid-x-on-a") is not None, timeout=10)
    api.set_status("pods", "x", "default", {"phase": "Succeeded"})
    assert wait_until(
        lambda: twin(extender).verbs()["/scheduler/filter"](args)["NodeNames"] == ["a"],
        timeout=10,
    )
    assert verbs_agree(extender, "filter", args)["NodeNames"] == ["a"]


def _holder(name: str, gpus: tuple[str, ...], hcas: tuple[str, ...] = ()) -> ContainerAlignment:
    return ContainerAlignment("default", name, "c0", gpus, hcas, None, None, f"uid-{name}")


def _bound(api: ApiServerImitation, name: str, node: str, requests: dict[str, int]) -> None:
    body = pod(name, [requests])
    body["spec"]["nodeName"] = node
    body["status"]["phase"] = "Running"
    api.put("pods", body)


def test_a_time_sliced_node_is_judged_by_its_free_replicas(
    api: ApiServerImitation, tmp_path: Path, extender: Running
) -> None:
    # 8 GPUs served as 4 replicas each: 8 pods hold one replica of each GPU,
    # so 24 of 32 replicas are free, and every GPU has a holder.
    inv = inventory("hgx-h100", tmp_path / "inv")
    served = {g.uuid: (GPU, 4) for g in inv.gpus} | {h.device_id: (HCA, 1) for h in inv.hcas}
    held = [_holder(f"s{i}", (g.uuid,)) for i, g in enumerate(inv.gpus)]
    for i in range(len(inv.gpus)):
        _bound(api, f"s{i}", "n", {GPU: 1})
    put_record(api, "n", "hgx-h100", tmp_path, held=held, served=served)
    synced(extender, {"n"})
    assert wait_until(lambda: len(extender[0].pods.on_node("n")) == 8, timeout=10)
    args = {"Pod": pod("next", [{GPU: 4, HCA: 1}]), "NodeNames": ["n"]}
    assert verbs_agree(extender, "filter", args)["NodeNames"] == ["n"]
    # One replica per GPU as long as it can: 24 fit, 25 do not.
    assert verbs_agree(extender, "filter", {**args, "Pod": pod("all", [{GPU: 24}])})[
        "NodeNames"
    ] == ["n"]
    too_many = verbs_agree(extender, "filter", {**args, "Pod": pod("more", [{GPU: 25}])})
    assert "24 " in too_many["FailedAndUnresolvableNodes"]["n"]
    # The kubelet admits it with no eviction: preemption proposes none.
    urgent = pod("urgent", [{GPU: 4}])
    urgent["spec"]["priority"] = 1000
    proposed = {"n": {"Pods": [{"UID": "uid-s0"}], "NumPDBViolations": 0}}
    answer = extender[0].verbs()["/scheduler/preempt"](
        {"Pod": urgent, "NodeNameToMetaVictims": proposed}
    )
    assert answer == {"NodeNameToMetaVictims": {}}


def _mig_record(
    api: ApiServerImitation, tmp_path: Path, name: str, holders: list[ContainerAlignment]
) -> tuple[list[str], list[str], list[str], dict[str, int]]:
    """The mixed-MIG HGX node's record: its whole GPUs, its MIG devices, its
    HCAs, and each HCA's NUMA node."""
    inv = inventory(hgx_h100_mig(), tmp_path / "inv", mig_strategy="mixed")
    served = {h.device_id: (HCA, 1) for h in inv.hcas}
    for g in inv.gpus:
        profile = g.slice.device.profile if g.slice is not None else None
        served[g.uuid] = (profile_resource(GPU, profile) if profile else GPU, 1)
    found = record(inv, name, allocations=holders, served=served)
    found["status"]["updated"] = stamp()
    found["metadata"] = {"name": name}
    api.put("nodedevices", found)
    whole = [g.uuid for g in inv.gpus if g.slice is None]
    migs = [g.uuid for g in inv.gpus if g.slice is not None]
    numa = {h.device_id: h.numa_node if h.numa_node is not None else -1 for h in inv.hcas}
    return whole, migs, [h.device_id for h in inv.hcas], numa


def test_mig_devices_are_not_whole_gpus(
    api: ApiServerImitation, tmp_path: Path, extender: Running
) -> None:
    whole, migs, _, _ = _mig_record(api, tmp_path / "probe", "probe", [])
    assert len(whole) == 4
    assert len(migs) == 16
    # Every whole GPU held: a whole-GPU pod has nothing, MIG devices or not.
    held = [_holder(f"w{i}", (g,)) for i, g in enumerate(whole)]
    _mig_record(api, tmp_path, "m", held)
    synced(extender, {"m"})
    args = {"Pod": pod("whole", [{GPU: 1, HCA: 1}]), "NodeNames": ["m"]}
    result = verbs_agree(extender, "filter", args)
    assert result["NodeNames"] == []
    assert b'"Score":0' in verbs_agree(extender, "prioritize", args)
    # A pod asking a MIG profile is placed on one, next to an HCA.
    slice_pod = pod("slice", [{"nvidia.com/mig-1g.10gb": 1, HCA: 1}])
    sliced = {"Pod": slice_pod, "NodeNames": ["m"]}
    assert verbs_agree(extender, "filter", sliced)["NodeNames"] == ["m"]
    assert b'"Score":10' in verbs_agree(extender, "prioritize", sliced)
    five = {"Pod": pod("five", [{"nvidia.com/mig-3g.40gb": 5}]), "NodeNames": ["m"]}
    assert (
        "4 nvidia.com/mig-3g.40gb free"
        in verbs_agree(extender, "filter", five)["FailedAndUnresolvableNodes"]["m"]
    )


def test_a_pix_required_whole_gpu_pod_is_not_paired_through_a_mig_device(
    api: ApiServerImitation, tmp_path: Path, extender: Running
) -> None:
    _, _, hcas, numa = _mig_record(api, tmp_path / "probe", "probe", [])
    # The HCAs beside the whole GPUs (socket 1) are held: whole GPUs pair at SYS.
    beside = tuple(h for h in hcas if numa[h] == 1)
    assert beside
    _mig_record(api, tmp_path, "m", [_holder("nics", (), beside)])
    synced(extender, {"m"})
    required = pod(
        "pix",
        [{GPU: 1, HCA: 1}],
        **{"devplugin.io/alignment": "PIX", "devplugin.io/alignment-policy": "required"},
    )
    result = verbs_agree(extender, "filter", {"Pod": required, "NodeNames": ["m"]})
    assert result["NodeNames"] == []
    assert "requires PIX" in str(result)


def test_the_pod_watch_keeps_mig_only_pods(
    api: ApiServerImitation, tmp_path: Path, extender: Running
) -> None:
    _bound(api, "sliced", "m", {"nvidia.com/mig-2g.20gb": 1})
    synced(extender, set())
    assert wait_until(lambda: extender[0].pods.get("uid-sliced") is not None, timeout=10)


class _Ticking:
    """A clock that moves on a tenth of a second each time it is read."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 0.1
        return self.now


def test_a_preempt_call_over_many_full_nodes_stops_at_its_deadline(
    api: ApiServerImitation, tmp_path: Path, extender: Running
) -> None:
    # 16-GPU nodes full of one-GPU pods, an 8-GPU preemptor: every node's
    # search is long, and the call as a whole must end at its deadline
    # with the best found so far, the nodes left counted.
    inv = inventory("16-gpu", tmp_path / "inv")
    names = [f"full-{n}" for n in range(6)]
    for n, node in enumerate(names):
        held = []
        # Each node with its own free GPUs (n of them): no two searches alike.
        for i, gpu in enumerate(inv.gpus[n:], start=n):
            name = f"{node}-p{i}"
            held.append(_holder(name, (gpu.uuid,)))
            _bound(api, name, node, {GPU: 1})
        put_record(api, node, "16-gpu", tmp_path, held=held)
    synced(extender, set(names))
    assert wait_until(
        lambda: all(len(extender[0].pods.on_node(f"full-{n}")) == 16 - n for n in range(6)),
        timeout=10,
    )
    verb = extender[0].preemption
    verb._clock = _Ticking()  # each node's search sees time pass
    urgent = pod("urgent", [{GPU: 8, HCA: 1}])
    urgent["spec"]["priority"] = 1000
    proposed = {
        node: {"Pods": [{"UID": f"uid-{node}-p{i}"} for i in range(n, 16)], "NumPDBViolations": 0}
        for n, node in enumerate(names)
    }
    answer = verb.preempt({"Pod": urgent, "NodeNameToMetaVictims": proposed})
    chosen = answer["NodeNameToMetaVictims"]
    assert chosen  # the best found before the deadline
    assert all(len(v["Pods"]) <= 8 for v in chosen.values())
    metrics = extender[0].metrics.registry
    left = metrics.get_sample_value(
        "devplugin_extender_preempt_unproven_total", {"why": "deadline"}
    )
    assert left is not None
    assert 0 < left < len(names)


def test_preempt_reads_the_victims_kept_per_node_and_pod_kind(
    api: ApiServerImitation, tmp_path: Path, extender: Running
) -> None:
    inv = inventory("hgx-h100", tmp_path / "inv")
    for node in ("a", "b"):
        held = [_holder(f"{node}-p{i}", (g.uuid,)) for i, g in enumerate(inv.gpus)]
        for i in range(len(inv.gpus)):
            _bound(api, f"{node}-p{i}", node, {GPU: 1})
        put_record(api, node, "hgx-h100", tmp_path, held=held)
    synced(extender, {"a", "b"})
    assert wait_until(lambda: len(extender[0].pods.on_node("b")) == 8, timeout=10)
    urgent = pod("urgent", [{GPU: 2, HCA: 2}])
    urgent["spec"]["priority"] = 1000
    proposed = {
        node: {"Pods": [{"UID": f"uid-{node}-p{i}"} for i in range(8)], "NumPDBViolations": 0}
        for node in ("a", "b")
    }
    args = {"Pod": urgent, "NodeNameToMetaVictims": proposed}
    registry = extender[0].metrics.registry

    def hits() -> float:
        return registry.get_sample_value("devplugin_extender_memo_total", {"result": "hit"}) or 0

    # Each question from a pod that goes after it (its answer's room with it).
    with asking(api, extender, urgent):
        first = verbs_agree(extender, "preempt", args)
    assert {len(v["Pods"]) for v in first["NodeNameToMetaVictims"].values()} == {2}
    before = hits()
    with asking(api, extender, urgent):
        assert verbs_agree(extender, "preempt", args) == first
    assert hits() - before >= 2  # both nodes' victims read, none searched again
    # A pod on a ends: a is searched again, and now needs one victim fewer.
    api.remove("pods", "a-p0", "default")
    assert wait_until(lambda: extender[0].pods.get("uid-a-p0") is None, timeout=10)
    with asking(api, extender, urgent):
        again = verbs_agree(extender, "preempt", args)
    assert list(again["NodeNameToMetaVictims"]) == ["a"]
    assert len(again["NodeNameToMetaVictims"]["a"]["Pods"]) == 1
