"""The checkpoint's format: version 2 carries a checksum over the rest of
the file, and today's version 1 files (without one) are still read."""

from __future__ import annotations

import json
from pathlib import Path

from devplugin.model import DeviceKind
from devplugin.node.lifecycle.checkpoint import Checkpoint, LifecycleState


def _state() -> LifecycleState:
    state = LifecycleState()
    state.assigned[DeviceKind.GPU] = {"GPU-aaaa", "GPU-bbbb"}
    state.pending[DeviceKind.HCA] = {"0000:1a:00.0"}
    return state


def test_a_saved_checkpoint_has_a_version_and_a_checksum_and_reads_back(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path / "state.json")
    checkpoint.save(_state())
    data = json.loads(checkpoint.path.read_text())
    assert data["version"] == 2
    assert data["checksum"].startswith("sha256:")
    loaded = checkpoint.load()
    assert loaded.trusted
    assert loaded.assigned[DeviceKind.GPU] == {"GPU-aaaa", "GPU-bbbb"}
    assert loaded.pending[DeviceKind.HCA] == {"0000:1a:00.0"}


def test_a_checkpoint_changed_after_it_was_written_is_not_trusted(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path / "state.json")
    checkpoint.save(_state())
    # Still valid JSON of the right shape: one device id changed (a bit flip,
    # a hand edit). Without the checksum it would be believed.
    text = checkpoint.path.read_text().replace("GPU-aaaa", "GPU-aaab")
    checkpoint.path.write_text(text)
    loaded = checkpoint.load()
    assert not loaded.trusted
    assert loaded.assigned[DeviceKind.GPU] == set()
    assert (tmp_path / "state.json.corrupt").exists()


def test_a_version_2_file_without_its_checksum_is_not_trusted(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path / "state.json")
    checkpoint.save(_state())
    data = json.loads(checkpoint.path.read_text())
    del data["checksum"]
    checkpoint.path.write_text(json.dumps(data))
    assert not checkpoint.load().trusted


def test_todays_version_1_file_is_still_read(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text(
        json.dumps(
            {
                "version": 1,
                "assigned": {"gpu": ["GPU-old"], "hca": []},
                "pending_cleanup": {"gpu": [], "hca": ["0000:1b:00.0"]},
                "running_hooks": [],
                "claims": [],
            }
        )
    )
    loaded = Checkpoint(path).load()
    assert loaded.trusted
    assert loaded.assigned[DeviceKind.GPU] == {"GPU-old"}
    assert loaded.pending[DeviceKind.HCA] == {"0000:1b:00.0"}
