"""What the daemon's two HTTP endpoints (the node's status, the extender)
share: one event loop per listening address, so an open connection costs a
few kilobytes and no thread, and a client however slow or hostile holds
nothing anyone else needs.

Why asyncio (the standard library's): the endpoints answer a handful of
small requests a second from the scheduler or a scraper, while anything on
the cluster network may open thousands of connections and never send a
byte. A thread per connection (the standard library's threading server)
let 256 idle ones refuse the scheduler's calls; on an event loop 10,000
idle ones cost tens of megabytes and the scheduler's call is read as soon
as its bytes arrive. The answers themselves are computed on a small pool
of worker threads (`workers`): the verbs are Python computations that
must not stall the loop that reads everyone else's requests.

* A request's first byte must come within `idle_timeout` (an idle
  keep-alive connection is closed then), and the whole request (its line,
  headers and body) within `request_timeout` of that byte: a client that
  sends a byte now and then is cut off at that deadline.
* At most `max_connections` at once. Past that, the connection idle the
  longest (waiting for its first byte) is closed to make room; a new one
  is refused only when every open one is in the middle of a request.
* A body larger than `max_body` is refused (400); at most `in_flight`
  bytes of bodies are held at once (a request that finds no room within
  `body_wait` gets a 503: the scheduler retries).
* POSTs take one of `workers` call slots, waiting at most `slot_wait`
  (then a 503); GETs (probes and scrapes) run beside them on a pool of
  their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import itertools
import logging
import ssl
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus

from devplugin.web_head import MAX_FIELDS, MAX_LINE, BadHead, header_fields, request_line

log = logging.getLogger(__name__)

# Writing an answer to a client that does not read: given up after this.
WRITE_TIMEOUT = 10.0
# The listen backlog: the default of 100 drops SYNs under a burst, and a
# client then waits out TCP's one-second retransmission.
BACKLOG = 1024


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # without the query
    headers: http.client.HTTPMessage
    body: bytes


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    close: bool = False  # close the connection after it

    @classmethod
    def text(cls, status: int, text: str, *, close: bool = False) -> Response:
        return cls(status, text.encode(), close=close)


Handler = Callable[[Request], Response]
# How a request refused before its handler is told (status, reason).
Refusal = Callable[[int, str], Response]


def text_refusal(status: int, reason: str) -> Response:
    return Response.text(status, reason + "\n")


@dataclass(frozen=True)
class Limits:
    max_connections: int
    request_timeout: float
    idle_timeout: float
    max_body: int = 1 << 20
    in_flight: int = 4 << 20
    body_wait: float = 10.0
    workers: int = 4
    slot_wait: float = 5.0
    # What a body over max_body is told.
    too_large: str = "body too large"
    # What a POST without Content-Length is told.
    no_length: str = "Content-Length required"
    refusal: Refusal = text_refusal


class Slots:
    """The call slots: taken by POSTs (on the loop, waiting their turn) and
    given back from any thread; and since when all of them are taken."""

    def __init__(self, count: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._count = count
        self._free = count
        self._clock = clock
        self._lock = threading.Lock()
        self._waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = deque()
        self.full_since: float | None = None

    def take_one(self) -> bool:
        """Take a slot now if one is free (for callers off the loop)."""
        with self._lock:
            return self._take_locked()

    def _take_locked(self) -> bool:
        if self._free <= 0:
            return False
        self._free -= 1
        if self._free == 0 and self.full_since is None:
            self.full_since = self._clock()
        return True

    async def take(self, wait: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            with self._lock:
                if self._take_locked():
                    return True
                future: asyncio.Future[None] = loop.create_future()
                self._waiters.append((loop, future))
            try:
                await asyncio.wait_for(future, max(0.0, deadline - loop.time()))
            except TimeoutError:
                return False
            finally:
                with self._lock, contextlib.suppress(ValueError):
                    self._waiters.remove((loop, future))

    def give_one(self) -> None:
        with self._lock:
            self._free = min(self._count, self._free + 1)
            self.full_since = None
            waiters = list(self._waiters)
            self._waiters.clear()
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # its loop has closed
                loop.call_soon_threadsafe(_wake, future)

    def stuck(self) -> float:
        """How long every slot has been taken (0 when one is free)."""
        since = self.full_since
        return 0.0 if since is None else self._clock() - since


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class BodyBudget:
    """Bytes of request bodies held at once (on the loop's thread only; a
    body larger than the whole budget is held alone)."""

    def __init__(self, total: int) -> None:
        self._total = total
        self._used = 0
        self._changed = asyncio.Condition()

    async def take(self, amount: int, wait: float) -> bool:
        amount = min(amount, self._total)
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self._used + amount <= self._total), wait
                )
            except TimeoutError:
                return False
            self._used += amount
            return True

    async def give(self, amount: int) -> None:
        async with self._changed:
            self._used -= min(amount, self._total)
            self._changed.notify_all()


class _Refused(Exception):
    """A request answered with an error before its handler ran."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status)
        self.response = response


