"""A hook for the tests: records each run, then behaves as told.

    python hook_helper.py LOG MODE

Appends one JSON line to LOG per run (stdin, DEVPLUGIN_* environment, pid,
start/end times), then by MODE: `ok`, `fail` (stderr + exit 3), `hang`
(sleeps a minute), `fail-times:N` (fails the first N runs), `wait:FILE`
(waits for FILE to exist, up to 20 s, then succeeds).
"""

import json
import os
import sys
import time
from pathlib import Path


def main() -> int:
    log, mode = Path(sys.argv[1]), sys.argv[2]
    record = {
        "stdin": json.load(sys.stdin),
        "env": {k: v for k, v in os.environ.items() if k.startswith("DEVPLUGIN_")},
        "pid": os.getpid(),
        "start": time.monotonic(),
    }
    with log.open("a") as handle:
        handle.write(json.dumps(record) + "\n")
    runs = sum(1 for _ in log.open())
    if mode == "fail":
        print("boom: device not ready", file=sys.stderr)
        return 3
    if mode == "hang":
        time.sleep(60)
        return 0
    if mode.startswith("fail-times:"):
        if runs <= int(mode.split(":", 1)[1]):
            print(f"attempt {runs} failed", file=sys.stderr)
            return 1
        return 0
    if mode.startswith("wait:"):
        target = Path(mode.split(":", 1)[1])
        deadline = time.monotonic() + 20
        while not target.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    with log.open("a") as handle:
        handle.write(json.dumps({"end": time.monotonic(), "pid": os.getpid()}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
