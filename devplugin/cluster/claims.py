"""Reading DRA ResourceClaims for the node's DRA driver.

Every request goes through a client whose timeout is `dra.claim_timeout_seconds`,
so a prepare waits on the API server for at most that long; any failure is
a `ClaimReadError` that becomes the claim's error (the kubelet retries).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightkube import ApiError, Client

from devplugin.cluster.objects import as_dict
from devplugin.policy.claims import ClaimReadError, results_for
from devplugin.wire.resources import ResourceClaim


class ApiClaimReader:
    """Claims through a client whose every request gives up after its timeout."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def get(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        try:
            return as_dict(self._client.get(ResourceClaim, name, namespace=namespace))
        except ApiError as exc:
            if exc.status.code == 404:
                return None
            raise ClaimReadError(f"{exc.status.code} {exc.status.reason}") from exc
        except Exception as exc:
            raise ClaimReadError(f"{type(exc).__name__}: {exc}"[:300]) from exc

    def on_node(self, driver: str, pool: str) -> list[Mapping[str, Any]]:
        try:
            claims = [as_dict(item) for item in self._client.list(ResourceClaim, namespace="*")]
        except ApiError as exc:
            raise ClaimReadError(f"{exc.status.code} {exc.status.reason}") from exc
        except Exception as exc:
            raise ClaimReadError(f"{type(exc).__name__}: {exc}"[:300]) from exc
        found: list[Mapping[str, Any]] = []
        for claim in claims:
            try:
                results = results_for(claim, driver)
            except ValueError:
                continue
            if any(result.pool == pool for result in results):
                found.append(claim)
        return found
