"""The nominations' rules as data: how long a preempt answer holds, which
pods its room holds against, and what a node looks like to the asker."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from devplugin.extender.nominations import (
    DELETE_WITHIN,
    HOLD_SLACK,
    Claim,
    Effect,
    Nominations,
    apply,
    without_pods,
)
from devplugin.model import DeviceKind
from devplugin.policy.allocator import Allocator
from devplugin.policy.node_record import node_from_record
from devplugin.policy.node_state import Holding, NodeState
from devplugin.policy.placement import place
from devplugin.policy.pod_request import Shape
from tests.extender_support import Clock, Pods, info, inventory, record

GPU, HCA = "nvidia.com/gpu", "rdma/hca"


def store(pods: Pods, clock: Clock) -> Nominations:
    return Nominations(pods, (GPU, HCA), clock)


ROOM = frozenset({"gpu0", "gpu1", "hca0", "hca1"})


def test_an_answer_holds_for_its_victims_grace_and_the_slack_unless_confirmed() -> None:
    pods, clock = Pods(), Clock()
    pods.by_uid["v"] = info("v", node="n", grace=45)
    nominations = store(pods, clock)
    asker = info("p", 1000)
    nominations.answered(asker, {"n": (frozenset({"v"}), ROOM)})
    clock.now += 45 + HOLD_SLACK - 0.1
    assert [p.node for p in nominations.plans()] == ["n"]
    clock.now += 0.2
    assert nominations.plans() == []
    # Confirmed by the watch, it holds while the nomination does.
    nominations.answered(asker, {"n": (frozenset({"v"}), ROOM)})
    nominations.pod_changed("p", asker, replace(asker, nominated="n"))
    clock.now += 3600
    assert [p.node for p in nominations.plans()] == ["n"]


def test_the_watch_settles_a_plan() -> None:
    pods, clock = Pods(), Clock()
    nominations = store(pods, clock)
    asker = info("p", 1000)
    cases = {
        "bound": replace(asker, node="n"),
        "deleting": replace(asker, deleting=True),
        "finished": replace(asker, phase="Failed"),
        "nominated elsewhere": replace(asker, nominated="m"),
    }
    for why, after in cases.items():
        nominations.answered(asker, {"n": (frozenset(), ROOM)})
        nominations.pod_changed("p", asker, after)
        assert nominations.plans() == [], why
    nominations.answered(asker, {"n": (frozenset(), ROOM)})
    nominations.pod_changed("p", asker, None)
    assert nominations.plans() == [], "gone"
    # A stale nomination elsewhere in an unrelated update is not a new one.
    old = replace(asker, nominated="m")
    nominations.answered(old, {"n": (frozenset(), ROOM)})
    nominations.pod_changed("p", old, replace(old, phase="Pending"))
    assert [p.node for p in nominations.plans()] == ["n"]
    # Confirmed, then taken back: gone.
    nominations.pod_changed("p", old, replace(asker, nominated="n"))
    nominations.pod_changed("p", replace(asker, nominated="n"), asker)
    assert nominations.plans() == []


def test_a_victim_still_running_past_delete_within_counts_again() -> None:
    pods, clock = Pods(), Clock()
    pods.by_uid["v"] = info("v", node="n")
    pods.by_uid["w"] = info("w", node="n")
    nominations = store(pods, clock)
    asker = info("p", 1000, nominated="n")
    nominations.answered(asker, {"n": (frozenset({"v", "w"}), ROOM)})
    assert nominations.effects(asker)["n"].gone == {"v", "w"}
    clock.now += DELETE_WITHIN + 1
    pods.by_uid["w"] = replace(pods.by_uid["w"], deleting=True)
    assert nominations.effects(asker)["n"].gone == {"w"}
    del pods.by_uid["w"]
    assert nominations.effects(asker)["n"].gone == {"w"}  # gone from the watch


def test_a_room_holds_against_lower_and_equal_priority_only_and_never_its_own_pod() -> None:
    pods, clock = Pods(), Clock()
    nominations = store(pods, clock)
    nominations.answered(info("p", 1000), {"n": (frozenset({"v"}), ROOM)})
    for priority in (0, 1000):
        (claim,) = nominations.effects(info("q", priority))["n"].claims
        assert (claim.uid, claim.devices) == ("p", ROOM)
    assert nominations.effects(info("q", 1001)) == {}
    own = nominations.effects(info("p", 1000))["n"]
    assert own.claims == ()
    assert own.gone == {"v"}


def test_a_nomination_known_only_from_the_watch_claims_where_it_would_be_placed() -> None:
    pods, clock = Pods(), Clock()
    pods.by_uid["v"] = replace(info("v", node="n"), deleting=True)
    pods.by_uid["p"] = info("p", 1000, nominated="n")
    nominations = store(pods, clock)
    effect = nominations.effects(info("q", 500))["n"]
    (claim,) = effect.claims
    assert claim.devices is None
    assert claim.gone == {"v"}
    assert claim.shape == Shape(((2, 2),), 2, 2, ((GPU, HCA),))
    assert nominations.effects(info("p", 1000))["n"] == Effect(frozenset({"v"}), ())


def _node(base: Path) -> tuple[NodeState, Allocator]:
    state = node_from_record(record(inventory("hgx-h100", base)))
    return state, Allocator(state.topology)


def test_apply_gives_the_askers_victims_back_then_takes_every_room(tmp_path: Path) -> None:
    node, allocator = _node(tmp_path)
    gpus, hcas = sorted(node.free[DeviceKind.GPU]), sorted(node.free[DeviceKind.HCA])
    held = Holding("default", "v", "v", frozenset(gpus[:2] + hcas[:2]))
    full = replace(
        node,
        free={DeviceKind.GPU: frozenset(gpus[2:]), DeviceKind.HCA: frozenset(hcas[2:])},
        holdings=(held,),
        holders=frozenset({("default", "v")}),
    )
    # The asker's own victim gone: its devices back, its holding dropped.
    back = without_pods(full, frozenset({"v"}))
    assert back.free == node.free
    assert back.holdings == ()
    # Another's planned room taken, and not freed by evicting its holder.
    room = frozenset(gpus[:2] + hcas[:2])
    claimed = apply(Effect(claims=(Claim("p", 1000, room, None, frozenset()),)), full, allocator)
    assert claimed.free == full.free
    healthy = claimed.healthy or {}
    assert not room & (healthy[DeviceKind.GPU] | healthy[DeviceKind.HCA])
    assert without_pods(claimed, frozenset({"v"})).free == full.free
    # A claim by shape is placed as its pod would be, after the earlier rooms.
    shape = Shape(((2, 2),), 2, 2)
    by_shape = Claim("r", 900, None, shape, frozenset())
    both = apply(
        Effect(claims=(Claim("p", 1000, room, None, frozenset()), by_shape)), back, allocator
    )
    expected = place(back.reserve(room), shape, allocator)
    assert expected.fits
    taken = expected.taken(back.reserve(room).free)
    assert both.free == back.reserve(room).reserve(taken).free


def test_reserving_a_shared_device_holds_one_replica(tmp_path: Path) -> None:
    node, _ = _node(tmp_path)
    gpu = sorted(node.free[DeviceKind.GPU])[0]
    shared = replace(node, replicas={gpu: 2}, used={gpu: 0})
    once = shared.reserve([gpu])
    assert once.used[gpu] == 1
    assert gpu in once.free[DeviceKind.GPU]
    assert gpu in (once.healthy or {})[DeviceKind.GPU]
    twice = once.reserve([gpu])
    assert gpu not in twice.free[DeviceKind.GPU]
