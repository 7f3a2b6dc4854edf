"""A nominated pod's room, over real HTTP against the API server imitation:
what the preempt verb answered holds until the pod watch settles it, and
a nomination the watch shows (status.nominatedNodeName) holds without an
answer, as kube-scheduler holds its nominated pods' rooms
(framework/runtime/framework.go, addGENominatedPods: pods of priority >=
the asker's, not the asker itself).

The node: an HGX with four 2-GPU + 2-HCA pods of priority 0, full. A
preemptor P (2 + 2, priority 1000) evicts one of them; its room is then
exactly the devices that pod held, so a rival of P's shape fits there and
nowhere else."""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

import pytest

from devplugin.testing.apiserver import ApiServerImitation
from tests.extender_support import (
    GPU,
    HCA,
    Running,
    call,
    extender,
    fill,
    meta,
    pod,
    running_extender,
    synced,
    uids,
)
from tests.waiting import wait_until

__all__ = ["extender"]

HOLDERS = [("a", 2, 2, 0, {}), ("b", 2, 2, 0, {}), ("c", 2, 2, 0, {}), ("d", 2, 2, 0, {})]


def pending(name: str, priority: int, **status: str) -> dict[str, Any]:
    """A 2 + 2 pod waiting to be scheduled (with `status` fields)."""
    body = pod(name, [{GPU: 2, HCA: 2}])
    body["spec"]["priority"] = priority
    body["status"] = {"phase": "Pending", **status}
    return body


def passes(running: Running, asker: dict[str, Any], node: str = "hgx") -> bool:
    code, answer = call(running, "filter", {"Pod": asker, "NodeNames": [node]})
    assert code == 200, answer
    return node in answer["NodeNames"]


def seen(running: Running, name: str, check: Any = None) -> None:
    """Wait until the extender's pod watch holds `name` (as `check` wants)."""

    def holds() -> bool:
        found = [p for p in running[0].pods.pods().values() if p.name == name]
        return bool(found) and (check is None or check(found[0]))

    assert wait_until(holds, timeout=10)


def gone(running: Running, name: str) -> None:
    pods = running[0].pods
    assert wait_until(lambda: all(p.name != name for p in pods.pods().values()), timeout=10)


@pytest.fixture
def full(api: ApiServerImitation, tmp_path: Path, extender: Running) -> Running:
    fill(api, "hgx", "hgx-h100", tmp_path, HOLDERS)
    synced(extender, {"hgx"})
    assert wait_until(lambda: len(extender[0].pods.on_node("hgx")) == 4, timeout=10)
    return extender


def preempt(api: ApiServerImitation, running: Running, asker: dict[str, Any]) -> list[str]:
    """The victims the verb answers for `asker` on hgx (every holder proposed)."""
    ids = uids(api)
    proposal = meta({"hgx": [ids[name] for name, *_ in HOLDERS if name in ids]})
    code, answer = call(running, "preempt", {"Pod": asker, "NodeNameToMetaVictims": proposal})
    assert code == 200, answer
    return [v["UID"] for v in answer["NodeNameToMetaVictims"].get("hgx", {}).get("Pods", [])]


def evict(api: ApiServerImitation, uid: str) -> str:
    """What the scheduler does to a victim: delete it (the kubelet takes
    its grace to confirm); the pod's name."""
    (victim,) = [p for p in api.items("pods") if p["metadata"]["uid"] == uid]
    victim = copy.deepcopy(victim)
    victim["metadata"]["deletionTimestamp"] = "2026-12-07T00:00:00Z"
    api.put("pods", victim)
    return str(victim["metadata"]["name"])


def test_a_preemptors_victims_count_as_gone_for_it_and_its_room_as_taken_for_others(
    api: ApiServerImitation, full: Running
) -> None:
    p = pending("p", 1000)
    api.put("pods", p)
    seen(full, "p")
    assert not passes(full, p)  # full: it must preempt
    (victim,) = preempt(api, full, p)
    # The scheduler evicts and retries at once: the watch still shows the
    # victim running, and the record its devices held. P passes its node.
    assert passes(full, p)
    # The victim's end is seen: a rival of P's priority fits there by the
    # devices alone, but that is P's room; a pod of higher priority may take it.
    name = evict(api, victim)
    api.remove("pods", name, "default")
    gone(full, name)
    rival, urgent = pending("rival", 1000), pending("urgent", 2000)
    assert passes(full, p)
    assert not passes(full, rival)
    assert passes(full, urgent)
    # Asked again while its room holds, P gets no victims, and it is said why.
    assert preempt(api, full, p) == []
    registry = full[0].metrics.registry
    waiting = {"outcome": "waiting"}
    assert registry.get_sample_value("devplugin_extender_preempt_answers_total", waiting) == 1
    # Once P is bound there the room is its holding; once it ends, the rival fits.
    bound = copy.deepcopy(p)
    bound["spec"]["nodeName"] = "hgx"
    api.put("pods", bound)
    seen(full, "p", lambda pod: pod.node == "hgx")
    assert full[0].nominations.plans() == []
    assert not passes(full, rival)
    api.remove("pods", "p", "default")
    gone(full, "p")
    assert passes(full, rival)


