"""An in-process kubelet for the demo and the tests, speaking the kubelet's protos.

It behaves like the kubelet's device manager where a device plugin can tell:

* serves `v1beta1.Registration` on `kubelet.sock` in the plugin directory;
  inside Register it dials the plugin's endpoint and calls
  GetDevicePluginOptions, then opens ListAndWatch;
* when a ListAndWatch stream ends it marks that plugin's devices Unhealthy
  and does not reconnect (only a new Register brings it back);
* admits one pod at a time, as the kubelet's sync loop does
  (`HandlePodAdditions` in pkg/kubelet/kubelet.go runs admission, and with it
  the device manager's Allocate, for each pod in turn); within a pod,
  container by container (init containers first), resource by
  resource (in random order unless told), asking GetPreferredAllocation when
  offered, then Allocate, then PreStartContainer when required; devices of a
  finished (non-restartable) init container are reused first by the pod's
  later containers and stay the pod's until it ends, and PodResources lists
  app containers and sidecars only;
* on restart, removes every socket in the plugin directory and creates a new
  `kubelet.sock`, keeping its record of which container holds which device;
* serves `v1.PodResourcesLister` on its own socket.

One thing it does more tidily than the kubelet: a PodResources call waits
(boundedly) for container allocations in flight, so an answer never lacks
devices whose Allocate had already returned. The kubelet records them just
after Allocate returns; the daemon's bookkeeping grace covers that gap (its
unit tests drive it with a fake clock), and the tests run with a short
grace that a loaded machine could otherwise outlast.
"""

from __future__ import annotations

import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from devplugin.api import deviceplugin_v1beta1_pb2 as pb
from devplugin.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from devplugin.api import podresources_v1_pb2 as pr
from devplugin.api import podresources_v1_pb2_grpc as pr_grpc
from devplugin.rpc import rpc_failure
from devplugin.testing.apiserver import ApiServerImitation

log = logging.getLogger(__name__)

