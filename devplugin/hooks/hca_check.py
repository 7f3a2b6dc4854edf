"""HCA cleanup: check the ports and clear their counters.

For each HCA: every port must be `4: ACTIVE` / `5: LinkUp` in sysfs (exit 1
otherwise, keeping the HCA quarantined until it is). When infiniband-diags'
`perfquery` is installed, each port's counters are reset so the next pod's
monitoring starts from zero. Running it twice changes nothing the second
time.

    resources:
      hca:
        hooks:
          cleanup: [python3, -m, devplugin.hooks.hca_check]

`DEVPLUGIN_SYSFS_ROOT` points it at another sysfs root (tests).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ACTIVE, LINK_UP = "4", "5"


def check_ports(sysfs_root: Path, names: Sequence[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """(problems, every (hca, port) found)."""
    problems: list[str] = []
    ports: list[tuple[str, str]] = []
    for name in names:
        ports_dir = sysfs_root / "class" / "infiniband" / name / "ports"
        try:
            numbers = sorted(os.listdir(ports_dir), key=lambda n: int(n) if n.isdigit() else 0)
        except OSError as exc:
            problems.append(f"{name}: cannot read ports: {exc.strerror}")
            continue
        for number in numbers:
            state = (ports_dir / number / "state").read_text().strip()
            phys = (ports_dir / number / "phys_state").read_text().strip()
            ports.append((name, number))
            if state.split(":")[0] != ACTIVE or phys.split(":")[0] != LINK_UP:
                problems.append(f"{name} port {number}: {state} / {phys}")
    return problems, ports


def reset_counters(ports: Sequence[tuple[str, str]]) -> list[str]:
    perfquery = shutil.which("perfquery")
    if perfquery is None:
        return []
    problems: list[str] = []
    for name, port in ports:
        result = subprocess.run(
            [perfquery, "-C", name, "-P", port, "-R"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if result.returncode != 0:
            problems.append(f"{name} port {port}: counter reset failed: {result.stderr.strip()}")
    return problems


def main() -> int:
    payload = json.load(sys.stdin)
    names = [device.get("hca_name") or device["id"] for device in payload["devices"]]
    sysfs_root = Path(os.environ.get("DEVPLUGIN_SYSFS_ROOT", "/sys"))
    problems, ports = check_ports(sysfs_root, names)
    if not problems:
        problems = reset_counters(ports)
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
