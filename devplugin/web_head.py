"""An HTTP/1.x request's head (its request line and header fields), read
for the daemon's two HTTP endpoints.

The standard library's handler parses header fields with the e-mail
package's feed parser: about 40 microseconds a request idle, more under
load, paid twice per pod the scheduler places through the extender. The
fields are read here line by line into the same `HTTPMessage`, with the
same limits (a line at most MAX_LINE bytes, at most MAX_FIELDS fields);
HTTP/0.9 and 2+ are refused, and so is a field folded over two lines (RFC
9112 lets a server refuse obsolete folding with a 400).
"""

from __future__ import annotations

import http.client
from collections.abc import Callable
from http import HTTPStatus

MAX_LINE = 65536
MAX_FIELDS = 100
_ENDS = (b"\r\n", b"\n", b"")


class BadHead(ValueError):
    """A head that cannot be served: the status to answer with and why."""

    def __init__(self, status: HTTPStatus, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def request_line(line: str) -> tuple[str, str, str, tuple[int, int]]:
    """`METHOD TARGET HTTP/x.y` -> (method, target, version text, version)."""
    words = line.split()
    if len(words) != 3:
        raise BadHead(HTTPStatus.BAD_REQUEST, f"Bad request syntax ({line[:200]!r})")
    method, target, version = words
    major, dot, minor = version.removeprefix("HTTP/").partition(".")
    if (
        not version.startswith("HTTP/")
        or not dot
        or not (major.isdigit() and minor.isdigit())
        or len(major) > 10
        or len(minor) > 10
    ):
        raise BadHead(HTTPStatus.BAD_REQUEST, f"Bad request version ({version[:50]!r})")
    number = (int(major), int(minor))
    if number >= (2, 0) or number < (1, 0):
        raise BadHead(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, f"Invalid HTTP version ({version})")
    if target.startswith("//"):
        target = "/" + target.lstrip("/")
    return method, target, version, number


def header_fields(readline: Callable[[int], bytes]) -> http.client.HTTPMessage:
    """The header fields up to the blank line, read through `readline`."""
    message = http.client.HTTPMessage()
    count = 0
    while True:
        raw = readline(MAX_LINE + 1)
        if len(raw) > MAX_LINE:
            raise BadHead(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Line too long")
        if raw in _ENDS:
            return message
        count += 1
        if count > MAX_FIELDS:
            raise BadHead(
                HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, f"More than {MAX_FIELDS} headers"
            )
        text = raw.decode("iso-8859-1")
        if text[0] in " \t":
            raise BadHead(HTTPStatus.BAD_REQUEST, "A header folded over two lines")
        name, colon, value = text.partition(":")
        if not colon or not name or name != name.strip():
            raise BadHead(HTTPStatus.BAD_REQUEST, f"Bad header line ({text[:100]!r})")
        message[name] = value.strip()
