"""DRA claims in the lifecycle checkpoint: the cleanup manager's claim side,
without gRPC (the driver's tests drive it through the kubelet's calls)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from devplugin.model import DeviceKind
from devplugin.node.lifecycle.checkpoint import Checkpoint, ClaimDevice, ClaimRecord
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
    cleanup = node.cleanup
    cleanup.start()
    try:
        assert cleanup.begin_claim(claim("u1", "a", "b")) is None
        assert cleanup.in_use(GPU) == {"a", "b"}
        assert cleanup.claimed_by(GPU, "a") == "u1"
        # PodResources lists no DRA device: polls must not release them.
        node.observe({GPU: set()}, time.monotonic() + 10)
        node.observe({GPU: set()}, time.monotonic() + 11)
        assert cleanup.in_use(GPU) == {"a", "b"}
        assert runner.calls == []
        assert cleanup.complete_claim(claim("u1", "a", "b")) is None
        stored = cleanup.claim("u1")
        assert stored is not None
        assert stored.completed
        ended = cleanup.end_claim("u1")
        assert ended is not None
        assert ended.uid == "u1"
        assert wait_until(lambda: sorted(map(tuple, runner.calls)) == [("a",), ("b",)])
        assert wait_until(lambda: cleanup.verdicts() == {})
        assert cleanup.in_use(GPU) == set()
        assert cleanup.end_claim("u1") is None  # an unknown claim: nothing to do
    finally:
        cleanup.stop()


def test_a_device_of_another_claim_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    cleanup = dra_node(Runner([]), tmp_path).cleanup
    assert cleanup.begin_claim(claim("u1", "a")) is None
    error = cleanup.begin_claim(claim("u2", "b", "a"))
    assert str(error) == "a is prepared for claim u1"
    assert cleanup.claim("u2") is None
    assert cleanup.in_use(GPU) == {"a"}
    assert cleanup.claimed_by(GPU, "b") is None
    # The same claim again (a retried prepare) is not a conflict.
    assert cleanup.begin_claim(claim("u1", "a")) is None


def test_claims_and_their_state_survive_a_restart(tmp_path: Path) -> None:
    cleanup = dra_node(Runner([]), tmp_path).cleanup
    assert cleanup.begin_claim(claim("done", "a")) is None
    assert cleanup.complete_claim(claim("done", "a")) is None
    assert cleanup.begin_claim(claim("half", "b")) is None
    saved = json.loads((tmp_path / "c.json").read_text())
    assert {c["uid"]: c["state"] for c in saved["claims"]} == {
        "done": "completed",
        "half": "started",
    }
    restarted = dra_node(Runner([]), tmp_path).cleanup
    restarted.load()
    assert not restarted.untrusted
    done, half = restarted.claim("done"), restarted.claim("half")
    assert done is not None
    assert done.completed
    assert done.devices == claim("done", "a").devices
    assert half is not None
    assert not half.completed
    # A claimed device is known to be in use: offered, not awaiting anything.
    assert restarted.verdicts() == {}
    assert restarted.in_use(GPU) == {"a", "b"}


def test_a_failed_checkpoint_write_refuses_the_claim(tmp_path: Path) -> None:
    cleanup = dra_node(Runner([]), tmp_path).cleanup
    assert cleanup.begin_claim(claim("u0", "z")) is None
    # A directory where the file goes: the rename over it fails (even as root).
    (tmp_path / "c.json").unlink()
    (tmp_path / "c.json").mkdir()
    error = cleanup.begin_claim(claim("u1", "a"))
    assert error is not None
    assert str(error).startswith("checkpoint not written")
    assert cleanup.claim("u1") is None
    assert cleanup.in_use(GPU) == {"z"}
    assert cleanup.complete_claim(claim("u0", "z")) is not None
    stored = cleanup.claim("u0")
    assert stored is not None
    assert not stored.completed


def test_without_a_checkpoint_devices_wait_for_the_claims_list(tmp_path: Path) -> None:
    runner = Runner([True])
    node = dra_node(runner, tmp_path)
    cleanup = node.cleanup
    cleanup.load()
    assert cleanup.untrusted
    cleanup.present(GPU, ["a", "b", "c"])
    verdict = cleanup.verdict(GPU, "a")
    assert verdict is not None
    assert verdict.reason == "no trustworthy checkpoint; awaiting the claims list"
    cleanup.start()
    try:
        # The API says claim u9 holds b: it stays in use; a and c are cleaned.
        cleanup.adopt_claim(claim("u9", "b", completed=True))
        assert cleanup.release_unclaimed([GPU]) == 2
        assert wait_until(lambda: sorted(map(tuple, runner.calls)) == [("a",), ("c",)])
        assert wait_until(lambda: cleanup.verdicts() == {})
        assert cleanup.in_use(GPU) == {"b"}
        assert cleanup.claimed_by(GPU, "b") == "u9"
    finally:
        cleanup.stop()


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
    state = Checkpoint(path).load()
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
