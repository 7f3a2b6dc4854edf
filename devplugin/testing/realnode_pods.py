"""Pods the real node runs for the node tier and `devplugin demo --real-node`:
containers of the work image that print what they saw (their character
devices, their environment), a marker line, and then stay (PodResources
lists running pods only); and reading that back from the container's log."""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from typing import Any

from devplugin.testing.controlplane import ApiFailure, ControlPlane
from devplugin.testing.oci_image import SEEN_SCRIPT, WORK_IMAGE, Seen, parse
from devplugin.testing.realnode import RealNode

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
        "command": ["/bin/sh", "-c", SEEN_SCRIPT + f"; echo {DONE}; exec sleep 3600"],
        "resources": {"limits": limits},
    }


def pod(
    prefix: str, node: str | None, containers: Mapping[str, Mapping[str, int]]
) -> dict[str, Any]:
    """A pod in `default` of these containers (name -> resource counts);
    bound to `node` directly, or left to the scheduler when node is None."""
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


def status(plane: ControlPlane, name: str) -> dict[str, Any]:
    found: dict[str, Any] = plane.request("GET", f"{PODS}/{name}")
    return dict(found.get("status", {}))


def delete(plane: ControlPlane, name: str) -> None:
    try:
        plane.request("DELETE", f"{PODS}/{name}")
    except ApiFailure as exc:
        if exc.code != 404:
            raise


def gone(plane: ControlPlane, name: str) -> bool:
    try:
        plane.request("GET", f"{PODS}/{name}")
    except ApiFailure as exc:
        if exc.code == 404:
            return True
        raise
    return False


def log(node: RealNode, name: str, container_name: str = "main") -> str:
    return node.container_log("default", name, container_name) + "\n"


def wait_seen(
    node: RealNode, name: str, container_name: str = "main", within: float = 60.0
) -> Seen | None:
    """What the container printed, once it has printed all of it; None if
    it has not within the time (or its pod failed)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        text = log(node, name, container_name)
        if DONE in text:
            return parse(text.split(DONE)[0])
        if status(node.plane, name).get("phase") == "Failed":
            return None
        time.sleep(0.2)
    return None
