"""Small helpers shared by the gRPC servers and clients (the daemon's and
the simulator's): unix socket paths and identities, a server on one unix
socket, failure details, a call's deadline."""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

SOCKET_MODE = 0o600
# The kernel limit for sun_path, including the terminating NUL.
MAX_SOCKET_PATH = 107
# A server binds `.<name>.<hex token>` beside its path first (see SocketServer.start).
_HIDDEN_TOKEN_BYTES = 3
_HIDDEN_EXTRA = len(".") + len(".") + 2 * _HIDDEN_TOKEN_BYTES


def deadline_of(context: grpc.ServicerContext) -> float | None:
    """The caller's deadline on the monotonic clock, if it set one."""
    left = context.time_remaining()
    return None if left is None else time.monotonic() + left


def check_socket_path(path: Path) -> None:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ValueError(
            f"unix socket path {path} is {len(os.fsencode(path))} bytes; "
            f"the kernel allows at most {MAX_SOCKET_PATH}"
        )


def check_server_path(path: Path) -> None:
    """A path a SocketServer can serve on (its hidden name is longer)."""
    check_socket_path(path)
    if len(os.fsencode(path)) + _HIDDEN_EXTRA > MAX_SOCKET_PATH:
        raise ValueError(
            f"unix socket path {path} is {len(os.fsencode(path))} bytes; the server "
            f"binds a temporary name {_HIDDEN_EXTRA} bytes longer first, so at most "
            f"{MAX_SOCKET_PATH - _HIDDEN_EXTRA} are allowed"
        )


@dataclass(frozen=True)
class SocketIdentity:
    """Which file a path names: a replaced socket has a new inode."""

    device: int
    inode: int
    ctime_ns: int

    @classmethod
    def of(cls, path: Path) -> SocketIdentity | None:
        try:
            stat = os.stat(path)
        except OSError:
            return None
        return cls(stat.st_dev, stat.st_ino, stat.st_ctime_ns)


class SocketServer:
    """A grpc.Server on one unix socket, restartable on a fresh socket after
    the file was removed or replaced (a kubelet restart wipes its
    directories). `add` puts the services on each new grpc.Server;
    subclasses hear of the start and the stop (`_opening`, `_closing`).

    The socket appears at its path only once it accepts connections, with
    its final mode: the server binds a hidden name beside it (the kubelet's
    plugin watcher ignores names starting with a dot) and renames it into
    place. Bound at the path itself, the file exists a moment before
    listen(); a watcher that connects in that moment is refused and, if it
    tells sockets apart by inode only, never tries that socket again.
    """

    def __init__(
        self,
        name: str,
        path: Path,
        add: Callable[[grpc.Server], None],
        *,
        workers: int = 8,
        thread_prefix: str = "",
    ) -> None:
        check_server_path(path)
        self.name = name
        self.path = path
        self._add = add
        self._workers = workers
        self._thread_prefix = thread_prefix or name
        self._server: grpc.Server | None = None
        self._identity: SocketIdentity | None = None
        self.starts = 0

    @property
    def running(self) -> bool:
        return self._server is not None

    def _opening(self) -> None:
        """Before a new server starts serving."""

    def _closing(self) -> None:
        """Before the server stops (open streams end first)."""

    def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("server already running")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)
        self._sweep_hidden()
        self._opening()
        server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=self._workers, thread_name_prefix=self._thread_prefix
            ),
            options=[("grpc.so_reuseport", 0)],
        )
        self._add(server)
        # A fresh hidden name each start: gRPC unlinks the name it bound when
        # a server shuts down, and a late shutdown of the previous server
        # must not take the new server's file.
        token = secrets.token_hex(_HIDDEN_TOKEN_BYTES)
        hidden = self.path.with_name(f".{self.path.name}.{token}")
        server.add_insecure_port(f"unix://{hidden}")
        try:
            server.start()
            # gRPC creates the socket under the process umask (0777 under
            # 000): only root, which the kubelet runs as, may connect.
            os.chmod(hidden, SOCKET_MODE)
            os.replace(hidden, self.path)
        except BaseException:
            server.stop(None)
            hidden.unlink(missing_ok=True)
            raise
        self._server = server
        self._identity = SocketIdentity.of(self.path)
        self.starts += 1
        log.info("%s: serving on %s", self.name, self.path)

    def _sweep_hidden(self) -> None:
        """Hidden names a killed process bound and never renamed."""
        prefix = f".{self.path.name}."
        for stale in self.path.parent.iterdir():
            if stale.name.startswith(prefix):
                stale.unlink(missing_ok=True)

    def intact(self) -> bool:
        """False once the socket file was removed or replaced."""
        return self._identity is not None and SocketIdentity.of(self.path) == self._identity

    def stop(self, grace: float = 1.0, *, remove_socket: bool = True) -> None:
        server, self._server = self._server, None
        self._closing()
        if server is not None:
            server.stop(grace).wait(grace + 1.0)
        if remove_socket and self._identity is not None and self.intact():
            self.path.unlink(missing_ok=True)
        self._identity = None

    def restart(self) -> None:
        self.stop(grace=0.5, remove_socket=False)
        self.start()


def rpc_failure(exc: grpc.RpcError) -> tuple[grpc.StatusCode | None, str]:
    """The status code and details of a failed call.

    Client-side failures are `grpc.Call` objects carrying both; anything
    else (a channel that never connected) has only its text.
    """
    if isinstance(exc, grpc.Call):
        return exc.code(), exc.details() or ""
    return None, str(exc)
