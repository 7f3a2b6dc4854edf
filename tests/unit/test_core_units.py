"""Fake-clock unit tests for the parts of the core that keep time: the holdings
ledger, the coordinator's pairing window and the registrar's backoff."""

from __future__ import annotations

import itertools
from pathlib import Path

from devplugin.frontends.deviceplugin.kubelet import KUBELET_SOCKET, Registrar
from devplugin.frontends.deviceplugin.server import DevicePluginServicer, PluginServer
from devplugin.model import DeviceKind
from devplugin.node.coordination import Coordinator
from devplugin.node.gpu.resource import GpuResource
from devplugin.node.ledger import Holdings, Ledger
from devplugin.node.resources import ResourceState
from devplugin.policy.allocator import Role
from devplugin.policy.topology import Topology
from devplugin.testing.layouts import LAYOUTS
from devplugin.testing.node import devices_from_spec
from tests.support import Clock

GPU, HCA = DeviceKind.GPU, DeviceKind.HCA


def held(**containers: tuple[str, ...]) -> Holdings:
    return Holdings({("ns", pod, "main"): {GPU: ids} for pod, ids in containers.items()})


# -- the ledger --------------------------------------------------------------------


def test_a_fresh_allocation_stays_taken_through_a_poll_that_began_before_it() -> None:
    clock = Clock()
    ledger = Ledger(grace=5.0, clock=clock)
    poll_began = clock()
    clock.advance(0.1)
    ledger.allocated(GPU, ["a"])
    ledger.observe(held(), poll_began)
    assert ledger.taken(GPU) == {"a"}


def test_a_poll_that_saw_the_allocation_confirms_it() -> None:
    clock = Clock()
    ledger = Ledger(grace=5.0, clock=clock)
    ledger.allocated(GPU, ["a"])
    clock.advance(0.5)
    ledger.observe(held(p=("a",)), clock())
    assert len(ledger) == 0  # confirmed: no longer a recent entry
    assert ledger.taken(GPU) == {"a"}  # but held, per the poll
    ledger.observe(held(), clock())
    assert ledger.taken(GPU) == frozenset()


def test_an_allocation_no_poll_shows_is_dropped_after_the_grace() -> None:
    clock = Clock()
    ledger = Ledger(grace=5.0, clock=clock)
    ledger.allocated(GPU, ["a"])
    clock.advance(4.0)
    ledger.observe(held(), clock())
    assert ledger.taken(GPU) == {"a"}  # within the grace: the kubelet may lag
    clock.advance(2.0)
    ledger.observe(held(), clock())
    assert ledger.taken(GPU) == frozenset()


def test_without_any_poll_the_ledger_is_bounded_in_size_and_age() -> None:
    clock = Clock()
    ledger = Ledger(grace=5.0, max_age=300.0, clock=clock)
    devices = [f"GPU-{i}" for i in range(8)]
    for n in range(100_000):
        ledger.allocated(GPU, [devices[n % 8]])
        if n % 1000 == 0:
            clock.advance(0.01)
    # One entry per device, whatever the number of Allocates.
    assert len(ledger) == 8
    clock.advance(301.0)
    assert len(ledger) == 0
    assert ledger.taken(GPU) == frozenset()


def test_the_version_moves_when_taken_may_have_changed() -> None:
    clock = Clock()
    ledger = Ledger(grace=1.0, max_age=10.0, clock=clock)
    first = ledger.version
    ledger.allocated(GPU, ["a"])
    second = ledger.version
    assert second != first
    clock.advance(11.0)  # expiry alone must move it too: callers cache on it
    assert ledger.version != second


# -- the coordinator's pairing -------------------------------------------------------


def coordinator(clock: Clock) -> tuple[Coordinator, list[str], list[str]]:
    gpus, hcas = devices_from_spec(LAYOUTS["hgx-h100"]())
    coord = Coordinator(Ledger(clock=clock), pairing_window=2.0, clock=clock)
    coord.set_topology(Topology(gpus, hcas))
    gpu_ids, hca_ids = [g.uuid for g in gpus], [h.device_id for h in hcas]
    coord.set_healthy(GPU, gpu_ids)
    coord.set_healthy(HCA, hca_ids)
    return coord, gpu_ids, hca_ids


def test_the_other_resource_within_the_window_is_the_same_containers_second() -> None:
    clock = Clock()
    coord, gpus, hcas = coordinator(clock)
    coord.allocated(GPU, gpus[:2])
    clock.advance(1.9)
    choice, role = coord.preferred(HCA, hcas, (), 2)
    assert role is Role.SECOND
    # Chosen against the GPUs just given: the best worst GPU-HCA level.
    topology = coord.topology

    def worst(chosen: tuple[str, ...]) -> int:
        return max(min(topology.level(g, h) for h in chosen) for g in gpus[:2])

    best = min(worst(pair) for pair in itertools.combinations(hcas, 2))
    assert worst(tuple(choice.ids)) == best


def test_after_the_window_a_request_is_a_first_one() -> None:
    clock = Clock()
    coord, gpus, hcas = coordinator(clock)
    coord.allocated(GPU, gpus[:2])
    clock.advance(2.1)
    _, role = coord.preferred(HCA, hcas, (), 2)
    assert role is Role.FIRST


def test_a_completed_pair_teaches_the_partner_count_for_that_shape() -> None:
    clock = Clock()
    coord, gpus, hcas = coordinator(clock)
    assert coord.expected_partners(GPU, 4) == 4  # no history: one HCA per GPU
    coord.allocated(GPU, gpus[:4])
    clock.advance(0.5)
    coord.allocated(HCA, hcas[:1])
    assert coord.expected_partners(GPU, 4) == 1
    assert coord.expected_partners(HCA, 1) == 4
    # A GPU pod nothing followed within the window: next time, no partner.
    coord.allocated(GPU, gpus[4:6])
    clock.advance(3.0)
    coord.allocated(GPU, gpus[6:7])
    assert coord.expected_partners(GPU, 2) == 0


# -- the registrar's backoff ----------------------------------------------------------


def test_registration_backs_off_exponentially_and_a_new_kubelet_resets_it(
    sock_dir: Path,
) -> None:
    clock = Clock()
    servicer = DevicePluginServicer(GpuResource(), ResourceState(devices=(), allocations={}))
    server = PluginServer(servicer, sock_dir / "gpu.sock")
    # A kubelet.sock nothing listens on: every Register fails at once.
    (sock_dir / KUBELET_SOCKET).write_text("")
    registrar = Registrar(
        [server],
        sock_dir,
        interval=0.2,
        register_timeout=0.5,
        backoff_initial=0.1,
        backoff_max=0.8,
        clock=clock,
    )
    server.start()
    try:
        attempts = lambda: registrar.attempts()["nvidia.com/gpu"]  # noqa: E731
        times: list[float] = []
        for _ in range(200):  # 20 s of ticks, 0.1 s apart
            before = attempts()
            registrar.tick()
            if attempts() > before:
                times.append(round(clock() - 1000.0, 1))
            clock.advance(0.1)
        gaps = [round(b - a, 1) for a, b in itertools.pairwise(times)]
        assert gaps[:4] == [0.1, 0.2, 0.4, 0.8]
        assert set(gaps[4:]) == {0.8}  # capped
        # A restarted kubelet (a new socket file) is tried at the next tick.
        (sock_dir / KUBELET_SOCKET).unlink()
        (sock_dir / KUBELET_SOCKET).write_text("")
        before = attempts()
        registrar.tick()
        assert attempts() == before + 1
        assert registrar.registered() == {"nvidia.com/gpu": False}
    finally:
        server.stop()