@dataclass(eq=False)
class _Connection:
    writer: asyncio.StreamWriter
    idle: bool = True


@dataclass
class _State:
    open: dict[int, _Connection] = field(default_factory=dict)
    # Connections waiting for a request's first byte, longest idle first.
    idle: OrderedDict[int, _Connection] = field(default_factory=OrderedDict)
    refused: int = 0
    evicted: int = 0


class Server:
    """One listening address served on its own event loop thread."""

    def __init__(
        self,
        address: tuple[str, int],
        handler: Handler,
        limits: Limits,
        *,
        name: str,
        context: ssl.SSLContext | None = None,
        slots: Slots | None = None,
    ) -> None:
        self._handler = handler
        self.limits = limits
        self.name = name
        self._context = context
        self.slots = slots or Slots(limits.workers)
        self._state = _State()
        self._ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._calls = ThreadPoolExecutor(limits.workers, thread_name_prefix=f"{name}-call")
        self._probes = ThreadPoolExecutor(2, thread_name_prefix=f"{name}-get")
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None
        try:
            self._server = self._loop.run_until_complete(self._listen(address))
        except BaseException:
            self._close_pools()
            self._loop.close()
            raise
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = (str(host), int(port))

    async def _listen(self, address: tuple[str, int]) -> asyncio.Server:
        self._stopped = asyncio.Event()
        self._bytes = BodyBudget(self.limits.in_flight)
        return await asyncio.start_server(
            self._serve,
            address[0] or None,
            address[1],
            ssl=self._context,
            ssl_handshake_timeout=self.limits.request_timeout if self._context else None,
            backlog=BACKLOG,
            limit=MAX_LINE + 2,
            reuse_address=True,
        )

    @property
    def connections(self) -> int:
        return len(self._state.open)

    @property
    def refused(self) -> int:
        return self._state.refused

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        log.debug("%s serving on %s:%d", self.name, *self.address)
        try:
            self._loop.run_until_complete(self._until_stopped())
        finally:
            self._loop.close()

    async def _until_stopped(self) -> None:
        assert self._stopped is not None
        await self._stopped.wait()
        self._server.close()
        for connection in list(self._state.open.values()):
            connection.writer.transport.abort()
        await self._server.wait_closed()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def stop(self) -> None:
        thread = self._thread
        if thread is None:
            self._server.close()
            self._loop.close()
        else:
            stopped = self._stopped
            if stopped is not None:
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(stopped.set)
            thread.join(5.0)
            self._thread = None
        self._close_pools()

    def _close_pools(self) -> None:
        self._calls.shutdown(wait=False, cancel_futures=True)
        self._probes.shutdown(wait=False, cancel_futures=True)

    # -- one connection --------------------------------------------------------
    def _admit(self, key: int, connection: _Connection) -> bool:
        state = self._state
        if len(state.open) >= self.limits.max_connections:
            if not state.idle:
                state.refused += 1
                return False
            _, oldest = state.idle.popitem(last=False)
            state.evicted += 1
            oldest.writer.transport.abort()
        state.open[key] = connection
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        key = next(self._ids)
        connection = _Connection(writer)
        if not self._admit(key, connection):
            writer.transport.abort()
            return
        try:
            await self._requests(key, connection, reader, writer)
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        except Exception:
            log.debug("%s: a connection failed", self.name, exc_info=True)
        finally:
            self._state.open.pop(key, None)
            self._state.idle.pop(key, None)
            writer.transport.abort()

    async def _requests(
        self,
        key: int,
        connection: _Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        limits = self.limits
        while True:
            self._state.idle[key] = connection
            try:
                first = await asyncio.wait_for(reader.read(1), limits.idle_timeout)
            finally:
                self._state.idle.pop(key, None)
            if not first:
                return
            try:
                async with asyncio.timeout(limits.request_timeout):
                    response, keep = await self._one(first, reader, writer)
            except _Refused as refused:
                response, keep = refused.response, False
            await self._send(writer, response, keep)
            if not keep:
                return

    async def _one(
        self, first: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[Response, bool]:
        """Read one request (its first byte read already) and answer it;
        whether the connection stays open after."""
        line = first + await _line(reader)
        try:
            method, target, _, version = request_line(line.decode("iso-8859-1").rstrip("\r\n"))
            raw = [await _line(reader)]
            while raw[-1] not in (b"\r\n", b"\n", b"") and len(raw) <= MAX_FIELDS:
                raw.append(await _line(reader))
            lines = iter(raw)
            headers = header_fields(lambda limit: next(lines, b""))
        except BadHead as bad:
            raise _Refused(self.limits.refusal(bad.status, bad.reason)) from bad
        except asyncio.LimitOverrunError as exc:
            status = HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE
            raise _Refused(self.limits.refusal(status, "Line too long")) from exc
        connection = headers.get("Connection", "").lower()
        keep = connection != "close" and (version >= (1, 1) or connection == "keep-alive")
        path = target.split("?", 1)[0]
        length_text = headers.get("Content-Length")
        if method == "POST" and (length_text is None or not length_text.isdigit()):
            raise _Refused(self.limits.refusal(400, self.limits.no_length))
        length = int(length_text) if length_text and length_text.isdigit() else 0
        if length > self.limits.max_body:
            raise _Refused(self.limits.refusal(400, self.limits.too_large))
        if headers.get("Expect", "").lower() == "100-continue" and version >= (1, 1):
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
        if not await self._bytes.take(length, self.limits.body_wait):
            message = f"too many large requests at once; retry ({length} bytes waiting)"
            raise _Refused(self.limits.refusal(503, message))
        try:
            body = await reader.readexactly(length) if length else b""
            request = Request(method, path, headers, body)
            del body
            response = await self._call(request)
        except asyncio.IncompleteReadError as exc:
            short = self.limits.refusal(400, "body shorter than its Content-Length")
            raise _Refused(short) from exc
        finally:
            await self._bytes.give(length)
        return response, keep and not response.close

    async def _call(self, request: Request) -> Response:
        loop = asyncio.get_running_loop()
        if request.method != "POST":
            return await loop.run_in_executor(self._probes, self._handler, request)
        if not await self.slots.take(self.limits.slot_wait):
            return self.limits.refusal(503, "every call slot is busy; retry")
        try:
            return await loop.run_in_executor(self._calls, self._handler, request)
        finally:
            self.slots.give_one()

    async def _send(self, writer: asyncio.StreamWriter, response: Response, keep: bool) -> None:
        reason = _reason(response.status)
        head = (
            f"HTTP/1.1 {response.status} {reason}\r\n"
            f"Content-Type: {response.content_type}\r\n"
            f"Content-Length: {len(response.body)}\r\n"
            + ("" if keep else "Connection: close\r\n")
            + "\r\n"
        )
        writer.write(head.encode("latin-1") + response.body)
        await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT)


async def _line(reader: asyncio.StreamReader) -> bytes:
    """One line, at most MAX_LINE bytes (LimitOverrunError past that)."""
    try:
        return await reader.readuntil(b"\n")
    except asyncio.IncompleteReadError as exc:
        return exc.partial


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"
