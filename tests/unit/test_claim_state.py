"""DRA claims in the lifecycle checkpoint: the DRA claim ledger on the custody book,
without gRPC (the driver's tests drive it through the kubelet's calls)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from devplugin.frontends.dra.claim_record import ClaimDevice, ClaimRecord
from devplugin.model import DeviceKind
from devplugin.node.lifecycle.checkpoint import Checkpoint
from tests.support import Node, Runner
from tests.waiting import wait_until

GPU, HCA = DeviceKind.GPU, DeviceKind.HCA


def claim(uid: str, *ids: str, completed: bool = False) -> ClaimRecord:
    devices = tuple(
        ClaimDevice(GPU, i, "node-a", f"gpu-{i}", ("gpu",), (f"k8s.devplugin.io/claim={uid}-{i}",))
        for i in ids
    )
    return ClaimRecord(uid, "ns", f"claim-{uid}", devices, completed=completed)


def dra_node(runner: Runner, tmp_path: Path, **kwargs: object) -> Node:
    return Node(runner, tmp_path, explicit=[GPU], **kwargs)


def test_a_claim_holds_its_devices_until_it_ends_then_they_are_cleaned(tmp_path: Path) -> None:
    runner = Runner([True])
    node = dra_node(runner, tmp_path, confirmations=1)
    node.lifecycle.start()
    try:
        assert node.claims.begin(claim("u1", "a", "b")) is None
        assert node.book.in_use(GPU) == {"a", "b"}
        assert node.claims.claimed_by(GPU, "a") == "u1"
        # PodResources lists no DRA device: polls must not release them.
        node.observe({GPU: set()}, time.monotonic() + 10)
        node.observe({GPU: set()}, time.monotonic() + 11)
        assert node.book.in_use(GPU) == {"a", "b"}
        assert runner.calls == []
        assert node.claims.complete(claim("u1", "a", "b")) is None
        stored = node.claims.claim("u1")
        assert stored is not None
        assert stored.completed
        ended = node.claims.end("u1")
        assert ended is not None
        assert ended.uid == "u1"
        assert wait_until(lambda: sorted(map(tuple, runner.calls)) == [("a",), ("b",)])
        assert wait_until(lambda: node.book.verdicts() == {})
        assert node.book.in_use(GPU) == set()
        assert node.claims.end("u1") is None  # an unknown claim: nothing to do
    finally:
        node.lifecycle.stop()


def test_a_device_of_another_claim_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    node = dra_node(Runner([]), tmp_path)
    assert node.claims.begin(claim("u1", "a")) is None
    error = node.claims.begin(claim("u2", "b", "a"))
    assert str(error) == "a is prepared for claim u1"
    assert node.claims.claim("u2") is None
    assert node.book.in_use(GPU) == {"a"}
    assert node.claims.claimed_by(GPU, "b") is None
    # The same claim again (a retried prepare) is not a conflict.
    assert node.claims.begin(claim("u1", "a")) is None


def test_claims_and_their_state_survive_a_restart(tmp_path: Path) -> None:
    node = dra_node(Runner([]), tmp_path)
    assert node.claims.begin(claim("done", "a")) is None
    assert node.claims.complete(claim("done", "a")) is None
    assert node.claims.begin(claim("half", "b")) is None
    saved = json.loads((tmp_path / "c.json").read_text())
    assert {c["uid"]: c["state"] for c in saved["claims"]} == {
        "done": "completed",
        "half": "started",
    }
    restarted = dra_node(Runner([]), tmp_path)
    restarted.lifecycle.load()
    assert not restarted.claims.untrusted
    done, half = restarted.claims.claim("done"), restarted.claims.claim("half")
    assert done is not None
    assert done.completed
    assert done.devices == claim("done", "a").devices
    assert half is not None
    assert not half.completed
    # A claimed device is known to be in use: offered, not awaiting anything.
    assert restarted.book.verdicts() == {}
    assert restarted.book.in_use(GPU) == {"a", "b"}


def test_a_failed_checkpoint_write_refuses_the_claim(tmp_path: Path) -> None:
    node = dra_node(Runner([]), tmp_path)
    assert node.claims.begin(claim("u0", "z")) is None
    # A directory where the file goes: the rename over it fails (even as root).
    (tmp_path / "c.json").unlink()
    (tmp_path / "c.json").mkdir()
    error = node.claims.begin(claim("u1", "a"))
    assert error is not None
    assert str(error).startswith("checkpoint not written")
    assert node.claims.claim("u1") is None
    assert node.book.in_use(GPU) == {"z"}
    assert node.claims.complete(claim("u0", "z")) is not None
    stored = node.claims.claim("u0")
    assert stored is not None
    assert not stored.completed


def test_without_a_checkpoint_devices_wait_for_the_claims_list(tmp_path: Path) -> None:
    runner = Runner([True])
    node = dra_node(runner, tmp_path)
    node.lifecycle.load()
    assert node.claims.untrusted
    node.view.present(GPU, ["a", "b", "c"])
    verdict = node.book.verdict((GPU, "a"))
    assert verdict is not None
    assert verdict.reason == "no trustworthy checkpoint; awaiting the claims list"
    node.lifecycle.start()
    try:
        # The API says claim u9 holds b: it stays in use; a and c are cleaned.
        node.claims.adopt(claim("u9", "b", completed=True))
        assert node.claims.release_unclaimed([GPU]) == 2
        assert wait_until(lambda: sorted(map(tuple, runner.calls)) == [("a",), ("c",)])
        assert wait_until(lambda: node.book.verdicts() == {})
        assert node.book.in_use(GPU) == {"b"}
        assert node.claims.claimed_by(GPU, "b") == "u9"
    finally:
        node.lifecycle.stop()


@pytest.mark.parametrize(
    "entry",
    [
        {"uid": "", "namespace": "n", "name": "c", "state": "completed"},
        {"uid": "u", "namespace": "n", "name": "c", "state": "halfway"},
        {"uid": "u", "namespace": "n", "name": "c", "state": "started", "devices": [{}]},
        {
            "uid": "u",
            "namespace": "n",
            "name": "c",
            "state": "started",
            "devices": [{"kind": "gpu", "id": "a", "pool": "p", "device": "d", "requests": "gpu"}],
        },
    ],
)
def test_a_damaged_claim_entry_makes_the_checkpoint_untrusted(
    tmp_path: Path, entry: dict[str, object]
) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"version": 1, "claims": [entry]}))
    state = Checkpoint(path, ClaimRecord.from_json).load()
    assert not state.trusted
    assert state.claims == {}
    assert not path.exists()  # moved aside for an operator


def test_an_admin_access_device_keeps_its_mark_through_the_checkpoint() -> None:
    device = ClaimDevice(DeviceKind.GPU, "GPU-1", "node-1", "gpu-0", ("g",), ("k/c=x",), admin=True)
    assert ClaimDevice.from_json(device.to_json()) == device
    plain = ClaimDevice(DeviceKind.GPU, "GPU-1", "node-1", "gpu-0")
    assert "admin" not in plain.to_json()  # records written before stay as they were
    with pytest.raises(ValueError, match="admin"):
        ClaimDevice.from_json({**device.to_json(), "admin": "yes"})
