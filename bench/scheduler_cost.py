"""The extender's cost inside the real kube-scheduler, at 1,000 and 5,000 nodes.

A real control plane (the newest pin built by upstream/build.sh: etcd,
kube-apiserver, kube-controller-manager, kube-scheduler) holds N Nodes
(8 GPUs and 8 HCAs each, as their kubelets would report them) and one
NodeDevices record per node, HGX-like, a quarter of the nodes with 0, 1, 2
or 3 GPU+HCA pairs held. The extender runs as its own process reading
them. Three kube-schedulers run side by side over the same nodes, each
with its own schedulerName: one without an extender, one with the chart's
extender entry (filter, prioritize and preempt verbs, nodeCacheCapable,
the chart's weight and managed resources) pointed at the extender, and one
with the same entry pointed at a null extender (bench/null_extender.py:
every node passes, every score 0, in the plainest Python HTTP server), the
floor any HTTP extender pays. GPU pods (1+1, 2+1, 2+2 and 4+4) go:

* as a burst per scheduler, one after the other, after a warm-up batch:
  pods per second (the burst's creation to its last binding), the pods
  deleted after each;
* one at a time, taking turns among the three schedulers, so drift in the
  machine's load lands on all three alike: the scheduler's own
  `scheduler_scheduling_attempt_duration_seconds` for scheduled attempts,
  p50 and p99 read from its buckets as Prometheus' histogram_quantile
  reads them (linear within a bucket; the buckets double from 1 ms), and
  the mean (its _sum over _count, exact).

The scheduler scores only part of a large cluster (percentageOfNodesToScore,
adaptive by default: about 420 of 1,000 nodes, 500 of 5,000), so that is
what the extenders are asked about per pod.

Goal: at 5,000 nodes the extender adds at most 5 ms to the p50 attempt
(against the scheduler without one). Needs Go (the binaries are built,
once, when missing); skipped with one line where they cannot be had.
"""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from bench.proc import terminate
from devplugin.testing.controlplane import ControlPlane, Unavailable, binaries
from devplugin.testing.extender_proc import extender_process, free_port, ready
from devplugin.testing.promtext import Histogram, histogram
from devplugin.testing.records import gpu_id, hca_id, hgx_record

VERSION = "v1.37"
GPU, HCA = "nvidia.com/gpu", "rdma/hca"
SIZES = (1_000, 5_000)
SHAPES = ((1, 1), (2, 1), (2, 2), (4, 4))
WARM, MEASURED, PACED = 40, 400, 200
GOAL_MS = 5.0
CHART = Path(__file__).resolve().parents[1] / "charts" / "devplugin"
METRIC = "scheduler_scheduling_attempt_duration_seconds"


class Api:
    """Many requests as the administrator, one kept-alive connection per
    thread (a fresh TLS handshake per object would be most of the cost)."""

    def __init__(self, plane: ControlPlane) -> None:
        self.host, self.port = "127.0.0.1", plane.port
        self.context = plane.context()
        self.local = threading.local()

    def call(self, method: str, path: str, body: Any = None) -> Any:
        connection: http.client.HTTPSConnection | None = getattr(self.local, "connection", None)
        if connection is None:
            connection = http.client.HTTPSConnection(
                self.host, self.port, context=self.context, timeout=60
            )
            self.local.connection = connection
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        connection.request(method, path, body=data, headers=headers)
        answer = connection.getresponse()
        payload = answer.read()
        if answer.status >= 300:
            raise RuntimeError(f"{method} {path}: {answer.status} {payload[:300]!r}")
        return json.loads(payload or b"null")

    def each(self, calls: Iterable[Callable[[], object]], workers: int = 16) -> None:
        with ThreadPoolExecutor(workers) as pool:
            for _ in pool.map(lambda call: call(), calls):
                pass


