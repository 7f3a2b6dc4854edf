"""Registration with the kubelet, and registration again when it restarts."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from devplugin.api import deviceplugin_v1beta1_pb2 as pb
from devplugin.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from devplugin.frontends.deviceplugin.server import PluginServer
from devplugin.loops import Backoff, ThreadLoop
from devplugin.rpc import SocketIdentity, rpc_failure

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"


class RegistrationFailed(Exception):
    pass


def register(
    kubelet_socket: Path,
    endpoint: str,
    resource_name: str,
    options: pb.DevicePluginOptions,
    timeout: float,
) -> None:
    """One Register call. The kubelet dials back and asks for options inside it,
    so the plugin's own server must already be serving."""
    with grpc.insecure_channel(f"unix://{kubelet_socket}") as channel:
        stub = pb_grpc.RegistrationStub(channel)
        request = pb.RegisterRequest(
            version=API_VERSION,
            endpoint=endpoint,
            resource_name=resource_name,
            options=options,
        )
        try:
            stub.Register(request, timeout=timeout, wait_for_ready=False)
        except grpc.RpcError as exc:
            code, details = rpc_failure(exc)
            raise RegistrationFailed(f"{code.name if code else 'error'}: {details}") from exc


@dataclass
class _Registration:
    server: PluginServer
    registered_with: SocketIdentity | None = None
    attempted_with: SocketIdentity | None = None
    next_attempt: float = 0.0
    backoff: float = 0.0
    failures: int = 0
    attempts: int = 0


# How often the sockets are looked at while a server is not registered.
UNREGISTERED_POLL = 0.2
# The registered poll is this many times slower while the directory's
# events are heard (they poke at once; the poll is only the net).
WATCHED_FACTOR = 10


class Registrar(ThreadLoop):
    """Keeps every plugin server serving and registered with the current kubelet.

    One loop, one owner: each tick it (1) restarts any server whose socket was
    removed or replaced (the kubelet wipes its directory when it restarts),
    then (2) registers every server not yet registered with the kubelet.sock
    that exists now. A new kubelet.sock resets the backoff, so a restarted
    kubelet is answered at the next tick rather than after a long wait.
    """

    def __init__(
        self,
        servers: Sequence[PluginServer],
        plugin_dir: Path,
        *,
        interval: float,
        register_timeout: float,
        backoff_initial: float,
        backoff_max: float,
        on_register: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # A failed tick is tried again at the next one, not sooner or later.
        super().__init__(
            "registrar",
            backoff=Backoff(interval, interval),
            join_timeout=register_timeout + 5.0,
            failing="registrar tick failed",
        )
        self._plugin_dir = plugin_dir
        self._kubelet_socket = plugin_dir / KUBELET_SOCKET
        self._entries = [_Registration(server) for server in servers]
        self._interval = interval
        self._timeout = register_timeout
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._on_register = on_register
        self._clock = clock
        self._kubelet_seen: bool | None = None
        self._lock = threading.Lock()
        self._watched: Callable[[], bool] = lambda: False

    def pace(self) -> float:
        """The poll once every server is registered."""
        return self._interval * (WATCHED_FACTOR if self._watched() else 1)

    def heard_through(self, watching: Callable[[], bool]) -> None:
        """The directory's events reach `poke` while `watching()` says so:
        the poll under them can be slower then."""
        self._watched = watching

    def registered(self) -> dict[str, bool]:
        """Resource name -> registered with the kubelet.sock present now."""
        current = SocketIdentity.of(self._kubelet_socket)
        with self._lock:
            return {
                entry.server.servicer.resource.name: (
                    current is not None and entry.registered_with == current
                )
                for entry in self._entries
            }

    def attempts(self) -> dict[str, int]:
        """Resource name -> Register calls made so far."""
        with self._lock:
            return {e.server.servicer.resource.name: e.attempts for e in self._entries}

    def start(self) -> None:
        if not self._entries:
            return  # every resource is served through DRA: nothing to register here
        super().start()

    def starting(self) -> None:
        log.info("registrar started (kubelet socket %s)", self._kubelet_socket)

    def step(self) -> float:
        self.tick()
        # The poll is the net under the directory's events: relaxed once
        # every server is registered, quick while one is not (a restart's
        # events may come before its kubelet.sock serves); a registration
        # waiting out its backoff is tried when that ends.
        now = self._clock()
        kubelet = SocketIdentity.of(self._kubelet_socket)
        waiting = [
            entry
            for entry in self._entries
            if entry.registered_with is None or entry.registered_with != kubelet
        ]
        if not waiting:
            return self.pace()
        due = [entry.next_attempt - now for entry in waiting if entry.next_attempt > now]
        return max(0.0, min([self._interval, UNREGISTERED_POLL, *due]))

    def tick(self) -> None:
        for entry in self._entries:
            if not entry.server.intact():
                log.warning(
                    "%s: socket %s is gone or replaced (kubelet restart?); restarting server",
                    entry.server.servicer.resource.name,
                    entry.server.path,
                )
                entry.server.restart()
                with self._lock:
                    entry.registered_with = None
        kubelet = SocketIdentity.of(self._kubelet_socket)
        if kubelet is None:
            if self._kubelet_seen is not False:
                log.warning(
                    "kubelet socket %s not present; waiting for the kubelet", self._kubelet_socket
                )
            self._kubelet_seen = False
            return
        self._kubelet_seen = True
        now = self._clock()
        for entry in self._entries:
            if entry.registered_with == kubelet:
                continue
            if entry.attempted_with != kubelet:
                # A new kubelet: forget the old one's backoff.
                entry.backoff = 0.0
                entry.next_attempt = now
            if now < entry.next_attempt:
                continue
            self._attempt(entry, kubelet)

    def _attempt(self, entry: _Registration, kubelet: SocketIdentity) -> None:
        servicer = entry.server.servicer
        name = servicer.resource.name
        entry.attempted_with = kubelet
        with self._lock:
            entry.attempts += 1
        servicer.expect_kubelet()
        try:
            register(
                self._kubelet_socket,
                entry.server.path.name,
                name,
                servicer.options(),
                self._timeout,
            )
        except RegistrationFailed as exc:
            entry.failures += 1
            entry.backoff = min(
                self._backoff_max,
                max(self._backoff_initial, entry.backoff * 2),
            )
            entry.next_attempt = self._clock() + entry.backoff
            log.warning(
                "%s: registration with the kubelet failed (%s); retrying in %.1fs",
                name,
                exc,
                entry.backoff,
            )
            return
        with self._lock:
            entry.registered_with = kubelet
            entry.failures = 0
            entry.backoff = 0.0
        log.info("%s: registered with the kubelet as %s", name, entry.server.path.name)
        if self._on_register is not None:
            self._on_register(name)
