"""The room a pod is about to take, over real HTTP against the API server
imitation: a prioritize answer that ranks one node first alone holds the
devices the pod would get there in the rankings of the pods asked about
next, until the pod watch shows where it went (kube-scheduler assumes a
pod on its node at the end of its cycle and binds it in the background:
schedule_one.go, `assume` and `bindingCycle`).

Two HGX nodes, each with one GPU and one HCA free: on x they share a PCIe
switch, on y they sit as far apart as the node allows. Two 1 + 1 pods
waiting; x is the best place for either, and only one of them fits."""

from __future__ import annotations

import copy
import random
import threading
from pathlib import Path
from typing import Any

import pytest

from devplugin.model import DeviceKind
from devplugin.node.alignment import ContainerAlignment
from devplugin.policy.node_record import node_from_record
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
    record,
    synced,
)
from tests.waiting import wait_until

__all__ = ["extender"]


def pending(name: str) -> dict[str, Any]:
    return pod(name, [{GPU: 1, HCA: 1}])


def one_pair_free(api: ApiServerImitation, node: str, base: Path, *, near: bool) -> None:
    """An HGX whose every device but one GPU and one HCA is held by one
    bound pod; the pair left shares a switch (`near`) or is the farthest
    apart there is. Chosen here from the layout's levels, not by the
    allocator."""
    inv = inventory("hgx-h100", base / f"{node}-plan")
    topology = node_from_record(record(inv)).topology
    gpus = sorted(topology.id_set(DeviceKind.GPU))
    hcas = sorted(topology.id_set(DeviceKind.HCA))
    gpu = gpus[0]
    levels = {h: int(topology.level(gpu, h)) for h in hcas}
    hca = (min if near else max)(hcas, key=lambda h: (levels[h], h))
    rest = pod(f"{node}-rest", [{GPU: 7, HCA: 7}])
    rest["spec"]["nodeName"] = node
    rest["status"] = {"phase": "Running", "startTime": "2026-12-01T00:00:00Z"}
    uid = api.put("pods", rest)["metadata"]["uid"]
    held = ContainerAlignment(
        "default",
        f"{node}-rest",
        "c0",
        tuple(g for g in gpus if g != gpu),
        tuple(h for h in hcas if h != hca),
        None,
        None,
        uid,
    )
    put_record(api, node, "hgx-h100", base, held=[held])


@pytest.fixture
def pair(api: ApiServerImitation, tmp_path: Path, extender: Running) -> Running:
    one_pair_free(api, "x", tmp_path, near=True)
    one_pair_free(api, "y", tmp_path, near=False)
    synced(extender, {"x", "y"})
    assert wait_until(lambda: all(extender[0].pods.on_node(n) for n in "xy"), timeout=10)
    return extender


def waiting(api: ApiServerImitation, running: Running, *names: str) -> list[dict[str, Any]]:
    bodies = [pending(name) for name in names]
    for body in bodies:
        api.put("pods", body)
    pods = running[0].pods
    known = {body["metadata"]["uid"] for body in bodies}
    assert wait_until(lambda: known <= set(pods.pods()), timeout=10)
    return bodies


def ranking(running: Running, asker: dict[str, Any]) -> dict[str, int]:
    code, answer = call(running, "prioritize", {"Pod": asker, "NodeNames": ["x", "y"]})
    assert code == 200, answer
    return {entry["Host"]: entry["Score"] for entry in answer}


def first(running: Running, asker: dict[str, Any]) -> str:
    scores = ranking(running, asker)
    best = max(scores.values())
    (top,) = [node for node, score in scores.items() if score == best]
    return top


def passing(running: Running, asker: dict[str, Any]) -> set[str]:
    code, answer = call(running, "filter", {"Pod": asker, "NodeNames": ["x", "y"]})
    assert code == 200, answer
    return set(answer["NodeNames"] or [])


def bind(api: ApiServerImitation, running: Running, body: dict[str, Any], node: str) -> None:
    bound = copy.deepcopy(body)
    bound["spec"]["nodeName"] = node
    api.put("pods", bound)
    uid = body["metadata"]["uid"]
    pods = running[0].pods
    assert wait_until(lambda: (p := pods.get(uid)) is not None and p.node == node, timeout=10)


