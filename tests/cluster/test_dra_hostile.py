"""Hostile input on the DRA socket: claim uids that are paths, huge names,
a claim named twice, more claims than the kubelet waits for; and a slice
generation at the int64 limit. Over real gRPC on real unix sockets, with the
API server imitation."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from devplugin.cluster.slices import GENERATION_MAX, next_generation
from devplugin.testing.dra_kubelet import ClaimCall
from devplugin.testing.node import hgx_node
from tests.dra_support import DraCluster, start_dra
from tests.waiting import wait_until

__all__ = ["start_dra"]

Start = Callable[..., DraCluster]


def ready(start: Start) -> DraCluster:
    cluster = start(hgx_node())
    assert wait_until(lambda: len(cluster.devices()) == 16, timeout=10)
    return cluster


def refused(cluster: DraCluster, *claims: ClaimCall) -> str:
    with pytest.raises(grpc.RpcError) as caught:
        cluster.prepare(*claims)
    call = caught.value
    assert isinstance(call, grpc.Call)
    assert call.code() is grpc.StatusCode.INVALID_ARGUMENT
    return call.details() or ""


def test_a_uid_that_is_a_path_is_refused_and_no_file_outside_the_directory_changes(
    start_dra: Start, tmp_path: Path
) -> None:
    cluster = ready(start_dra)
    outside = cluster.cdi_dir.parent / "victim.json"
    outside.write_text("{}")
    for uid in ("../victim", "../../etc/x", "a/b", "..", "uid.json"):
        for call in (cluster.prepare, cluster.unprepare):
            with pytest.raises(grpc.RpcError) as caught:
                call(ClaimCall("default", uid, "c"))
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert outside.read_text() == "{}"
    assert sorted(p.name for p in cluster.cdi_dir.parent.iterdir() if p.suffix == ".json") == [
        "victim.json"
    ]
    # The driver keeps serving.
    gpu = sorted(name for name in cluster.devices() if name.startswith("gpu-"))[0]
    claim = cluster.claim("fine", [("gpu", gpu)])
    assert cluster.prepare(claim)[claim.uid]["error"] == ""


def test_huge_names_get_a_short_error_and_a_short_log(
    start_dra: Start, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = ready(start_dra)
    huge = "n" * 1_000_000
    for claim in (
        ClaimCall("default", "u-1", huge),
        ClaimCall(huge, "u-2", "c"),
        ClaimCall("default", "u" * 1_000_000, "c"),
    ):
        caplog.clear()
        details = refused(cluster, claim)
        assert len(details) < 2000, len(details)
        logged = sum(len(record.getMessage()) for record in caplog.records)
        assert logged < 4000, logged


def test_a_claim_named_twice_in_one_call_is_prepared_and_answered_once(
    start_dra: Start,
) -> None:
    cluster = ready(start_dra)
    gpu = sorted(name for name in cluster.devices() if name.startswith("gpu-"))[0]
    claim = cluster.claim("twice", [("gpu", gpu)])
    answer = cluster.prepare(claim, claim)
    assert list(answer) == [claim.uid]
    assert [d["device"] for d in answer[claim.uid]["devices"]] == [gpu]
    # One uid for two claims is not a kubelet's call.
    other = ClaimCall("default", claim.uid, "another")
    assert "named twice" in refused(cluster, claim, other)


def test_claims_past_the_callers_deadline_are_not_started(start_dra: Start) -> None:
    cluster = ready(start_dra)
    cluster.api.delay = 0.05  # each claim read takes a while
    cluster.kubelet.call_timeout = 1.0
    claims = [ClaimCall("default", f"missing-{i}", f"missing-{i}") for i in range(1024)]
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        cluster.prepare(*claims)
    assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
    cluster.api.delay = 0.0
    # The daemon stopped working for that call soon after the kubelet gave up:
    # a claim read now is answered at once, not after 1,024 reads.
    reads = len(cluster.api.requests)
    time.sleep(0.5)
    assert len(cluster.api.requests) - reads < 5
    cluster.kubelet.call_timeout = 10.0
    gpu = sorted(name for name in cluster.devices() if name.startswith("gpu-"))[0]
    claim = cluster.claim("after", [("gpu", gpu)])
    assert cluster.prepare(claim)[claim.uid]["error"] == ""
    assert time.monotonic() - started < 20


def test_the_slice_generation_stays_within_int64() -> None:
    assert next_generation([]) == 1
    assert next_generation([4, 4]) == 5
    assert next_generation([GENERATION_MAX - 1]) == GENERATION_MAX
    assert next_generation([GENERATION_MAX]) == 1
    assert next_generation([-3]) == 1


def test_a_pool_at_the_int64_generation_limit_is_rewritten_at_generation_one(
    start_dra: Start,
) -> None:
    cluster = ready(start_dra)
    # Someone (or a long life) left the pool's slices at the last int64.
    for item in cluster.slices():
        item["spec"]["pool"]["generation"] = GENERATION_MAX
        cluster.api.put("resourceslices", item)
    # A change to publish: a port goes down.
    hca = cluster.node.hcas[0]
    (hca.directory / "infiniband" / hca.name / "ports" / "1" / "state").write_text("1: DOWN\n")

    def generations() -> set[int]:
        return {item["spec"]["pool"]["generation"] for item in cluster.slices()}

    assert wait_until(lambda: generations() == {1}, timeout=10), generations()
    assert len(cluster.devices()) == 16