def _stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _node(name: str) -> dict[str, Any]:
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110", GPU: "8", HCA: "8"}
    # A kubelet registers its Node with its status: create keeps it.
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "status": {"capacity": resources, "allocatable": resources,
                   "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                   "lastHeartbeatTime": _stamp(),
                                   "lastTransitionTime": _stamp()}]},
    }  # fmt: skip


def _record(name: str, index: int) -> dict[str, Any]:
    held = [(f"{name}-h{i}", f"uid-{name}-h{i}", [gpu_id(i), hca_id(i)]) for i in range(index % 4)]
    record = hgx_record(name, held=held)
    record["status"]["updated"] = _stamp()
    return record


def add_nodes(api: Api, first: int, last: int) -> None:
    """Nodes first..last-1, each with its record (written, as the daemon
    writes it, through the status subresource)."""
    base = "/apis/devplugin.io/v1alpha1/nodedevices"

    def add(index: int) -> None:
        name = f"node-{index:05d}"
        api.call("POST", "/api/v1/nodes", _node(name))
        record = _record(name, index)
        status = record.pop("status")
        record["metadata"].pop("resourceVersion", None)
        created = api.call("POST", base, record)
        api.call("PUT", f"{base}/{name}/status", {**created, "status": status})

    api.each(partial(add, index) for index in range(first, last))


def _pod(name: str, shape: tuple[int, int], scheduler: str) -> dict[str, Any]:
    limits = {GPU: str(shape[0]), HCA: str(shape[1])}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"schedulerName": scheduler,
                 "containers": [{"name": "c", "image": "bench/none",
                                 "resources": {"limits": limits}}]},
    }  # fmt: skip


def scheduler_config(name: str, extender: str | None) -> dict[str, Any]:
    """One default profile named `name`; with the chart's extender entry
    (charts/devplugin/templates/_helpers.tpl) pointed at `extender`."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    config: dict[str, Any] = {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "profiles": [{"schedulerName": name}],
    }
    if extender is not None:
        config["extenders"] = [{
            "urlPrefix": f"{extender}/scheduler", "filterVerb": "filter",
            "prioritizeVerb": "prioritize", "preemptVerb": "preempt",
            "weight": values["extender"]["scheduler"]["weight"], "nodeCacheCapable": True,
            "ignorable": True, "managedResources": [
                {"name": GPU, "ignoredByScheduler": False},
                {"name": HCA, "ignoredByScheduler": False}],
        }]  # fmt: skip
    return config


# -- one run ------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    nodes: int
    variant: str  # one of VARIANTS
    pods_per_s: float
    burst: Histogram  # attempts while the burst was placed
    paced: Histogram  # attempts of pods sent one at a time


# The schedulers side by side: without an extender, with the null one, with ours.
WITHOUT, NULL, OURS = "without", "null", "extender"
VARIANTS = (WITHOUT, NULL, OURS)


class Bindings:
    """When each pod of `default` was bound, from a watch (no polling): a
    thread lists, then watches from the list's resourceVersion, and lists
    again whenever the server ends the stream, until `close`."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.bound: dict[str, float] = {}
        self.changed = threading.Condition()
        self.closed = threading.Event()
        self.connection: http.client.HTTPSConnection | None = None
        self.thread = threading.Thread(target=self._run, name="bench-bindings", daemon=True)
        self.thread.start()

    def _seen(self, pods: Iterable[dict[str, Any]]) -> None:
        with self.changed:
            for pod in pods:
                if pod.get("spec", {}).get("nodeName"):
                    self.bound.setdefault(pod["metadata"]["name"], time.monotonic())
            self.changed.notify_all()

    def _run(self) -> None:
        path = "/api/v1/namespaces/default/pods"
        while not self.closed.is_set():
            connection = http.client.HTTPSConnection(
                "127.0.0.1", self.plane.port, context=self.plane.context(), timeout=None
            )
            self.connection = connection
            if self.closed.is_set():
                connection.close()  # `close` may have looked before this connection was set
                return
            try:
                connection.request("GET", path)
                listed = json.loads(connection.getresponse().read())
                self._seen(listed["items"])
                version = listed["metadata"]["resourceVersion"]
                connection.request("GET", f"{path}?watch=1&resourceVersion={version}")
                for line in connection.getresponse():
                    if line.strip():
                        event = json.loads(line)
                        if event.get("type") in ("ADDED", "MODIFIED"):
                            self._seen([event["object"]])
            except (OSError, ValueError, http.client.HTTPException):
                pass  # closed, or the stream broke: list again
            finally:
                connection.close()

    def wait(self, names: Sequence[str], within: float = 600.0) -> float:
        """When the last of `names` was bound."""
        with self.changed:
            if not self.changed.wait_for(lambda: all(n in self.bound for n in names), within):
                raise RuntimeError(f"{len(names)} pods not all bound within {within:.0f} s")
            return max(self.bound[n] for n in names)

    def close(self) -> None:
        self.closed.set()
        # Shutting the socket ends the reader's blocking read at once.
        connection = self.connection
        if connection is not None and connection.sock is not None:
            connection.sock.shutdown(socket.SHUT_RDWR)
        self.thread.join(10)


