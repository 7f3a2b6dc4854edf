"""The kubelet side of the DRA driver: its two unix sockets and what they serve.

* `<registry>/<driver>-reg.sock` serves `pluginregistration.Registration`:
  the kubelet's plugin watcher finds the socket, asks GetInfo (type
  DRAPlugin, the driver's name, the service socket, the services served)
  and says with NotifyRegistrationStatus whether it took the plugin.
* `<plugins>/<driver>/dra.sock` serves the DRAPlugin service in v1 and in
  v1beta1 (kubelets from 1.32 speak v1beta1, from 1.34 prefer v1) and
  DRAResourceHealth v1alpha1, whose stream sends the whole device list
  with each device's health whenever the judged state changes.

A kubelet that restarts finds the sockets again by itself; one that wipes
the directories leaves the driver unreachable, so `watch` (called by the
daemon's loop) starts a server again on a fresh socket when its file is
gone or replaced, which makes the plugin watcher register it again.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from devplugin.api import dra_health_v1alpha1_pb2 as health_pb
from devplugin.api import dra_health_v1alpha1_pb2_grpc as health_grpc
from devplugin.api import dra_v1_pb2 as v1
from devplugin.api import dra_v1_pb2_grpc as v1_grpc
from devplugin.api import dra_v1beta1_pb2 as v1beta1
from devplugin.api import dra_v1beta1_pb2_grpc as v1beta1_grpc
from devplugin.api import pluginregistration_v1_pb2 as reg_pb
from devplugin.api import pluginregistration_v1_pb2_grpc as reg_grpc
from devplugin.frontends.dra.claim_record import ClaimDevice
from devplugin.frontends.dra.prepare import ClaimRef, Preparer
from devplugin.model import shown
from devplugin.policy.claims import plain_uid
from devplugin.rpc import SocketServer, deadline_of

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth")
# More claims than this in one call is not a kubelet's request.
MAX_CLAIMS = 1024
WORKERS = 8
MESSAGE_MAX = 1024


@dataclass(frozen=True)
class DeviceHealth:
    pool: str
    device: str
    healthy: bool
    message: str = ""


# The request name of the entry that carries CDI ids for containers naming
# the whole claim. The kubelet gives a container that names the claim every
# entry, and one that names a request only the entries listing that request
# (pkg/kubelet/cm/dra/claiminfo.go, cdiDevicesAsList). Request names are DNS
# labels, so no container can name this one.
WHOLE_CLAIM = "devplugin.io/whole-claim"


def claim_problem(namespace: str, uid: str, name: str) -> str | None:
    """Why a claim the kubelet names is not one a kubelet can mean: a uid is
    a UUID-like name (never a path: it names a file), a namespace a DNS
    label, a name a DNS subdomain."""
    if not uid:
        return "has no uid"
    if not plain_uid(uid):
        return f"uid {shown(uid)} is not a uid (letters, digits, '-'; at most 64)"
    if not _LABEL.fullmatch(namespace):
        return f"namespace {shown(namespace)} is not a DNS label"
    if len(name) > 253 or not _SUBDOMAIN.fullmatch(name):
        return f"name {shown(name)} is not a DNS subdomain"
    return None


_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_SUBDOMAIN = re.compile(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?")


def _refs(claims: Sequence[Any], context: grpc.ServicerContext) -> list[ClaimRef]:
    """The call's claims, each once, before anything is done for any."""
    if len(claims) > MAX_CLAIMS:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{len(claims)} claims in one call (at most {MAX_CLAIMS})",
        )
    refs: dict[str, ClaimRef] = {}
    for claim in claims:
        problem = claim_problem(claim.namespace, claim.uid, claim.name)
        if problem is not None:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"claim {shown(claim.namespace)}/{shown(claim.name)} {problem}",
            )
        ref = ClaimRef(claim.namespace, claim.uid, claim.name)
        if refs.setdefault(ref.uid, ref) != ref:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"claim uid {ref.uid} is named twice, for two claims",
            )
    return list(refs.values())


