"""The prioritize holds' rules as data: which pods get one, how long it
lasts, what lets it go, and where it counts."""

from __future__ import annotations

from dataclasses import replace

from devplugin.extender.holds import HOLD_FOR, Holds, Rooms
from devplugin.extender.nominations import Claim, Effect, Nominations
from tests.extender_support import GPU, HCA, Clock, Pods, info

ROOM = frozenset({"g1", "h1"})


def setup() -> tuple[Pods, Clock, Holds]:
    pods, clock = Pods(), Clock()
    pods.by_uid = {uid: info(uid) for uid in ("a", "b")}
    return pods, clock, Holds(pods.get, clock)


def test_a_hold_lasts_hold_for_seconds_unless_an_event_ends_it() -> None:
    pods, clock, holds = setup()
    holds.ranked(pods.by_uid["a"], "x", ROOM)
    assert [(h.uid, h.node, h.devices) for h in holds.holds()] == [("a", "x", ROOM)]
    clock.now += HOLD_FOR - 0.1
    assert len(holds.holds()) == 1
    clock.now += 0.2
    assert holds.holds() == []


def test_bound_deleting_ending_or_gone_lets_go_and_a_new_ranking_replaces() -> None:
    pods, _clock, holds = setup()
    a = pods.by_uid["a"]
    for after in (
        replace(a, node="y"),
        replace(a, deleting=True),
        replace(a, phase="Failed"),
        None,
    ):
        holds.ranked(a, "x", ROOM)
        holds.pod_changed("a", a, replace(a, nominated="x"))  # a status change: kept
        assert len(holds.holds()) == 1
        holds.pod_changed("a", a, after)
        assert holds.holds() == [], after
    holds.ranked(a, "x", ROOM)
    holds.ranked(a, "y", frozenset({"g2"}))
    assert [(h.node, h.devices) for h in holds.holds()] == [("y", frozenset({"g2"}))]
    holds.unranked("a")
    assert holds.holds() == []


def test_a_pod_bound_or_ending_is_not_held_nor_nothing_but_one_not_seen_yet_is() -> None:
    pods, _clock, holds = setup()
    pods.by_uid["bound"] = info("bound", node="x")
    pods.by_uid["ending"] = replace(info("ending"), deleting=True)
    holds.ranked(pods.by_uid["bound"], "x", ROOM)
    holds.ranked(pods.by_uid["ending"], "x", ROOM)
    holds.ranked(pods.by_uid["a"], "x", frozenset())
    assert holds.holds() == []
    # Ahead of the watch: held, until its first event says it is bound.
    stranger = info("stranger")
    holds.ranked(stranger, "x", ROOM)
    assert [h.uid for h in holds.holds()] == ["stranger"]
    holds.pod_changed("stranger", None, stranger)
    assert len(holds.holds()) == 1
    holds.pod_changed("stranger", stranger, replace(stranger, node="y"))
    assert holds.holds() == []


def test_a_hold_counts_for_every_other_pod_whatever_its_priority_and_not_for_its_own() -> None:
    pods, _clock, holds = setup()
    holds.ranked(pods.by_uid["a"], "x", ROOM)
    assert holds.effects(pods.by_uid["a"], {}) == {}
    urgent = info("urgent", priority=10_000)
    (claim,) = holds.effects(urgent, {})["x"].claims
    assert (claim.uid, claim.devices, claim.gone) == ("a", ROOM, frozenset())
    # Beside a nomination's claims on the node, once (a pod both nominated
    # there and held there is one room).
    nominated = Claim("a", 0, ROOM, None, frozenset())
    other = Claim("n", 5, frozenset({"g9"}), None, frozenset())
    merged = holds.effects(urgent, {"x": Effect(frozenset({"v"}), (other,))})["x"]
    assert merged.gone == frozenset({"v"})
    assert [c.uid for c in merged.claims] == ["n", "a"]
    assert holds.effects(urgent, {"x": Effect(claims=(nominated,))})["x"].claims == (nominated,)
    # Bound already (the watch ahead of the event's listener): its node's view has it.
    pods.by_uid["a"] = replace(pods.by_uid["a"], node="x")
    assert holds.effects(urgent, {}) == {}


def test_copies_are_stores_of_their_own() -> None:
    pods, clock, holds = setup()
    holds.ranked(pods.by_uid["a"], "x", ROOM)
    rooms = Rooms(Nominations(pods, (GPU, HCA), clock), holds)
    copied = rooms.copy()
    holds.ranked(pods.by_uid["b"], "y", ROOM)
    assert [h.uid for h in copied.holds.holds()] == ["a"]
    copied.holds.unranked("a")
    assert [h.uid for h in holds.holds()] == ["a", "b"]


def test_past_the_limit_the_oldest_hold_goes() -> None:
    pods, clock = Pods(), Clock()
    pods.by_uid = {str(i): info(str(i)) for i in range(5)}
    holds = Holds(pods.get, clock, limit=3)
    for i in range(5):
        holds.ranked(pods.by_uid[str(i)], "x", ROOM)
    assert [h.uid for h in holds.holds()] == ["2", "3", "4"]
