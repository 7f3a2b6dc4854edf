"""A TCP proxy that can go silent, for the tests of watches that must not trust a
connection blindly.

Between `silence()` and `heal()` nothing crosses: bytes are neither
forwarded nor refused, and no FIN or RST is sent either way, which is what a
client sees when the API server's machine dies or a load balancer fails
over. Connections that were open when the silence began, or opened during
it, stay frozen for good (their peer is gone); only connections opened
after `heal()` carry data again. `stop()` closes everything.

With `lag`, what the upstream sends reaches the client that many seconds
late, in order: a client whose watch trails the API server (and every
other client of it) by that much, as a busy one far from it does.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class _Link:
    client: socket.socket
    upstream: socket.socket | None
    frozen: threading.Event = field(default_factory=threading.Event)


class SilentProxy:
    def __init__(self, upstream: tuple[str, int], *, lag: float = 0.0) -> None:
        self._upstream = upstream
        self._lag = lag
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._lock = threading.Lock()
        self._links: list[_Link] = []
        self._silent = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="silent-proxy", daemon=True)
        self.accepted = 0

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        return "http://{}:{}".format(*self.address)

    def start(self) -> None:
        self._thread.start()

    def silence(self) -> None:
        """From now on nothing crosses any connection open now or opened later
        (until `heal`), and nothing is closed."""
        with self._lock:
            self._silent = True
            for link in self._links:
                link.frozen.set()

    def heal(self) -> None:
        """New connections work again; frozen ones stay frozen."""
        with self._lock:
            self._silent = False

    def stop(self) -> None:
        self._stopped.set()
        # A close alone does not wake a thread blocked in accept(); a shutdown does.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._listener.close()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5)
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.frozen.set()
            for sock in (link.client, link.upstream):
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.close()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.accepted += 1
            with self._lock:
                silent = self._silent
            link = _Link(client, None)
            if silent:
                link.frozen.set()  # accepted, then nothing ever answers
            else:
                try:
                    link.upstream = socket.create_connection(self._upstream, timeout=5)
                    link.upstream.settimeout(None)
                except OSError:
                    client.close()
                    continue
            with self._lock:
                self._links.append(link)
            if link.upstream is not None:
                for source, target in ((client, link.upstream), (link.upstream, client)):
                    late = self._lag if source is link.upstream else 0.0
                    threading.Thread(
                        target=self._pump, args=(link, source, target, late), daemon=True
                    ).start()

    def _pump(self, link: _Link, source: socket.socket, target: socket.socket, late: float) -> None:
        sink: _Sink = _Late(target, late, self._stopped) if late > 0 else target
        source.settimeout(0.05)
        while not self._stopped.is_set():
            if link.frozen.is_set():
                # Hold the connection open and say nothing, ever.
                self._stopped.wait()
                return
            try:
                data = source.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                data = b""
            if link.frozen.is_set():
                continue  # read during the silence: dropped, as a dead peer would
            if not data:
                with contextlib.suppress(OSError):
                    sink.shutdown(socket.SHUT_WR)
                return
            try:
                sink.sendall(data)
            except OSError:
                return


class _Sink(Protocol):
    def sendall(self, data: bytes, /) -> None: ...

    def shutdown(self, how: int, /) -> None: ...


class _Late:
    """A socket's sending side that delivers each chunk `lag` seconds after
    it was handed over, in order (a thread of its own does the sending)."""

    def __init__(self, sock: socket.socket, lag: float, stopped: threading.Event) -> None:
        self._sock, self._lag, self._stopped = sock, lag, stopped
        self._queue: queue.SimpleQueue[tuple[float, bytes | None]] = queue.SimpleQueue()
        threading.Thread(target=self._send, daemon=True).start()

    def sendall(self, data: bytes) -> None:
        self._queue.put((time.monotonic() + self._lag, data))

    def shutdown(self, how: int) -> None:
        self._queue.put((time.monotonic() + self._lag, None))

    def _send(self) -> None:
        while not self._stopped.is_set():
            try:
                due, data = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if self._stopped.wait(max(0.0, due - time.monotonic())):
                return
            try:
                if data is None:
                    self._sock.shutdown(socket.SHUT_WR)
                    return
                self._sock.sendall(data)
            except OSError:
                return
