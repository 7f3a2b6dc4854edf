"""Small helpers shared by the gRPC servers and clients (the daemon's and
the simulator's): unix socket paths and identities, failure details."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

SOCKET_MODE = 0o600
# The kernel limit for sun_path, including the terminating NUL.
MAX_SOCKET_PATH = 107


def check_socket_path(path: Path) -> None:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ValueError(
            f"unix socket path {path} is {len(os.fsencode(path))} bytes; "
            f"the kernel allows at most {MAX_SOCKET_PATH}"
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


def rpc_failure(exc: grpc.RpcError) -> tuple[grpc.StatusCode | None, str]:
    """The status code and details of a failed call.

    Client-side failures are `grpc.Call` objects carrying both; anything
    else (a channel that never connected) has only its text.
    """
    if isinstance(exc, grpc.Call):
        return exc.code(), exc.details() or ""
    return None, str(exc)
