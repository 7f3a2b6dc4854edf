"""The HTTP endpoint: /metrics, /healthz (alive), /readyz (registered) and
/record (the NodeDevices record as this daemon would publish it now: what
`devplugin topo --daemon` draws, with or without API access).

Listens on every configured address (the node's loopback, and the pod IP
when the chart passes it), each a plain `host:port`; port 0 picks a free port.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from devplugin.config import parse_address
from devplugin.web import Limits, Request, Response, Server

log = logging.getLogger(__name__)

Probe = Callable[[], tuple[bool, str]]
Record = Callable[[], Mapping[str, Any]]

# A scrape or probe takes milliseconds. Half-open, idle or trickling
# connections must not pile up (a descriptor each; no thread, web.py): a
# request must arrive whole within CONNECTION_TIMEOUT seconds, and past
# MAX_CONNECTIONS the one idle the longest is closed for a new one.
MAX_CONNECTIONS = 256
CONNECTION_TIMEOUT = 5.0


class StatusServer:
    def __init__(
        self,
        addresses: list[str],
        registry: CollectorRegistry,
        *,
        healthy: Probe,
        ready: Probe,
        record: Record | None = None,
    ) -> None:
        self._addresses = [parse_address(address) for address in addresses]
        self._registry = registry
        self._healthy = healthy
        self._ready = ready
        self._record = record
        self._servers: list[Server] = []

    @property
    def bound(self) -> list[tuple[str, int]]:
        return [server.address for server in self._servers]

    def start(self) -> None:
        limits = Limits(
            max_connections=MAX_CONNECTIONS,
            request_timeout=CONNECTION_TIMEOUT,
            idle_timeout=CONNECTION_TIMEOUT,
            max_body=0,
            workers=1,
        )
        for host, port in self._addresses:
            try:
                server = Server((host, port), self._handle, limits, name=f"http-{port}")
            except OSError as exc:
                self.stop()
                raise OSError(
                    exc.errno, f"cannot listen on {host}:{port}: {exc.strerror or exc}"
                ) from exc
            server.start()
            self._servers.append(server)
            log.info("metrics and probes on http://%s:%d", *server.address)

    def stop(self) -> None:
        for server in self._servers:
            server.stop()
        self._servers = []

    # A part of the daemon's loops: stopping closes the ports at once.
    @property
    def join_timeout(self) -> float:
        return 5.0

    def signal_stop(self) -> None:
        self.stop()

    def join(self, timeout: float | None = None) -> None:
        """Nothing to wait for: `signal_stop` joined the servers."""

    def _handle(self, request: Request) -> Response:
        if request.method not in ("GET", "HEAD"):
            return Response.text(405, "method not allowed\n")
        if request.path == "/metrics":
            return Response(200, generate_latest(self._registry), CONTENT_TYPE_LATEST)
        if request.path in ("/healthz", "/readyz"):
            ok, detail = (self._healthy if request.path == "/healthz" else self._ready)()
            return Response.text(200 if ok else 503, ("ok" if ok else detail or "not ok") + "\n")
        if request.path == "/record" and self._record is not None:
            # Built from the last judged state: no hardware read, no API call.
            body = json.dumps(self._record(), sort_keys=True).encode()
            return Response(200, body, "application/json")
        return Response.text(404, "not found\n")
