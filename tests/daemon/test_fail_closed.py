"""Fail closed on damaged or unwritable state, and on hooks that misbehave.

Through the real daemon (in-process with real sockets, or as a subprocess
for SIGKILL and SIGTERM) and the kubelet simulator.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from devplugin.cli import main
from devplugin.model import DeviceKind
from devplugin.node.lifecycle.checkpoint import Checkpoint, LifecycleState
from devplugin.node.lifecycle.hooks import HookDevice, HookSpec, run_hook
from devplugin.runtime import build
from devplugin.testing.fake_nvml import FakeNvml
from devplugin.testing.kubelet import ContainerRequest, KubeletSimulator
from devplugin.testing.node import BuiltNode, build_node, hgx_node
from tests.conftest import GPU, HCA, Cluster, fast_config
from tests.support import alive, cleanup_runs, daemon_config, hook, probe, spawn
from tests.waiting import log_entries, wait_until

Start = Callable[..., Cluster]
DEVICE = HookDevice(
    "GPU-x", "0000:1a:00.0", ("/dev/nvidia0",), 0, {"gpu_uuid": "GPU-x"}, {"UUID": "GPU-x"}
)


def never_offered_before_cleaned(kubelet: KubeletSimulator, resource: str, log: Path) -> None:
    """Every list sent before a device's first cleanup ended shows it Unhealthy."""
    done = cleanup_runs(log)
    for at, healths in kubelet.history(resource):
        for device, health in healths.items():
            spans = done.get(device)
            if spans is None or at < spans[0][1]:
                assert health == "Unhealthy", (device, at, spans)


# -- damaged checkpoints --------------------------------------------------------------


def _deep(path: Path) -> None:
    path.write_text("[" * 100_000 + "]" * 100_000)