def test_the_pod_ranked_first_holds_its_devices_in_the_next_pods_ranking_until_it_binds(
    api: ApiServerImitation, pair: Running
) -> None:
    one, two = waiting(api, pair, "one", "two")
    assert first(pair, one) == "x"
    # The scheduler has assumed `one` on x and asks about `two` before the
    # binding shows: x's pair is spoken for, y ranks first.
    assert first(pair, two) == "y"
    assert ranking(pair, two)["x"] == 0
    # A guess never fails a filter: x still passes (the scheduler counts
    # its own assumed pods; were `one` sent elsewhere, x would be free).
    assert passing(pair, two) == {"x", "y"}
    # `one` is asked about again (a retry): its own hold is not in its way.
    assert first(pair, one) == "x"
    # Bound: the hold goes, the node's view places `one` on x itself.
    bind(api, pair, one, "x")
    assert [h.uid for h in pair[0].holds.holds()] == [two["metadata"]["uid"]]  # on y
    assert first(pair, two) == "y"
    # It ends: x's pair is free again, for `two` as well.
    api.remove("pods", "one", "default")
    assert wait_until(lambda: pair[0].pods.get(one["metadata"]["uid"]) is None, timeout=10)
    assert first(pair, two) == "x"


def test_a_hold_goes_with_its_pod_even_one_the_watch_did_not_know_when_it_was_ranked(
    api: ApiServerImitation, pair: Running
) -> None:
    one, two = waiting(api, pair, "one", "two")
    assert first(pair, one) == "x"
    assert first(pair, two) == "y"
    api.remove("pods", "one", "default")
    holds = pair[0].holds
    assert wait_until(lambda: [h.node for h in holds.holds()] == ["y"], timeout=10)
    # Only `two`'s own hold (on y) is left; x is first for it again. Gone
    # unbound, it holds nothing anywhere.
    assert first(pair, two) == "x"
    api.remove("pods", "two", "default")
    assert wait_until(lambda: holds.holds() == [], timeout=10)
    # A pod the scheduler asks about before the extender's watch has it
    # (the scheduler's watch is ahead): held all the same, and let go of
    # by its first event, which shows it bound already.
    stranger = pending("stranger")
    assert first(pair, stranger) == "x"
    assert [h.node for h in holds.holds()] == ["x"]
    bind(api, pair, stranger, "y")
    assert holds.holds() == []
    # The stranger bound on y: another pod sees x free.
    (three,) = waiting(api, pair, "three")
    assert first(pair, three) == "x"


def test_holds_under_concurrent_rankings_and_churn_end_with_their_pods(
    api: ApiServerImitation, pair: Running
) -> None:
    """Rankings for many waiting pods from threads at once while they are
    bound and deleted, events milliseconds apart: every call answers, and
    once the churn stops no hold is left for a pod bound or gone."""
    names = [f"p{i}" for i in range(12)]
    bodies = dict(zip(names, waiting(api, pair, *names), strict=True))
    failures: list[str] = []
    answered: list[str] = []
    stop = threading.Event()

    def rank(name: str) -> None:
        while not stop.is_set():
            try:
                code, answer = call(
                    pair, "prioritize", {"Pod": bodies[name], "NodeNames": ["x", "y"]}
                )
                if code != 200 or len(answer) != 2:
                    failures.append(f"{name}: {code} {answer}")
                answered.append(name)
            except OSError as exc:
                failures.append(f"{name}: {exc}")

    threads = [threading.Thread(target=rank, args=(name,)) for name in names[:6]]
    for thread in threads:
        thread.start()
    rng = random.Random(3)
    try:
        for name in names:
            if rng.random() < 0.5:
                bound = copy.deepcopy(bodies[name])
                bound["spec"]["nodeName"] = rng.choice("xy")
                api.put("pods", bound)
            else:
                api.remove("pods", name, "default")
            stop.wait(0.01)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    assert not failures, failures[:5]
    assert len(answered) > len(names)  # the rankings overlapped the churn
    pods = pair[0].pods
    uids = {body["metadata"]["uid"] for body in bodies.values()}

    def settled() -> bool:
        return all((p := pods.get(u)) is None or p.node for u in uids)

    assert wait_until(settled, timeout=10)
    assert [h.uid for h in pair[0].holds.holds() if h.uid in uids] == []
