"""The extender's HTTP(S) front: its verbs' paths, /healthz, /readyz and
/metrics, with bounded requests.

Bodies up to MAX_BODY, at most IN_FLIGHT_BYTES of them decoded at once,
CONCURRENT calls handled at once with a listen backlog of BACKLOG; JSON
that cannot be decoded (nested too deeply included) is a 400, a call that
finds no room a 503 (the scheduler retries).
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler
from typing import Any, ClassVar, Protocol

from prometheus_client import generate_latest

from devplugin.extender.metrics import ExtenderMetrics
from devplugin.extender.views import MAX_REASON
from devplugin.web import BoundedHandler, BoundedServer, Listener

log = logging.getLogger(__name__)

Verb = Callable[[Mapping[str, Any]], Any]


# Request bodies. A NodeNames call (the chart's scheduler profile is
# nodeCacheCapable) is about 20 bytes a node; a full Nodes list about 5 KiB a
# node, and decoded it takes about ten times its size. The chart's limit is
# 512 MiB: bodies at most MAX_BODY, and at most IN_FLIGHT_BYTES of bodies
# read and decoded at once (a larger one waits its turn, up to BODY_WAIT
# seconds, then gets a 503), keep requests within about 200 MiB of it.
MAX_BODY = 16 << 20
IN_FLIGHT_BYTES = 20 << 20
BODY_WAIT = 10.0
# Calls answered at once; a call whose body has arrived waits up to
# SLOT_WAIT for one, then gets a 503 (the scheduler retries). Bodies are
# read before a slot is taken, each within REQUEST_TIMEOUT as a whole.
CONCURRENT = 8
SLOT_WAIT = 5.0
REQUEST_TIMEOUT = 30.0
# A connection with no request for this long is closed (the scheduler opens
# new ones freely; idle ones only hold threads).
IDLE_TIMEOUT = 5.0
# Connections at once (a thread each); more are closed at once.
MAX_CONNECTIONS = 256
BACKLOG = 128
# /healthz fails once every call slot has been busy this long.
FULL_FOR = 10.0


class BadRequest(ValueError):
    pass


class Busy(RuntimeError):
    """Too much request data in flight: answered 503, the scheduler retries."""


class Budget:
    """Bytes of request bodies in flight (a request larger than the whole
    budget runs alone)."""

    def __init__(self, total: int) -> None:
        self._total = total
        self._used = 0
        self._cond = threading.Condition()

    def take(self, amount: int, wait: float) -> bool:
        amount = min(amount, self._total)
        with self._cond:
            if not self._cond.wait_for(lambda: self._used + amount <= self._total, wait):
                return False
            self._used += amount
            return True

    def give(self, amount: int) -> None:
        with self._cond:
            self._used -= min(amount, self._total)
            self._cond.notify_all()


class Slots(Budget):
    """The call slots (a budget of one per call), and since when all of
    them have been taken."""

    def __init__(self, count: int, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(count)
        self._clock = clock
        self.full_since: float | None = None

    def take_one(self, wait: float) -> bool:
        if not self.take(1, wait):
            return False
        with self._cond:
            if self._used == self._total and self.full_since is None:
                self.full_since = self._clock()
        return True

    def give_one(self) -> None:
        with self._cond:
            self.full_since = None
        self.give(1)

    def stuck(self) -> float:
        """How long every slot has been taken (0 when one is free)."""
        since = self.full_since
        return 0.0 if since is None else self._clock() - since


class Served(Protocol):
    """What the HTTP front answers from (extender/app.py's Extender)."""

    metrics: ExtenderMetrics

    def verbs(self) -> dict[str, Verb]: ...

    def ready(self) -> tuple[bool, str]: ...

    def count_records(self) -> None: ...


class ExtenderServer:
    """The HTTP(S) front: the two verbs, /healthz, /readyz, /metrics."""

    def __init__(
        self,
        extender: Served,
        address: tuple[str, int],
        *,
        tls: tuple[str, str] | None = None,
        timeout: float = REQUEST_TIMEOUT,
        idle: float = IDLE_TIMEOUT,
        full_for: float = FULL_FOR,
    ) -> None:
        self.extender = extender
        self.slots = Slots(CONCURRENT)
        handler = _handler(extender, self.slots, full_for)
        context = None
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
        self._server = _Server(address, handler, context, timeout, idle)
        self._listener = Listener(self._server, "extender-http")

    @property
    def address(self) -> tuple[str, int]:
        return self._listener.address

    def start(self) -> None:
        self._listener.start()

    @property
    def connections(self) -> int:
        return self._server.open

    def stop(self) -> None:
        self._listener.stop()


class _Server(BoundedServer):
    """TLS, when on, is negotiated in each connection's own thread (with the
    connection's timeout): a client that never finishes its handshake holds
    only its thread, never the accept loop."""

    request_queue_size = BACKLOG

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        context: ssl.SSLContext | None,
        timeout: float,
        idle: float,
    ) -> None:
        super().__init__(
            address,
            handler,
            max_connections=MAX_CONNECTIONS,
            request_timeout=timeout,
            idle_timeout=idle,
        )
        self._context = context
        self._timeout = timeout

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self._context is not None:
            request.settimeout(self._timeout)
            request = self._context.wrap_socket(request, server_side=True)
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("extender connection from %s failed", client_address, exc_info=True)


