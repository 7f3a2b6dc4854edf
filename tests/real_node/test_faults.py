"""Faults on the real node: the kubelet restarted with pods running, the
daemon killed inside an Allocate, the node cordoned and drained. After
each: no device handed out twice, the daemon registered again, running
containers untouched, custody kept (a device is cleaned before anyone else
gets it, and only then)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from devplugin.testing.realnode import RealNode
from tests.real_cluster.nodes import DEFAULT_SCHEDULER
from tests.real_node.conftest import GPU, HCA, Running
from tests.real_node.pods import allocatable, create, delete, gone, held, phase, pod, seen, status
from tests.waiting import wait_until

pytestmark = pytest.mark.node

# A hook run: its phase and device ids, when it began and ended. An init
# hook waits while the gate file exists (the test kills the daemon then).
HOOK = """#!/bin/sh
began=$(date +%s.%N)
cat >/dev/null
echo "start $DEVPLUGIN_HOOK $DEVPLUGIN_DEVICE_IDS $began" >> "$1"
if [ "$DEVPLUGIN_HOOK" = init ] && [ -e "$2" ]; then
    while [ -e "$2" ]; do sleep 0.1; done
fi
echo "$DEVPLUGIN_HOOK $DEVPLUGIN_DEVICE_IDS $began $(date +%s.%N)" >> "$1"
"""


def hooked(node: RealNode, base: Path) -> dict[str, Any]:
    script = base / "hook.sh"
    script.write_text(HOOK)
    argv = ["/bin/sh", str(script), str(base / "hooks.log"), str(base / "gate")]
    return {"resources.gpu.hooks.init": argv, "resources.gpu.hooks.cleanup": argv}


def runs(base: Path, phase_name: str, since: int = 0) -> list[set[str]]:
    """The device sets of the finished runs of one phase from line `since`
    of the hook log on, in order."""
    return [ids for found, ids in lines(base)[since:] if found == phase_name]


def lines(base: Path, since: float = 0.0) -> list[tuple[str, set[str]]]:
    """Every finished hook run in the log (begun at `since` or later, in
    seconds since the epoch): (phase, device ids)."""
    path = base / "hooks.log"
    found = []
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = line.split()
        if parts[0] != "start" and float(parts[2]) >= since:
            found.append((parts[0], set(parts[1].split(","))))
    return found


def cleaned(base: Path, since: int = 0) -> set[str]:
    """Every device a cleanup run finished on, from run `since` on."""
    return set().union(*runs(base, "cleanup", since))


def held_now(running: Running, name: str) -> dict[str, list[str]] | None:
    """`held`, or None while the kubelet's PodResources is not serving."""
    try:
        return held(running, name)
    except grpc.RpcError:
        return None


def container_ids(running: Running, name: str) -> list[str]:
    statuses = status(running, name).get("containerStatuses") or []
    return [str(s.get("containerID")) for s in statuses if s.get("containerID")]


def restarts(running: Running, name: str) -> int:
    statuses = status(running, name).get("containerStatuses") or []
    return sum(int(s.get("restartCount", 0)) for s in statuses)


def serving(running: Running) -> bool:
    """The kubelet hands out every device of both resources again."""
    return allocatable(running) == {GPU: 8, HCA: 8}


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
            assert wait_until(lambda n=name: gone(running, n), timeout=30)
            name = make()
        time.sleep(0.2)
    raise AssertionError(f"no pod admitted within {within}s: {status(running, name)}")


def admit(running: Running, prefix: str, gpus: int, hcas: int) -> str:
    name = create(running, pod(prefix, running.node.name, {"main": {GPU: gpus, HCA: hcas}}))
    seen(running, name)
    assert wait_until(lambda: phase(running, name) == "Running", timeout=60)
    return name


def disjoint(running: Running, names: list[str]) -> None:
    """No device of a resource held by two containers (the kubelet's word)."""
    for resource in (GPU, HCA):
        sets = [set(held(running, name).get(resource, [])) for name in names]
        together = set().union(*sets)
        assert len(together) == sum(len(s) for s in sets), (resource, sets)


@pytest.mark.parametrize("running", [hooked], indirect=True)
def test_a_kubelet_restart_with_pods_running_keeps_them_and_their_devices(
    running: Running,
) -> None:
    assert wait_until(lambda: running.allocatable().get(GPU) == "8", timeout=30)
    first, second = admit(running, "keep", 2, 2), admit(running, "keep", 1, 1)
    before = {n: (container_ids(running, n), held(running, n)) for n in (first, second)}
    registrar = running.served.registrar
    mark = len(lines(running.base))  # the daemon's first cleanups and the pods' inits
    running.node.stop_kubelet()
    running.node.start_kubelet()
    assert running.node.wait_ready(60)
    assert wait_until(lambda: all(registrar.registered().values()), timeout=30)
    assert wait_until(lambda: serving(running), timeout=30)
    # The running containers are the same ones, never restarted, and hold
    # the same devices by the restarted kubelet's own account.
    for name, (ids, devices) in before.items():
        assert container_ids(running, name) == ids
        assert restarts(running, name) == 0
        assert wait_until(lambda n=name, d=devices: held_now(running, n) == d, timeout=30)
    # Custody kept: nothing of theirs was cleaned; a new pod gets the rest only.
    theirs = set(before[first][1][GPU]) | set(before[second][1][GPU])
    assert not cleaned(running.base, mark) & theirs, lines(running.base)[mark:]
    third = admit(running, "after", 4, 4)
    disjoint(running, [first, second, third])
    for name in (first, second, third):
        delete(running, name)


