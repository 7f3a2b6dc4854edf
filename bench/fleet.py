"""What a node's daemon costs the API server, idle and under churn.

A few real daemons (each behind its kubelet simulator) with production
timings talk to one API server imitation, which counts every request and
byte by resource and verb. For a minute they sit idle, then for a minute
each node gets a pod every 10 s (each deleted 15 s later: two live at
most, as the PCIe node has two HCAs). The table is per
node per minute: requests, and bytes written (request bodies; for the pod
watch, bytes the server streamed to the daemon). Multiply by the number of
nodes for what a fleet costs: at 5,000 nodes, one write per node per minute
is 83 writes a second into etcd.

Goals: idle, at most 1 write per node per minute to records (and slices);
under churn, record writes within the 1/s budget (60 a minute).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.cluster import GPU, HCA, SimCluster
from devplugin.testing.kubelet import ContainerRequest
from devplugin.testing.layouts import LAYOUTS

NODES = ["hgx-h100", "pcie-server", "asymmetric", "dgx-a100"]
WRITES = ("create", "update", "patch", "delete")
# row label -> (resource plural, verbs counted)
ROWS = {
    "NodeDevices record": ("nodedevices", (*WRITES, "get", "list", "watch")),
    "Lease": ("leases", (*WRITES, "get")),
    "Events": ("events", WRITES),
    "pod watch": ("pods", ("list", "watch")),
}
IDLE_GOAL = 1.0
CHURN_BUDGET = 60.0
POD_EVERY = 10.0
POD_LIFE = 15.0

Traffic = dict[tuple[str, str], list[int]]


def _snapshot(api: ApiServerImitation) -> Traffic:
    return {key: list(value) for key, value in api.traffic.items()}


def _rates(
    before: Traffic, after: Traffic, nodes: int, seconds: float
) -> dict[str, tuple[float, float, float]]:
    """Row -> (requests, writes, bytes) per node per minute."""
    scale = 60.0 / seconds / nodes
    found: dict[str, tuple[float, float, float]] = {}
    for label, (plural, verbs) in ROWS.items():
        requests = writes = volume = 0
        for verb in verbs:
            now, then = after.get((plural, verb), [0, 0, 0]), before.get((plural, verb), [0, 0, 0])
            requests += now[0] - then[0]
            if verb in WRITES:
                writes += now[0] - then[0]
                volume += now[1] - then[1]
            elif label == "pod watch":
                volume += now[2] - then[2]
        found[label] = (requests * scale, writes * scale, volume * scale)
    return found


def _churn(nodes: list[SimCluster], seconds: float) -> None:
    start = time.monotonic()
    live: list[tuple[float, SimCluster, str]] = []
    index = 0
    while time.monotonic() - start < seconds:
        for cluster in nodes:
            name = f"job-{index}"
            cluster.kubelet.admit(name, [ContainerRequest("main", {GPU: 1, HCA: 1})])
            live.append((time.monotonic(), cluster, name))
            index += 1
        deadline = time.monotonic() + POD_EVERY
        while time.monotonic() < deadline:
            while live and time.monotonic() - live[0][0] >= POD_LIFE:
                _, cluster, name = live.pop(0)
                cluster.kubelet.remove(name)
            time.sleep(0.2)
    for _, cluster, name in live:
        cluster.kubelet.remove(name)


def fleet_bench(quick: bool = False) -> bool:
    seconds = 15.0 if quick else 60.0
    base = Path(tempfile.mkdtemp(prefix="dpfl-", dir="/tmp"))
    api = ApiServerImitation()
    api.start()
    try:
        with ExitStack() as stack:
            nodes = [
                stack.enter_context(
                    SimCluster(
                        LAYOUTS[layout](), api=api, node_name=f"node-{i}", workdir=base,
                        settings={"metrics.enabled": False},
                    )
                )
                for i, layout in enumerate(NODES)
            ]  # fmt: skip
            time.sleep(3.0)  # start-up writes (record creation, first status) settle
            before = _snapshot(api)
            time.sleep(seconds)
            idle = _rates(before, _snapshot(api), len(nodes), seconds)
            before = _snapshot(api)
            started = time.monotonic()
            _churn(nodes, seconds)
            churn = _rates(before, _snapshot(api), len(nodes), time.monotonic() - started)
    finally:
        api.stop()
        shutil.rmtree(base, ignore_errors=True)
    print(
        f"API traffic per node per minute: {len(NODES)} daemons with production timings, "
        f"{seconds:.0f} s idle, then {seconds:.0f} s with a pod every {POD_EVERY:.0f} s per node"
    )
    print(
        f"{'':20} {'idle req':>9} {'writes':>7} {'bytes':>9}   {'churn req':>9} "
        f"{'writes':>7} {'bytes':>9}"
    )
    for label in ROWS:
        a, b = idle[label], churn[label]
        print(
            f"{label:20} {a[0]:9.1f} {a[1]:7.1f} {a[2]:9.0f}   {b[0]:9.1f} {b[1]:7.1f} {b[2]:9.0f}"
        )
    print("(bytes: written to the API; for the pod watch, streamed to the daemon)")
    record_idle, record_churn = idle["NodeDevices record"][1], churn["NodeDevices record"][1]
    ok = record_idle <= IDLE_GOAL and 0 < record_churn <= CHURN_BUDGET
    print(
        f"== fleet: idle record writes {record_idle:.1f}/node/min (goal <= {IDLE_GOAL:.0f}), "
        f"under churn {record_churn:.1f} (follow changes, <= {CHURN_BUDGET:.0f}): "
        f"{'met' if ok else 'MISSED'}"
    )
    return ok


if __name__ == "__main__":
    import sys

    sys.exit(0 if fleet_bench("--quick" in sys.argv) else 1)