def _create(api: Api, names: Sequence[str], scheduler: str) -> None:
    pods = [_pod(name, SHAPES[i % len(SHAPES)], scheduler) for i, name in enumerate(names)]
    api.each(partial(api.call, "POST", "/api/v1/namespaces/default/pods", pod) for pod in pods)


def _clear(api: Api) -> None:
    api.call("DELETE", "/api/v1/namespaces/default/pods?gracePeriodSeconds=0")
    while api.call("GET", "/api/v1/namespaces/default/pods?limit=1")["items"]:
        time.sleep(0.1)


def _attempts(plane: ControlPlane, scheduler: str) -> Histogram:
    return histogram(plane.scheduler_metrics(scheduler), METRIC, {"result": "scheduled"})


def _scheduler(nodes: int, variant: str) -> str:
    return f"bench-{variant}-{nodes}"


def measure(api: Api, plane: ControlPlane, nodes: int, urls: dict[str, str | None]) -> list[Run]:
    """The schedulers of `urls` (variant -> extender URL or None) started side
    by side; each places a warm-up batch then its burst alone (pods per
    second, attempts under load); then pods one at a time taking turns
    (attempts alone, drift shared)."""
    names = {variant: _scheduler(nodes, variant) for variant in urls}
    for variant, url in urls.items():
        plane.start_scheduler(scheduler_config(names[variant], url), names[variant])
    bindings = Bindings(plane)
    rates: dict[str, float] = {}
    bursts: dict[str, Histogram] = {}
    try:
        for variant, scheduler in names.items():
            warm = [f"warm-{scheduler}-{i}" for i in range(WARM)]
            _create(api, warm, scheduler)
            bindings.wait(warm)
            before = _attempts(plane, scheduler)
            burst = [f"burst-{scheduler}-{i}" for i in range(MEASURED)]
            started = time.monotonic()
            _create(api, burst, scheduler)
            rates[variant] = MEASURED / (bindings.wait(burst) - started)
            bursts[variant] = _attempts(plane, scheduler).minus(before)
            _clear(api)
        before_paced = {variant: _attempts(plane, name) for variant, name in names.items()}
        for i in range(PACED):
            for scheduler in names.values():
                pod = f"paced-{scheduler}-{i}"
                _create(api, [pod], scheduler)
                bindings.wait([pod])
        paced = {
            variant: _attempts(plane, name).minus(before_paced[variant])
            for variant, name in names.items()
        }
    finally:
        bindings.close()
        for scheduler in names.values():
            plane.stop_scheduler(scheduler)
    _clear(api)
    return [Run(nodes, v, rates[v], bursts[v], paced[v]) for v in names]


