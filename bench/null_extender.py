"""A scheduler extender that decides nothing: every node passes its filter
and scores 0. It is written as most Python extenders are (the standard
library's threading HTTP server, JSON in and out), so the scheduler-cost
bench can show what any HTTP extender costs the scheduler before its own
work: the floor the project's extender is read against.

Run as `python -m bench.null_extender PORT`; serves on 127.0.0.1 until
SIGTERM.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes (see devplugin/web.py).
    disable_nagle_algorithm = True

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        names = body.get("NodeNames") or []
        answer: Any
        if self.path.endswith("/filter"):
            answer = {
                "NodeNames": names,
                "FailedNodes": {},
                "FailedAndUnresolvableNodes": {},
                "Error": "",
            }
        elif self.path.endswith("/prioritize"):
            answer = [{"Host": name, "Score": 0} for name in names]
        else:
            answer = {"NodeNameToMetaVictims": body.get("NodeNameToMetaVictims") or {}}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "3")
        self.end_headers()
        self.wfile.write(b"ok\n")

    def log_message(self, format: str, *args: object) -> None:
        pass


def main(port: int) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", port), _Handler)
    server.daemon_threads = True
    stopping = threading.Thread(target=server.serve_forever, name="null-extender")
    stopping.start()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    done.wait()
    server.shutdown()
    server.server_close()
    stopping.join()


if __name__ == "__main__":
    main(int(sys.argv[1]))
