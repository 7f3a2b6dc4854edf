"""Nodes of the cluster tier: Node objects whose status the tier writes as a
kubelet would, and each node's daemon identity (a service-account token
bound to a pod on that node, which is how the API server learns the
node a daemon runs on)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from devplugin.testing.controlplane import ApiFailure, ControlPlane

# A scheduler of the default profile only (what pods without a schedulerName get).
DEFAULT_SCHEDULER = {
    "apiVersion": "kubescheduler.config.k8s.io/v1",
    "kind": "KubeSchedulerConfiguration",
    "profiles": [{"schedulerName": "default-scheduler"}],
}
GPU = "nvidia.com/gpu"
HCA = "rdma/hca"


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def add_node(
    plane: ControlPlane,
    name: str,
    extended: Mapping[str, int],
    labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A Ready Node with these extended resources, as its kubelet would
    report it (capacity and allocatable, the Ready condition)."""
    every = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", **(labels or {})}
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": every}}
    plane.request("POST", "/api/v1/nodes", node)
    set_node_resources(plane, name, extended)
    result: dict[str, Any] = plane.request("GET", f"/api/v1/nodes/{name}")
    return result


def set_node_resources(plane: ControlPlane, name: str, extended: Mapping[str, int]) -> None:
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110",
                 **{k: str(v) for k, v in extended.items()}}  # fmt: skip
    status = {"status": {
        "capacity": resources, "allocatable": resources,
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                        "message": "tier", "lastHeartbeatTime": now(),
                        "lastTransitionTime": now()}],
        "nodeInfo": {"kubeletVersion": plane.bins.version, "architecture": "amd64",
                     "operatingSystem": "linux", "containerRuntimeVersion": "containerd://2",
                     "kernelVersion": "6", "osImage": "tier", "kubeProxyVersion": "",
                     "machineID": name, "systemUUID": name, "bootID": name},
    }}  # fmt: skip
    plane.request(
        "PATCH",
        f"/api/v1/nodes/{name}/status",
        status,
        content_type="application/merge-patch+json",
    )


def daemon_pod(plane: ControlPlane, namespace: str, account: str, node: str) -> dict[str, Any]:
    """A pod of the daemon bound to `node` (no kubelet runs it: it stands
    for the DaemonSet's pod there, to bind the node's token to)."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": f"daemon-{node}", "namespace": namespace},
           "spec": {"nodeName": node, "serviceAccountName": account,
                    "containers": [{"name": "daemon", "image": "devplugin:tier"}]}}  # fmt: skip
    created: dict[str, Any] = plane.request("POST", f"/api/v1/namespaces/{namespace}/pods", pod)
    return created


def node_token(plane: ControlPlane, namespace: str, account: str, node: str) -> str:
    """A token of the daemon's account bound to its pod on `node`: the API
    server puts the node's name into the token's user info."""
    return pod_token(plane, namespace, account, daemon_pod(plane, namespace, account, node))


def pod_token(plane: ControlPlane, namespace: str, account: str, pod: dict[str, Any]) -> str:
    """A token of `account` bound to `pod` (a created pod of that account)."""
    request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
               "spec": {"audiences": ["https://kubernetes.default.svc"],
                        "expirationSeconds": 7200,
                        "boundObjectRef": {"apiVersion": "v1", "kind": "Pod",
                                           "name": pod["metadata"]["name"],
                                           "uid": pod["metadata"]["uid"]}}}  # fmt: skip
    answer = plane.request(
        "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token", request
    )
    return str(answer["status"]["token"])


def remove_node(plane: ControlPlane, node: str) -> None:
    """The Node and every pod bound to it, at once (gone ones are no error)."""
    bound = plane.request("GET", f"/api/v1/pods?fieldSelector=spec.nodeName={node}")
    for pod in bound["items"]:
        meta = pod["metadata"]
        with contextlib.suppress(ApiFailure):
            plane.request(
                "DELETE",
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}?gracePeriodSeconds=0",
            )
    with contextlib.suppress(ApiFailure):
        plane.request("DELETE", f"/api/v1/nodes/{node}")


def who_am_i(plane: ControlPlane, token: str) -> dict[str, Any]:
    review = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
    answer = plane.request(
        "POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews", review, token=token
    )
    info: dict[str, Any] = answer["status"]["userInfo"]
    return info


def eventually(check: Callable[[], bool], timeout: float = 30.0, every: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return True
        except ApiFailure:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(every)


def delete_pod(plane: ControlPlane, name: str, namespace: str = "default") -> None:
    """Delete a pod at once, as its kubelet confirms a pod it stopped: with
    no kubelet here a graceful deletion would leave it terminating, its
    resources counted, for good."""
    plane.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}?gracePeriodSeconds=0")


def outcome(plane: ControlPlane, name: str) -> tuple[str, dict[str, Any]] | None:
    """('bound', pod) or ('unschedulable', pod) for a pod of `default` as
    the scheduler left it; None while undecided."""
    pod: dict[str, Any] = plane.request("GET", f"/api/v1/namespaces/default/pods/{name}")
    if pod["spec"].get("nodeName"):
        return "bound", pod
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition["type"] == "PodScheduled" and condition.get("reason") == "Unschedulable":
            return "unschedulable", pod
    return None


def decision(
    plane: ControlPlane, name: str, timeout: float = 60.0, every: float = 0.1
) -> tuple[str, dict[str, Any]]:
    """The pod's outcome once the scheduler has decided it (it fails the
    test when the scheduler has not within `timeout`)."""
    found: list[tuple[str, dict[str, Any]]] = []

    def decided() -> bool:
        seen = outcome(plane, name)
        if seen is not None:
            found.append(seen)
        return seen is not None

    assert eventually(decided, timeout, every), f"pod {name}: neither bound nor unschedulable"
    return found[-1]
