"""What each container holds, per the kubelet's PodResources API (v1).

Node machinery, not a front-end: the holdings it reads serve whichever
protocol handed the devices out."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from devplugin.api import podresources_v1_pb2 as pr
from devplugin.api import podresources_v1_pb2_grpc as pr_grpc


@dataclass(frozen=True)
class ContainerDevices:
    """Devices of one resource held by one container, per the kubelet."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


class PodResourcesClient:
    """Reads which devices each container holds from the kubelet's PodResources API."""

    def __init__(self, socket_path: Path, timeout: float = 5.0) -> None:
        self._socket_path = socket_path
        self._timeout = timeout

    def list(self) -> list[ContainerDevices]:
        with grpc.insecure_channel(f"unix://{self._socket_path}") as channel:
            stub = pr_grpc.PodResourcesListerStub(channel)
            response = stub.List(pr.ListPodResourcesRequest(), timeout=self._timeout)
        found: list[ContainerDevices] = []
        for pod in response.pod_resources:
            for container in pod.containers:
                for devices in container.devices:
                    found.append(
                        ContainerDevices(
                            namespace=pod.namespace,
                            pod=pod.name,
                            container=container.name,
                            resource=devices.resource_name,
                            device_ids=tuple(devices.device_ids),
                        )
                    )
        return found
