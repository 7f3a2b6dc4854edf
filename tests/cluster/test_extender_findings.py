"""What a long-lived extender kept must never differ from a fresh
computation over the same caches: cases that once made them differ."""

from __future__ import annotations

from pathlib import Path

from devplugin.node.alignment import ContainerAlignment
from devplugin.policy.topology import Level
from devplugin.testing.apiserver import ApiServerImitation
from tests.extender_support import (
    GPU,
    HCA,
    Running,
    extender,
    inventory,
    pod,
    put_record,
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
