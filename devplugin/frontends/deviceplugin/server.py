"""One DevicePlugin gRPC server per resource, each on its own unix socket."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, NoReturn, Protocol

import grpc

from devplugin.api import deviceplugin_v1beta1_pb2 as pb
from devplugin.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from devplugin.model import DeviceKind, Refused, shown, shown_ids
from devplugin.node.coordination import Coordinator, Known
from devplugin.node.metrics import Metrics
from devplugin.node.resources import (
    ContainerAllocation,
    Resource,
    ResourceState,
    merge_allocations,
)
from devplugin.policy.allocator import Role
from devplugin.rpc import SocketServer, deadline_of

log = logging.getLogger(__name__)

# A status detail travels in gRPC metadata (8 KiB by default): stay well inside.
MAX_DETAIL = 2000


def socket_name(resource_name: str) -> str:
    """The endpoint file name for a resource: stable and unique per resource."""
    return "devplugin-" + resource_name.replace("/", "-") + ".sock"


def status_of(refusal: Refused) -> grpc.StatusCode:
    """A malformed request is INVALID_ARGUMENT; one that may be met when
    asked again soon, UNAVAILABLE; one that cannot be met now,
    FAILED_PRECONDITION."""
    if refusal.invalid_argument:
        return grpc.StatusCode.INVALID_ARGUMENT
    if refusal.retry:
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.FAILED_PRECONDITION


def to_proto_devices(state: ResourceState) -> pb.ListAndWatchResponse:
    response = pb.ListAndWatchResponse()
    for device in state.devices:
        entry = response.devices.add(ID=device.id, health=device.health.value)
        if device.numa_node is not None:
            entry.topology.nodes.add(ID=device.numa_node)
    return response


def to_proto_allocation(allocation: ContainerAllocation) -> pb.ContainerAllocateResponse:
    response = pb.ContainerAllocateResponse()
    response.envs.update(allocation.envs)
    for node in allocation.devices:
        response.devices.add(
            container_path=node.container_path,
            host_path=node.host_path,
            permissions=node.permissions,
        )
    response.annotations.update(allocation.annotations)
    for name in allocation.cdi_devices:
        response.cdi_devices.add(name=name)
    return response


class AllocationHooks(Protocol):
    """What a resource does around an allocation besides building the response.

    Every method takes the physical device ids of one container. The
    servicer calls them only after the whole request was validated.
    """

    def take(self, physical: Sequence[str], deadline: float | None) -> None:
        """Take custody of the devices for this container: clean ones at once,
        ones owed a cleanup once it has run (waiting never past `deadline`,
        monotonic, when the caller set one). Raises Refused."""
        ...

    def abandon(self, physical: Sequence[str], *, dirty: bool) -> None:
        """The Allocate failed after `take`: give the devices back (`dirty`:
        the init hook ran, so they are cleaned first)."""
        ...

    def extra(self, physical: Sequence[str]) -> ContainerAllocation | None:
        """More for the same container (attach mode: the nearest HCAs)."""
        ...

    def init(self, physical: Sequence[str]) -> str | None:
        """The init hook when it runs in Allocate; an error text on failure."""
        ...

    def pre_start(self, physical: Sequence[str]) -> str | None:
        """The init hook when it runs in PreStartContainer."""
        ...

    def allocated(self, physical: Sequence[str]) -> None:
        """The Allocate succeeded: record who holds what."""
        ...


class PartnerOracle(Protocol):
    """Who is asking: what is known of the container being admitted (its
    other resource's count, and whether it already got it) from the pod
    cache, else None."""

    def identify(
        self, kind: DeviceKind, size: int, resource: str | None = None
    ) -> Known | None: ...

    def add_resource(self, kind: DeviceKind, name: str) -> None:
        """Another resource serving `kind` (mixed MIG), before serving starts."""
        ...


class NoHooks:
    """A resource with nothing to do around allocations."""

    def take(self, physical: Sequence[str], deadline: float | None) -> None:
        return None

    def abandon(self, physical: Sequence[str], *, dirty: bool) -> None:
        return None

    def extra(self, physical: Sequence[str]) -> ContainerAllocation | None:
        return None

    def init(self, physical: Sequence[str]) -> str | None:
        return None

    def pre_start(self, physical: Sequence[str]) -> str | None:
        return None

    def allocated(self, physical: Sequence[str]) -> None:
        return None


NO_HOOKS = NoHooks()
# ListAndWatch streams besides the kubelet's one may hold this many workers;
# more are refused, so streams can never starve Allocate of threads.
MAX_EXTRA_STREAMS = 4
# After a registration, the next stream opened within this long is the kubelet's.
KUBELET_STREAM_WINDOW = 10.0
WORKERS = 16


class _Stream:
    def __init__(self, kubelet: bool) -> None:
        self.kubelet = kubelet
        self.ended = False


class DevicePluginServicer(pb_grpc.DevicePluginServicer):
    """Serves one resource from the latest `ResourceState` it was given.

    The state is replaced whole by `update`; every open ListAndWatch stream
    sends the new list when it differs from the last one sent.
    """

    def __init__(
        self,
        resource: Resource,
        initial: ResourceState,
        *,
        coordinator: Coordinator | None = None,
        hooks: AllocationHooks = NO_HOOKS,
        partners: PartnerOracle | None = None,
        partner_ids: Callable[[str], frozenset[str] | None] = lambda name: None,
        metrics: Metrics | None = None,
        max_extra_streams: int = MAX_EXTRA_STREAMS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`partner_ids`: the devices a resource of the other kind serves now,
        by its name (None: not one of this daemon's), where that kind is
        served as several resources (mixed MIG)."""
        self.resource = resource
        self._partner_ids = partner_ids
        self._metrics = metrics
        self._coordinator = coordinator
        self._hooks = hooks
        self._oracle = partners
        self._children: dict[str, Any] = {}
        self._max_extra = max_extra_streams
        self._clock = clock
        self._cond = threading.Condition()
        self._state = initial
        self._ids = frozenset(d.id for d in initial.devices)
        self._version = 0
        self._closed = False
        self._streams: list[_Stream] = []
        self._kubelet_until = float("-inf")

    @property
    def state(self) -> ResourceState:
        with self._cond:
            return self._state

    @property
    def ids(self) -> frozenset[str]:
        """The ids it serves now (what a GetPreferredAllocation's lists cover)."""
        with self._cond:
            return self._ids

    def update(self, state: ResourceState) -> bool:
        """Install a new state; returns whether the device list changed."""
        with self._cond:
            changed = state.devices != self._state.devices
            self._state = state
            if changed:
                self._ids = frozenset(d.id for d in state.devices)
                self._version += 1
                self._cond.notify_all()
            return changed

    def close_streams(self) -> None:
        """End every open ListAndWatch stream (server shutdown)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def reopen(self) -> None:
        with self._cond:
            self._closed = False

    def expect_kubelet(self) -> None:
        """A registration is under way: the next stream is the kubelet's."""
        with self._cond:
            self._kubelet_until = self._clock() + KUBELET_STREAM_WINDOW

    def open_streams(self) -> int:
        with self._cond:
            return len(self._streams)

    def options(self) -> pb.DevicePluginOptions:
        caps = self.resource.capabilities
        return pb.DevicePluginOptions(
            pre_start_required=caps.pre_start,
            get_preferred_allocation_available=caps.preferred_allocation,
        )

    # -- RPCs --------------------------------------------------------------
    def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> pb.DevicePluginOptions:
        return self.options()

    def _admit_stream(self) -> _Stream | None:
        with self._cond:
            kubelet = self._clock() <= self._kubelet_until
            if kubelet:
                self._kubelet_until = float("-inf")
                # One kubelet stream at a time: a newer registration's replaces it.
                for other in self._streams:
                    if other.kubelet:
                        other.ended = True
                self._cond.notify_all()
            elif sum(not other.kubelet for other in self._streams) >= self._max_extra:
                return None
            stream = _Stream(kubelet)
            self._streams.append(stream)
            return stream

    def ListAndWatch(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> Iterator[pb.ListAndWatchResponse]:
        stream = self._admit_stream()
        if stream is None:
            log.warning(
                "%s: refused a ListAndWatch stream: %d others already open",
                self.resource.name,
                self._max_extra,
            )
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.resource.name}: too many ListAndWatch streams",
            )

        def on_end() -> None:
            with self._cond:
                stream.ended = True
                self._cond.notify_all()

        context.add_callback(on_end)
        log.info(
            "%s: %s opened ListAndWatch",
            self.resource.name,
            "kubelet" if stream.kubelet else "a client",
        )
        sent = -1
        try:
            while True:
                with self._cond:

                    def ready(last: int = sent) -> bool:
                        return self._version != last or self._closed or stream.ended

                    self._cond.wait_for(ready)
                    if self._closed or stream.ended:
                        break
                    state, sent = self._state, self._version
                log.info(
                    "%s: sending %d devices (%d healthy)",
                    self.resource.name,
                    len(state.devices),
                    sum(1 for device in state.devices if device.health.value == "Healthy"),
                )
                yield to_proto_devices(state)
        finally:
            with self._cond:
                self._streams.remove(stream)
        log.info("%s: ListAndWatch stream ended", self.resource.name)

    def Allocate(
        self, request: pb.AllocateRequest, context: grpc.ServicerContext
    ) -> pb.AllocateResponse:
        started = time.perf_counter()
        try:
            return self._allocate(request, context)
        finally:
            if self._metrics is not None:
                self._metrics.allocate_seconds.labels(self.resource.name).observe(
                    time.perf_counter() - started
                )

    def _allocate(
        self, request: pb.AllocateRequest, context: grpc.ServicerContext
    ) -> pb.AllocateResponse:
        if not request.container_requests:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no container requests")
        resource, hooks = self.resource, self._hooks
        requested = [list(container.devices_ids) for container in request.container_requests]
        # Validate everything before any side effect (cleanups, hooks, records).
        state = self.state
        for index, ids in enumerate(requested):
            try:
                resource.validate(state, ids)
            except Refused as exc:
                self._refuse(context, status_of(exc), index, ids, exc.reason)
        deadline = deadline_of(context)
        response = pb.AllocateResponse()
        given: list[list[str]] = []
        inited = 0  # containers whose init hook ran (or began)
        done = False
        try:
            for index, ids in enumerate(requested):
                physical = resource.physical(ids)
                try:
                    hooks.take(physical, deadline)
                except Refused as exc:
                    self._refuse(context, status_of(exc), index, ids, exc.reason)
                given.append(physical)
                try:
                    # The state again: the take may have waited for a cleanup.
                    allocation = resource.allocate(self.state, ids)
                except Refused as exc:
                    self._refuse(context, status_of(exc), index, ids, exc.reason)
                extra = hooks.extra(physical)
                if extra is not None:
                    allocation = merge_allocations(allocation, extra)
                inited = index + 1
                problem = hooks.init(physical)
                if problem is not None:
                    self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION, index, ids, problem)
                log.info("%s: allocated %s", resource.name, ",".join(ids))
                if self._metrics is not None:
                    self._metrics.allocations.labels(resource.name, "ok").inc()
                response.container_responses.append(to_proto_allocation(allocation))
            for physical in given:
                hooks.allocated(physical)
            done = True
        finally:
            if not done:
                # Whatever stopped it (a refusal aborts the call by raising):
                # nothing taken stays taken.
                for index, physical in enumerate(given):
                    hooks.abandon(physical, dirty=index < inited)
        return response

    def _refuse(
        self,
        context: grpc.ServicerContext,
        code: grpc.StatusCode,
        index: int,
        ids: Sequence[str],
        reason: str,
    ) -> NoReturn:
        # Both the log line and the status detail are bounded and escaped,
        # whatever the request holds (10k ids, a 1 MiB id, a newline).
        log.warning(
            "%s: refused Allocate of container %d [%s]: %s",
            self.resource.name,
            index,
            shown_ids(ids),
            shown(reason, MAX_DETAIL),
        )
        if self._metrics is not None:
            self._metrics.allocations.labels(self.resource.name, "refused").inc()
        context.abort(code, f"{self.resource.name}: {shown(reason, MAX_DETAIL)}")

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        started = time.perf_counter()
        try:
            return self._preferred(request, context)
        finally:
            if self._metrics is not None:
                self._preferred_seconds().observe(time.perf_counter() - started)

    # Metric children looked up once: GetPreferredAllocation is the hot path.
    def _preferred_seconds(self) -> Any:
        child = self._children.get("seconds")
        if child is None:
            assert self._metrics is not None
            child = self._children["seconds"] = self._metrics.preferred_seconds.labels(
                self.resource.name
            )
        return child

    def _corrected(self) -> None:
        if self._metrics is None:
            return
        child = self._children.get("corrected")
        if child is None:
            child = self._children["corrected"] = self._metrics.corrections.labels(
                self.resource.name
            )
        child.inc()

    def _preferred_ok(self, role: Role) -> Any:
        child = self._children.get(role.value)
        if child is None:
            assert self._metrics is not None
            child = self._children[role.value] = self._metrics.preferred.labels(
                self.resource.name, role.value, "ok"
            )
        return child

    def _preferred(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        coordinator = self._coordinator
        if coordinator is None or not self.resource.capabilities.preferred_allocation:
            context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                f"{self.resource.name} does not offer preferred allocations",
            )
        response = pb.PreferredAllocationResponse()
        kind = self.resource.kind
        # Exclusive devices: what the kubelet lists is what is free (shared
        # ones are listed while other replicas are held).
        exclusive = self.resource.reuse_proves_release
        for container in request.container_requests:
            listed: Collection[str] = container.available_deviceIDs
            must: Collection[str] = container.must_include_deviceIDs
            if exclusive:
                # Sets once, for the holdings and the choice (shared resources
                # keep the kubelet's order for their replicas).
                listed, must = frozenset(listed), frozenset(must)
                if coordinator.observe_available(kind, listed, must, self.ids):
                    self._corrected()
            # Who is being admitted (the oracle reads a cache; it may wait
            # briefly for a pod to arrive).
            known = (
                self._oracle.identify(kind, container.allocation_size, self.resource.name)
                if self._oracle is not None
                else None
            )
            if known is not None and known.partner_resource is not None:
                known = replace(known, partner_ids=self._partner_ids(known.partner_resource))
            roles: list[Role] = []
            pick = _Picker(coordinator, kind, known, roles)
            try:
                ids = self.resource.choose(listed, must, container.allocation_size, pick)
            except Refused as exc:
                if self._metrics is not None:
                    self._metrics.preferred.labels(self.resource.name, "-", "refused").inc()
                log.warning(
                    "%s: no preferred allocation of %d from %d available: %s",
                    self.resource.name,
                    container.allocation_size,
                    len(container.available_deviceIDs),
                    shown(exc.reason, MAX_DETAIL),
                )
                context.abort(
                    status_of(exc), f"{self.resource.name}: {shown(exc.reason, MAX_DETAIL)}"
                )
            role = roles[-1] if roles else Role.FIRST
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s: preferred %s (%s)", self.resource.name, ",".join(ids), role.value)
            if self._metrics is not None:
                self._preferred_ok(role).inc()
            response.container_responses.add(deviceIDs=ids)
        return response

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        ids = list(request.devices_ids)
        problem = self._hooks.pre_start(self.resource.physical(ids))
        if problem is not None:
            log.warning(
                "%s: PreStartContainer [%s] failed: %s",
                self.resource.name,
                shown_ids(ids),
                shown(problem, MAX_DETAIL),
            )
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{self.resource.name}: {shown(problem, MAX_DETAIL)}",
            )
        return pb.PreStartContainerResponse()


@dataclass
class _Picker:
    """The allocator's choice of physical devices for one container request,
    remembering the pairing role it was chosen in."""

    coordinator: Coordinator
    kind: DeviceKind
    known: Known | None
    roles: list[Role]

    def __call__(self, candidates: frozenset[str], must: frozenset[str], count: int) -> list[str]:
        choice, role = self.coordinator.preferred(
            self.kind, candidates, must, count, known=self.known
        )
        self.roles.append(role)
        return list(choice.ids)


class PluginServer(SocketServer):
    """One resource's DevicePlugin service on its socket in the kubelet's
    device-plugin directory."""

    def __init__(
        self, servicer: DevicePluginServicer, socket_path: Path, workers: int = WORKERS
    ) -> None:
        super().__init__(
            servicer.resource.name,
            socket_path,
            partial(pb_grpc.add_DevicePluginServicer_to_server, servicer),
            workers=workers,
            thread_prefix=f"dp-{servicer.resource.kind.value}",
        )
        self.servicer = servicer

    def _opening(self) -> None:
        self.servicer.reopen()

    def _closing(self) -> None:
        self.servicer.close_streams()