DAMAGE: dict[str, Callable[[Path], None]] = {
    "empty": lambda p: p.write_bytes(b""),
    "truncated": lambda p: p.write_text('{"version": 1, "assigned": {"gpu": ["GPU-'),
    "nul-filled": lambda p: p.write_bytes(b"\0" * 4096),
    "wrong-shape": lambda p: p.write_text('{"version": 1, "assigned": []}'),
    "a-directory": lambda p: p.mkdir(),
    "dangling-symlink": lambda p: p.symlink_to(p.parent / "nowhere.json"),
    "looping-symlink": lambda p: p.symlink_to(p),
    "invalid-utf8": lambda p: p.write_bytes(b'{"version": 1, "assigned": {"gpu": ["\xff\xfe"]}}'),
    "deeply-nested": _deep,
    "deleted": lambda p: None,
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_checkpoint_means_every_idle_device_is_cleaned_before_it_is_offered(
    start_cluster: Start, tmp_path: Path, damage: str
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    checkpoint = state / "checkpoint.json"
    DAMAGE[damage](checkpoint)
    log = tmp_path / "cleanup.log"
    cluster = start_cluster(
        hgx_node(),
        wait=False,
        **{
            "lifecycle.checkpoint_file": str(checkpoint),
            "resources.gpu.hooks.cleanup": hook(log, "ok"),
        },
    )
    every = {gpu.uuid for gpu in cluster.node.gpus}
    assert wait_until(lambda: set(cleanup_runs(log)) == every, timeout=20)
    assert cluster.kubelet.wait_for(
        lambda: all(
            cluster.kubelet.devices(GPU).get(uuid) is not None
            and cluster.kubelet.devices(GPU)[uuid].health == "Healthy"
            for uuid in every
        ),
        timeout=10,
    )
    never_offered_before_cleaned(cluster.kubelet, GPU, log)
    assert all(len(spans) == 1 for spans in cleanup_runs(log).values())
    if damage != "deleted":
        assert (state / "checkpoint.json.corrupt").exists() or (
            state / "checkpoint.json.corrupt"
        ).is_symlink()
    # A fresh, valid checkpoint is in place again.
    assert Checkpoint(checkpoint).load().trusted


def test_with_a_damaged_checkpoint_devices_held_by_running_containers_are_not_cleaned(
    tmp_path: Path, sock_dir: Path
) -> None:
    node = build_node(hgx_node(), tmp_path / "node")
    log = tmp_path / "cleanup.log"
    kubelet = KubeletSimulator(sock_dir / "dp", sock_dir / "pr" / "kubelet.sock", seed=3)
    kubelet.start()
    config = fast_config(
        node,
        sock_dir / "dp",
        sock_dir / "pr" / "kubelet.sock",
        **{"resources.gpu.hooks.cleanup": hook(log, "ok")},
    )
    checkpoint = Path(config.lifecycle.checkpoint_file)
    Checkpoint(checkpoint).save(LifecycleState())
    first = build(config, FakeNvml.from_file(node.fixture))
    first.start()
    try:
        assert kubelet.wait_for_devices(GPU, 8, timeout=10)
        pod = kubelet.admit("keep", [ContainerRequest("c", {GPU: 2})])
        held = set(pod.container("c").devices[GPU])
    finally:
        first.stop()
    checkpoint.write_text('{"version": 1, "assig')  # damaged while the daemon was down
    second = build(config, FakeNvml.from_file(node.fixture))
    second.start()
    try:
        idle = {gpu.uuid for gpu in node.gpus} - held
        assert wait_until(lambda: set(cleanup_runs(log)) == idle, timeout=20)
        calls = kubelet.pod_resources_calls
        assert wait_until(lambda: kubelet.pod_resources_calls >= calls + 3, timeout=10)
        assert set(cleanup_runs(log)) == idle  # the held GPUs were never cleaned
        assert second.core.lifecycle.book.in_use(DeviceKind.GPU) >= held
    finally:
        second.stop()
        kubelet.stop()


# -- an unwritable checkpoint ----------------------------------------------------------


def test_a_failed_checkpoint_write_shows_in_readyz_and_keeps_the_released_device_out(
    start_cluster: Start, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    checkpoint = state / "checkpoint.json"
    Checkpoint(checkpoint).save(LifecycleState())
    cluster = start_cluster(hgx_node(), **{"lifecycle.checkpoint_file": str(checkpoint)})
    kubelet = cluster.kubelet
    assert wait_until(lambda: probe(cluster, "/readyz")[0] == 200)
    pod = kubelet.admit("p", [ContainerRequest("c", {HCA: 1})])
    (hca,) = pod.container("c").devices[HCA]
    assert wait_until(lambda: json.loads(checkpoint.read_text())["assigned"]["hca"] == [hca])
    # The directory becomes unwritable (a file where it was: every write fails).
    os.rename(state, tmp_path / "state.moved")
    state.write_text("")
    kubelet.remove("p")
    assert kubelet.wait_for(lambda: kubelet.devices(HCA)[hca].health == "Unhealthy", timeout=5)
    reason = cluster.daemon.servicer(HCA).state.device(hca)
    assert reason is not None
    assert reason.reason.startswith("release not recorded: checkpoint write failed")
    code, body = probe(cluster, "/readyz")
    assert code == 503
    assert "checkpoint not written" in body
    metrics = probe(cluster, "/metrics")[1]
    assert "devplugin_checkpoint_ok 0.0" in metrics
    assert "devplugin_checkpoint_write_failures_total 0.0" not in metrics
    # Writable again: the next poll records the release and the HCA returns.
    state.unlink()
    os.rename(tmp_path / "state.moved", state)
    assert kubelet.wait_for(lambda: kubelet.devices(HCA)[hca].health == "Healthy", timeout=5)
    assert wait_until(lambda: probe(cluster, "/readyz")[0] == 200)
    assert json.loads(checkpoint.read_text())["assigned"]["hca"] == []


# -- hooks across a SIGKILL and a SIGTERM ---------------------------------------------


def gpu_hooks_config(node: BuiltNode, sock_dir: Path, path: Path, **hooks: object) -> Path:
    return daemon_config(
        node,
        sock_dir,
        path,
        checkpoint=path.parent / "checkpoint.json",
        resources={"gpu": {"hooks": hooks}},
    )


def hook_pids(log: Path) -> list[int]:
    if not log.exists():
        return []
    return [entry["pid"] for entry in log_entries(log) if "stdin" in entry]


def owe_cleanup(path: Path, device: str) -> None:
    state = LifecycleState()
    state.pending[DeviceKind.GPU].add(device)
    Checkpoint(path).save(state)


def test_sigkill_during_a_hanging_cleanup_never_runs_two_at_once(
    tmp_path: Path, sock_dir: Path
) -> None:
    node = build_node(hgx_node(), tmp_path / "node")
    log, go = tmp_path / "cleanup.log", tmp_path / "go"
    config = gpu_hooks_config(
        node, sock_dir, tmp_path / "devplugin.yaml", cleanup=hook(log, f"wait:{go}")
    )
    owed = node.gpus[1].uuid
    owe_cleanup(tmp_path / "checkpoint.json", owed)
    kubelet = KubeletSimulator(sock_dir / "dp", sock_dir / "pr" / "kubelet.sock")
    kubelet.start()
    first = spawn(config)
    second: subprocess.Popen[str] | None = None
    try:
        assert wait_until(lambda: len(hook_pids(log)) == 1, timeout=20)
        (leftover,) = hook_pids(log)
        recorded = json.loads((tmp_path / "checkpoint.json").read_text())["running_hooks"]
        assert [entry["device"] for entry in recorded] == [owed]
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        assert alive(leftover)  # it survives in its own session
        go.touch()  # from now on a cleanup succeeds at once
        second = spawn(config)
        last_seen_alive = time.monotonic()
        while alive(leftover) and time.monotonic() < last_seen_alive + 20:
            last_seen_alive = time.monotonic()
            time.sleep(0.005)
        assert not alive(leftover)
        assert wait_until(lambda: len(hook_pids(log)) == 2, timeout=20)
        runs = [e for e in log_entries(log) if "stdin" in e]
        # The second cleanup began only after the first had been killed.
        assert runs[1]["start"] > last_seen_alive
        assert kubelet.wait_for(
            lambda: getattr(kubelet.devices(GPU).get(owed), "health", None) == "Healthy", 10
        )
        # Never offered while a hook ran on it.
        healthy_at = [at for at, healths in kubelet.history(GPU) if healths.get(owed) == "Healthy"]
        assert healthy_at
        assert min(healthy_at) > runs[1]["start"]
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=20)
        kubelet.stop()


def test_sigterm_during_a_long_hook_stops_it_quickly_and_the_cleanup_stays_owed(
    tmp_path: Path, sock_dir: Path
) -> None:
    node = build_node(hgx_node(), tmp_path / "node")
    log = tmp_path / "cleanup.log"
    config = gpu_hooks_config(
        node, sock_dir, tmp_path / "devplugin.yaml", cleanup=hook(log, "hang"), timeout_seconds=60
    )
    owed = node.gpus[4].uuid
    owe_cleanup(tmp_path / "checkpoint.json", owed)
    process = spawn(config)
    try:
        assert wait_until(lambda: len(hook_pids(log)) == 1, timeout=20)
        (running,) = hook_pids(log)
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=25) == 0
        stopped_in = time.monotonic() - started
        assert not alive(running)
        saved = json.loads((tmp_path / "checkpoint.json").read_text())
        assert saved["pending_cleanup"]["gpu"] == [owed]
        assert saved["running_hooks"] == []
        assert stopped_in < 10, stopped_in
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


# -- hooks that misbehave -----------------------------------------------------------------


def test_a_hook_that_exits_zero_while_a_child_keeps_stderr_open_succeeds(tmp_path: Path) -> None:
    script = tmp_path / "hook.py"
    script.write_text(
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "open(sys.argv[1], 'w').write(str(child.pid))\n"
    )
    pid_file = tmp_path / "child.pid"
    result = run_hook(
        HookSpec((sys.executable, str(script), str(pid_file)), 10), "cleanup", "r/x", [DEVICE]
    )
    assert result.ok, result
    assert result.exit_code == 0
    assert not result.timed_out
    assert result.duration < 5
    # What it left in its group does not outlive it.
    assert wait_until(lambda: not alive(int(pid_file.read_text())), timeout=5)


def test_a_hook_flooding_stderr_keeps_only_a_bounded_tail(tmp_path: Path) -> None:
    script = tmp_path / "flood.py"
    script.write_text(
        "import sys\n"
        "chunk = b'x' * (1 << 20)\n"
        "for _ in range(300):\n"
        "    sys.stderr.buffer.write(chunk)\n"
        "sys.stderr.buffer.write(b'the end')\n"
        "sys.exit(4)\n"
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = run_hook(HookSpec((sys.executable, str(script)), 60), "init", "r/x", [DEVICE])
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert result.exit_code == 4
    assert result.stderr_tail.endswith("the end")
    assert len(result.stderr_tail) <= 2000
    assert grown_kib < 64 * 1024, grown_kib  # 300 MB went through, not into memory


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["/nonexistent/hook"], "/nonexistent/hook does not exist"),
        (["{tmp}/plain-file"], "plain-file is not executable"),
        (["no-such-command-anywhere", "--x"], "no-such-command-anywhere not found on PATH"),
    ],
)
def test_a_hook_that_cannot_run_is_a_configuration_error(
    tmp_path: Path, argv: list[str], problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "plain-file").write_text("#!/bin/sh\n")  # mode 0644: not executable
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    node = build_node(hgx_node(), tmp_path / "node")
    config = gpu_hooks_config(node, tmp_path, tmp_path / "devplugin.yaml", init=argv)
    assert main(["run", "--config", str(config)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("devplugin: config error: resources.gpu.hooks.init: ")
    assert problem in lines[0]
