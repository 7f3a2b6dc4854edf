"""Small helpers several test modules share: hook commands and their logs,
the status endpoint, a settable clock, a daemon run as a process.

Test modules import helpers from here (or from conftest, dra_support,
custody_support and devplugin.testing), never from one another."""

from __future__ import annotations

import dataclasses
import http.client
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from devplugin.frontends.dra.claim_record import ClaimRecord
from devplugin.frontends.dra.ledger import ClaimLedger
from devplugin.model import DeviceKind, Inventory
from devplugin.node.discovery import Discoverer, NvmlGpuSource, Roots
from devplugin.node.ledger import Holdings, Ledger
from devplugin.node.lifecycle.assembly import CleanupPolicy, Hooks, Lifecycle
from devplugin.node.lifecycle.checkpoint import Checkpoint
from devplugin.node.lifecycle.hooks import HookDevice, HookResult, HookSpec
from devplugin.testing.fake_nvml import FakeNvml
from devplugin.testing.node import (
    BuiltNode,
    Gpu,
    Hca,
    NodeSpec,
    Port,
    RootComplex,
    Switch,
)
from tests.conftest import Cluster
from tests.waiting import log_entries

# The hook program the tests configure (it logs what it was given).
HELPER = str(Path(__file__).with_name("hook_helper.py"))
# Device id -> (start, end) of every finished cleanup run.
Runs = dict[str, list[tuple[float, float]]]


def hook(log: Path, mode: str) -> list[str]:
    """A hook command that logs its runs to `log` and behaves as `mode` says."""
    return [sys.executable, HELPER, str(log), mode]


def runs(log: Path) -> list[dict[str, Any]]:
    """The runs a hook log holds, in the order they started."""
    return [entry for entry in log_entries(log) if "stdin" in entry]


def cleanup_runs(log: Path) -> Runs:
    """Device id -> (start, end) of every finished cleanup run."""
    starts: dict[int, tuple[str, float]] = {}
    found: Runs = {}
    for entry in log_entries(log):
        if "stdin" in entry:
            starts[entry["pid"]] = (entry["env"]["DEVPLUGIN_DEVICE_IDS"], entry["start"])
        elif entry["pid"] in starts:
            device, start = starts[entry["pid"]]
            found.setdefault(device, []).append((start, entry["end"]))
    return found


def probe(cluster: Cluster, path: str) -> tuple[int, str]:
    """GET a path of the daemon's status endpoint: (status, body)."""
    assert cluster.daemon.status is not None
    host, port = cluster.daemon.status.bound[0]
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (OSError, http.client.HTTPException) as exc:
        # Refused or closed unanswered (the connection cap, in a burst): no
        # answer, as a kubelet's probe would see it; callers wait and retry.
        return 0, f"{type(exc).__name__}: {exc}"


class Clock:
    """A clock a test sets."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def spawn(config: Path) -> subprocess.Popen[str]:
    """`devplugin run` as a process of its own."""
    return subprocess.Popen(
        [sys.executable, "-m", "devplugin", "run", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )


def daemon_config(
    node: BuiltNode,
    sock_dir: Path,
    path: Path,
    *,
    checkpoint: Path,
    resources: dict[str, object],
) -> Path:
    """A config file for a daemon run as a subprocess against a simulated node."""
    config = node.run_config(sock_dir, checkpoint)
    config["resources"] = resources
    config["health"] = {"interval_seconds": 0.2}
    config["pod_resources"] = {"poll_interval_seconds": 0.3, "min_interval_seconds": 0.05}
    path.write_text(yaml.safe_dump(config))
    return path


def alive(pid: int) -> bool:
    """Whether a process is running (a zombie is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


class Runner:
    """A hook runner that answers from a list of results (ok when it runs out)."""

    def __init__(self, results: list[bool]) -> None:
        self.results = results
        self.calls: list[list[str]] = []

    def __call__(
        self, spec: HookSpec, phase: str, resource: str, devices: object, **_: object
    ) -> HookResult:
        assert isinstance(devices, list)
        self.calls.append([d.id for d in devices])
        ok = self.results.pop(0) if self.results else True
        return HookResult(ok, 0 if ok else 1, "" if ok else "nope", 0.0)


class Node:
    """The custody book, its ports and the holdings ledger they read, fed as
    the daemon feeds them (the DRA claim ledger built on the same book)."""

    def __init__(self, runner: Runner, tmp_path: Path, **kwargs: object) -> None:
        self.ledger = Ledger(grace=5.0)
        # The policy's fields may be given one by one, as keywords.
        fields = {f.name for f in dataclasses.fields(CleanupPolicy)}
        chosen = {key: kwargs.pop(key) for key in list(kwargs) if key in fields}
        if "explicit" in chosen:
            chosen["explicit"] = frozenset(chosen["explicit"])  # type: ignore[arg-type]
        kwargs["policy"] = CleanupPolicy(**chosen)  # type: ignore[arg-type]
        names = {DeviceKind.GPU: "nvidia.com/gpu", DeviceKind.HCA: "rdma/hca"}
        self.lifecycle = Lifecycle(
            hooks=Hooks(
                {DeviceKind.GPU: HookSpec(("x",), 5)},
                describe=lambda kind, ids: [HookDevice(i, "", (), None) for i in ids],
                runner=runner,
            ),
            names=names,
            checkpoint=Checkpoint(tmp_path / "c.json", ClaimRecord.from_json),
            ledger=self.ledger,
            **kwargs,  # type: ignore[arg-type]
        )
        self.book = self.lifecycle.book
        self.takes = self.lifecycle.takes
        self.view = self.lifecycle.view
        self.claims = ClaimLedger(self.book, names=names, cancel=self.lifecycle.cancel)

    def allocated(self, kind: DeviceKind, ids: list[str]) -> None:
        self.ledger.allocated(kind, ids)
        self.takes.allocated(kind, ids)

    def observe(self, held: dict[DeviceKind, set[str]], polled_at: float) -> None:
        containers = {
            ("ns", f"pod-{d}", "c"): {kind: (d,)} for kind, ids in held.items() for d in ids
        }
        self.ledger.observe(Holdings(containers), polled_at)
        self.lifecycle.releases.observe()


def nested_spec() -> NodeSpec:
    """GPUs and HCAs behind nested switches, a dual-port HCA, one without a netdev."""
    return NodeSpec(
        roots=[
            RootComplex(
                numa_node=0,
                local_cpulist="0-15",
                children=[
                    Switch(
                        [
                            Switch([Gpu(), Hca()]),
                            Switch([Gpu(), Hca(ports=[Port(), Port()])]),
                        ]
                    ),
                    Gpu(),
                ],
            ),
            RootComplex(numa_node=0, local_cpulist="0-15", children=[Switch([Hca(netdevs=0)])]),
            RootComplex(numa_node=1, local_cpulist="16-31", children=[Switch([Gpu(), Gpu()])]),
        ],
        nvlink_pairs={(0, 1): 12},
    )


def scan(node: BuiltNode) -> Inventory:
    """One scan of a simulated node with its fake NVML, read threads closed after."""
    discoverer = Discoverer(
        Roots(node.sysfs_root, node.dev_root), NvmlGpuSource(FakeNvml.from_file(node.fixture))
    )
    try:
        return discoverer.scan()
    finally:
        discoverer.close()
