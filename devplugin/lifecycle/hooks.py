"""Running the per-resource init and cleanup hooks.

A hook is an argv list (never a shell string), run with a timeout in its own
process group so that a hanging hook and anything it started are killed.
It receives the devices twice: as environment variables and as JSON on
stdin.

Environment:
    DEVPLUGIN_HOOK            init | cleanup
    DEVPLUGIN_RESOURCE        the resource name (nvidia.com/gpu)
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
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

STDERR_TAIL = 2000


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
    gpu_uuid: str | None = None
    hca_name: str | None = None

    def as_json(self) -> dict[str, object]:
        entry: dict[str, object] = {
            "id": self.id,
            "pci_address": self.pci_address,
            "device_nodes": list(self.device_nodes),
            "numa_node": self.numa_node,
        }
        if self.gpu_uuid is not None:
            entry["gpu_uuid"] = self.gpu_uuid
        if self.hca_name is not None:
            entry["hca_name"] = self.hca_name
        return entry


@dataclass(frozen=True)
class HookResult:
    ok: bool
    exit_code: int | None
    stderr_tail: str
    duration: float
    timed_out: bool = False

    def describe(self, phase: str, timeout: float) -> str:
        if self.timed_out:
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
        if device.gpu_uuid is not None:
            env[prefix + "UUID"] = device.gpu_uuid
        if device.hca_name is not None:
            env[prefix + "NAME"] = device.hca_name
    return env


def run_hook(
    spec: HookSpec,
    phase: str,
    resource: str,
    devices: Sequence[HookDevice],
    base_env: Mapping[str, str] | None = None,
) -> HookResult:
    """Run one hook to completion or its timeout; never raises for hook failures."""
    base = base_env if base_env is not None else {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    env = hook_environment(phase, resource, devices, base)
    payload = json.dumps(
        {"hook": phase, "resource": resource, "devices": [d.as_json() for d in devices]}
    )
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
    try:
        _, stderr = process.communicate(payload.encode(), timeout=spec.timeout)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        try:
            _, stderr = process.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            # A descendant left the group and holds the pipe: stop reading.
            process.kill()
            stderr = b""
        return HookResult(
            False, process.returncode, _tail(stderr), time.monotonic() - started, timed_out=True
        )
    duration = time.monotonic() - started
    return HookResult(process.returncode == 0, process.returncode, _tail(stderr), duration)


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def _tail(data: bytes | None) -> str:
    if not data:
        return ""
    text = data.decode("utf-8", errors="replace")
    return text[-STDERR_TAIL:]