@pytest.mark.parametrize("running", [hooked], indirect=True)
@pytest.mark.timeout(300)
def test_a_daemon_killed_inside_an_allocate_cleans_those_devices_before_anyone_gets_them(
    running: Running,
) -> None:
    """The daemon as its own process (`devplugin run`, the DaemonSet's
    command), killed with SIGKILL while the kubelet's Allocate waits on
    its init hook; started again, it finds from its checkpoint what it was
    doing."""
    running.stop_daemon()
    base = running.base
    config = base / "daemon.yaml"
    config.write_text(yaml.safe_dump(nested({**running.settings, "version": "v1"})))

    def spawn() -> subprocess.Popen[bytes]:
        log = (base / "daemon.log").open("ab")
        command = [sys.executable, "-m", "devplugin", "run", "--config", str(config)]
        return subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    gate = base / "gate"
    daemon = spawn()
    try:
        assert wait_until(lambda: serving(running), timeout=60)
        gate.touch()  # the next init hook waits
        stuck = create(running, pod("stuck", running.node.name, {"main": {GPU: 2, HCA: 2}}))
        log = base / "hooks.log"
        assert wait_until(lambda: log.exists() and "start init" in log.read_text(), timeout=60)
        logged = log.read_text().splitlines()
        inside = {line.split()[2] for line in logged if line.startswith("start init")}
        taken = set().union(*(set(ids.split(",")) for ids in inside))
        os.killpg(daemon.pid, signal.SIGKILL)  # the daemon and its hook, at once
        daemon.wait(10)
        gate.unlink()
        # The kubelet's Allocate failed: that pod is turned away, never started.
        assert wait_until(lambda: phase(running, stuck) == "Failed", timeout=60), status(
            running, stuck
        )
        delete(running, stuck)
        assert wait_until(lambda: gone(running, stuck), timeout=30)
        mark = len(lines(base))
        restarted = time.time()
        daemon = spawn()
        # A pod asking for every GPU at once, at once: the kubelet may turn it
        # away while the daemon withholds devices; it is asked again.
        whole = pod("every", running.node.name, {"main": {GPU: 8, HCA: 8}})
        every = admitted(running, lambda: create(running, whole))
        # The devices of the Allocate it died in were cleaned, and only then
        # given again (the kubelet keeps a gone plugin's devices for a grace
        # period: its allocatable proves nothing here).
        assert taken <= cleaned(base, mark), lines(base)[mark:]
        assert len(held(running, every).get(GPU, [])) == 8
        done = lines(base, restarted)
        last_clean = max(i for i, (p, ids) in enumerate(done) if p == "cleanup" and ids & taken)
        first_init = min(i for i, (p, ids) in enumerate(done) if p == "init" and ids & taken)
        assert last_clean < first_init, done
        delete(running, every)
    finally:
        if daemon.poll() is None:
            daemon.terminate()
            daemon.wait(15)


@pytest.mark.parametrize("running", [hooked], indirect=True)
def test_a_cordoned_and_drained_node_has_its_pods_devices_cleaned_and_takes_nothing_new(
    running: Running,
) -> None:
    plane, name = running.node.plane, running.node.name
    plane.start_scheduler(DEFAULT_SCHEDULER)
    assert wait_until(lambda: running.allocatable().get(GPU) == "8", timeout=30)
    pods = [admit(running, "drained", 2, 2), admit(running, "drained", 2, 1)]
    gpus = set().union(*(set(held(running, p).get(GPU, [])) for p in pods))
    mark = len(lines(running.base))
    plane.kubectl("cordon", name)
    drain = ("--ignore-daemonsets", "--force", "--grace-period=1", "--timeout=120s")
    plane.kubectl("drain", name, *drain)
    assert all(wait_until(lambda p=p: gone(running, p), timeout=60) for p in pods)
    # Every device they held is cleaned.
    assert wait_until(lambda: gpus <= cleaned(running.base, mark), timeout=60)
    # Cordoned: a pod left to the scheduler is not placed there.
    asked = pod("after-drain", None, {"main": {GPU: 1, HCA: 1}})
    new = create(running, asked)
    assert not wait_until(lambda: bool(status(running, new).get("hostIP")), timeout=5)
    node = plane.request("GET", f"/api/v1/nodes/{name}")
    assert node["spec"].get("unschedulable") is True
    plane.kubectl("uncordon", name)
    assert wait_until(lambda: phase(running, new) == "Running", timeout=60)
    delete(running, new)


def nested(settings: dict[str, Any]) -> dict[str, Any]:
    """Dotted settings ("a.b": 1) as the config file's sections."""
    found: dict[str, Any] = {}
    for key, value in settings.items():
        *path, last = key.split(".")
        place = found
        for part in path:
            place = place.setdefault(part, {})
        place[last] = value
    return found
