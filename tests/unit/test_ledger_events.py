"""The holdings ledger moved by events, one rule per source, on a fake clock:
Allocate, the pod watch, the kubelet's available lists and PodResources polls."""

from __future__ import annotations

from devplugin.model import DeviceKind
from devplugin.node.coordination import Coordinator
from devplugin.node.ledger import ENDED_LIMIT, Holdings, Ledger
from devplugin.policy.topology import Topology
from devplugin.testing.layouts import LAYOUTS
from devplugin.testing.node import devices_from_spec
from tests.support import Clock

GPU, HCA = DeviceKind.GPU, DeviceKind.HCA
MAIN = ("ns", "train", "main")


def poll(**pods: dict[DeviceKind, tuple[str, ...]]) -> Holdings:
    return Holdings({("ns", pod, "main"): kinds for pod, kinds in pods.items()})


def ledger(clock: Clock) -> Ledger:
    return Ledger(grace=5.0, max_age=300.0, clock=clock)


def test_a_pod_that_ended_frees_both_kinds_at_once() -> None:
    clock = Clock()
    book = ledger(clock)
    book.allocated(GPU, ["g0", "g1"], holder=MAIN, uid="u1")
    book.allocated(HCA, ["h0"], holder=MAIN, uid="u1")
    assert book.taken(GPU) == {"g0", "g1"}
    assert book.taken(HCA) == {"h0"}
    clock.advance(0.01)
    assert book.pod_ended("ns", "train", "u1")
    assert book.taken(GPU) == frozenset()
    assert book.taken(HCA) == frozenset()


def test_a_poll_begun_before_the_end_cannot_bring_the_devices_back() -> None:
    clock = Clock()
    book = ledger(clock)
    book.observe(poll(train={GPU: ("g0",)}), clock())
    began = clock()
    clock.advance(0.2)
    book.pod_ended("ns", "train", "u1")
    # The kubelet answered before it forgot the pod; the answer arrives late.
    book.observe(poll(train={GPU: ("g0",)}), began + 0.1)
    assert book.taken(GPU) == frozenset()
    # A later answer still naming the ended pod (a kubelet slow to forget) too.
    clock.advance(1.0)
    book.observe(poll(train={GPU: ("g0",)}), clock())
    assert book.taken(GPU) == frozenset()


def test_a_namesake_with_another_uid_keeps_its_own_devices() -> None:
    clock = Clock()
    book = ledger(clock)
    book.allocated(GPU, ["g0"], holder=MAIN, uid="old")
    book.allocated(GPU, ["g1"], holder=MAIN, uid="new")
    book.pod_ended("ns", "train", "old", successor=True)
    assert book.taken(GPU) == {"g1"}
    # Once the namesake is seen live, polls naming it count again.
    book.pod_started("ns", "train", "new")
    clock.advance(1.0)
    book.observe(poll(train={GPU: ("g1", "g2")}), clock())
    assert book.taken(GPU) == {"g1", "g2"}


def test_the_available_list_frees_what_it_lists_and_the_rest_of_that_pod() -> None:
    clock = Clock()
    book = ledger(clock)
    book.observe(poll(a={GPU: ("g0",), HCA: ("h0",)}, b={GPU: ("g1",), HCA: ("h1",)}), clock())
    clock.advance(0.5)
    # The kubelet offers g0: pod a is gone from its books, with every device.
    changed = book.available(GPU, ["g0", "g2"], [], served=["g0", "g1", "g2"])
    assert changed
    assert book.taken(GPU) == {"g1"}
    assert book.taken(HCA) == {"h1"}
    assert book.corrections == 1
    # The same list again changes nothing.
    assert not book.available(GPU, ["g0", "g2"], [], served=["g0", "g1", "g2"])


