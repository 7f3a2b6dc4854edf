"""Request heads on the extender's HTTP front (web_head.py through
web.py's handler): a connection carries request after request until the
client closes it; a head that cannot be served gets its status and the
front keeps serving; 100-continue is answered."""

from __future__ import annotations

import http.client
import json
import socket

import pytest

from tests.extender_support import Running, call, extender, pod

__all__ = ["extender"]

BODY = json.dumps({"Pod": pod("p", [{"nvidia.com/gpu": 1}]), "NodeNames": ["a", "b"]}).encode()


def head(verb: str, length: int, *extra: str) -> bytes:
    lines = [f"POST /scheduler/{verb} HTTP/1.1", "Host: x", f"Content-Length: {length}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_one_connection_carries_many_calls(extender: Running) -> None:
    host, port = extender[1].address
    connection = http.client.HTTPConnection(host, port, timeout=10)
    try:
        for verb in ("filter", "prioritize") * 5:
            connection.request("POST", f"/scheduler/{verb}", body=BODY)
            answer = connection.getresponse()
            assert answer.status == 200
            assert json.loads(answer.read())
        sock = connection.sock
        assert sock is not None  # still the first connection: never closed by the server
    finally:
        connection.close()


def test_connection_close_is_honoured(extender: Running) -> None:
    with socket.create_connection(extender[1].address, timeout=10) as sock:
        sock.sendall(head("filter", len(BODY), "Connection: close") + BODY)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        assert received.startswith(b"HTTP/1.1 200")  # answered, then closed by the server


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"POST /scheduler/filter HTTP/2.0\r\n\r\n", b"505"),
        (b"POST /scheduler/filter\r\n\r\n", b"400"),
        (b"POST /scheduler/filter HTTP/1.1\r\nA: 1\r\n folded\r\n\r\n", b"400"),
        (b"POST /scheduler/filter HTTP/1.1\r\n" + b"A: 1\r\n" * 101 + b"\r\n", b"431"),
    ],
)
def test_a_head_that_cannot_be_served_gets_its_status_and_service_goes_on(
    extender: Running, raw: bytes, status: bytes
) -> None:
    with socket.create_connection(extender[1].address, timeout=10) as sock:
        sock.sendall(raw)
        assert sock.recv(65536).split(b" ")[1] == status
    code, answer = call(extender, "filter", json.loads(BODY))
    assert code == 200
    assert answer["NodeNames"] == ["a", "b"]


def test_expect_100_continue_is_answered_before_the_body(extender: Running) -> None:
    with socket.create_connection(extender[1].address, timeout=10) as sock:
        sock.sendall(head("filter", len(BODY), "Expect: 100-continue"))
        assert sock.recv(65536).startswith(b"HTTP/1.1 100")
        sock.sendall(BODY)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
