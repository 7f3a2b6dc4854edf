"""The lifecycle survives a SIGKILL: in-use devices are not cleaned, and a
device released while the daemon was down is cleaned before it is offered."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

from devplugin.node.lifecycle.checkpoint import Checkpoint, LifecycleState
from devplugin.testing.kubelet import ContainerRequest, KubeletSimulator
from devplugin.testing.node import build_node, hgx_node
from tests.conftest import GPU, HCA
from tests.support import cleanup_runs, daemon_config, hook, spawn
from tests.waiting import wait_until


def test_sigkill_then_restart_cleans_only_what_was_released(tmp_path: Path, sock_dir: Path) -> None:
    node = build_node(hgx_node(), tmp_path / "node")
    log = tmp_path / "cleanup.log"
    checkpoint = tmp_path / "state" / "checkpoint.json"
    config = daemon_config(
        node,
        sock_dir,
        tmp_path / "devplugin.yaml",
        checkpoint=checkpoint,
        resources={
            "gpu": {"hooks": {"cleanup": hook(log, "ok")}},
            "hca": {"hooks": {"cleanup": hook(log, "ok")}},
        },
    )
    Checkpoint(checkpoint).save(LifecycleState())  # a node known clean
    kubelet = KubeletSimulator(sock_dir / "dp", sock_dir / "pr" / "kubelet.sock")
    kubelet.start()
    first = spawn(config)
    second: subprocess.Popen[str] | None = None
    try:
        assert kubelet.wait_for_devices(GPU, 8, timeout=20)
        assert kubelet.wait_for_devices(HCA, 8, timeout=20)
        a = kubelet.admit("a", [ContainerRequest("c", {GPU: 1, HCA: 1})]).container("c")
        b = kubelet.admit("b", [ContainerRequest("c", {GPU: 1, HCA: 1})]).container("c")
        released = {a.devices[GPU][0], a.devices[HCA][0]}
        in_use = {b.devices[GPU][0], b.devices[HCA][0]}

        def saved() -> set[str]:
            try:
                state = json.loads(checkpoint.read_text())
            except (OSError, ValueError):
                return set()
            return {d for ids in state["assigned"].values() for d in ids}

        assert wait_until(lambda: saved() >= released | in_use, timeout=20)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        kubelet.remove("a")  # released while the daemon is down
        before = len(kubelet.registrations)
        second = spawn(config)
        assert kubelet.wait_for(lambda: len(kubelet.registrations) >= before + 2, timeout=20)
        if not wait_until(lambda: set(cleanup_runs(log)) >= released, timeout=20):
            second.send_signal(signal.SIGTERM)
            _, err = second.communicate(timeout=20)
            raise AssertionError(err[-6000:])
        for resource, device in ((GPU, a.devices[GPU][0]), (HCA, a.devices[HCA][0])):
            assert kubelet.wait_for(
                lambda r=resource, d=device: kubelet.devices(r)[d].health == "Healthy", timeout=10
            )
        # Some polls later: the in-use devices were never cleaned.
        calls = kubelet.pod_resources_calls
        assert wait_until(lambda: kubelet.pod_resources_calls >= calls + 3, timeout=20)
        done = cleanup_runs(log)
        assert set(done) == released
        assert all(len(spans) == 1 for spans in done.values())
        # Never offered before cleaned: every list the restarted daemon sent
        # before a released device's cleanup ended shows it Unhealthy.
        for resource in (GPU, HCA):
            for at, healths in kubelet.history(resource):
                for device in released & set(healths):
                    if at < done[device][0][1]:
                        assert healths[device] == "Unhealthy", (resource, device, at)
        assert all(
            kubelet.devices(GPU)[d].health == "Healthy" for d in in_use if d in kubelet.devices(GPU)
        )
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=20)
        kubelet.stop()
