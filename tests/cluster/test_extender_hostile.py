"""Hostile HTTP clients of the extender and of the node's status endpoint:
trickled bodies, idle connections by the hundred, a full call pool. Over
real sockets, with the API server imitation."""

from __future__ import annotations

import copy
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from devplugin.extender.serving import CONCURRENT, ExtenderServer
from devplugin.node.status import CONNECTION_TIMEOUT
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.node import hgx_node
from tests.conftest import Cluster
from tests.extender_support import (
    GPU,
    HCA,
    Running,
    call,
    extender,
    lease,
    pod,
    post,
    put_record,
    stamp,
    synced,
)
from tests.support import probe
from tests.waiting import wait_until

__all__ = ["extender"]


@pytest.fixture
def quick_server(extender: Running) -> Iterator[ExtenderServer]:
    """A second front on the same extender, with short limits."""
    server = ExtenderServer(extender[0], ("127.0.0.1", 0), timeout=1.0, idle=0.5, full_for=0.5)
    server.start()
    yield server
    server.stop()


FILTER = {"Pod": {"metadata": {"name": "p", "namespace": "default", "uid": "u"},
                  "spec": {"containers": [{"name": "c"}]}}, "NodeNames": []}  # fmt: skip


class Trickler:
    """Connections that send a request's headers, then a byte of its body now and then."""

    def __init__(self, address: tuple[str, int], count: int, every: float) -> None:
        self.socks = [socket.create_connection(address, timeout=5) for _ in range(count)]
        for sock in self.socks:
            sock.sendall(
                b"POST /scheduler/filter HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
            )
        self.cut: set[int] = set()
        self._every = every
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self._every):
            for index, sock in enumerate(self.socks):
                if index in self.cut:
                    continue
                try:
                    sock.sendall(b" ")
                except OSError:
                    self.cut.add(index)

    def close(self) -> None:
        self._done.set()
        self._thread.join(5)
        for sock in self.socks:
            sock.close()


def test_trickled_bodies_hold_no_call_slot(extender: Running) -> None:
    trickler = Trickler(extender[1].address, CONCURRENT + 2, 0.3)
    try:
        time.sleep(0.5)
        for _ in range(3):
            started = time.monotonic()
            status, _ = call(extender, "filter", FILTER)
            assert status == 200
            assert time.monotonic() - started < 3
    finally:
        trickler.close()


def test_a_trickled_request_is_cut_off_at_its_whole_deadline(quick_server: ExtenderServer) -> None:
    trickler = Trickler(quick_server.address, 2, 0.1)
    try:
        # A byte every 0.1 s would keep a per-recv timeout of 1 s happy forever.
        assert wait_until(lambda: len(trickler.cut) == 2, timeout=5)
    finally:
        trickler.close()


def _filter_over(address: tuple[str, int]) -> int:
    return post(address, "filter", FILTER)[0]


def test_idle_connections_by_the_thousand_hold_no_thread_and_block_no_call(
    extender: Running,
) -> None:
    def serving() -> int:
        # The front's own threads (its loop, its call workers); the API
        # imitation in this process starts threads of its own meanwhile.
        return sum(t.name.startswith("extender-http") for t in threading.enumerate())

    threads, total = serving(), threading.active_count()
    idle = [socket.create_connection(extender[1].address, timeout=5) for _ in range(1500)]
    try:
        assert wait_until(lambda: extender[1].connections >= 1500, timeout=10)
        assert serving() == threads
        # A thread per connection would be hundreds more.
        assert threading.active_count() <= total + 20
        assert _filter_over(extender[1].address) == 200
        assert _filter_over(extender[1].address) == 200
    finally:
        for sock in idle:
            sock.close()


def test_past_the_cap_the_longest_idle_connection_makes_room(extender: Running) -> None:
    server = ExtenderServer(extender[0], ("127.0.0.1", 0), max_connections=64)
    server.start()
    idle = [socket.create_connection(server.address, timeout=5) for _ in range(64)]
    try:
        assert wait_until(lambda: server.connections == 64, timeout=5)
        assert _filter_over(server.address) == 200
        # The first idle one was closed for it.
        idle[0].settimeout(5)
        assert idle[0].recv(1) == b""
    finally:
        for sock in idle:
            sock.close()
        server.stop()


