"""What an idle daemon costs its node: CPU, memory and threads.

`devplugin run` as its own process, with the production defaults, on a
simulated 8-GPU node and a 64-GPU one, behind the kubelet simulator (so it
is registered, streams ListAndWatch and polls PodResources as on a real
node); one pod holds devices. Once start-up has settled, the process's CPU
time is read from /proc over the window (60 s; 10 s with --quick).

Goals: 8 GPUs at most 0.5% of a core and 60 MiB (issue 43; it was 1% and
64 MiB); 64 GPUs at most 2%.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.proc import status_field, terminate
from devplugin.testing.kubelet import ContainerRequest, KubeletSimulator
from devplugin.testing.layouts import LAYOUTS
from devplugin.testing.node import build_node

GPU, HCA = "nvidia.com/gpu", "rdma/hca"
GOALS = {"hgx-h100": (0.5, 60.0), "64-gpu": (2.0, None)}
SETTLE = 10.0


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def measure(layout: str, window: float, base: Path) -> tuple[float, float, int, int]:
    """(CPU % of a core, RSS MiB, threads, GPUs) of an idle daemon."""
    node = build_node(LAYOUTS[layout](), base / layout)
    sockets = base / f"{layout}-s"
    # Production defaults otherwise: that is what is measured.
    config = node.run_config(sockets, base / f"{layout}-checkpoint.json")
    path = base / f"{layout}.yaml"
    path.write_text(yaml.safe_dump(config))
    kubelet = KubeletSimulator(sockets / "dp", sockets / "pr" / "kubelet.sock")
    kubelet.start()
    process = subprocess.Popen(
        [sys.executable, "-m", "devplugin", "run", "--config", str(path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def registered() -> bool:
            return bool(kubelet.devices(GPU)) and bool(kubelet.devices(HCA))

        if not kubelet.wait_for(registered, timeout=60):
            raise RuntimeError(f"{layout}: the daemon did not register")
        gpus = len(kubelet.devices(GPU))
        kubelet.admit("resident", [ContainerRequest("main", {GPU: 1, HCA: 1})])
        time.sleep(SETTLE)
        cpu0, wall0 = _cpu_seconds(process.pid), time.monotonic()
        time.sleep(window)
        cpu = (_cpu_seconds(process.pid) - cpu0) / (time.monotonic() - wall0) * 100
        rss = status_field(process.pid, "VmRSS") / 1024
        return cpu, rss, status_field(process.pid, "Threads"), gpus
    finally:
        terminate(process, 15)
        kubelet.stop()


def idle_bench(quick: bool = False) -> bool:
    window = 20.0 if quick else 60.0
    print(
        f"Idle daemon (devplugin run, production defaults, {window:.0f} s after start-up settles)"
    )
    print(f"{'node':<10} {'GPUs':>5} {'CPU %':>6} {'RSS MiB':>8} {'threads':>8}  goal")
    met = True
    with tempfile.TemporaryDirectory(prefix="dpi-") as scratch:
        for layout, (cpu_goal, rss_goal) in GOALS.items():
            cpu, rss, threads, gpus = measure(layout, window, Path(scratch))
            ok = cpu <= cpu_goal and (rss_goal is None or rss <= rss_goal)
            met &= ok
            goal = f"<= {cpu_goal:g}%" + (f", <= {rss_goal:.0f} MiB" if rss_goal else "")
            print(
                f"{layout:<10} {gpus:>5} {cpu:>6.2f} {rss:>8.0f} {threads:>8}  {goal}: "
                + ("met" if ok else "NOT met")
            )
    print("== idle: " + ("met" if met else "NOT met" if not quick else "(quick run: no verdict)"))
    return met or quick


if __name__ == "__main__":
    sys.exit(0 if idle_bench("--quick" in sys.argv) else 1)
