"""The extender's preemption verb over real HTTP, with ExtenderPreemptionArgs
shaped as kube-scheduler sends them, against records, pods and
PodDisruptionBudgets in the API server imitation."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from devplugin.extender.victims import candidates
from devplugin.model import DeviceKind
from devplugin.policy.node_record import node_from_record
from devplugin.policy.node_state import Holding
from devplugin.policy.podinfo import parse_pod
from devplugin.testing.apiserver import ApiServerImitation
from tests.extender_support import (
    GPU,
    HCA,
    Running,
    ask_preempt,
    call,
    extender,
    fill,
    inventory,
    meta,
    pod,
    record,
    synced,
    uids,
)
from tests.waiting import wait_until

__all__ = ["extender"]


def preemptor(gpus: int, hcas: int, priority: int = 1000) -> dict[str, Any]:
    asking = pod("urgent", [{GPU: gpus, HCA: hcas}])
    asking["spec"]["priority"] = priority
    return asking


def test_the_verb_frees_the_best_aligned_set_with_the_fewest_and_lowest_victims(
    api: ApiServerImitation, tmp_path: Path, extender: Running
) -> None:
    # hgx: four 2+2 pods (PIX pairs), one at priority 0; pcie: full too.
    fill(api, "hgx", "hgx-h100", tmp_path, [
        ("a", 2, 2, 100, {}), ("b", 2, 2, 0, {}), ("c", 2, 2, 200, {}), ("d", 2, 2, 100, {}),
    ])  # fmt: skip
    fill(api, "pcie", "pcie-server", tmp_path, [("e", 4, 1, 0, {}), ("f", 4, 1, 0, {})])
    synced(extender, {"hgx", "pcie"})
    assert wait_until(lambda: len(extender[0].pods.pods()) == 6, timeout=10)
    ids = uids(api)
    # The scheduler's count-only proposal: every pod on each node.
    proposal = meta({"hgx": [ids[n] for n in "abcd"], "pcie": [ids["e"], ids["f"]]})
    code, result = ask_preempt(
        api, extender, {"Pod": preemptor(2, 2), "NodeNameToMetaVictims": proposal}
    )
    assert code == 200
    # Both give a PIX pair: hgx by one pod (the lowest), pcie by both
    # (priority 0 each, which the scheduler's own pick would prefer): hgx only.
    assert result == {
        "NodeNameToMetaVictims": {"hgx": {"Pods": [{"UID": ids["b"]}], "NumPDBViolations": 0}}
    }
    # 4 GPUs + 2 HCAs: PIX on pcie, at best NODE on hgx, which is dropped.
    _, result = ask_preempt(
        api, extender, {"Pod": preemptor(4, 2), "NodeNameToMetaVictims": proposal}
    )
    assert list(result["NodeNameToMetaVictims"]) == ["pcie"]
    # 8 + 8: pcie has 2 HCAs, whatever goes; hgx needs every pod gone.
    _, result = ask_preempt(
        api, extender, {"Pod": preemptor(8, 8), "NodeNameToMetaVictims": proposal}
    )
    assert list(result["NodeNameToMetaVictims"]) == ["hgx"]
    assert len(result["NodeNameToMetaVictims"]["hgx"]["Pods"]) == 4


def test_victims_come_highest_priority_first_and_only_below_the_preemptor(
    api: ApiServerImitation, tmp_path: Path, extender: Running
) -> None:
    fill(api, "hgx", "hgx-h100", tmp_path, [
        ("a", 4, 4, 100, {}), ("b", 4, 4, 50, {}),
    ])  # fmt: skip
    synced(extender, {"hgx"})
    assert wait_until(lambda: len(extender[0].pods.pods()) == 2, timeout=10)
    ids = uids(api)
    proposal = meta({"hgx": [ids["a"], ids["b"]]})
    _, both = ask_preempt(
        api, extender, {"Pod": preemptor(8, 8), "NodeNameToMetaVictims": proposal}
    )
    assert both["NodeNameToMetaVictims"]["hgx"]["Pods"] == [{"UID": ids["a"]}, {"UID": ids["b"]}]
    # A preemptor of priority 100 may not evict "a": the node cannot help it.
    _, none = ask_preempt(
        api, extender, {"Pod": preemptor(8, 8, 100), "NodeNameToMetaVictims": proposal}
    )
    assert none == {"NodeNameToMetaVictims": {}}
    # Each answer counted by outcome (what DevpluginPreemptionWithoutVictims reads).
    registry = extender[0].metrics.registry
    name = "devplugin_extender_preempt_answers_total"
    assert registry.get_sample_value(name, {"outcome": "victims"}) == 1
    assert registry.get_sample_value(name, {"outcome": "none"}) == 1
    assert registry.get_sample_value(name, {"outcome": "untold"}) == 0


def test_disruption_budgets_are_counted_and_steer_the_choice(
    api: ApiServerImitation, tmp_path: Path, extender: Running
) -> None:
    fill(api, "hgx", "hgx-h100", tmp_path, [
        ("a", 4, 4, 0, {"app": "web"}), ("b", 4, 4, 0, {"app": "db"}),
    ])  # fmt: skip
    api.put("poddisruptionbudgets", {
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"selector": {"matchLabels": {"app": "web"}}},
        "status": {"disruptionsAllowed": 0},
    })  # fmt: skip
    synced(extender, {"hgx"})
    assert wait_until(lambda: len(extender[0].budgets.items()) == 1, timeout=10)
    assert wait_until(lambda: len(extender[0].pods.pods()) == 2, timeout=10)
    ids = uids(api)
    proposal = meta({"hgx": [ids["a"], ids["b"]]})
    _, one = ask_preempt(api, extender, {"Pod": preemptor(4, 4), "NodeNameToMetaVictims": proposal})
    # Either half frees a PIX set; the one no budget protects goes.
    assert one["NodeNameToMetaVictims"]["hgx"] == {
        "Pods": [{"UID": ids["b"]}],
        "NumPDBViolations": 0,
    }
    _, both = ask_preempt(
        api, extender, {"Pod": preemptor(8, 8), "NodeNameToMetaVictims": proposal}
    )
    assert both["NodeNameToMetaVictims"]["hgx"]["NumPDBViolations"] == 1


def test_the_whole_pods_form_and_nodes_it_knows_nothing_about(
    api: ApiServerImitation, tmp_path: Path, extender: Running
) -> None:
    fill(api, "hgx", "hgx-h100", tmp_path, [("a", 8, 8, 0, {})])
    synced(extender, {"hgx"})
    assert wait_until(lambda: len(extender[0].pods.pods()) == 1, timeout=10)
    ids = uids(api)
    whole = {
        "hgx": {"Pods": [{"metadata": {"uid": ids["a"]}}], "NumPDBViolations": 0},
        "unknown": {"Pods": [{"metadata": {"uid": "someone"}}], "NumPDBViolations": 0},
    }
    _, result = ask_preempt(api, extender, {"Pod": preemptor(2, 2), "NodeNameToVictims": whole})
    # A node with a record that can take the pod wins over one without.
    assert result == {
        "NodeNameToMetaVictims": {"hgx": {"Pods": [{"UID": ids["a"]}], "NumPDBViolations": 0}}
    }
    # A victim UID it has never seen: ignored, its own view answers.
    strange = meta({"hgx": ["no-such-pod", ids["a"]]})
    _, same = ask_preempt(api, extender, {"Pod": preemptor(2, 2), "NodeNameToMetaVictims": strange})
    assert same == result
    # Only nodes it knows nothing about: the scheduler's own victims stand.
    only = {"unknown": whole["unknown"]}
    _, kept = ask_preempt(api, extender, {"Pod": preemptor(2, 2), "NodeNameToVictims": only})
    assert kept == {
        "NodeNameToMetaVictims": {"unknown": {"Pods": [{"UID": "someone"}], "NumPDBViolations": 0}}
    }


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"Pod": {"metadata": {}}}, "Pod:"),
        ({"NodeNameToMetaVictims": {}}, "Pod: required"),
        ({"Pod": None, "NodeNameToMetaVictims": {}}, "Pod: required"),
        ("just a string", "JSON object"),
    ],
)
def test_bad_preemption_requests_get_a_400_and_it_keeps_serving(
    extender: Running, body: Any, reason: str
) -> None:
    code, result = call(extender, "preempt", body)
    assert code == 400
    assert reason in result["Error"]
    asking = preemptor(1, 1)
    for bad, why in [
        ({"Pod": asking}, "one of NodeNameToMetaVictims"),
        ({"Pod": asking, "NodeNameToMetaVictims": {"n": []}}, "must be an object"),
        ({"Pod": asking, "NodeNameToMetaVictims": {"n": {"Pods": [{}]}}}, "without a UID"),
    ]:
        code, result = call(extender, "preempt", bad)
        assert code == 400
        assert why in result["Error"]
    code, _ = call(extender, "preempt", {"Pod": asking, "NodeNameToMetaVictims": {}})
    assert code == 200


def test_the_filter_marks_failures_preemption_can_resolve_and_those_it_cannot(
    api: ApiServerImitation, tmp_path: Path, extender: Running
) -> None:
    fill(api, "hgx", "hgx-h100", tmp_path, [
        ("a", 2, 2, 500, {}), ("b", 2, 2, 500, {}), ("c", 2, 2, 500, {}), ("d", 2, 2, 0, {}),
    ])  # fmt: skip
    synced(extender, {"hgx"})
    assert wait_until(lambda: len(extender[0].pods.pods()) == 4, timeout=10)

    def failed(gpus: int, hcas: int, priority: int) -> tuple[list[str], list[str]]:
        args = {"Pod": preemptor(gpus, hcas, priority), "NodeNames": ["hgx"]}
        _, result = call(extender, "filter", args)
        return list(result["FailedNodes"]), list(result["FailedAndUnresolvableNodes"])

    # Evicting "d" (priority 0) makes room: the scheduler may preempt here.
    assert failed(2, 2, 100) == (["hgx"], [])
    # 4 + 4 needs a priority-500 pod gone: only a preemptor above 500 can.
    assert failed(4, 4, 100) == ([], ["hgx"])
    assert failed(4, 4, 1000) == (["hgx"], [])
    # More HCAs than the node has: nothing resolves it.
    assert failed(1, 9, 1000) == ([], ["hgx"])


def test_a_node_where_the_pod_fits_by_counts_is_one_preemption_cannot_help(
    api: ApiServerImitation, tmp_path: Path, extender: Running
) -> None:
    # One GPU and one HCA stay free, on different sockets (SYS apart).
    fill(api, "hgx", "hgx-h100", tmp_path, [("a", 3, 4, 0, {}), ("b", 4, 3, 0, {})])
    synced(extender, {"hgx"})
    assert wait_until(lambda: len(extender[0].pods.pods()) == 2, timeout=10)

    def failed(gpus: int, hcas: int) -> tuple[list[str], list[str]]:
        asking = preemptor(gpus, hcas)
        asking["metadata"]["annotations"] = {
            "devplugin.io/alignment": "PIX",
            "devplugin.io/alignment-policy": "required",
        }
        _, result = call(extender, "filter", {"Pod": asking, "NodeNames": ["hgx"]})
        return list(result["FailedNodes"]), list(result["FailedAndUnresolvableNodes"])

    # 1 + 1 fits by counts: kube-scheduler's dry run re-runs only its own
    # filters, which pass with nobody evicted, so it reprieves every victim
    # and never proposes this node, though evicting "a" would give PIX.
    assert failed(1, 1) == ([], ["hgx"])
    # 2 + 2 does not fit by counts: there its dry run finds victims.
    assert failed(2, 2) == (["hgx"], [])


def test_a_holder_is_matched_by_uid_and_a_namesake_is_not_a_victim(tmp_path: Path) -> None:
    # The record's holder "a" (uid-old) ended; a namesake "a" of low priority
    # is bound now and holds nothing. Only the pod the record names may go.
    state = node_from_record(record(inventory("hgx-h100", tmp_path)))
    gpu = sorted(state.free[DeviceKind.GPU])[0]
    held = replace(state, holdings=(Holding("default", "a", "uid-old", frozenset({gpu})),))
    namesake = pod("a", [{GPU: 1}])
    namesake["metadata"]["uid"] = "uid-new"
    namesake["spec"]["nodeName"] = "n"
    found, _ = candidates(held, [parse_pod(namesake)], 1000, ())
    assert found == []
    old = pod("a", [{GPU: 1}])
    old["metadata"]["uid"] = "uid-old"
    found, _ = candidates(held, [parse_pod(old)], 1000, ())
    assert [c.uid for c in found] == ["uid-old"]
