"""The extender's HTTP(S) front: its verbs' paths, /healthz, /readyz and
/metrics, on the event-driven server web.py gives both endpoints.

Bodies up to MAX_BODY, at most IN_FLIGHT_BYTES of them held at once,
CONCURRENT calls answered at once; JSON that cannot be decoded (nested too
deeply included) is a 400, a call that finds no room a 503 (the scheduler
retries). Connections cost no thread: MAX_CONNECTIONS may be open, and
past that the one idle the longest makes room for a new one.
"""

from __future__ import annotations

import json
import logging
import ssl
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from prometheus_client import generate_latest

from devplugin.extender.metrics import ExtenderMetrics, verb_name
from devplugin.extender.views import MAX_REASON
from devplugin.loops import FailureLog
from devplugin.web import Limits, Request, Response, Server, Slots

log = logging.getLogger(__name__)

Verb = Callable[[Mapping[str, Any]], Any]


# Request bodies. A NodeNames call (the chart's scheduler profile is
# nodeCacheCapable) is about 20 bytes a node; a full Nodes list about 5 KiB a
# node, and decoded it takes about ten times its size. The chart's limit
# leaves room for bodies at most MAX_BODY, and at most IN_FLIGHT_BYTES of
# bodies held and decoded at once (a larger one waits its turn, up to
# BODY_WAIT seconds, then gets a 503).
MAX_BODY = 16 << 20
IN_FLIGHT_BYTES = 20 << 20
BODY_WAIT = 10.0
# Calls answered at once; a call whose body has arrived waits up to
# SLOT_WAIT for one, then gets a 503 (the scheduler retries).
CONCURRENT = 8
SLOT_WAIT = 5.0
REQUEST_TIMEOUT = 30.0
# A connection with no request for this long is closed.
IDLE_TIMEOUT = 5.0
# Connections open at once (no thread each: a few kilobytes).
MAX_CONNECTIONS = 16384
# /healthz fails once every call slot has been busy this long.
FULL_FOR = 10.0


class BadRequest(ValueError):
    pass


class Served(Protocol):
    """What the HTTP front answers from (extender/app.py's Extender)."""

    metrics: ExtenderMetrics

    def verbs(self) -> dict[str, Verb]: ...

    def ready(self) -> tuple[bool, str]: ...

    def count_records(self) -> None: ...


class ExtenderServer:
    """The HTTP(S) front: the verbs, /healthz, /readyz, /metrics."""

    def __init__(
        self,
        extender: Served,
        address: tuple[str, int],
        *,
        tls: tuple[str, str] | None = None,
        timeout: float = REQUEST_TIMEOUT,
        idle: float = IDLE_TIMEOUT,
        full_for: float = FULL_FOR,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.extender = extender
        self._failures = FailureLog(log)
        self.full_for = full_for
        self.verbs = extender.verbs()
        self.slots = Slots(CONCURRENT)
        context = None
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
        limits = Limits(
            max_connections=max_connections,
            request_timeout=timeout,
            idle_timeout=idle,
            max_body=MAX_BODY,
            in_flight=IN_FLIGHT_BYTES,
            body_wait=BODY_WAIT,
            workers=CONCURRENT,
            slot_wait=SLOT_WAIT,
            too_large=(
                f"body larger than {MAX_BODY} bytes (a scheduler sending whole Nodes "
                "should be nodeCacheCapable)"
            ),
            refusal=lambda status, reason: _json(status, {"Error": reason[: MAX_REASON * 4]}),
        )
        self._server = Server(
            address, self.handle, limits, name="extender-http", context=context, slots=self.slots
        )
        extender.metrics.connections.set_function(lambda: float(self._server.connections))

    @property
    def address(self) -> tuple[str, int]:
        return self._server.address

    @property
    def connections(self) -> int:
        return self._server.connections

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop()

    def handle(self, request: Request) -> Response:
        """One request, on a worker thread."""
        if request.method == "POST":
            verb = self.verbs.get(request.path)
            if verb is None:
                return _json(404, {"Error": f"no such verb: {request.path[:100]}"})
            return self._serve(verb_name(request.path), verb, request.body)
        if request.method in ("GET", "HEAD"):
            return self._probe(request.path)
        return Response.text(405, "method not allowed\n")

    def _serve(self, name: str, verb: Verb, raw: bytes) -> Response:
        started = time.perf_counter()
        metrics = self.extender.metrics
        try:
            answer = _answer(verb, raw)
        except BadRequest as exc:
            metrics.requests.labels(name, "bad-request").inc()
            return _json(400, {"Error": str(exc)[: MAX_REASON * 4]})
        except Exception as exc:  # noqa: BLE001 - answer, log (once per verb and message), serve on
            self._failures.failed(name, "extender %s failed", name)
            metrics.requests.labels(name, "error").inc()
            return _json(500, {"Error": f"{type(exc).__name__}: {exc}"[:MAX_REASON]})
        metrics.seconds.labels(name).observe(time.perf_counter() - started)
        metrics.requests.labels(name, "ok").inc()
        return Response(200, answer, "application/json")

    def _probe(self, path: str) -> Response:
        if path == "/healthz":
            stuck = self.slots.stuck()
            if stuck > self.full_for:
                return Response.text(503, f"every call slot busy for {stuck:.0f}s\n")
            return Response.text(200, "ok\n")
        if path == "/readyz":
            ok, why = self.extender.ready()
            return Response.text(200 if ok else 503, "ok\n" if ok else why + "\n")
        if path == "/metrics":
            self.extender.count_records()
            data = generate_latest(self.extender.metrics.registry)
            return Response(200, data, "text/plain; version=0.0.4")
        return Response.text(404, "not found\n")


def _answer(verb: Verb, raw: bytes) -> bytes:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise BadRequest(f"body is not JSON: {reason[:100]}") from exc
    del raw
    try:
        answer = verb(body)
        # A verb may answer already encoded (scores_json.py).
        return answer if isinstance(answer, bytes) else json.dumps(answer).encode()
    except RecursionError as exc:
        raise BadRequest("a value nested too deeply") from exc


def _json(status: int, body: Any) -> Response:
    return Response(status, json.dumps(body).encode(), "application/json")
