"""Pods on the real node, as the tier's tests make and read them: a pod
whose container prints what it saw (its character devices, its
environment) and then stays, and what the kubelet, the container's log
and the daemon's metrics say about it."""

from __future__ import annotations

import itertools
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from devplugin.node.podresources import PodResourcesClient
from devplugin.testing.controlplane import ApiFailure
from devplugin.testing.oci_image import WORK_IMAGE
from tests.real_node.conftest import Running
from tests.real_runtime import SCRIPT, Seen, parse
from tests.waiting import wait_until

# The container's last line once it has printed what it saw.
DONE = "=== seen"
PODS = "/api/v1/namespaces/default/pods"
_serial = itertools.count()


def container(name: str, requests: Mapping[str, int]) -> dict[str, Any]:
    limits = {resource: str(count) for resource, count in requests.items()}
    return {
        "name": name,
        "image": WORK_IMAGE,
        "imagePullPolicy": "Never",
        # What it saw, then it stays: PodResources lists running pods only.
        "command": ["/bin/sh", "-c", SCRIPT + f"; echo {DONE}; exec sleep 3600"],
        "resources": {"limits": limits},
    }


def pod(
    prefix: str, node: str | None, containers: Mapping[str, Mapping[str, int]]
) -> dict[str, Any]:
    """A pod of these containers (name -> resource counts); bound to `node`
    directly, or left to the scheduler when node is None."""
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "automountServiceAccountToken": False,
        "containers": [container(name, asks) for name, asks in containers.items()],
    }
    if node is not None:
        spec["nodeName"] = node
    name = f"{prefix}-{next(_serial)}"
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default"}, "spec": spec}  # fmt: skip


def create(running: Running, found: dict[str, Any]) -> str:
    running.node.plane.request("POST", PODS, found)
    return str(found["metadata"]["name"])


def delete(running: Running, name: str) -> None:
    try:
        running.node.plane.request("DELETE", f"{PODS}/{name}")
    except ApiFailure as exc:
        if exc.code != 404:
            raise


def gone(running: Running, name: str) -> bool:
    try:
        running.node.plane.request("GET", f"{PODS}/{name}")
    except ApiFailure as exc:
        if exc.code == 404:
            return True
        raise
    return False


def status(running: Running, name: str) -> dict[str, Any]:
    found: dict[str, Any] = running.node.plane.request("GET", f"{PODS}/{name}")
    return dict(found.get("status", {}))


def phase(running: Running, name: str) -> str:
    return str(status(running, name).get("phase", ""))


def log(running: Running, name: str, container_name: str = "main") -> str:
    return running.node.container_log("default", name, container_name) + "\n"


def seen(running: Running, name: str, container_name: str = "main", within: float = 60) -> Seen:
    """What the container printed, once it has printed all of it."""
    done = wait_until(lambda: DONE in log(running, name, container_name), timeout=within)
    assert done, (status(running, name), running.node.tail("kubelet", 20))
    return parse(log(running, name, container_name).split(DONE)[0])


def added(running: Running, saw: Seen) -> dict[str, tuple[int, int]]:
    """The character devices a container saw beyond those every container
    of this runtime sees (a pod asking for nothing, started once per node)."""
    if running.baseline is None:
        name = create(running, pod("plain", running.node.name, {"main": {}}))
        running.baseline = dict(seen(running, name).nodes)
        delete(running, name)
    return {path: numbers for path, numbers in saw.nodes.items() if path not in running.baseline}


def held(running: Running, name: str, container_name: str = "main") -> dict[str, list[str]]:
    """The devices the kubelet's PodResources gives the container, by resource."""
    found: dict[str, list[str]] = {}
    for entry in PodResourcesClient(running.node.pod_resources_socket).list():
        if entry.pod == name and entry.container == container_name:
            found.setdefault(entry.resource, []).extend(entry.device_ids)
    return found


def metric(running: Running, name: str, **labels: str) -> float:
    """The sum of a daemon metric's samples that carry these labels."""
    answered = running.served.status
    assert answered is not None
    host, port = answered.bound[0]
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def switch(device: Path) -> Path:
    """The switch a device sits behind: its sysfs directory's grandparent
    (the device, the switch's downstream port, the switch's upstream port)."""
    return device.resolve().parents[1]