def test_a_device_the_available_list_omits_is_taken_until_a_list_offers_it() -> None:
    clock = Clock()
    book = ledger(clock)
    # g3 is held by a pod's finished init container: the kubelet keeps it,
    # PodResources does not list it.
    book.available(GPU, ["g0", "g1", "g2"], [], served=["g0", "g1", "g2", "g3"])
    assert book.taken(GPU) == {"g3"}
    clock.advance(10.0)
    book.observe(poll(), clock())
    assert book.taken(GPU) == {"g3"}  # a poll cannot see it either way
    book.available(GPU, ["g0", "g3"], [], served=["g0", "g1", "g2", "g3"])
    assert book.taken(GPU) == {"g1", "g2"}


def test_must_include_devices_are_the_pods_own_not_free() -> None:
    clock = Clock()
    book = ledger(clock)
    book.allocated(GPU, ["g0"], holder=("ns", "train", "prep"), uid="u1")
    book.available(GPU, ["g0", "g1"], ["g0"], served=["g0", "g1"])
    assert book.taken(GPU) == {"g0"}


def test_a_poll_reconciles_allocations_it_does_not_list_after_the_grace() -> None:
    clock = Clock()
    book = ledger(clock)
    book.allocated(GPU, ["g0"], holder=MAIN, uid="u1")
    clock.advance(1.0)
    book.observe(poll(), clock())
    assert book.taken(GPU) == {"g0"}  # the kubelet may not have recorded it yet
    clock.advance(5.0)
    book.observe(poll(), clock())
    assert book.taken(GPU) == frozenset()


def test_a_newer_allocation_wins_over_an_older_poll() -> None:
    clock = Clock()
    book = ledger(clock)
    began = clock()
    clock.advance(0.1)
    book.pod_ended("ns", "old", "u0")
    book.allocated(GPU, ["g0"], holder=MAIN, uid="u1")
    book.observe(poll(old={GPU: ("g0",)}), began)
    assert [held.container for held in book.holders()] == [MAIN]


def test_free_for_planning_is_not_released_for_cleanup() -> None:
    clock = Clock()
    book = ledger(clock)
    book.observe(poll(train={GPU: ("g0",)}), clock())
    book.pod_ended("ns", "train", "u1")
    assert book.taken(GPU) == frozenset()
    # Cleanup counts its own confirmations on what PodResources said.
    assert book.in_use(GPU) == {"g0"}
    clock.advance(1.0)
    book.observe(poll(), clock())
    assert book.in_use(GPU) == frozenset()


def test_every_change_of_the_view_is_told_and_the_age_follows_the_sources() -> None:
    clock = Clock()
    book = ledger(clock)
    told: list[int] = []
    book.listen(lambda: told.append(1))
    book.allocated(GPU, ["g0"], holder=MAIN, uid="u1")
    clock.advance(3.0)
    assert book.age() == 3.0
    book.pod_ended("ns", "train", "u1")
    assert book.age() == 0.0
    assert len(told) == 2
    book.pod_ended("ns", "other", "u2")  # held nothing: nothing to tell
    assert len(told) == 2


def test_ended_pods_and_unconfirmed_entries_stay_bounded() -> None:
    clock = Clock()
    book = ledger(clock)
    for n in range(ENDED_LIMIT * 2):
        book.pod_ended("ns", f"p{n}", f"u{n}")
    book.allocated(GPU, ["g0"])
    book.available(GPU, ["g0"], [], served=["g0", "g1"])
    assert len(book) <= 2
    clock.advance(301.0)
    assert book.taken(GPU) == frozenset()
    assert len(book) == 0


def test_the_coordinator_hands_only_served_ids_to_the_ledger() -> None:
    gpus, hcas = devices_from_spec(LAYOUTS["hgx-h100"]())
    book = Ledger()
    coordinator = Coordinator(book)
    coordinator.set_topology(Topology(gpus, hcas))
    ids = [g.uuid for g in gpus]
    coordinator.set_healthy(GPU, ids)
    # Two free on each NUMA node (the hgx-h100's GPUs 0-3 and 4-7): the
    # other two of each are held; junk is no device.
    coordinator.observe_available(GPU, [*ids[:2], *ids[4:6], "junk", "x" * 10_000], [])
    assert book.taken(GPU) == frozenset([*ids[2:4], *ids[6:]])
    assert len(book) == 4
