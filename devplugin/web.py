"""What the daemon's two HTTP endpoints (the node's status, the extender)
share: a client, however slow or hostile, holds a bounded number of
threads for a bounded time.

* A request's first byte must come within the server's `idle_timeout`
  (an idle keep-alive connection is closed then), and the whole request
  (its line, headers and body) within `request_timeout` of that byte: a
  client that sends a byte now and then is cut off at that deadline, not
  kept alive by each byte (a per-`recv` timeout would be).
* At most `max_connections` connections at once, each on its own thread;
  past that a new connection is closed at once.
* One accept loop per server on its own thread (`Listener`), stopped the
  same way for both: shut down, woken by a knock, closed, joined.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from devplugin.loops import ThreadLoop
from devplugin.web_head import BadHead, header_fields, request_line

# Writing an answer to a client that does not read: given up after this.
WRITE_TIMEOUT = 10.0
_CHUNK = 65536


class DeadlineFile:
    """The request side of a connection, read straight from the socket with
    one deadline for everything a request reads (what `rfile` is to
    BaseHTTPRequestHandler: `readline` and `read`)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = bytearray()
        self.deadline = float("inf")
        self._whole = float("inf")
        self._waiting = False

    def begin(self, idle: float, whole: float) -> None:
        """A new request: its first byte within `idle`, all of it within
        `whole` of that byte."""
        now = time.monotonic()
        self._whole = whole
        self._waiting = not self._buffer  # a pipelined request has begun already
        self.deadline = now + (idle if self._waiting else whole)

    def _fill(self) -> bool:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the request did not arrive in time")
        self._sock.settimeout(remaining)
        try:
            chunk = self._sock.recv(_CHUNK)
        finally:
            self._sock.settimeout(WRITE_TIMEOUT)
        if not chunk:
            return False
        if self._waiting:
            self._waiting = False
            self.deadline = time.monotonic() + self._whole
        self._buffer += chunk
        return True

    def _take(self, count: int) -> bytes:
        taken = bytes(self._buffer[:count])
        del self._buffer[:count]
        return taken

    def readline(self, limit: int = -1) -> bytes:
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0 and (limit < 0 or end < limit):
                return self._take(end + 1)
            if 0 <= limit <= len(self._buffer):
                return self._take(limit)
            if not self._fill():
                return self._take(len(self._buffer))

    def read(self, count: int = -1) -> bytes:
        while count < 0 or len(self._buffer) < count:
            if not self._fill():
                break
        return self._take(len(self._buffer) if count < 0 else count)

    def close(self) -> None:
        self._buffer.clear()


class BoundedHandler(BaseHTTPRequestHandler):
    """A handler whose every request must arrive whole within the server's
    `request_timeout`."""

    server: BoundedServer
    # Headers and body go out in two writes; with Nagle on, the body waits
    # for the client's delayed ACK of the headers (40 ms and more on Linux).
    disable_nagle_algorithm = True

    def setup(self) -> None:
        super().setup()
        self.rfile.close()
        self.rfile = DeadlineFile(self.connection)  # type: ignore[assignment]
        self.connection.settimeout(WRITE_TIMEOUT)

    def handle_one_request(self) -> None:
        reader = self.rfile
        if isinstance(reader, DeadlineFile):
            reader.begin(self.server.idle_timeout, self.server.request_timeout)
        super().handle_one_request()

    def parse_request(self) -> bool:
        """The request line and header fields (web_head.py); False, with the
        error answered, where they cannot be served."""
        self.command = None  # type: ignore[assignment]  # what send_error reads on a bad line
        # Errors go out with a status line (HTTP/0.9, the default, has none).
        self.request_version = "HTTP/1.0"
        self.close_connection = True
        raw: bytes = getattr(self, "raw_requestline", b"")
        line = str(raw, "iso-8859-1").rstrip("\r\n")
        self.requestline = line
        if not line.strip():
            return False
        try:
            self.command, self.path, self.request_version, version = request_line(line)
            self.headers = header_fields(self.rfile.readline)
        except BadHead as bad:
            self.send_error(bad.status, bad.reason)
            return False
        connection = self.headers.get("Connection", "").lower()
        persistent = self.protocol_version >= "HTTP/1.1"  # this server keeps connections
        keep = persistent and (version >= (1, 1) or connection == "keep-alive")
        self.close_connection = connection == "close" or not keep
        expect = self.headers.get("Expect", "").lower()
        if expect == "100-continue" and persistent and version >= (1, 1):
            return bool(self.handle_expect_100())
        return True

    def reply(self, code: int, body: bytes, content_type: str) -> None:
        """A whole answer: status, type and length, then the body."""
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class BoundedServer(ThreadingHTTPServer):
    """A threading server with a cap on connections at once."""

    daemon_threads = True
    block_on_close = False
    # The default backlog of 5 drops SYNs under a burst: clients (and the
    # kubelet's probe) then wait out TCP's one-second retransmission.
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        *,
        max_connections: int,
        request_timeout: float,
        idle_timeout: float | None = None,
    ) -> None:
        super().__init__(address, handler)
        self.request_timeout = request_timeout
        self.idle_timeout = request_timeout if idle_timeout is None else idle_timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self.open = 0
        self.refused = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        with self._lock:
            self.open += 1
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _release(self) -> None:
        with self._lock:
            self.open -= 1
        self._slots.release()


# How often an idle accept loop looks at its stop flag. `stop` knocks
# instead of waiting, so this can be long: a short poll was a fifth of an
# idle daemon's CPU.
POLL = 5.0


def knock(address: tuple[Any, ...]) -> None:
    """Connect once to wake an accept loop (nothing is sent)."""
    host, port = str(address[0]), int(address[1])
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    # Not listening any more, or not reachable: the poll ends it.
    with contextlib.suppress(OSError):
        socket.create_connection((host, port), timeout=0.5).close()


class Listener(ThreadLoop):
    """One server's accept loop on its own thread, with one way to stop it:
    shut down (woken by a knock, not by the poll), close, join."""

    def __init__(self, server: BoundedServer, name: str) -> None:
        super().__init__(name, join_timeout=5.0)
        self.server = server

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server.server_address[:2]
        return str(host), int(port)

    def run(self) -> None:
        self.server.serve_forever(poll_interval=POLL)

    def signal_stop(self) -> None:
        super().signal_stop()
        thread = self._thread
        if thread is not None and thread.is_alive():
            stopping = threading.Thread(target=self.server.shutdown, daemon=True)
            stopping.start()
            while stopping.is_alive():
                knock(self.server.server_address)
                stopping.join(0.05)

    def stop(self) -> None:
        self.signal_stop()
        self.server.server_close()
        self.join()
