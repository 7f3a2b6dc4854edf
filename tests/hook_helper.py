"""A hook for the tests: records each run, then behaves as told.

    python hook_helper.py LOG MODE

Appends one JSON line to LOG per run (stdin, DEVPLUGIN_* environment, pid,
start/end times), then by MODE: `ok`, `fail` (stderr + exit 3), `hang`
(sleeps a minute), `fail-times:N` (fails the first N runs), `wait:FILE`
(waits for FILE to exist, up to 20 s, then succeeds), `gate:DIR` (waits
for DIR/<first device id> to exist, up to 20 s, then succeeds), `sleep:LO:HI:P`
(sleeps between LO and HI seconds, then fails with probability P). An end
line (`end`, `pid`, `ok`) follows a run that finished by itself. Each line
is one write in append mode, so hooks running at once never mix lines.

It reads stdin first: the daemon writes it only once the hook's process is
recorded in its checkpoint, so a hook whose daemon died before that ends
here without touching (or logging) anything.
"""

import json
import os
import random
import sys
import time
from pathlib import Path


def append(log: Path, record: dict[str, object]) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def main() -> int:
    # Before waiting on stdin: the daemon that started this may die meanwhile.
    parent = os.getppid()
    log, mode = Path(sys.argv[1]), sys.argv[2]
    record = {
        "stdin": json.load(sys.stdin),
        "env": {k: v for k, v in os.environ.items() if k.startswith("DEVPLUGIN_")},
        "pid": os.getpid(),
        # The daemon that started it (its parent until that parent dies).
        "ppid": parent,
        "start": time.monotonic(),
    }
    append(log, record)
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
    if mode.startswith("sleep:"):
        low, high, failing = (float(part) for part in mode.split(":")[1:4])
        time.sleep(random.uniform(low, high))
        ok = random.random() >= failing
        append(log, {"end": time.monotonic(), "pid": os.getpid(), "ok": ok})
        if not ok:
            print("storm: this run fails", file=sys.stderr)
        return 0 if ok else 1
    if mode.startswith(("wait:", "gate:")):
        target = Path(mode.split(":", 1)[1])
        if mode.startswith("gate:"):
            target = target / record["env"]["DEVPLUGIN_DEVICE_IDS"].split(",")[0]
        deadline = time.monotonic() + 20
        while not target.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    append(log, {"end": time.monotonic(), "pid": os.getpid(), "ok": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
