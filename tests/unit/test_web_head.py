"""Request heads (web_head.py): the request line and header fields read as
the standard library reads them, with its limits, and the heads it would
pass but this server refuses."""

from __future__ import annotations

import email.parser
import http.client
import io
import random
import string
from http import HTTPStatus

import pytest

from devplugin.web_head import MAX_FIELDS, MAX_LINE, BadHead, header_fields, request_line


def fields(raw: bytes) -> http.client.HTTPMessage:
    return header_fields(io.BytesIO(raw).readline)


def test_a_request_line_gives_method_target_and_version() -> None:
    line = request_line("POST /scheduler/filter HTTP/1.1")
    assert line == ("POST", "/scheduler/filter", "HTTP/1.1", (1, 1))
    assert request_line("GET //metrics HTTP/1.0")[1] == "/metrics"


@pytest.mark.parametrize(
    ("line", "status"),
    [
        ("GET /", HTTPStatus.BAD_REQUEST),  # HTTP/0.9
        ("GET / HTTP/1.1 extra", HTTPStatus.BAD_REQUEST),
        ("GET / HTTQ/1.1", HTTPStatus.BAD_REQUEST),
        ("GET / HTTP/1", HTTPStatus.BAD_REQUEST),
        ("GET / HTTP/1.x", HTTPStatus.BAD_REQUEST),
        ("GET / HTTP/" + "1" * 11 + ".1", HTTPStatus.BAD_REQUEST),
        ("GET / HTTP/2.0", HTTPStatus.HTTP_VERSION_NOT_SUPPORTED),
        ("GET / HTTP/0.9", HTTPStatus.HTTP_VERSION_NOT_SUPPORTED),
    ],
)
def test_a_request_line_that_cannot_be_served_names_its_status(
    line: str, status: HTTPStatus
) -> None:
    with pytest.raises(BadHead) as caught:
        request_line(line)
    assert caught.value.status == status


def test_fields_read_as_the_standard_parser_reads_them() -> None:
    rng = random.Random(7)
    names = ["Content-Length", "Content-Type", "Connection", "X-Thing", "Accept-Encoding"]
    for _ in range(200):
        lines = []
        for _ in range(rng.randrange(0, 8)):
            value = "".join(rng.choices(string.printable[:94] + " ", k=rng.randrange(0, 30)))
            lines.append(f"{rng.choice(names)}:{' ' * rng.randrange(3)}{value.strip()}")
        raw = ("\r\n".join(lines) + "\r\n\r\n").encode()
        ours = fields(raw)
        theirs = email.parser.Parser(_class=http.client.HTTPMessage).parsestr(raw.decode())
        assert ours.items() == theirs.items()
        for name in names:
            assert ours.get_all(name) == theirs.get_all(name)


def test_fields_end_at_a_bare_newline_or_the_end_of_input() -> None:
    assert fields(b"A: 1\nB: 2\n\nbody")["B"] == "2"
    assert fields(b"A: 1\r\n")["A"] == "1"


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"A: 1\r\n folded\r\n\r\n", HTTPStatus.BAD_REQUEST),
        (b"no colon here\r\n\r\n", HTTPStatus.BAD_REQUEST),
        (b": empty name\r\n\r\n", HTTPStatus.BAD_REQUEST),
        (b"Space : before colon\r\n\r\n", HTTPStatus.BAD_REQUEST),
        (b"A: " + b"x" * MAX_LINE + b"\r\n\r\n", HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE),
        (b"A: 1\r\n" * (MAX_FIELDS + 1) + b"\r\n", HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE),
    ],
)
def test_fields_that_cannot_be_served_name_their_status(raw: bytes, status: HTTPStatus) -> None:
    with pytest.raises(BadHead) as caught:
        fields(raw)
    assert caught.value.status == status


def test_as_many_fields_as_the_limit_are_read() -> None:
    assert len(fields(b"A: 1\r\n" * MAX_FIELDS + b"\r\n").get_all("A") or []) == MAX_FIELDS