_EXTENDED_NAME = re.compile(
    r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
CHECKPOINT_FILE = "kubelet_internal_checkpoint"
# How long a PodResources call waits for allocations in flight (a plugin
# that hangs in Allocate must not stop PodResources for long).
ALLOCATION_WAIT = 1.0


class AdmissionError(Exception):
    """A pod could not be admitted; carries the gRPC status when a plugin refused."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class DeviceRecord:
    id: str
    health: str
    numa_nodes: tuple[int, ...]


@dataclass(frozen=True)
class RegistrationRecord:
    resource: str
    endpoint: str
    version: str
    options: pb.DevicePluginOptions
    at: float


@dataclass(frozen=True)
class PreferredCall:
    resource: str
    available: tuple[str, ...]
    must_include: tuple[str, ...]
    size: int
    answer: tuple[str, ...] | None
    error: str | None


@dataclass(frozen=True)
class ContainerRequest:
    name: str
    requests: Mapping[str, int]
    # An init container; `sidecar` makes it restartable (runs the pod's life).
    init: bool = False
    sidecar: bool = False


@dataclass
class ContainerResult:
    name: str
    devices: dict[str, tuple[str, ...]] = field(default_factory=dict)
    responses: dict[str, pb.ContainerAllocateResponse] = field(default_factory=dict)
    order: tuple[str, ...] = ()


@dataclass
class PodResult:
    namespace: str
    name: str
    containers: list[ContainerResult]

    def container(self, name: str) -> ContainerResult:
        for container in self.containers:
            if container.name == name:
                return container
        raise KeyError(name)


class _Endpoint:
    """The kubelet side of one registered plugin."""

    def __init__(self, sim: KubeletSimulator, record: RegistrationRecord, path: Path) -> None:
        self.sim = sim
        self.record = record
        self.channel = grpc.insecure_channel(f"unix://{path}")
        self.stub = pb_grpc.DevicePluginStub(self.channel)
        self.options = record.options
        self.devices: dict[str, DeviceRecord] = {}
        self.connected = True
        self.updates = 0
        # (monotonic time, id -> health) for every list received.
        self.history: list[tuple[float, dict[str, str]]] = []
        self._thread = threading.Thread(
            target=self._watch, name=f"sim-law-{record.resource}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def _watch(self) -> None:
        try:
            for response in self.stub.ListAndWatch(pb.Empty()):
                devices = {
                    device.ID: DeviceRecord(
                        device.ID,
                        device.health,
                        tuple(node.ID for node in device.topology.nodes),
                    )
                    for device in response.devices
                }
                with self.sim._cond:
                    self.devices = devices
                    self.updates += 1
                    self.history.append(
                        (time.monotonic(), {d: r.health for d, r in devices.items()})
                    )
                    self.sim._cond.notify_all()
        except grpc.RpcError as exc:
            log.info(
                "sim kubelet: ListAndWatch for %s ended: %s",
                self.record.resource,
                rpc_failure(exc)[0] or exc,
            )
        with self.sim._cond:
            # What the kubelet does when a plugin's stream ends.
            self.connected = False
            self.devices = {
                device_id: DeviceRecord(device_id, "Unhealthy", record.numa_nodes)
                for device_id, record in self.devices.items()
            }
            self.sim._cond.notify_all()

    def close(self) -> None:
        self.channel.close()
        self._thread.join(timeout=5)


class _Registration(pb_grpc.RegistrationServicer):
    def __init__(self, sim: KubeletSimulator) -> None:
        self.sim = sim

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        return self.sim._register(request, context)


class _PodResources(pr_grpc.PodResourcesListerServicer):
    def __init__(self, sim: KubeletSimulator) -> None:
        self.sim = sim

    def List(
        self, request: pr.ListPodResourcesRequest, context: grpc.ServicerContext
    ) -> pr.ListPodResourcesResponse:
        with self.sim._cond:
            self.sim._await_allocations_locked()
            self.sim.pod_resources_calls += 1
            pods = [
                self.sim._pod_proto(key, pod)
                for key, pod in self.sim._pods.items()
                if not self.sim.blank_pod_resources
            ]
        return pr.ListPodResourcesResponse(pod_resources=pods)

    def Get(
        self, request: pr.GetPodResourcesRequest, context: grpc.ServicerContext
    ) -> pr.GetPodResourcesResponse:
        with self.sim._cond:
            self.sim._await_allocations_locked()
            self.sim.pod_resources_calls += 1
            key = (request.pod_namespace, request.pod_name)
            pod = self.sim._pods.get(key)
            proto = self.sim._pod_proto(key, pod) if pod is not None else None
        if proto is None:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"pod {request.pod_namespace}/{request.pod_name} not found",
            )
        return pr.GetPodResourcesResponse(pod_resources=proto)

    def GetAllocatableResources(
        self, request: pr.AllocatableResourcesRequest, context: grpc.ServicerContext
    ) -> pr.AllocatableResourcesResponse:
        response = pr.AllocatableResourcesResponse()
        with self.sim._cond:
            self.sim.pod_resources_calls += 1
            response.cpu_ids.extend(sorted(self.sim.allocatable_cpus))
            for resource, endpoint in self.sim._endpoints.items():
                for device in endpoint.devices.values():
                    if device.health == "Healthy":
                        entry = response.devices.add(resource_name=resource, device_ids=[device.id])
                        for node in device.numa_nodes:
                            entry.topology.nodes.add(ID=node)
        return response


def _serve(socket: Path, add: Callable[[grpc.Server], None]) -> grpc.Server:
    """A started gRPC server on a fresh unix socket."""
    socket.unlink(missing_ok=True)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    add(server)
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    return server


class KubeletSimulator:
    """See the module docstring. All public methods are thread-safe."""

    def __init__(
        self,
        plugin_dir: Path,
        pod_resources_socket: Path | None = None,
        *,
        seed: int = 0,
        options_timeout: float = 5.0,
        api: ApiServerImitation | None = None,
        node_name: str = "node-1",
    ) -> None:
        self.plugin_dir = plugin_dir
        self.kubelet_socket = plugin_dir / "kubelet.sock"
        self.pod_resources_socket = pod_resources_socket
        self._rng = random.Random(seed)
        # Go's set iteration order, apart from the resource order above.
        self._unordered = random.Random(seed + 1)
        self._options_timeout = options_timeout
        self._cond = threading.Condition()
        self._endpoints: dict[str, _Endpoint] = {}
        self._retired: list[_Endpoint] = []
        self._server: grpc.Server | None = None
        self._pr_server: grpc.Server | None = None
        # (namespace, pod) -> {container -> {resource -> ids}}
        self._pods: dict[tuple[str, str], dict[str, dict[str, tuple[str, ...]]]] = {}
        self.registrations: list[RegistrationRecord] = []
        self.preferred_calls: list[PreferredCall] = []
        self.pod_resources_calls = 0
        # While set, PodResources List answers with no pods (a kubelet blip).
        self.blank_pod_resources = False
        # A static CPU manager's side of PodResources, as a test sets it: the
        # CPUs it may give exclusively, and those each container holds.
        self.allocatable_cpus: frozenset[int] = frozenset()
        self.exclusive_cpus: dict[tuple[str, str, str], tuple[int, ...]] = {}
        # (namespace, pod, container) of non-restartable init containers.
        self._init_only: set[tuple[str, str, str]] = set()
        # Called after each resource of a container is allocated (container,
        # resource): tests change the world between a container's two calls.
        self.between_resources: Callable[[str, str], None] | None = None
        # Called once a pod is in the API, before its admission (namespace,
        # pod): a test can let the daemon's watch see it first, as a kubelet
        # that learns of the pod from the same API server usually does.
        self.after_bind: Callable[[str, str], None] | None = None
        self.restarts = 0
        # Where pods are created before admission (as the scheduler binds them).
        self.api = api
        self.node_name = node_name
        self._created = 0
        # Container resources being allocated (preference, Allocate, record).
        self._allocating = 0
        # Held through each admission: one pod at a time.
        self._admission = threading.Lock()
        # The longest an Allocate call took to be answered (seconds).
        self.slowest_allocate = 0.0

    # -- lifecycle -----------------------------------------------------------
    def start(self) -> None:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self._start_registration()
        if self.pod_resources_socket is not None:
            self.pod_resources_socket.parent.mkdir(parents=True, exist_ok=True)
            self._pr_server = _serve(
                self.pod_resources_socket,
                lambda server: pr_grpc.add_PodResourcesListerServicer_to_server(
                    _PodResources(self), server
                ),
            )

    def stop_pod_resources(self) -> None:
        """Only the PodResources API goes away (its socket too)."""
        pr_server, self._pr_server = self._pr_server, None
        if pr_server is not None:
            pr_server.stop(0).wait(5)
        if self.pod_resources_socket is not None:
            self.pod_resources_socket.unlink(missing_ok=True)

    def _start_registration(self) -> None:
        self._server = _serve(
            self.kubelet_socket,
            lambda server: pb_grpc.add_RegistrationServicer_to_server(_Registration(self), server),
        )

    def _stop_registration(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop(0).wait(5)
        with self._cond:
            endpoints = list(self._endpoints.values()) + self._retired
            self._retired = []
        for endpoint in endpoints:
            endpoint.close()

    def stop(self) -> None:
        """The kubelet goes away: its sockets disappear, plugins' streams end."""
        self._stop_registration()
        self.kubelet_socket.unlink(missing_ok=True)
        self.stop_pod_resources()

    def restart(self) -> float:
        """Restart as the kubelet does: wipe the plugin directory, new kubelet.sock.

        Returns the monotonic time at which the new kubelet.sock appeared.
        """
        self._stop_registration()
        with self._cond:
            self._endpoints = {}
            self.restarts += 1
        for entry in os.listdir(self.plugin_dir):
            if entry != CHECKPOINT_FILE:
                (self.plugin_dir / entry).unlink(missing_ok=True)
        self._start_registration()
        return time.monotonic()

    # -- registration ----------------------------------------------------------
    def _register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        if request.version != "v1beta1":
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"unsupported version {request.version!r}"
            )
        if not _EXTENDED_NAME.match(request.resource_name):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"invalid resource name {request.resource_name!r}",
            )
        if not request.endpoint or "/" in request.endpoint:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"invalid endpoint {request.endpoint!r}"
            )
        path = self.plugin_dir / request.endpoint
        with grpc.insecure_channel(f"unix://{path}") as channel:
            try:
                options = pb_grpc.DevicePluginStub(channel).GetDevicePluginOptions(
                    pb.Empty(), timeout=self._options_timeout
                )
            except grpc.RpcError as exc:
                context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"cannot reach plugin at {path}: {rpc_failure(exc)[1]}",
                )
        if options != request.options:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "options in RegisterRequest differ from GetDevicePluginOptions",
            )
        record = RegistrationRecord(
            request.resource_name, request.endpoint, request.version, options, time.monotonic()
        )
        endpoint = _Endpoint(self, record, path)
        with self._cond:
            old = self._endpoints.get(request.resource_name)
            if old is not None:
                self._retired.append(old)
            self._endpoints[request.resource_name] = endpoint
            self.registrations.append(record)
            self._cond.notify_all()
        endpoint.start()
        return pb.Empty()

    # -- observation -------------------------------------------------------
    def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
        """Wait until `predicate()` (called under the simulator's lock) holds."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout=timeout)

    def registered(self, resource: str) -> bool:
        with self._cond:
            endpoint = self._endpoints.get(resource)
            return endpoint is not None and endpoint.connected

    def devices(self, resource: str) -> dict[str, DeviceRecord]:
        with self._cond:
            endpoint = self._endpoints.get(resource)
            return dict(endpoint.devices) if endpoint is not None else {}

    def options(self, resource: str) -> pb.DevicePluginOptions:
        with self._cond:
            return self._endpoints[resource].options

    def history(self, resource: str) -> list[tuple[float, dict[str, str]]]:
        """Every device list received from the current registration of `resource`."""
        with self._cond:
            endpoint = self._endpoints.get(resource)
            return list(endpoint.history) if endpoint is not None else []

    def stub(self, resource: str) -> pb_grpc.DevicePluginStub:
        with self._cond:
            return self._endpoints[resource].stub

    def wait_for_devices(self, resource: str, count: int, timeout: float = 5.0) -> bool:
        def ready() -> bool:
            endpoint = self._endpoints.get(resource)
            return endpoint is not None and endpoint.connected and len(endpoint.devices) >= count

        return self.wait_for(ready, timeout)

    def allocated(self) -> dict[str, set[str]]:
        """resource -> ids held by any container."""
        with self._cond:
            return self._allocated_locked()

    def _await_allocations_locked(self) -> None:
        """Under the lock: let container allocations in flight be recorded
        (at most ALLOCATION_WAIT), so PodResources never lacks them."""
        self._cond.wait_for(lambda: not self._allocating, timeout=ALLOCATION_WAIT)

    def _allocated_locked(self) -> dict[str, set[str]]:
        held: dict[str, set[str]] = {}
        for containers in self._pods.values():
            for resources in containers.values():
                for resource, ids in resources.items():
                    held.setdefault(resource, set()).update(ids)
        return held

    # -- admission ---------------------------------------------------------
    def admit(
        self,
        pod: str,
        containers: Sequence[ContainerRequest],
        *,
        namespace: str = "default",
        order: Sequence[str] | None = None,
        priority: int | None = None,
        annotations: Mapping[str, str] | None = None,
    ) -> PodResult:
        """Admit a pod, allocating each container's resources like the
        kubelet (`priority`: the pod's spec.priority, as admission set it;
        `annotations`: its metadata's, with the API server)."""
        with self._admission:
            return self._admit(pod, containers, namespace, order, priority, annotations)

    def _admit(
        self,
        pod: str,
        containers: Sequence[ContainerRequest],
        namespace: str,
        order: Sequence[str] | None,
        priority: int | None = None,
        annotations: Mapping[str, str] | None = None,
    ) -> PodResult:
        key = (namespace, pod)
        with self._cond:
            if key in self._pods:
                raise AdmissionError(f"pod {namespace}/{pod} already exists")
            self._pods[key] = {}
            self._created += 1
            created = self._created
        if self.api is not None:
            bound = self._pod_object(namespace, pod, containers, created)
            if priority is not None:
                bound["spec"]["priority"] = priority
            if annotations:
                bound["metadata"]["annotations"] = dict(annotations)
            self.api.put("pods", bound)
            if self.after_bind is not None:
                self.after_bind(namespace, pod)
        results: list[ContainerResult] = []
        ordered = [c for c in containers if c.init] + [c for c in containers if not c.init]
        # resource -> devices of finished init containers, reused first.
        reusable: dict[str, list[str]] = {}
        try:
            for container in ordered:
                results.append(self._admit_container(key, container, order, reusable))
        except Exception:
            with self._cond:
                del self._pods[key]
                self._init_only = {k for k in self._init_only if k[:2] != key}
                self._cond.notify_all()
            if self.api is not None:
                # A pod the kubelet rejects at admission ends Failed.
                self.api.set_status("pods", pod, namespace, {"phase": "Failed"})
            raise
        if self.api is not None:
            # What the kubelet's status manager reports once containers run.
            self.api.set_status("pods", pod, namespace, {"phase": "Running"})
        return PodResult(namespace, pod, results)

    def _admit_container(
        self,
        key: tuple[str, str],
        container: ContainerRequest,
        order: Sequence[str] | None,
        reusable: dict[str, list[str]],
    ) -> ContainerResult:
        resources = [name for name, count in container.requests.items() if count > 0]
        if order is not None:
            resources.sort(
                key=lambda name: list(order).index(name) if name in order else len(order)
            )
        else:
            # The kubelet walks a Go map: no order can be relied upon.
            self._rng.shuffle(resources)
        result = ContainerResult(container.name, order=tuple(resources))
        if container.init and not container.sidecar:
            with self._cond:
                self._init_only.add((*key, container.name))
        for resource in resources:
            with self._cond:
                self._allocating += 1
            try:
                ids, response = self._allocate(
                    resource, container.requests[resource], reusable.get(resource, [])
                )
                result.devices[resource] = ids
                result.responses[resource] = response
                if container.init and not container.sidecar:
                    reusable[resource] = sorted(set(reusable.get(resource, [])) | set(ids))
                else:
                    reusable[resource] = [d for d in reusable.get(resource, []) if d not in ids]
                with self._cond:
                    self._pods[key].setdefault(container.name, {})[resource] = ids
            finally:
                with self._cond:
                    self._allocating -= 1
                    self._cond.notify_all()
            if self.between_resources is not None:
                self.between_resources(container.name, resource)
        return result

    def _allocate(
        self, resource: str, count: int, reusable: Sequence[str] = ()
    ) -> tuple[tuple[str, ...], pb.ContainerAllocateResponse]:
        with self._cond:
            endpoint = self._endpoints.get(resource)
            if endpoint is None or not endpoint.connected:
                raise AdmissionError(f"no device plugin registered for {resource}")
            held = self._allocated_locked().get(resource, set())
            available = sorted(
                device.id
                for device in endpoint.devices.values()
                if device.health == "Healthy" and device.id not in held
            )
            options = endpoint.options
            stub = endpoint.stub
        reuse = sorted(reusable)
        if len(reuse) >= count:
            # All from the pod's finished init containers: no preference asked.
            chosen: list[str] = []
            self._take(chosen, reuse, count)
            return tuple(chosen), self._allocate_call(resource, stub, options, chosen)
        available = sorted(set(available) | set(reuse))
        if len(available) < count:
            raise AdmissionError(f"{resource}: requested {count}, only {len(available)} available")
        # pkg/kubelet/cm/devicemanager/manager.go, devicesToAllocate (no
        # topology hint: every device is in the no-affinity set): the reused
        # devices first, then those of the preference that are available, then
        # any available ones; Go's set iteration gives no order, so neither
        # does this.
        chosen = list(reuse)
        if options.get_preferred_allocation_available:
            # Both lists go as UnsortedList() of Go sets: in no fixed order.
            offered, must = self._unsorted(available), self._unsorted(reuse)
            preferred = self._preferred(resource, stub, offered, count, must)
            self._take(chosen, [d for d in preferred if d in set(available)], count)
        self._take(chosen, available, count)
        # Allocate gets the chosen set's UnsortedList() too.
        chosen = self._unsorted(chosen)
        return tuple(chosen), self._allocate_call(resource, stub, options, chosen)

    def _unsorted(self, devices: Sequence[str]) -> list[str]:
        listed = list(devices)
        with self._cond:
            self._unordered.shuffle(listed)
        return listed

    def _take(self, chosen: list[str], source: Sequence[str], count: int) -> None:
        """allocateRemainingFrom: devices of `source` not chosen yet, in no
        fixed order, until `count` are chosen."""
        rest = sorted(set(source) - set(chosen))
        with self._cond:
            self._unordered.shuffle(rest)
        chosen.extend(rest[: max(0, count - len(chosen))])

    def _allocate_call(
        self,
        resource: str,
        stub: pb_grpc.DevicePluginStub,
        options: pb.DevicePluginOptions,
        chosen: list[str],
    ) -> pb.ContainerAllocateResponse:
        asked = time.monotonic()
        try:
            response = stub.Allocate(
                pb.AllocateRequest(
                    container_requests=[pb.ContainerAllocateRequest(devices_ids=chosen)]
                ),
                timeout=30,
            )
        except grpc.RpcError as exc:
            code, details = rpc_failure(exc)
            raise AdmissionError(f"{resource}: Allocate failed: {details}", code) from exc
        finally:
            with self._cond:
                self.slowest_allocate = max(self.slowest_allocate, time.monotonic() - asked)
        if len(response.container_responses) != 1:
            raise AdmissionError(
                f"{resource}: Allocate returned {len(response.container_responses)} responses"
            )
        if options.pre_start_required:
            try:
                stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=chosen), timeout=30)
            except grpc.RpcError as exc:
                code, details = rpc_failure(exc)
                raise AdmissionError(
                    f"{resource}: PreStartContainer failed: {details}", code
                ) from exc
        return response.container_responses[0]

    def _preferred(
        self,
        resource: str,
        stub: pb_grpc.DevicePluginStub,
        available: list[str],
        count: int,
        must: Sequence[str] = (),
    ) -> list[str]:
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available,
                    must_include_deviceIDs=list(must),
                    allocation_size=count,
                )
            ]
        )
        try:
            response = stub.GetPreferredAllocation(request, timeout=30)
        except grpc.RpcError as exc:
            details = rpc_failure(exc)[1]
            with self._cond:
                self.preferred_calls.append(
                    PreferredCall(resource, tuple(available), tuple(must), count, None, details)
                )
            return []
        answer = (
            list(response.container_responses[0].deviceIDs) if response.container_responses else []
        )
        with self._cond:
            self.preferred_calls.append(
                PreferredCall(resource, tuple(available), tuple(must), count, tuple(answer), None)
            )
        # The kubelet keeps what of the answer it can give (its intersection
        # with the available set); the rest of the answer is ignored.
        return answer

    def remove(self, pod: str, namespace: str = "default") -> None:
        with self._cond:
            self._pods.pop((namespace, pod), None)
            self._init_only = {k for k in self._init_only if k[:2] != (namespace, pod)}
            self._cond.notify_all()
        if self.api is not None:
            self.api.remove("pods", pod, namespace)

    def finish(self, pod: str, namespace: str = "default", phase: str = "Succeeded") -> None:
        """Every container exited: the pod is terminal (in the API) and its
        devices are free, but the pod object stays until someone deletes it."""
        with self._cond:
            self._pods.pop((namespace, pod), None)
            self._init_only = {k for k in self._init_only if k[:2] != (namespace, pod)}
            self._cond.notify_all()
        if self.api is not None:
            self.api.set_status("pods", pod, namespace, {"phase": phase})

    def _pod_object(
        self, namespace: str, pod: str, containers: Sequence[ContainerRequest], created: int
    ) -> dict[str, Any]:
        # Creation times one second apart keep admission order = creation order.
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(1_700_000_000 + created))
        return {
            "metadata": {"name": pod, "namespace": namespace, "creationTimestamp": stamp},
            "spec": {
                "nodeName": self.node_name,
                "initContainers": [_container_spec(c) for c in containers if c.init],
                "containers": [_container_spec(c) for c in containers if not c.init],
            },
            "status": {"phase": "Pending"},
        }

    def _pod_proto(
        self, key: tuple[str, str], containers: dict[str, dict[str, tuple[str, ...]]]
    ) -> pr.PodResources:
        namespace, name = key
        proto = pr.PodResources(name=name, namespace=namespace)
        for container, resources in containers.items():
            if (namespace, name, container) in self._init_only:
                continue  # the kubelet lists app containers and sidecars only
            entry = proto.containers.add(name=container)
            entry.cpu_ids.extend(self.exclusive_cpus.get((namespace, name, container), ()))
            for resource, ids in resources.items():
                endpoint = self._endpoints.get(resource)
                devices = entry.devices.add(resource_name=resource, device_ids=list(ids))
                nodes: set[int] = set()
                for device_id in ids:
                    record = endpoint.devices.get(device_id) if endpoint is not None else None
                    if record is not None:
                        nodes.update(record.numa_nodes)
                for node in sorted(nodes):
                    devices.topology.nodes.add(ID=node)
        return proto


def _container_spec(container: ContainerRequest) -> dict[str, object]:
    spec: dict[str, object] = {
        "name": container.name,
        "image": "sim",
        "resources": {"limits": {k: v for k, v in container.requests.items() if v}},
    }
    if container.sidecar:
        spec["restartPolicy"] = "Always"
    return spec
