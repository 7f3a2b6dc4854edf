"""What each container holds, per the kubelet's PodResources API (v1).

Node machinery, not a front-end: the holdings it reads serve whichever
protocol handed the devices out."""

from __future__ import annotations

import threading
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


# A kubelet that restarts is dialled again within this (gRPC's default
# backoff reaches minutes; the socket path is local and cheap to try).
_RECONNECT_MS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


class PodResourcesClient:
    """Reads which devices each container holds from the kubelet's PodResources API.

    One channel is kept between polls (a channel per poll was most of an
    idle daemon's gRPC work); a failed call drops it, and the next call
    dials afresh."""

    def __init__(self, socket_path: Path, timeout: float = 5.0) -> None:
        self._socket_path = socket_path
        self._timeout = timeout
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: pr_grpc.PodResourcesListerStub | None = None
        # The CPUs containers hold exclusively, as of the last List.
        self.assigned_cpus: frozenset[int] = frozenset()

    def _lister(self) -> pr_grpc.PodResourcesListerStub:
        with self._lock:
            if self._stub is None:
                self._channel = grpc.insecure_channel(
                    f"unix://{self._socket_path}", options=_RECONNECT_MS
                )
                self._stub = pr_grpc.PodResourcesListerStub(self._channel)
            return self._stub

    def __enter__(self) -> PodResourcesClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            channel.close()

    def list(self) -> list[ContainerDevices]:
        try:
            response = self._lister().List(pr.ListPodResourcesRequest(), timeout=self._timeout)
        except grpc.RpcError:
            self.close()
            raise
        found: list[ContainerDevices] = []
        cpus: set[int] = set()
        for pod in response.pod_resources:
            for container in pod.containers:
                cpus.update(container.cpu_ids)
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
        self.assigned_cpus = frozenset(cpus)
        return found

    def allocatable_cpus(self) -> frozenset[int]:
        """The CPUs the kubelet may give containers exclusively (a static CPU
        manager's: the machine's less the reserved; empty otherwise)."""
        try:
            response = self._lister().GetAllocatableResources(
                pr.AllocatableResourcesRequest(), timeout=self._timeout
            )
        except grpc.RpcError:
            self.close()
            raise
        return frozenset(response.cpu_ids)
