"""A device's life on the real node: its cleanup hook runs after its pod is
deleted and before the kubelet's next pod gets it; a device made unhealthy
leaves the Node's allocatable and comes back when it heals; a restarted
daemon is registered again within two seconds."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from devplugin.testing.realnode import RealNode
from tests.real_node.conftest import GPU, HCA, Running
from tests.real_node.pods import create, delete, held, phase, pod, seen, status
from tests.waiting import wait_until

pytestmark = pytest.mark.node

# Each run of a hook appends: its phase, the device ids, when it began and
# when it ended (seconds since the epoch). Cleanup takes a second.
HOOK = """#!/bin/sh
began=$(date +%s.%N)
[ "$DEVPLUGIN_HOOK" = cleanup ] && sleep 1
echo "$DEVPLUGIN_HOOK $DEVPLUGIN_DEVICE_IDS $began $(date +%s.%N)" >> "$1"
"""


def hooked(node: RealNode, base: Path) -> dict[str, Any]:
    script = base / "hook.sh"
    script.write_text(HOOK)
    argv = ["/bin/sh", str(script), str(base / "hooks.log")]
    return {"resources.gpu.hooks.init": argv, "resources.gpu.hooks.cleanup": argv}


def runs(base: Path) -> list[tuple[str, set[str], float, float]]:
    path = base / "hooks.log"
    found = []
    for line in path.read_text().splitlines() if path.exists() else []:
        phase_name, ids, began, ended = line.split()
        found.append((phase_name, set(ids.split(",")), float(began), float(ended)))
    return found


def admitted(running: Running, make: Callable[[], str], within: float = 90) -> str:
    """A pod the kubelet admits: while it turns one down (devices it counts
    unavailable: UnexpectedAdmissionError), another of the same spec."""
    deadline = time.monotonic() + within
    name = make()
    while time.monotonic() < deadline:
        current = status(running, name)
        if current.get("phase") == "Running":
            return name
        if current.get("phase") == "Failed":
            assert current.get("reason") == "UnexpectedAdmissionError", current
            delete(running, name)
            name = make()
        time.sleep(0.2)
    raise AssertionError(f"no pod admitted within {within}s: {status(running, name)}")


@pytest.mark.parametrize("running", [hooked], indirect=True)
def test_a_deleted_pods_devices_are_cleaned_before_the_next_pod_gets_them(
    running: Running,
) -> None:
    assert wait_until(lambda: running.allocatable().get(GPU) == "8", timeout=30)
    first = create(running, pod("first", running.node.name, {"main": {GPU: 2}}))
    seen(running, first)
    mine = set(held(running, first)[GPU])
    delete(running, first)
    # At once: every GPU, so the next pod must have the first one's two.
    second = admitted(
        running, lambda: create(running, pod("all", running.node.name, {"main": {GPU: 8}}))
    )
    gpu_nodes = [p for p in seen(running, second).nodes if re.fullmatch(r"/dev/nvidia\d+", p)]
    assert len(gpu_nodes) == 8
    assert len(held(running, second)[GPU]) == 8
    done = runs(running.base)
    inits = [(ids, began) for name, ids, began, _ in done if name == "init"]
    assert inits[0][0] == mine
    taken = inits[0][1]
    given = next(began for ids, began in inits if len(ids) == 8)
    # Cleanups after the first pod took its GPUs (every GPU is cleaned once
    # at the daemon's first start: no checkpoint says they are clean).
    cleanups = [
        (ids, ended) for name, ids, began, ended in done if name == "cleanup" and began > taken
    ]
    for device in mine:
        ended = [end for ids, end in cleanups if device in ids]
        assert ended, f"{device} was not cleaned after the first pod: {done}"
        assert ended[0] <= given, f"{device} was given before its cleanup ended: {done}"
    # The others were not held by anyone since their first cleanup.
    assert {device for ids, _ in cleanups for device in ids} == mine
    delete(running, second)


def test_an_unhealthy_device_leaves_allocatable_and_comes_back(running: Running) -> None:
    assert wait_until(lambda: running.allocatable().get(GPU) == "8", timeout=30)
    assert wait_until(lambda: running.allocatable().get(HCA) == "8", timeout=30)
    assert running.nvml is not None
    assert running.nvml.inject_xid(3, 79) == 1
    hca = running.hardware.hcas[0]
    state = hca.directory / "infiniband" / hca.name / "ports" / "1" / "state"
    healthy = state.read_text()
    state.write_text("1: DOWN\n")
    assert wait_until(lambda: running.allocatable().get(GPU) == "7", timeout=30)
    assert wait_until(lambda: running.allocatable().get(HCA) == "7", timeout=30)
    # Capacity counts every device, healthy or not.
    assert (running.capacity().get(GPU), running.capacity().get(HCA)) == ("8", "8")
    # A pod asking for every HCA is not admitted while one is down.
    name = create(running, pod("every-hca", running.node.name, {"main": {HCA: 8}}))
    assert wait_until(lambda: phase(running, name) == "Failed", timeout=30)
    assert status(running, name).get("reason") == "UnexpectedAdmissionError"
    delete(running, name)
    state.write_text(healthy)
    assert wait_until(lambda: running.allocatable().get(HCA) == "8", timeout=30)


def test_a_restarted_daemon_is_registered_again_within_two_seconds(running: Running) -> None:
    assert wait_until(lambda: running.allocatable().get(GPU) == "8", timeout=30)
    running.stop_daemon()
    # The kubelet counts a gone plugin's devices unhealthy.
    assert wait_until(lambda: running.allocatable().get(GPU) == "0", timeout=30)
    started = time.monotonic()
    daemon = running.start_daemon()
    assert wait_until(lambda: all(daemon.registrar.registered().values()), timeout=10)
    assert time.monotonic() - started <= 2.0
    assert wait_until(lambda: running.allocatable().get(GPU) == "8", timeout=30)
    assert wait_until(lambda: running.allocatable().get(HCA) == "8", timeout=30)