def _expired(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


LATE = "not started: the call's deadline had passed"


class _DraServicer:
    """Both DRAPlugin versions: the same calls on messages of either module."""

    def __init__(self, preparer: Preparer, pb: Any) -> None:
        self._preparer = preparer
        self._pb = pb

    def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        answer = self._pb.NodePrepareResourcesResponse()
        deadline = deadline_of(context)
        for ref in _refs(request.claims, context):
            entry = answer.claims[ref.uid]
            if _expired(deadline):
                # The kubelet stopped waiting: nothing more is started for it.
                entry.error = LATE
                continue
            devices, error = self._preparer.prepare(ref, deadline)
            if error:
                entry.error = error
                continue
            for device in devices:
                entry.devices.append(self._device(device))
            # After every device: applied last, the claim's variables win
            # in a container that names the whole claim.
            for device in devices:
                if device.whole:
                    entry.devices.append(
                        self._pb.Device(
                            request_names=[WHOLE_CLAIM],
                            pool_name=device.pool,
                            device_name=device.device,
                            cdi_device_ids=list(device.whole),
                        )
                    )
        return answer

    def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        answer = self._pb.NodeUnprepareResourcesResponse()
        deadline = deadline_of(context)
        for ref in _refs(request.claims, context):
            if _expired(deadline):
                answer.claims[ref.uid].error = LATE
                continue
            error = self._preparer.unprepare(ref, deadline)
            answer.claims[ref.uid].error = error
        return answer

    def _device(self, device: ClaimDevice) -> Any:
        return self._pb.Device(
            request_names=list(device.requests),
            pool_name=device.pool,
            device_name=device.device,
            cdi_device_ids=list(device.cdi_ids),
        )


class DraV1Servicer(_DraServicer, v1_grpc.DRAPluginServicer):
    def __init__(self, preparer: Preparer) -> None:
        super().__init__(preparer, v1)


class DraV1beta1Servicer(_DraServicer, v1beta1_grpc.DRAPluginServicer):
    def __init__(self, preparer: Preparer) -> None:
        super().__init__(preparer, v1beta1)


class HealthServicer(health_grpc.DRAResourceHealthServicer):
    """Streams the complete device list whenever it changes."""

    def __init__(self, timeout_seconds: int, clock: Callable[[], float] = time.time) -> None:
        self._timeout = timeout_seconds
        self._clock = clock
        self._cond = threading.Condition()
        self._devices: tuple[DeviceHealth, ...] = ()
        self._version = 0
        self._closed = 0  # bumped to end every open stream
        self.streams = 0

    def update(self, devices: Sequence[DeviceHealth]) -> bool:
        """A new judged list; whether it differs from the last."""
        new = tuple(devices)
        with self._cond:
            if new == self._devices:
                return False
            self._devices = new
            self._version += 1
            self._cond.notify_all()
        return True

    def close_streams(self) -> None:
        with self._cond:
            self._closed += 1
            self._cond.notify_all()

    def NodeWatchResources(
        self, request: health_pb.NodeWatchResourcesRequest, context: grpc.ServicerContext
    ) -> Iterator[health_pb.NodeWatchResourcesResponse]:
        with self._cond:
            closed = self._closed
            self.streams += 1
        sent = -1
        try:
            while context.is_active():
                with self._cond:

                    def news(seen: int = sent) -> bool:
                        return self._version != seen or self._closed != closed

                    self._cond.wait_for(news, timeout=1.0)
                    if self._closed != closed:
                        return
                    if self._version == sent:
                        continue
                    sent, devices = self._version, self._devices
                yield self._response(devices)
        finally:
            with self._cond:
                self.streams -= 1

    def _response(self, devices: Sequence[DeviceHealth]) -> health_pb.NodeWatchResourcesResponse:
        now = int(self._clock())
        answer = health_pb.NodeWatchResourcesResponse()
        for device in devices:
            answer.devices.append(
                health_pb.DeviceHealth(
                    device=health_pb.DeviceIdentifier(
                        pool_name=device.pool, device_name=device.device
                    ),
                    health=health_pb.HEALTHY if device.healthy else health_pb.UNHEALTHY,
                    last_updated_time=now,
                    health_check_timeout_seconds=self._timeout,
                    message=device.message.encode()[:MESSAGE_MAX].decode("utf-8", "ignore"),
                )
            )
        return answer


class RegistrationServicer(reg_grpc.RegistrationServicer):
    def __init__(self, driver: str, endpoint: Path) -> None:
        self._driver = driver
        self._endpoint = endpoint
        self._lock = threading.Lock()
        self.registered = False
        self.error = ""
        self.notifications = 0

    def GetInfo(
        self, request: reg_pb.InfoRequest, context: grpc.ServicerContext
    ) -> reg_pb.PluginInfo:
        return reg_pb.PluginInfo(
            type=PLUGIN_TYPE,
            name=self._driver,
            endpoint=str(self._endpoint),
            supported_versions=list(SERVICES),
        )

    def NotifyRegistrationStatus(
        self, request: reg_pb.RegistrationStatus, context: grpc.ServicerContext
    ) -> reg_pb.RegistrationStatusResponse:
        with self._lock:
            self.registered = request.plugin_registered
            self.error = request.error
            self.notifications += 1
        if request.plugin_registered:
            log.info("DRA driver %s registered with the kubelet", self._driver)
        else:
            log.error(
                "the kubelet refused DRA driver %s: %s", self._driver, shown(request.error, 300)
            )
        return reg_pb.RegistrationStatusResponse()

    def reset(self) -> None:
        with self._lock:
            self.registered = False
            self.error = ""


def socket_paths(plugins_dir: Path, registry_dir: Path, driver: str) -> tuple[Path, Path]:
    """(the DRA service socket, the registration socket)."""
    return plugins_dir / driver / "dra.sock", registry_dir / f"{driver}-reg.sock"


class DraPlugin:
    """The two servers of one driver, and their upkeep."""

    def __init__(
        self,
        preparer: Preparer,
        *,
        plugins_dir: Path,
        registry_dir: Path,
        health_timeout: int,
    ) -> None:
        self.driver = preparer.driver
        self.health = HealthServicer(health_timeout)
        service_path, registration_path = socket_paths(plugins_dir, registry_dir, self.driver)
        self.registration = RegistrationServicer(self.driver, service_path)
        v1_servicer, beta_servicer = DraV1Servicer(preparer), DraV1beta1Servicer(preparer)

        def add_service(server: grpc.Server) -> None:
            v1_grpc.add_DRAPluginServicer_to_server(v1_servicer, server)
            v1beta1_grpc.add_DRAPluginServicer_to_server(beta_servicer, server)
            health_grpc.add_DRAResourceHealthServicer_to_server(self.health, server)

        def add_registration(server: grpc.Server) -> None:
            reg_grpc.add_RegistrationServicer_to_server(self.registration, server)

        self.service = SocketServer("dra", service_path, add_service, workers=WORKERS)
        self.registrar = SocketServer("dra-reg", registration_path, add_registration)

    def start(self) -> None:
        # The service first: the kubelet dials the endpoint as soon as it
        # has read GetInfo.
        self.service.start()
        self.registrar.start()

    def watch(self) -> None:
        """Start again whatever server lost its socket. A new service socket
        needs a new registration too: the kubelet dropped the old endpoint."""
        if not self.service.intact():
            log.warning("DRA socket %s was removed; serving on a new one", self.service.path)
            self.health.close_streams()
            self.service.restart()
            self.registration.reset()
            self.registrar.restart()
            return
        if not self.registrar.intact():
            log.warning(
                "registration socket %s was removed (kubelet restart?); registering again",
                self.registrar.path,
            )
            self.registration.reset()
            self.registrar.restart()

    def registered(self) -> bool:
        return self.registration.registered

    def stop(self) -> None:
        self.health.close_streams()
        self.registrar.stop(grace=0.5)
        self.service.stop(grace=0.5)


def health_list(pool: str, entries: Mapping[str, tuple[bool, str]]) -> list[DeviceHealth]:
    """Slice name -> (healthy, why not) as the health stream sends it."""
    return [
        DeviceHealth(pool, name, healthy, "" if healthy else reason)
        for name, (healthy, reason) in sorted(entries.items())
    ]