def _ms(value: float) -> str:
    return f"{value * 1e3:>7.2f}"


def _row(run: Run) -> str:
    paced = run.paced
    return (
        f"{run.nodes:>6} {run.variant:>9} {run.pods_per_s:>7.1f} "
        f"{_ms(run.burst.quantile(0.5))} {_ms(paced.quantile(0.5))} "
        f"{_ms(paced.quantile(0.99))} {_ms(paced.mean)}"
    )


def added_ms(runs: Sequence[Run], nodes: int, variant: str) -> float:
    """What `variant` adds to the p50 of attempts one at a time at `nodes`."""
    at = {r.variant: r.paced.quantile(0.5) for r in runs if r.nodes == nodes}
    return (at[variant] - at[WITHOUT]) * 1e3


def verdict(runs: Sequence[Run], largest: int) -> tuple[float, bool]:
    """The p50 the extender adds at the largest size, and whether the goal holds."""
    added = added_ms(runs, largest, OURS)
    return added, added <= GOAL_MS


def scheduler_cost_bench(sizes: Sequence[int] = SIZES) -> bool:
    print(
        f"Extender cost in kube-scheduler ({VERSION}): {MEASURED} GPU pods "
        f"({', '.join(f'{g}+{h}' for g, h in SHAPES)}) after {WARM} warm-up per scheduler, "
        f"then {PACED} each one at a time, without an extender, with a null one and with "
        f"ours, at {' and '.join(f'{n:,}' for n in sizes)} nodes"
    )
    try:
        bins = binaries(VERSION)
    except Unavailable as exc:
        print(f"== scheduler cost: skipped, {exc}")
        return True
    folder = Path(tempfile.mkdtemp(prefix="dpsched-"))
    runs: list[Run] = []
    try:
        with ControlPlane(bins, folder) as plane:
            runs = _runs(plane, folder, sizes, lambda run: print(_row(run), flush=True))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    largest = max(sizes)
    added, met = verdict(runs, largest)
    print(
        f"== scheduler cost: at {largest:,} nodes the extender adds {added:.2f} ms to the p50 "
        f"attempt (goal <= {GOAL_MS:.0f} ms): {'met' if met else 'NOT MET'}; "
        f"a null extender adds {added_ms(runs, largest, NULL):.2f} ms"
    )
    return met


def _runs(
    plane: ControlPlane, folder: Path, sizes: Sequence[int], report: Callable[[Run], None]
) -> list[Run]:
    crd = yaml.safe_load((CHART / "crds" / "nodedevices.yaml").read_text())
    plane.apply(crd)
    api = Api(plane)
    deadline = time.monotonic() + 60
    while True:
        try:
            api.call("GET", "/apis/devplugin.io/v1alpha1/nodedevices?limit=1")
            break
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    print(f"{'':>16} {'burst':>7} {'':>7} {'one at a time':^23}")
    header = ("nodes", "extender", "pods/s", "p50 ms", "p50 ms", "p99 ms", "mean ms")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (6, 9, 7, 7, 7, 7, 7), strict=True)))
    runs: list[Run] = []
    have = 0
    for size in sorted(sizes):
        add_nodes(api, have, size)
        have = size
        ours = extender_process(plane.admin, folder, stale_after=86_400, within=120)
        with ours as url, null_extender() as null:
            for run in measure(api, plane, size, {WITHOUT: None, NULL: null, OURS: url}):
                report(run)
                runs.append(run)
    return runs


@contextmanager
def null_extender() -> Iterator[str]:
    """bench/null_extender.py as its own process, answering; its URL."""
    port = free_port()
    command = [sys.executable, "-m", "bench.null_extender", str(port)]
    process = subprocess.Popen(command, cwd=Path(__file__).resolve().parents[1])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not ready(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the null extender did not start")
            time.sleep(0.05)
        yield url
    finally:
        terminate(process, 10)
