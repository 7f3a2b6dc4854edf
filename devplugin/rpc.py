"""Small helpers shared by the gRPC clients (the daemon's and the simulator's)."""

from __future__ import annotations

import grpc


def rpc_failure(exc: grpc.RpcError) -> tuple[grpc.StatusCode | None, str]:
    """The status code and details of a failed call.

    Client-side failures are `grpc.Call` objects carrying both; anything
    else (a channel that never connected) has only its text.
    """
    if isinstance(exc, grpc.Call):
        return exc.code(), exc.details() or ""
    return None, str(exc)
