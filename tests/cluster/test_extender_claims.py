"""The extender's verbs for pods that ask through ResourceClaims, over real
HTTP against the API server imitation: it filters and ranks nodes by what
the scheduler's allocator (the imitation) would pick there, follows claim
and slice events, and says nothing where it cannot tell."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devplugin.policy.claim_templates import Shape, claim_spec, device_classes
from devplugin.policy.topology import Topology
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.dra_scheduler import (
    Allocator,
    node_ids,
    pair_levels,
    put_claim,
    put_slices,
    spec_slices,
    taken_devices,
)
from devplugin.testing.layouts import LAYOUTS
from tests.extender_support import Running, call, running_extender
from tests.waiting import wait_until

DRIVER = "devplugin.io"
# Node -> layout. n-busy gets its PIX pairs taken by another claim.
NODES = {"n-free": "hgx-h100", "n-busy": "hgx-h100", "n-small": "pcie-server", "n-none": ""}


@pytest.fixture
def running(api: ApiServerImitation, tmp_path: Path) -> Iterator[Running]:
    yield from running_extender(api, tmp_path, dra=True)


def put_node(api: ApiServerImitation, node: str, layout: str) -> None:
    for old in [s for s in api.items("resourceslices") if s["spec"]["nodeName"] == node]:
        api.delete("resourceslices", old["metadata"]["name"])
    if not layout:
        return
    taken = {name for _, pool, name in taken_devices(api.items("resourceclaims")) if pool == node}
    put_slices(api, spec_slices(LAYOUTS[layout](), DRIVER, node, held=taken)[0])


def pod(claim: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "main"}]}
    status: dict[str, Any] = {"phase": "Pending"}
    if claim is not None:
        spec["resourceClaims"] = [{"name": "devices", "resourceClaimTemplateName": "2-pairs"}]
        status["resourceClaimStatuses"] = [{"name": "devices", "resourceClaimName": claim}]
    return {
        "apiVersion": "v1", "kind": "Pod", "spec": spec, "status": status,
        "metadata": {"name": "trainer", "namespace": "default", "uid": "u-trainer"},
    }  # fmt: skip


def scheduler_pick(api: ApiServerImitation, node: str, spec: dict[str, Any]) -> Any:
    classes = {c["metadata"]["name"]: c for c in api.items("deviceclasses")}
    allocator = Allocator(api.items("resourceslices"), classes, node)
    return allocator.allocate(spec, taken_devices(api.items("resourceclaims")))


def unpaired(node: str) -> list[dict[str, str]]:
    """Results holding an hgx-h100 node's first two GPUs and last six HCAs."""
    slices, _ = spec_slices(LAYOUTS["hgx-h100"](), DRIVER, node)
    names = sorted(d["name"] for s in slices for d in s["spec"]["devices"])
    gpus = [n for n in names if n.startswith("gpu-")]
    hcas = [n for n in names if n.startswith("hca-")]
    return [{"request": "h", "driver": DRIVER, "pool": node, "device": name}
            for name in gpus[:2] + hcas[2:]]  # fmt: skip


def setup(api: ApiServerImitation) -> dict[str, Any]:
    for item in device_classes(DRIVER):
        api.put("deviceclasses", item)
    # Another claim holds the first two GPUs and all HCAs but the first two
    # of n-busy: its free HCAs are left without a PIX GPU.
    put_claim(api, "other", {"devices": {"requests": []}}, results=unpaired("n-busy"))
    for node, layout in NODES.items():
        put_node(api, node, layout)
    spec = claim_spec(Shape(2, 2), DRIVER)
    put_claim(api, "trainer-devices", spec)
    return spec


def settled(running: Running, api: ApiServerImitation) -> None:
    _, caches = running[0].dra  # type: ignore[misc]
    want = len(api.items("resourceslices"))
    assert wait_until(
        lambda: (
            len(caches.slices) == want
            and len(caches.claims) == 2
            and len(caches.classes) == len(device_classes(DRIVER))
        ),
        timeout=10,
    )
    assert wait_until(lambda: running[0].ready()[0], timeout=10)


def test_claim_only_pods_are_filtered_and_ranked_by_the_allocators_pick(
    api: ApiServerImitation, running: Running
) -> None:
    spec = setup(api)
    settled(running, api)
    names = list(NODES)
    status, answer = call(
        running, "claims/filter", {"Pod": pod("trainer-devices"), "NodeNames": names}
    )
    assert status == 200
    picks = {node: scheduler_pick(api, node, spec) for node in names}
    assert answer["NodeNames"] == [n for n in names if picks[n] is not None]
    assert set(answer["FailedNodes"]) == {n for n in names if picks[n] is None} == {"n-none"}
    assert answer["FailedAndUnresolvableNodes"] == {}
    status, scores = call(
        running, "claims/prioritize", {"Pod": pod("trainer-devices"), "NodeNames": names}
    )
    assert status == 200
    score = {entry["Host"]: entry["Score"] for entry in scores}
    # The worst pair of what the scheduler would pick, node by node.
    worst = {}
    for node, layout in NODES.items():
        if picks[node] is None:
            continue
        slices = [s for s in api.items("resourceslices") if s["spec"]["nodeName"] == node]
        _, inventory = spec_slices(LAYOUTS[layout](), DRIVER, node)
        worst[node] = max(
            pair_levels(picks[node], node_ids(slices), Topology.from_inventory(inventory))
        )
    assert score["n-none"] == 0
    best = min(worst.values())
    assert {n for n in worst if score[n] == 10} == {n for n in worst if worst[n] == best}
    for a, level_a in worst.items():
        for b, level_b in worst.items():
            if level_a < level_b:
                assert score[a] > score[b], (worst, score)
    assert worst["n-busy"] > worst["n-free"]


