"""The extender's work follows events: per-node views rebuilt only for the
node that changed, pod events indexed one pod at a time, layouts built once
(large ones off the record cache's thread), bounded requests. Over real
HTTP against the API server imitation where a cluster is involved."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import random
import socket

import pytest

from devplugin.cluster.pods import PodCache
from devplugin.extender.views import INLINE_DEVICES, MAX_DEVICES, Layouts, parse_record
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.records import gpu_id, hca_id, hgx_record
from devplugin.web import BodyBudget
from tests.extender_support import GPU, HCA, Running, call, extender, pod, stamp
from tests.waiting import wait_until

__all__ = ["extender"]


def put(api: ApiServerImitation, record: dict[str, object]) -> None:
    record["status"]["updated"] = stamp()  # type: ignore[index]
    api.put("nodedevices", record)


def cluster(api: ApiServerImitation, running: Running, count: int) -> list[str]:
    names = [f"n{i}" for i in range(count)]
    for name in names:
        put(api, hgx_record(name))
    assert wait_until(lambda: all(running[0].records.get(n) for n in names), timeout=10)
    return names


def builds(running: Running) -> int:
    return running[0].views.builds


def test_views_are_rebuilt_for_the_node_that_changed_and_no_other(
    api: ApiServerImitation, extender: Running
) -> None:
    names = cluster(api, extender, 6)
    args = {"Pod": pod("t", [{GPU: 2, HCA: 2}]), "NodeNames": names}
    assert call(extender, "filter", args)[1]["NodeNames"] == names
    warm = builds(extender)
    assert warm == len(names)
    for verb in ("filter", "prioritize", "filter"):
        call(extender, verb, args)
    assert builds(extender) == warm  # nothing changed: read, not recomputed
    # A pod bound to n2 (not in its record yet): n2's view alone is rebuilt.
    bound = pod("bound", [{GPU: 8, HCA: 8}])
    bound["spec"]["nodeName"] = "n2"
    api.put("pods", bound)
    assert wait_until(lambda: extender[0].pods.generation("n2") > 0, timeout=5)
    result = call(extender, "filter", args)[1]
    assert result["NodeNames"] == [n for n in names if n != "n2"]
    assert builds(extender) == warm + 1
    # n4's record changes (two GPUs held): n4's view alone is rebuilt.
    record = hgx_record("n4", held=[("p", "uid-p", [gpu_id(0), gpu_id(1), hca_id(0)])], version="2")
    before = extender[0].records.get("n4")
    put(api, record)
    assert wait_until(lambda: extender[0].records.get("n4") is not before, timeout=5)
    # The next pod's cycle (the one just filtered would score its filter's
    # answers: one cycle, one snapshot).
    later = {"Pod": pod("t2", [{GPU: 2, HCA: 2}]), "NodeNames": names}
    ranked = {e["Host"]: e["Score"] for e in call(extender, "prioritize", later)[1]}
    assert builds(extender) == warm + 2
    assert ranked["n2"] == 0
    assert all(ranked[n] > 0 for n in names if n != "n2")


def test_nodes_alike_share_one_placement_and_a_node_that_differs_gets_its_own(
    api: ApiServerImitation, extender: Running
) -> None:
    names = cluster(api, extender, 6)
    # n5 has six GPUs held: a 4 + 4 pod no longer fits there.
    held = [("p", "uid-p", [gpu_id(i) for i in range(6)])]
    put(api, hgx_record("n5", held=held, version="2"))
    assert wait_until(lambda: extender[0].records.get("n5").parsed.holdings, timeout=5)
    views = extender[0].views
    before = views.placements
    args = {"Pod": pod("t", [{GPU: 4, HCA: 4}]), "NodeNames": names}
    result = call(extender, "filter", args)[1]
    assert result["NodeNames"] == names[:5]
    assert set(result["FailedNodes"]) == {"n5"}
    # Five empty HGX nodes: one placement answered them all; n5 its own.
    assert views.placements == before + 2
    ranked = {e["Host"]: e["Score"] for e in call(extender, "prioritize", args)[1]}
    assert len({ranked[n] for n in names[:5]}) == 1
    assert views.placements == before + 2


def test_a_health_or_holder_change_reuses_the_layout_and_a_large_one_is_built_apart() -> None:
    ready: list[str] = []
    layouts = Layouts(on_ready=ready.append)
    small = parse_record(hgx_record("s"))
    small_kept = layouts.want(small)
    assert layouts.get("s", small.layout_key) is not None  # small: built at once
    assert layouts.built == 1
    changed = parse_record(
        hgx_record("s", unhealthy=[gpu_id(3)], held=[("p", "u", [gpu_id(0)])], version="2")
    )
    assert changed.layout_key == small.layout_key
    layouts.want(changed)
    assert layouts.built == 1  # the same hardware: the same topology
    # Another node of the same model (its own GPU UUIDs): the same layout, shared.
    twin = hgx_record("t")
    for device in twin["status"]["devices"]:  # type: ignore[index]
        device["id"] = device["id"].replace("GPU-0", "GPU-f")
        for peer in device.get("nvlinkPeers", []):
            peer["id"] = peer["id"].replace("GPU-0", "GPU-f")
    kept = layouts.want(parse_record(twin))
    assert layouts.built == 1
    assert kept.gpus == ()
    assert kept.layout_key is small_kept.layout_key
    rewired = parse_record(hgx_record("s", per_switch=4))
    assert rewired.layout_key != small.layout_key
    layouts.want(rewired)
    assert layouts.built == 2
    # Past INLINE_DEVICES the build goes to the builder: `want` returns first.
    big = parse_record(hgx_record("b", gpus=INLINE_DEVICES, hcas=INLINE_DEVICES))
    layouts.want(big)
    assert wait_until(lambda: ready == ["b"], timeout=30)
    found = layouts.get("b", big.layout_key)
    assert found is not None
    assert len(found.topology.kind) == 2 * INLINE_DEVICES
    layouts.stop()


def test_a_record_past_the_limit_is_refused_with_one_log_line_and_the_node_passes(
    api: ApiServerImitation, extender: Running, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ValueError, match=f"at most {MAX_DEVICES}"):
        parse_record(hgx_record("x", gpus=MAX_DEVICES, hcas=1))
    caplog.set_level(logging.WARNING, logger="devplugin.cluster.watch")
    names = cluster(api, extender, 1)
    for version in ("1", "2", "3"):
        put(api, hgx_record("huge", gpus=MAX_DEVICES, hcas=8, version=version))
    put(api, hgx_record("after", version="1"))
    assert wait_until(lambda: extender[0].records.get("after") is not None, timeout=10)
    refused = [r for r in caplog.records if "huge" in r.getMessage()]
    assert len(refused) == 1, [r.getMessage() for r in refused]
    assert f"at most {MAX_DEVICES}" in refused[0].getMessage()
    args = {"Pod": pod("t", [{GPU: 8, HCA: 8}]), "NodeNames": [*names, "huge", "after"]}
    assert call(extender, "filter", args)[1]["NodeNames"] == [*names, "huge", "after"]


def test_the_extender_keeps_only_pods_with_device_requests_trimmed(
    api: ApiServerImitation, extender: Running
) -> None:
    plain = pod("web", [{}], team="a")
    plain["spec"]["nodeName"] = "n0"
    gpu = pod("train", [{GPU: 2, "example.com/fpga": 1}], team="b")
    gpu["spec"]["nodeName"] = "n0"
    api.put("pods", plain)
    api.put("pods", gpu)
    pods = extender[0].pods
    assert wait_until(lambda: len(pods) == 1, timeout=5)
    (kept,) = pods.items().values()
    assert kept.name == "train"
    assert dict(kept.containers[0].requests) == {GPU: 2}
    assert dict(kept.annotations) == {}


def test_pod_indexes_kept_one_event_at_a_time_match_a_full_recount(
    api: ApiServerImitation, extender: Running
) -> None:
    rng = random.Random(7)
    live: list[str] = []
    for step in range(300):
        if live and rng.random() < 0.3:
            api.remove("pods", live.pop(rng.randrange(len(live))), "default")
            continue
        if live and rng.random() < 0.3:
            api.set_status("pods", rng.choice(live), "default",
                           {"phase": rng.choice(["Running", "Succeeded", "Pending"])})  # fmt: skip
            continue
        name = f"p{step}"
        body = pod(name, [{GPU: rng.randint(1, 4), HCA: rng.randint(0, 2)}])
        body["metadata"]["creationTimestamp"] = f"2026-12-03T10:{rng.randrange(60):02d}:00Z"
        if rng.random() < 0.8:
            body["spec"]["nodeName"] = f"n{rng.randrange(5)}"
        api.put("pods", body)
        live.append(name)
    cache: PodCache = extender[0].pods
    assert wait_until(lambda: {p.name for p in cache.items().values()} == set(live), timeout=10)
    everything = list(cache.items().values())

    def order(p: object) -> tuple[str, str, str]:
        return (p.created, p.namespace, p.name)  # type: ignore[attr-defined]

    for node in [f"n{i}" for i in range(5)]:
        expected = sorted((p for p in everything if p.node == node and not p.terminal), key=order)
        assert list(cache.on_node(node)) == expected
    waiting = sorted(
        (p for p in everything if not (p.started or p.terminal or p.deleting)), key=order
    )
    assert list(cache.waiting()) == waiting
    for p in everything:
        assert cache.uid_of(p.namespace, p.name) == p.uid


def test_json_nested_too_deeply_is_a_400_and_service_goes_on(extender: Running) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    code, answer = call(extender, "filter", None, raw=deep)
    assert code == 400
    assert "nested too deeply" in answer["Error"]
    code, answer = call(extender, "filter", {"Pod": pod("ok", [{}]), "NodeNames": ["x"]})
    assert (code, answer["NodeNames"]) == (200, ["x"])


def test_a_body_past_the_cap_is_refused_before_it_is_read(extender: Running) -> None:
    host, port = extender[1].address
    connection = http.client.HTTPConnection(host, port, timeout=10)
    connection.putrequest("POST", "/scheduler/filter")
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Content-Length", str(1 << 30))  # 1 GiB promised, none sent
    connection.endheaders()
    answer = connection.getresponse()
    assert answer.status == 400
    assert "larger than" in json.loads(answer.read())["Error"]
    connection.close()


def test_two_hundred_connections_at_once_all_get_answers(extender: Running) -> None:
    host, port = extender[1].address
    body = json.dumps({"Pod": pod("ok", [{}]), "NodeNames": ["x"]}).encode()
    opened = []
    for _ in range(200):
        sock = socket.create_connection((host, port), timeout=20)
        opened.append(sock)
    request = (
        b"POST /scheduler/filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    for sock in opened:
        sock.sendall(request)
    answered = 0
    for sock in opened:
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        answered += data.startswith(b"HTTP/1.1 200")
        sock.close()
    assert answered == 200


def test_the_body_budget_lets_small_bodies_share_and_makes_a_large_one_wait() -> None:
    async def scenario() -> None:
        budget = BodyBudget(100)
        assert await budget.take(40, 0.1)
        assert await budget.take(40, 0.1)
        assert not await budget.take(40, 0.05)  # 120 > 100: waits, then gives up
        later = asyncio.get_running_loop().call_later(
            0.05, lambda: asyncio.ensure_future(budget.give(40))
        )
        assert await budget.take(40, 5.0)  # in once the first is given back
        later.cancel()
        await budget.give(40)
        await budget.give(40)
        assert await budget.take(500, 0.1)  # larger than the whole budget: runs alone
        assert not await budget.take(1, 0.05)
        await budget.give(500)
        assert await budget.take(100, 0.1)

    asyncio.run(scenario())
