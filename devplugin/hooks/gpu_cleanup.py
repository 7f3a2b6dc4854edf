"""GPU cleanup: put every GPU back to its default state through NVML.

For each GPU: refuse (exit 1) while compute processes still run on it, so a
GPU is never reset under a live job; otherwise restore the default compute
mode and the default application clocks. A MIG device (its UUID starts
MIG-) is only checked for processes: the rest belongs to its whole GPU.
Running it twice changes nothing the second time.

    resources:
      gpu:
        hooks:
          cleanup: [python3, -m, devplugin.hooks.gpu_cleanup]

`DEVPLUGIN_NVML_FIXTURE` makes it use the fake NVML (demo and tests).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def clean(lib: Any, uuids: Sequence[str]) -> list[str]:
    """Problems found; an empty list means every GPU is clean."""
    problems: list[str] = []
    default = getattr(lib, "NVML_COMPUTEMODE_DEFAULT", 0)
    not_supported = getattr(lib, "NVML_ERROR_NOT_SUPPORTED", 3)
    lib.nvmlInit()
    try:
        for uuid in uuids:
            try:
                handle = lib.nvmlDeviceGetHandleByUUID(uuid)
                running = lib.nvmlDeviceGetComputeRunningProcesses(handle)
                if running:
                    pids = ", ".join(str(process.pid) for process in running)
                    problems.append(f"{uuid}: still running processes {pids}")
                    continue
                if _is_mig(lib, handle):
                    # Compute mode and clocks belong to the whole GPU, which
                    # other MIG devices' containers share: a MIG device is
                    # clean once nothing runs on it.
                    continue
                if lib.nvmlDeviceGetComputeMode(handle) != default:
                    lib.nvmlDeviceSetComputeMode(handle, default)
                try:
                    lib.nvmlDeviceResetApplicationsClocks(handle)
                except lib.NVMLError as exc:
                    if getattr(exc, "value", None) != not_supported:
                        raise
            except lib.NVMLError as exc:
                problems.append(f"{uuid}: {exc}")
    finally:
        lib.nvmlShutdown()
    return problems


def _is_mig(lib: Any, handle: Any) -> bool:
    check = getattr(lib, "nvmlDeviceIsMigDeviceHandle", None)
    return bool(check(handle)) if check is not None else False


def _library() -> Any:
    fixture = os.environ.get("DEVPLUGIN_NVML_FIXTURE")
    if fixture:
        from devplugin.testing.fake_nvml import FakeNvml

        return FakeNvml.from_file(Path(fixture))
    from devplugin.node.discovery.nvml import load_pynvml

    return load_pynvml()


def main() -> int:
    payload = json.load(sys.stdin)
    uuids = [device.get("gpu_uuid") or device["id"] for device in payload["devices"]]
    problems = clean(_library(), uuids)
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