def test_idle_connections_are_closed_after_the_idle_timeout(quick_server: ExtenderServer) -> None:
    idle = [socket.create_connection(quick_server.address, timeout=5) for _ in range(50)]
    try:
        assert wait_until(lambda: quick_server.connections == 50, timeout=5)
        assert wait_until(lambda: quick_server.connections == 0, timeout=5)
    finally:
        for sock in idle:
            sock.close()


def test_healthz_fails_while_every_call_slot_stays_busy(quick_server: ExtenderServer) -> None:
    host, port = quick_server.address

    def healthz() -> int:
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=5) as answer:
                return int(answer.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    assert healthz() == 200
    for _ in range(CONCURRENT):
        assert quick_server.slots.take_one()
    try:
        assert wait_until(lambda: healthz() == 503, timeout=5)
    finally:
        for _ in range(CONCURRENT):
            quick_server.slots.give_one()
    assert healthz() == 200


def test_the_status_endpoint_cuts_off_a_trickled_request(start_cluster: object) -> None:
    cluster: Cluster = start_cluster(hgx_node())  # type: ignore[operator]
    assert cluster.daemon.status is not None
    address = cluster.daemon.status.bound[0]
    sock = socket.create_connection(address, timeout=5)
    sock.sendall(b"GET /healthz HTTP/1.1\r\n")
    started, cut = time.monotonic(), False
    try:
        while time.monotonic() - started < CONNECTION_TIMEOUT + 4:
            time.sleep(0.5)
            try:
                sock.sendall(b"X")  # a header that never ends
            except OSError:
                cut = True
                break
            sock.settimeout(0.01)
            try:
                if sock.recv(1) == b"":
                    cut = True
                    break
            except TimeoutError:
                pass
            except ConnectionResetError:  # cut with a reset (data was unread): cut all the same
                cut = True
                break
    finally:
        sock.close()
    assert cut
    assert time.monotonic() - started < CONNECTION_TIMEOUT + 3
    assert probe(cluster, "/healthz")[0] == 200


def forged_lease(
    api: ApiServerImitation, name: str, node: str, renew: str, duration: int = 40
) -> None:
    api.put("leases", {
        "metadata": {"name": name, "namespace": "default", "labels": {"devplugin.io/node": node}},
        "spec": {"holderIdentity": node, "leaseDurationSeconds": duration, "renewTime": renew},
    })  # fmt: skip


def scores(running: Running, names: list[str]) -> dict[str, int]:
    args = {"Pod": pod("t", [{GPU: 2, HCA: 2}]), "NodeNames": names}
    return {e["Host"]: e["Score"] for e in call(running, "prioritize", args)[1]}


def test_a_lease_is_timed_by_the_extender_not_by_the_time_it_carries(
    api: ApiServerImitation, tmp_path: Path, extender: Running
) -> None:
    put_record(api, "forged", "hgx-h100", tmp_path, age=3600)
    put_record(api, "live", "hgx-h100", tmp_path, age=3600)
    put_record(api, "shadowed", "hgx-h100", tmp_path, age=3600)
    # Renewed "in 2099", and never again.
    forged_lease(api, "devplugin-forged", "forged", "2099-01-01T00:00:00.000000Z")
    lease(api, "live", age=0)
    lease(api, "shadowed", age=0)
    # A second Lease labelled for a live node, saying it died long ago.
    forged_lease(api, "not-its-lease", "shadowed", "2001-01-01T00:00:00.000000Z")
    synced(extender, {"forged", "live", "shadowed"})
    names = ["forged", "live", "shadowed"]
    assert wait_until(lambda: set(names) <= set(extender[0].leases.items()), timeout=10)
    assert wait_until(lambda: scores(extender, names)["live"] > 0, timeout=5)
    found = scores(extender, names)
    assert found["forged"] == 0  # a renewal in the future is none
    assert found["shadowed"] == found["live"] > 0  # the real Lease counts, not the forged one
    # The forged node's daemon comes back and renews: from then on it counts.
    lease(api, "forged", age=0)
    assert wait_until(lambda: scores(extender, names)["forged"] > 0, timeout=5)


def test_a_lease_that_stops_changing_goes_stale_with_no_event_after_it_was_scored(
    api: ApiServerImitation, tmp_path: Path, extender: Running
) -> None:
    # The answer is kept between calls; only time says the daemon is gone.
    for node in ("quiet", "live"):
        put_record(api, node, "hgx-h100", tmp_path, age=3600)
    lease(api, "live", age=0)
    now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
    forged_lease(api, "devplugin-quiet", "quiet", now, duration=4)
    synced(extender, {"quiet", "live"})
    assert wait_until(lambda: {"quiet", "live"} <= set(extender[0].leases.items()), timeout=3)
    assert scores(extender, ["quiet", "live"])["quiet"] > 0
    assert wait_until(lambda: scores(extender, ["quiet", "live"])["quiet"] == 0, timeout=10)
    assert scores(extender, ["quiet", "live"])["live"] > 0


def _gpus(record: dict[str, Any]) -> list[dict[str, Any]]:
    return [d for d in record["status"]["devices"] if d["kind"] == "gpu"]


def _duplicate_id(record: dict[str, Any]) -> None:
    gpus = _gpus(record)
    gpus[1]["id"] = gpus[0]["id"]


def _shared_address(record: dict[str, Any]) -> None:
    hca = next(d for d in record["status"]["devices"] if d["kind"] == "hca")
    _gpus(record)[0]["pciAddress"] = hca["pciAddress"]


def _one_sided(record: dict[str, Any]) -> None:
    gpus = _gpus(record)
    gpus[0]["nvlinkPeers"] = [{"id": gpus[1]["id"], "links": 12}]
    gpus[1]["nvlinkPeers"] = []


def _self_peer(record: dict[str, Any]) -> None:
    gpu = _gpus(record)[0]
    gpu["nvlinkPeers"] = [{"id": gpu["id"], "links": 12}]


def _huge_count(record: dict[str, Any]) -> None:
    gpus = _gpus(record)
    gpus[0]["nvlinkPeers"] = [{"id": gpus[1]["id"], "links": 2**70}]
    gpus[1]["nvlinkPeers"] = [{"id": gpus[0]["id"], "links": 2**70}]


MALFORMED = {
    "duplicate GPU ids": _duplicate_id,
    "a GPU and an HCA on one PCI address": _shared_address,
    "a one-sided NVLink": _one_sided,
    "a GPU its own NVLink peer": _self_peer,
    "2^70 NVLinks": _huge_count,
}


@pytest.mark.parametrize("damage", list(MALFORMED.values()), ids=list(MALFORMED))
def test_a_malformed_record_leaves_its_node_unscored_with_one_line_and_a_metric(
    api: ApiServerImitation,
    tmp_path: Path,
    extender: Running,
    caplog: pytest.LogCaptureFixture,
    damage: Callable[[dict[str, Any]], None],
) -> None:
    put_record(api, "correct", "hgx-h100", tmp_path)
    bad = put_record(api, "malformed", "hgx-h100", tmp_path)
    synced(extender, {"correct", "malformed"})
    assert scores(extender, ["correct", "malformed"])["malformed"] > 0
    with caplog.at_level(logging.WARNING):
        broken = copy.deepcopy(bad)
        damage(broken)
        for _ in range(3):  # rewritten: still one line
            broken["status"]["updated"] = stamp()
            api.put("nodedevices", copy.deepcopy(broken))
        assert wait_until(lambda: "malformed" not in extender[0].records.items(), timeout=5)
    found = scores(extender, ["correct", "malformed"])
    assert found["malformed"] == 0
    assert found["correct"] > 0
    lines = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    refused = extender[0].metrics.registry.get_sample_value(
        "devplugin_watch_refused_objects", {"cache": "nodedevices"}
    )
    assert refused is not None
    assert refused >= 1
