"""DRA ResourceClaims as this driver reads them (pure): which allocation
results are its own, and the seam through which claims are read."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

# A claim uid as this driver accepts one: letters, digits and '-', from a
# letter or digit to a letter or digit, at most 64. Kubernetes uids are
# UUIDs; the uid also names the claim's CDI spec file, so it is never a path.
_UID = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,62}[A-Za-z0-9])?")


def plain_uid(uid: str) -> bool:
    return _UID.fullmatch(uid) is not None


class ClaimReadError(Exception):
    """The API server could not be asked (timeout, refused, 5xx)."""


class ClaimReader(Protocol):
    def get(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The ResourceClaim, or None when there is none of that name.
        Raises ClaimReadError; never waits past its timeout."""

    def on_node(self, driver: str, pool: str) -> list[Mapping[str, Any]]:
        """Every claim with a result of this driver in this pool.
        Raises ClaimReadError."""


@dataclass(frozen=True)
class Result:
    """One allocation result of this driver: the request (without its
    subrequest) and the device as the slice names it."""

    request: str
    pool: str
    device: str
    admin: bool = False


def results_for(claim: Mapping[str, Any], driver: str) -> list[Result]:
    """The allocation results of `driver` in a claim (raises ValueError when
    the claim is not allocated or its results are malformed)."""
    status = claim.get("status") or {}
    allocation = status.get("allocation") if isinstance(status, Mapping) else None
    if not isinstance(allocation, Mapping):
        raise ValueError("not allocated")
    devices = allocation.get("devices") or {}
    entries = devices.get("results") or [] if isinstance(devices, Mapping) else []
    if not isinstance(entries, list):
        raise ValueError("status.allocation.devices.results is not a list")
    found: list[Result] = []
    for entry in entries:
        if not isinstance(entry, Mapping) or entry.get("driver") != driver:
            continue
        request, pool, device = (entry.get(key) for key in ("request", "pool", "device"))
        if not all(isinstance(value, str) and value for value in (request, pool, device)):
            raise ValueError("an allocation result lacks its request, pool or device")
        found.append(
            Result(
                str(request).split("/", 1)[0],
                str(pool),
                str(device),
                admin=bool(entry.get("adminAccess")),
            )
        )
    return found


def claim_uid(claim: Mapping[str, Any]) -> str:
    metadata = claim.get("metadata") or {}
    return str(metadata.get("uid", "")) if isinstance(metadata, Mapping) else ""