class ExtenderHandler(BoundedHandler):
    """The extender's verbs and probes; `_handler` makes one subclass per
    served extender with what it answers from."""

    protocol_version = "HTTP/1.1"
    extender: ClassVar[Served]
    slots: ClassVar[Slots]
    full_for: ClassVar[float]
    budget: ClassVar[Budget]
    verbs: ClassVar[dict[str, Callable[[Mapping[str, Any]], Any]]]

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        verb = self.verbs.get(path)
        if verb is None:
            self._send(404, {"Error": f"no such verb: {path[:100]}"})
            return
        # The claims verbs counted apart: claims_filter, claims_prioritize.
        self._serve(path.removeprefix("/scheduler/").replace("/", "_"), verb)

    def _serve(self, name: str, verb: Callable[[Mapping[str, Any]], Any]) -> None:
        started = time.perf_counter()
        try:
            answer = self._call(verb)
        except BadRequest as exc:
            self.extender.metrics.requests.labels(name, "bad-request").inc()
            self._send(400, {"Error": str(exc)[: MAX_REASON * 4]})
            return
        except Busy as exc:
            self.extender.metrics.requests.labels(name, "busy").inc()
            self.close_connection = True  # the body was not read
            self._send(503, {"Error": str(exc)})
            return
        except Exception as exc:  # answer, log, keep serving
            log.exception("extender %s failed", name)
            self.extender.metrics.requests.labels(name, "error").inc()
            self._send(500, {"Error": f"{type(exc).__name__}: {exc}"[:MAX_REASON]})
            return
        self.extender.metrics.seconds.labels(name).observe(time.perf_counter() - started)
        self.extender.metrics.requests.labels(name, "ok").inc()
        self.reply(200, answer, "application/json")

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            stuck = self.slots.stuck()
            if stuck > self.full_for:
                self._text(503, f"every call slot busy for {stuck:.0f}s\n")
            else:
                self._text(200, "ok\n")
        elif path == "/readyz":
            ok, why = self.extender.ready()
            self._text(200 if ok else 503, "ok\n" if ok else why + "\n")
        elif path == "/metrics":
            self.extender.count_records()
            data = generate_latest(self.extender.metrics.registry)
            self.reply(200, data, "text/plain; version=0.0.4")
        else:
            self._text(404, "not found\n")

    def _call(self, verb: Callable[[Mapping[str, Any]], Any]) -> Any:
        """Read, decode and answer within the body budget (the decoded
        body and the answer built from it live only this long)."""
        length_text = self.headers.get("Content-Length")
        if length_text is None or not length_text.isdigit():
            self.close_connection = True
            raise BadRequest("Content-Length required")
        length = int(length_text)
        if length > MAX_BODY:
            self.close_connection = True
            raise BadRequest(
                f"body larger than {MAX_BODY} bytes (a scheduler sending whole Nodes "
                "should be nodeCacheCapable)"
            )
        if not self.budget.take(length, BODY_WAIT):
            raise Busy(f"too many large requests at once; retry ({length} bytes waiting)")
        try:
            # The whole body first (by the request's deadline), then a slot:
            # a client that trickles its body holds its own thread only.
            raw = self.rfile.read(length)
            if len(raw) < length:
                self.close_connection = True
                raise BadRequest("body shorter than its Content-Length")
            if not self.slots.take_one(SLOT_WAIT):
                raise Busy("every call slot is busy; retry")
            try:
                return self._answer(verb, raw)
            finally:
                self.slots.give_one()
        finally:
            self.budget.give(length)

    def _answer(self, verb: Callable[[Mapping[str, Any]], Any], raw: bytes) -> bytes:
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

    def _send(self, code: int, body: Any) -> None:
        self.reply(code, json.dumps(body).encode(), "application/json")

    def _text(self, code: int, text: str) -> None:
        self.reply(code, text.encode(), "text/plain; charset=utf-8")

    def log_message(self, format: str, *args: object) -> None:
        log.debug("extender http: " + format, *args)


def _handler(extender: Served, slots: Slots, full_for: float) -> type[BaseHTTPRequestHandler]:
    attributes = {
        "extender": extender, "slots": slots, "full_for": full_for,
        "budget": Budget(IN_FLIGHT_BYTES), "verbs": extender.verbs(),
    }  # fmt: skip
    return type("Handler", (ExtenderHandler,), attributes)
