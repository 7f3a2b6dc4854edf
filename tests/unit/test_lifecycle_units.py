"""The lifecycle's parts on their own: tracker, hook runner, checkpoint,
the custody book and its ports, and the two example hooks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devplugin.hooks.gpu_cleanup import clean
from devplugin.hooks.hca_check import check_ports
from devplugin.model import DeviceKind, Health
from devplugin.node.lifecycle.checkpoint import Checkpoint, LifecycleState
from devplugin.node.lifecycle.health import HealthTracker, Recovery
from devplugin.node.lifecycle.hooks import HookDevice, HookSpec, run_hook
from devplugin.testing.fake_nvml import FakeNvml, load_fixture
from devplugin.testing.node import (
    DOWN,
    Hca,
    NodeSpec,
    Port,
    RootComplex,
    Switch,
    build_node,
    hgx_node,
)
from tests.support import Node, Runner
from tests.waiting import wait_until

GPU, HCA = DeviceKind.GPU, DeviceKind.HCA


# -- health tracker ------------------------------------------------------------


def test_auto_recovery_needs_the_configured_good_checks() -> None:
    tracker = HealthTracker(Recovery.AUTO, good_checks=3)
    tracker.observe("d", False, "port down")
    assert tracker.verdict("d").health is Health.UNHEALTHY
    assert tracker.verdict("d").reason == "port down"
    assert not tracker.observe("d", True)
    assert not tracker.observe("d", True)
    tracker.observe("d", False, "port down again")  # a bad check resets the streak
    assert not tracker.observe("d", True)
    assert not tracker.observe("d", True)
    assert tracker.observe("d", True)
    assert tracker.verdict("d").health is Health.HEALTHY


def test_event_faults_can_need_longer_streaks() -> None:
    tracker = HealthTracker(Recovery.AUTO, good_checks=1)
    tracker.fault("g", "XID 79", good_checks=4)
    for _ in range(3):
        tracker.observe("g", True)
        assert tracker.verdict("g").reason == "XID 79"
    tracker.observe("g", True)
    assert tracker.verdict("g").health is Health.HEALTHY


def test_after_cleanup_recovery_waits_for_the_cleanup() -> None:
    tracker = HealthTracker(Recovery.AFTER_CLEANUP, good_checks=1)
    tracker.observe("d", False, "port down")
    for _ in range(10):
        tracker.observe("d", True)
    assert tracker.verdict("d").health is Health.UNHEALTHY
    assert tracker.cleaned("d")
    assert tracker.verdict("d").health is Health.HEALTHY
    assert not tracker.cleaned("d")


def test_forgotten_devices_lose_their_faults() -> None:
    tracker = HealthTracker()
    tracker.fault("gone", "XID 48")
    tracker.forget(["other"])
    assert tracker.faulted() == set()


# -- hook runner -----------------------------------------------------------------


def script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "hook.py"
    path.write_text(body)
    return [sys.executable, str(path)]


DEVICE = HookDevice(
    "0000:14:00.0",
    "0000:14:00.0",
    ("/dev/infiniband/uverbs0",),
    None,
    {"hca_name": "mlx5_0"},
    {"NAME": "mlx5_0"},
)


def test_hook_gets_env_and_json_and_no_shell(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    argv = script(
        tmp_path,
        "import json, os, sys\n"
        f"json.dump({{'stdin': json.load(sys.stdin), 'argv': sys.argv[1:], "
        f"'env': dict(os.environ)}}, open({str(out)!r}, 'w'))\n",
    )
    result = run_hook(HookSpec((*argv, "$HOME", "a;b"), 5), "cleanup", "rdma/hca", [DEVICE])
    assert result.ok
    seen = json.loads(out.read_text())
    assert seen["argv"] == ["$HOME", "a;b"]  # passed literally, no shell
    assert seen["env"]["DEVPLUGIN_DEVICE_0_NUMA"] == ""
    assert seen["env"]["DEVPLUGIN_DEVICE_0_NAME"] == "mlx5_0"
    assert seen["env"]["DEVPLUGIN_DEVICE_0_NODES"] == "/dev/infiniband/uverbs0"
    assert seen["stdin"]["devices"][0]["hca_name"] == "mlx5_0"


def test_hook_failure_carries_exit_status_and_stderr_tail(tmp_path: Path) -> None:
    argv = script(tmp_path, "import sys\nsys.stderr.write('x' * 5000 + 'THE END')\nsys.exit(7)\n")
    result = run_hook(HookSpec(tuple(argv), 5), "init", "nvidia.com/gpu", [DEVICE])
    assert not result.ok
    assert result.exit_code == 7
    assert result.stderr_tail.endswith("THE END")
    assert len(result.stderr_tail) <= 2000
    assert result.describe("init", 5).startswith("init hook failed with exit status 7: x")


def test_hook_that_hangs_is_killed_with_its_children(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    argv = script(
        tmp_path,
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
        "time.sleep(60)\n",
    )
    started = time.monotonic()
    result = run_hook(HookSpec(tuple(argv), 0.5), "cleanup", "r/x", [DEVICE])
    assert time.monotonic() - started < 10
    assert result.timed_out
    assert "timed out after 0.5s" in result.describe("cleanup", 0.5)
    for pid in map(int, pids.read_text().split()):
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.02)
        else:
            pytest.fail(f"process {pid} survived the hook's timeout")


def test_missing_hook_binary_is_a_clear_failure() -> None:
    result = run_hook(HookSpec(("/nonexistent/hook",), 5), "init", "r/x", [DEVICE])
    assert not result.ok
    assert result.exit_code is None
    assert "could not be started" in result.describe("init", 5)


# -- checkpoint -----------------------------------------------------------------


def test_checkpoint_round_trip_and_atomic_replace(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path / "d" / "c.json")
    assert checkpoint.load().assigned == {GPU: set(), HCA: set()}
    state = LifecycleState()
    state.assigned[GPU] = {"GPU-1"}
    state.pending[HCA] = {"0000:14:00.0"}
    checkpoint.save(state)
    loaded = checkpoint.load()
    assert loaded.assigned[GPU] == {"GPU-1"}
    assert loaded.pending[HCA] == {"0000:14:00.0"}
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["c.json"]  # no temp left over


def test_corrupt_checkpoint_is_set_aside_not_trusted(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text("{not json")
    assert Checkpoint(path).load().assigned == {GPU: set(), HCA: set()}
    assert (tmp_path / "c.json.corrupt").exists()
    assert not path.exists()


# -- the custody book and its ports -------------------------------------------------


def test_release_needs_confirmations_then_cleans_once(tmp_path: Path) -> None:
    runner = Runner([True])
    node = Node(runner, tmp_path, confirmations=2)
    node.lifecycle.start()
    try:
        node.allocated(GPU, ["a", "b"])
        now = time.monotonic() + 10  # polls after the bookkeeping grace
        node.observe({GPU: {"a", "b"}}, now)
        node.observe({GPU: {"b"}}, now + 1)
        assert node.book.verdict((GPU, "a")) is None  # one miss is not a release
        node.observe({GPU: {"b"}}, now + 2)
        assert wait_until(lambda: runner.calls == [["a"]] and node.book.verdict((GPU, "a")) is None)
        assert node.book.in_use(GPU) == {"b"}
    finally:
        node.lifecycle.stop()


def test_a_fresh_allocation_is_not_released_by_a_poll_that_missed_it(tmp_path: Path) -> None:
    runner = Runner([])
    node = Node(runner, tmp_path, confirmations=1)
    node.lifecycle.start()
    try:
        node.allocated(GPU, ["a"])
        # The kubelet had not recorded it yet when this poll began.
        node.observe({GPU: set()}, time.monotonic())
        assert node.book.in_use(GPU) == {"a"}
        assert runner.calls == []
    finally:
        node.lifecycle.stop()


def test_pending_cleanups_survive_in_the_checkpoint(tmp_path: Path) -> None:
    runner = Runner([False] * 100)
    node = Node(runner, tmp_path, confirmations=1, retry_initial=60, retry_max=60)
    node.lifecycle.start()
    node.allocated(GPU, ["a"])
    node.observe({GPU: set()}, time.monotonic() + 10)
    assert wait_until(lambda: len(runner.calls) == 1)
    node.lifecycle.stop()
    verdict = node.book.verdict((GPU, "a"))
    assert verdict is not None
    assert verdict.reason.startswith("quarantined: cleanup failed 1 time(s)")
    again = Runner([True])
    restarted = Node(again, tmp_path, confirmations=1)
    assert restarted.book.verdict((GPU, "a")) is None
    restarted.lifecycle.start()
    try:
        assert wait_until(lambda: again.calls == [["a"]])
    finally:
        restarted.lifecycle.stop()


# -- the example hooks -------------------------------------------------------------


def test_gpu_cleanup_restores_defaults_and_refuses_busy_gpus(tmp_path: Path) -> None:
    node = build_node(hgx_node(), tmp_path)
    lib = FakeNvml(load_fixture(node.fixture))
    uuids = [gpu.uuid for gpu in node.gpus[:2]]
    lib.compute_mode[0] = lib.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    assert clean(lib, uuids) == []
    assert lib.compute_mode[0] == lib.NVML_COMPUTEMODE_DEFAULT
    assert lib.clock_resets == [0, 1]
    assert clean(lib, uuids) == []  # safe to run twice
    lib.processes[1] = [4242]
    assert clean(lib, uuids) == [f"{uuids[1]}: still running processes 4242"]
    assert not lib.initialised


def test_gpu_cleanup_of_a_mig_device_checks_its_processes_and_leaves_the_gpu_alone(
    tmp_path: Path,
) -> None:
    from devplugin.testing.layouts import hgx_h100_mig
    from devplugin.testing.node import mig_uuid

    node = build_node(hgx_h100_mig(), tmp_path)
    lib = FakeNvml(load_fixture(node.fixture))
    parent = node.gpus[0].uuid
    slices = [mig_uuid(parent, 0), mig_uuid(parent, 1)]
    lib.compute_mode[0] = lib.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    assert clean(lib, slices) == []
    # The parent's settings are its other MIG devices' too: untouched.
    assert lib.compute_mode[0] == lib.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    assert lib.clock_resets == []
    lib.mig_processes[slices[1]] = [77]
    assert clean(lib, slices) == [f"{slices[1]}: still running processes 77"]


def test_gpu_cleanup_runs_as_a_hook(tmp_path: Path) -> None:
    node = build_node(hgx_node(), tmp_path)
    payload = {"devices": [{"id": node.gpus[0].uuid, "gpu_uuid": node.gpus[0].uuid}]}
    for _ in range(2):
        result = subprocess.run(
            [sys.executable, "-m", "devplugin.hooks.gpu_cleanup"],
            input=json.dumps(payload),
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(os.environ, DEVPLUGIN_NVML_FIXTURE=str(node.fixture)),
            check=False,
        )
        assert result.returncode == 0, result.stderr


def test_hca_check_passes_active_ports_and_fails_down_ones(tmp_path: Path) -> None:
    spec = NodeSpec(
        roots=[RootComplex(0, "0-7", [Switch([Hca(), Hca(ports=[Port(), Port(*DOWN)])])])]
    )
    node = build_node(spec, tmp_path)
    problems, ports = check_ports(node.sysfs_root, ["mlx5_0"])
    assert problems == []
    assert ports == [("mlx5_0", "1")]
    problems, _ = check_ports(node.sysfs_root, ["mlx5_1"])
    assert problems == ["mlx5_1 port 2: 1: DOWN / 3: Disabled"]
    payload = {"devices": [{"id": "x", "hca_name": "mlx5_1"}]}
    result = subprocess.run(
        [sys.executable, "-m", "devplugin.hooks.hca_check"],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, DEVPLUGIN_SYSFS_ROOT=str(node.sysfs_root)),
        check=False,
    )
    assert result.returncode == 1
    assert "port 2" in result.stderr
