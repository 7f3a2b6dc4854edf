"""Pods on the real node as the tier's tests read them: what the container
saw (devplugin/testing/realnode_pods.py starts them), what the kubelet's
PodResources gives it, and the daemon's metrics."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import grpc

from devplugin.api import podresources_v1_pb2 as pr
from devplugin.api import podresources_v1_pb2_grpc as pr_grpc
from devplugin.node.podresources import PodResourcesClient
from devplugin.testing import realnode_pods
from devplugin.testing.oci_image import Seen
from devplugin.testing.realnode_pods import PODS, container, pod
from tests.real_node.conftest import Running

__all__ = ["PODS", "container", "pod"]


def create(running: Running, found: dict[str, Any]) -> str:
    running.node.plane.request("POST", PODS, found)
    return str(found["metadata"]["name"])


def delete(running: Running, name: str) -> None:
    realnode_pods.delete(running.node.plane, name)


def gone(running: Running, name: str) -> bool:
    return realnode_pods.gone(running.node.plane, name)


def status(running: Running, name: str) -> dict[str, Any]:
    return realnode_pods.status(running.node.plane, name)


def phase(running: Running, name: str) -> str:
    return str(status(running, name).get("phase", ""))


def seen(running: Running, name: str, container_name: str = "main", within: float = 60) -> Seen:
    """What the container printed, once it has printed all of it."""
    found = realnode_pods.wait_seen(running.node, name, container_name, within)
    assert found is not None, (status(running, name), running.node.tail("kubelet", 20))
    return found


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
    with PodResourcesClient(running.node.pod_resources_socket) as client:
        listed = client.list()
    for entry in listed:
        if entry.pod == name and entry.container == container_name:
            found.setdefault(entry.resource, []).extend(entry.device_ids)
    return found


def allocatable(running: Running) -> dict[str, int] | None:
    """How many devices of each resource the kubelet's device manager would
    hand out now (PodResources' GetAllocatableResources: its healthy
    devices of plugins it is connected to); None while it does not answer.
    After a kubelet restart this, not the Node's allocatable, says the
    daemon is registered again: the Node keeps its old numbers, and the
    restarted kubelet counts a plugin's devices unhealthy until it is."""
    target = f"unix://{running.node.pod_resources_socket}"
    try:
        with grpc.insecure_channel(target) as channel:
            stub = pr_grpc.PodResourcesListerStub(channel)
            answer = stub.GetAllocatableResources(pr.AllocatableResourcesRequest(), timeout=5)
    except grpc.RpcError:
        return None
    counts: dict[str, int] = {}
    for devices in answer.devices:
        counts[devices.resource_name] = counts.get(devices.resource_name, 0) + len(
            devices.device_ids
        )
    return counts


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
