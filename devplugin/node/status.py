"""The HTTP endpoint: /metrics, /healthz (alive) and /readyz (registered).

Listens on every configured address (the node's loopback, and the pod IP
when the chart passes it), each a plain `host:port`; port 0 picks a free port.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from devplugin.config import parse_address
from devplugin.web import BoundedHandler, BoundedServer, Listener

log = logging.getLogger(__name__)

Probe = Callable[[], tuple[bool, str]]

# A scrape or probe takes milliseconds. Half-open, idle or trickling
# connections must not pile up (one thread and one descriptor each): a
# request must arrive whole within CONNECTION_TIMEOUT seconds, and past
# MAX_CONNECTIONS at once new ones are closed straight away.
MAX_CONNECTIONS = 32
CONNECTION_TIMEOUT = 5.0


class StatusServer:
    def __init__(
        self,
        addresses: list[str],
        registry: CollectorRegistry,
        *,
        healthy: Probe,
        ready: Probe,
    ) -> None:
        self._addresses = [parse_address(address) for address in addresses]
        self._registry = registry
        self._healthy = healthy
        self._ready = ready
        self._listeners: list[Listener] = []

    @property
    def bound(self) -> list[tuple[str, int]]:
        return [listener.address for listener in self._listeners]

    def start(self) -> None:
        handler = self._handler()
        for host, port in self._addresses:
            try:
                server = BoundedServer(
                    (host, port),
                    handler,
                    max_connections=MAX_CONNECTIONS,
                    request_timeout=CONNECTION_TIMEOUT,
                )
            except OSError as exc:
                self.stop()
                raise OSError(
                    exc.errno, f"cannot listen on {host}:{port}: {exc.strerror or exc}"
                ) from exc
            listener = Listener(server, f"http-{port}")
            listener.start()
            self._listeners.append(listener)
            log.info("metrics and probes on http://%s:%d", *listener.address)

    def stop(self) -> None:
        for listener in self._listeners:
            listener.stop()
        self._listeners = []

    # A part of the daemon's loops: stopping closes the ports at once.
    @property
    def join_timeout(self) -> float:
        return 5.0

    def signal_stop(self) -> None:
        self.stop()

    def join(self, timeout: float | None = None) -> None:
        """Nothing to wait for: `signal_stop` joined the listeners."""

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        registry, healthy, ready = self._registry, self._healthy, self._ready

        class Handler(BoundedHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self.reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path in ("/healthz", "/readyz"):
                    ok, detail = (healthy if path == "/healthz" else ready)()
                    body = ("ok" if ok else detail or "not ok") + "\n"
                    self.reply(200 if ok else 503, body.encode(), "text/plain; charset=utf-8")
                else:
                    self.reply(404, b"not found\n", "text/plain; charset=utf-8")

            def log_message(self, format: str, *args: object) -> None:
                log.debug("http: " + format, *args)

        return Handler
