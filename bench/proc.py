"""What a benchmark reads of a process it started, and how it ends one."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path


def status_field(pid: int, name: str) -> int:
    """A number from /proc/<pid>/status (`VmRSS`, `VmHWM` in KiB; `Threads`)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    return 0


def terminate(process: subprocess.Popen[bytes], wait: float) -> None:
    """SIGTERM, and SIGKILL when it has not exited within `wait` seconds."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(wait)
    except subprocess.TimeoutExpired:
        process.kill()