def test_an_allocation_elsewhere_changes_the_ranking_at_the_next_call(
    api: ApiServerImitation, running: Running
) -> None:
    spec = setup(api)
    settled(running, api)
    args = {"Pod": pod("trainer-devices"), "NodeNames": ["n-free", "n-busy"]}
    _, before = call(running, "claims/prioritize", args)
    assert before[0]["Score"] > before[1]["Score"]
    views, _ = running[0].dra  # type: ignore[misc]
    walks = views.walks
    _, again = call(running, "claims/prioritize", args)
    assert again == before
    assert views.walks == walks  # kept: no walk for an unchanged node
    # A claim takes devices of n-free so that its pairs are worse than
    # n-busy's; n-busy is not walked again.
    put_claim(api, "more", {"devices": {"requests": []}}, results=unpaired("n-free"))
    busy = scheduler_pick(api, "n-busy", spec)
    slices, inventory = spec_slices(LAYOUTS["hgx-h100"](), DRIVER, "n-free")
    topology = Topology.from_inventory(inventory)
    assert busy is not None

    def flipped() -> bool:
        _, now = call(running, "claims/prioritize", args)
        return bool(now[0]["Score"] <= now[1]["Score"])

    assert wait_until(flipped, timeout=10)
    # Same devices, same rank: both nodes now leave their pairs at NODE.
    after = scheduler_pick(api, "n-free", spec)
    assert after is not None
    assert max(pair_levels(after, node_ids(slices), topology)) == max(
        pair_levels(busy, node_ids(slices), topology)
    )
    _, final = call(running, "claims/prioritize", args)
    assert final[0]["Score"] == final[1]["Score"]
    assert views.walks == walks + 1  # n-free walked again, once; n-busy never


def test_pods_without_claims_or_with_unknown_ones_pass_everywhere_with_no_score(
    api: ApiServerImitation, running: Running
) -> None:
    setup(api)
    settled(running, api)
    names = list(NODES)
    for body in (pod(None), pod("not-created-yet")):
        started = time.perf_counter()
        _, answer = call(running, "claims/filter", {"Pod": body, "NodeNames": names})
        assert answer["NodeNames"] == names
        assert answer["FailedNodes"] == {}
        _, scores = call(running, "claims/prioritize", {"Pod": body, "NodeNames": names})
        assert {entry["Score"] for entry in scores} == {0}
        assert time.perf_counter() - started < 2.0
    # A selector outside the extender's CEL: it says nothing rather than guess.
    odd = claim_spec(Shape(1, 1), DRIVER)
    odd["devices"]["requests"][1]["exactly"]["selectors"] = [
        {"cel": {"expression": f'device.attributes["{DRIVER}"].ibdev.startsWith("mlx5")'}}
    ]
    put_claim(api, "odd", odd)
    assert wait_until(lambda: running[0].dra[1].claims.get("default/odd") is not None, timeout=10)  # type: ignore[index]
    _, answer = call(running, "claims/filter", {"Pod": pod("odd"), "NodeNames": names})
    assert answer["NodeNames"] == names


def test_bad_bodies_to_the_claims_verbs_get_a_400_and_it_keeps_serving(
    api: ApiServerImitation, running: Running
) -> None:
    setup(api)
    settled(running, api)
    names = list(NODES)
    host, port = running[1].address
    for raw in (b"{not json", b"[1]", b'{"NodeNames": ["n-free"]}'):
        url = f"http://{host}:{port}/scheduler/claims/filter"
        headers = {"Content-Type": "application/json"}
        request = urllib.request.Request(url, data=raw, method="POST", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=10)
        assert caught.value.code == 400
        assert json.loads(caught.value.read())["Error"]
    # resourceClaims that are not claim references: nothing to say, every node passes.
    odd = pod("trainer-devices")
    odd["spec"]["resourceClaims"] = ["not-a-mapping"]
    status, answer = call(running, "claims/filter", {"Pod": odd, "NodeNames": names})
    assert (status, answer["NodeNames"]) == (200, names)
    status, answer = call(
        running, "claims/filter", {"Pod": pod("trainer-devices"), "NodeNames": names}
    )
    assert status == 200
    assert answer["FailedNodes"] == {
        "n-none": "devplugin: the pod's ResourceClaims cannot be allocated here"
    }