def test_a_nomination_elsewhere_or_taken_back_gives_the_room_back(
    api: ApiServerImitation, full: Running
) -> None:
    p = pending("p", 1000)
    api.put("pods", p)
    seen(full, "p")
    (victim,) = preempt(api, full, p)
    name = evict(api, victim)
    api.remove("pods", name, "default")
    gone(full, name)
    rival = pending("rival", 1000)
    # The scheduler nominates hgx: confirmed, the room holds.
    api.put("pods", pending("p", 1000, nominatedNodeName="hgx"))
    seen(full, "p", lambda pod: pod.nominated == "hgx")
    assert [plan.node for plan in full[0].nominations.plans()] == ["hgx"]
    assert not passes(full, rival)
    # It takes the nomination back (preemption no longer helps): room free.
    api.put("pods", pending("p", 1000))
    seen(full, "p", lambda pod: pod.nominated == "")
    assert wait_until(lambda: full[0].nominations.plans() == [], timeout=10)
    assert passes(full, rival)


def test_a_nomination_in_the_watch_holds_the_room_for_an_extender_started_after_the_answer(
    api: ApiServerImitation, tmp_path: Path, full: Running
) -> None:
    # What a restart between the scheduler's preemption and its retry leaves:
    # P nominated to hgx, its victim being deleted, and no answer kept.
    ids = uids(api)
    evict(api, ids["a"])
    p = pending("p", 1000, nominatedNodeName="hgx")
    api.put("pods", p)
    later = tmp_path / "later"
    later.mkdir()
    started = running_extender(api, later)
    fresh = next(started)
    try:
        synced(fresh, {"hgx"})
        seen(fresh, "p", lambda pod: pod.nominated == "hgx")
        seen(fresh, "a", lambda pod: pod.deleting)
        assert fresh[0].nominations.plans() == []
        # P: the pod going on its node counts as gone.
        assert passes(fresh, p)
        # Once it has gone, its devices are P's room for pods of P's priority.
        api.remove("pods", "a", "default")
        gone(fresh, "a")
        rival = pending("rival", 1000)
        assert not passes(fresh, rival)
        assert passes(fresh, pending("urgent", 2000))
        assert passes(fresh, p)
    finally:
        next(started, None)


def test_room_promises_hold_under_concurrent_callers_and_churn(
    api: ApiServerImitation, full: Running
) -> None:
    """Filters for P and for a rival, and preempt calls for P, from threads
    at once, while the victim is deleted and gone and P's status changes
    (nominated from the sixth change on), events milliseconds apart: P
    never fails its node once answered, the rival never passes it while P
    waits, every call answers."""
    p = pending("p", 1000)
    api.put("pods", p)
    seen(full, "p")
    (victim,) = preempt(api, full, p)
    rival = pending("rival", 1000)
    stop = threading.Event()
    wrong: list[str] = []

    def ask(asker: dict[str, Any], want: bool) -> None:
        while not stop.is_set():
            try:
                if passes(full, asker) != want:
                    wrong.append(f"{asker['metadata']['name']}: {not want}")
            except AssertionError as exc:
                wrong.append(str(exc))

    def ask_preempt() -> None:
        while not stop.is_set():
            if preempt(api, full, p):
                wrong.append("p got victims again")

    threads = [
        threading.Thread(target=ask, args=(p, True)),
        threading.Thread(target=ask, args=(rival, False)),
        threading.Thread(target=ask_preempt),
    ]
    for thread in threads:
        thread.start()
    try:
        for step in range(20):
            name = evict(api, victim) if step == 0 else None
            if name is not None:
                api.remove("pods", name, "default")
            # The scheduler's status updates: its nomination from step 5 on.
            nominated = {"nominatedNodeName": "hgx"} if step >= 5 else {}
            api.put("pods", pending("p", 1000, message=f"attempt {step}", **nominated))
            stop.wait(0.005)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    assert not wrong, wrong[:5]
    assert passes(full, p)
    assert not passes(full, rival)
