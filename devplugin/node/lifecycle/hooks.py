"""Running the per-resource init and cleanup hooks.

A hook is an argv list (never a shell string), run with a timeout in its own
process group so that a hanging hook and anything it started are killed.
It receives the devices twice: as environment variables and as JSON on
stdin.

Environment:
    DEVPLUGIN_HOOK            init | cleanup
    DEVPLUGIN_RESOURCE        the resource name (nvidia.com/gpu)
    DEVPLUGIN_SYSFS_ROOT      the sysfs root the daemon reads (/sys, or /host/sys)
    DEVPLUGIN_DEV_ROOT        the /dev root the daemon reads
    DEVPLUGIN_DEVICE_IDS      the device ids, comma-separated
    DEVPLUGIN_DEVICE_COUNT    how many
    DEVPLUGIN_DEVICE_<i>_ID, _PCI, _NODES (comma-separated), _NUMA ("" if
    unknown), and _UUID (GPUs) or _NAME (HCAs), for i = 0 .. count-1

stdin: {"hook": ..., "resource": ..., "devices": [{"id", "pci_address",
"device_nodes", "numa_node", "gpu_uuid" | "hca_name"}]}
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

log = logging.getLogger(__name__)

STDERR_TAIL = 2000
# How often a running hook is checked for its timeout and for cancellation.
POLL = 0.05


@dataclass(frozen=True)
class HookSpec:
    argv: tuple[str, ...]
    timeout: float


@dataclass(frozen=True)
class HookDevice:
    id: str
    pci_address: str
    device_nodes: tuple[str, ...]
    numa_node: int | None
    # The kind's own fields, as its wing names them (gpu_uuid, hca_name).
    extra: Mapping[str, str] = field(default_factory=dict)
    # The same, as DEVPLUGIN_DEVICE_<n>_<suffix> variables: suffix -> value.
    env: Mapping[str, str] = field(default_factory=dict)

    def as_json(self) -> dict[str, object]:
        entry: dict[str, object] = {
            "id": self.id,
            "pci_address": self.pci_address,
            "device_nodes": list(self.device_nodes),
            "numa_node": self.numa_node,
        }
        entry.update(self.extra)
        return entry


@dataclass(frozen=True)
class HookResult:
    ok: bool
    exit_code: int | None
    stderr_tail: str
    duration: float
    timed_out: bool = False
    # Stopped because the daemon is shutting down; says nothing of the device.
    cancelled: bool = False

    def describe(self, phase: str, timeout: float) -> str:
        if self.cancelled:
            detail = f"{phase} hook stopped: the daemon is shutting down"
        elif self.timed_out:
            detail = f"{phase} hook timed out after {timeout:g}s and was killed"
        elif self.exit_code is None:
            detail = f"{phase} hook could not be started"
        else:
            detail = f"{phase} hook failed with exit status {self.exit_code}"
        tail = self.stderr_tail.strip()
        return f"{detail}: {tail}" if tail else detail


def hook_environment(
    phase: str, resource: str, devices: Sequence[HookDevice], base: Mapping[str, str]
) -> dict[str, str]:
    env = dict(base)
    env["DEVPLUGIN_HOOK"] = phase
    env["DEVPLUGIN_RESOURCE"] = resource
    env["DEVPLUGIN_DEVICE_IDS"] = ",".join(device.id for device in devices)
    env["DEVPLUGIN_DEVICE_COUNT"] = str(len(devices))
    for index, device in enumerate(devices):
        prefix = f"DEVPLUGIN_DEVICE_{index}_"
        env[prefix + "ID"] = device.id
        env[prefix + "PCI"] = device.pci_address
        env[prefix + "NODES"] = ",".join(device.device_nodes)
        env[prefix + "NUMA"] = "" if device.numa_node is None else str(device.numa_node)
        env.update((prefix + suffix, value) for suffix, value in device.env.items())
    return env


@dataclass(frozen=True)
class Started:
    """A hook process as it can be found again after a crash."""

    pgid: int
    # The kernel's start time of the leader (/proc/<pid>/stat field 22), so a
    # recycled pid is never mistaken for the hook.
    start_ticks: int | None


# Called with the hook's process group as soon as it exists, and with None
# when nothing of it runs any more.
Tracker = Callable[[Started | None], None]


class HookRunner(Protocol):
    """How hooks are run (`run_hook`, or a wrapper that counts runs)."""

    def __call__(
        self,
        spec: HookSpec,
        phase: str,
        resource: str,
        devices: Sequence[HookDevice],
        *,
        track: Tracker | None = None,
        cancel: threading.Event | None = None,
    ) -> HookResult: ...


def process_start_ticks(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The start time of a process in clock ticks since boot; None if gone."""
    try:
        stat = (proc / str(pid) / "stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    # The command name is in parentheses and may itself hold spaces or ')'.
    fields = stat.rpartition(")")[2].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def group_alive(pgid: int, proc: Path = Path("/proc")) -> bool:
    """Whether any process of the group still runs (zombies do not count:
    a parent that is not us may take its time to reap them)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        entries = [entry for entry in os.listdir(proc) if entry.isdigit()]
    except OSError:
        return True
    for entry in entries:
        try:
            stat = (proc / entry / "stat").read_text(encoding="ascii", errors="replace")
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def _reap(pgid: int) -> None:
    """Collect members of the group that are our children (as PID 1 in a
    container, orphaned grandchildren are), so they do not linger as zombies."""
    while True:
        try:
            pid, _ = os.waitpid(-pgid, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_group(pgid: int, *, wait: float = 5.0) -> bool:
    """SIGKILL a process group and wait until none of it is left; whether it is gone.
    The group's leader, if it is our child, must have been reaped already."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + wait
    while True:
        _reap(pgid)
        if not group_alive(pgid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


class _Tail:
    """The last `limit` bytes written to a pipe, read on a thread of its own."""

    def __init__(self, stream: IO[bytes], limit: int) -> None:
        self._stream = stream
        self._limit = limit
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._thread = threading.Thread(target=self._read, name="hook-stderr", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        fd = self._stream.fileno()
        with contextlib.suppress(OSError, ValueError):
            while chunk := os.read(fd, 65536):
                self._chunks.append(chunk)
                self._size += len(chunk)
                while self._size - len(self._chunks[0]) >= self._limit:
                    self._size -= len(self._chunks.popleft())

    def text(self, wait: float) -> str:
        self._thread.join(wait)
        data = b"".join(list(self._chunks))[-self._limit :]
        return data.decode("utf-8", errors="replace")


def _feed(stream: IO[bytes], payload: bytes) -> None:
    # A hook that never reads stdin must not block us: write from a thread.
    with contextlib.suppress(OSError, ValueError):
        stream.write(payload)
    with contextlib.suppress(OSError, ValueError):
        stream.close()


def run_hook(
    spec: HookSpec,
    phase: str,
    resource: str,
    devices: Sequence[HookDevice],
    *,
    base_env: Mapping[str, str] | None = None,
    track: Tracker | None = None,
    cancel: threading.Event | None = None,
) -> HookResult:
    """Run one hook to completion, its timeout, or `cancel`; never raises for
    hook failures. Success is the hook's own exit status; whatever it leaves
    running in its process group is killed when it exits, and only the last
    STDERR_TAIL characters of its stderr are kept, however much it writes."""
    base = base_env if base_env is not None else {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    env = hook_environment(phase, resource, devices, base)
    payload = json.dumps(
        {"hook": phase, "resource": resource, "devices": [d.as_json() for d in devices]}
    ).encode()
    started = time.monotonic()
    try:
        process = subprocess.Popen(
            list(spec.argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
    except OSError as exc:
        return HookResult(False, None, f"{spec.argv[0]}: {exc.strerror or exc}", 0.0)
    assert process.stdin is not None
    assert process.stderr is not None
    if track is not None:
        track(Started(process.pid, process_start_ticks(process.pid)))
    threading.Thread(target=_feed, args=(process.stdin, payload), daemon=True).start()
    tail = _Tail(process.stderr, STDERR_TAIL * 4)
    timed_out = cancelled = False
    deadline = started + spec.timeout
    while process.poll() is None:
        now = time.monotonic()
        if now >= deadline:
            timed_out = True
            break
        if cancel is not None and cancel.is_set():
            cancelled = True
            break
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=min(POLL, deadline - now))
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    # The hook itself is done (or out of time): nothing of its group may stay.
    kill_group(process.pid)
    if track is not None:
        track(None)
    text = tail.text(wait=0.5)[-STDERR_TAIL:]
    duration = time.monotonic() - started
    if timed_out or cancelled:
        return HookResult(
            False, process.returncode, text, duration, timed_out=timed_out, cancelled=cancelled
        )
    return HookResult(process.returncode == 0, process.returncode, text, duration)
