"""`make bench`: GetPreferredAllocation and Allocate end to end over gRPC, against a floor.

For each node (8-GPU/8-HCA HGX-like, 64-GPU/16-HCA PCIe) and each request
size, the daemon's real GetPreferredAllocation is called through a real
channel on its unix socket, with the available set drawn from 32 seeded
random states (all free, and partly used), so no two consecutive calls see
the same input. The floor is a servicer that does nothing but return a
response of the same size over the same gRPC path; our p50 is printed as a
ratio to the floor's p50 (what the daemon adds to Python gRPC itself).

Allocate is measured the same way for a few sizes (the same device ids
each time, as a kubelet re-admitting a container would), against a floor
that returns a response of the same shape. Then, with PodResources gone,
a run of Allocates shows the holdings ledger stays bounded and latency
does not drift, and the daemon's shutdown time is printed.

With the pod cache: the 8-GPU node again, its daemon watching 250 pods on
the node in the API server imitation (240 running, 10 waiting to be
admitted), each GPU preference identifying the waiting container from the
cache. Goal: p50 within 1.5x the floor.

Cluster placement (`bench/cluster.py`): 16 mixed nodes, a seeded stream
of pods placed by the default scheduler's rule and by the extender's.
With real daemons (`bench/cluster_live.py`): four mixed nodes, each a real
daemon behind its kubelet simulator, one API server imitation and the
extender process over HTTP; pods arriving every 0.05 s, 0.2 s and 1 s with
deletions between. Goal: at every cadence at least 98% of GPU+HCA pods at
the best level free anywhere at that moment, and a higher share at the
cluster-wide ideal than default placement on the same stream.

Fleet (`bench/fleet.py`): what each node's daemon costs the API server,
requests and bytes per node per minute, idle and with a pod every 10 s.
Goal: idle, at most one write a minute to records; under churn, record
writes follow the changes within the 1/s budget.

Extender at scale (`bench/extender_scale.py`): `devplugin extender` as its
own process at 100, 1,000 and 5,000 nodes with 20 bound pods per node and 9
pod shapes: startup, memory, filter+prioritize p50/p99 warm and right after
record changes, a bound pod counted under 60 pod updates a second, a
1,024-device record's parse, and peak memory under 8 concurrent maximum-size
requests. Goals: p99 < 50 ms at 1,000 nodes, counted within 1 s, parsed in
< 100 ms, peak under the chart's 512 MiB.

Extender cost inside the real kube-scheduler (`bench/scheduler_cost.py`):
a real control plane (the newest pin) with 1,000 and then 5,000 Nodes and
their NodeDevices records, the same GPU pods scheduled without and with
the chart's extender entry in one run: pods per second for a burst, and
the scheduler's own `scheduler_scheduling_attempt_duration_seconds`
(p50, p99, mean) for pods sent one at a time. Goal: the extender adds at
most 5 ms to the p50 attempt at 5,000 nodes. Needs Go (skipped with one
line without it); `--scheduler` runs it alone.

Idle (`bench/idle.py`): `devplugin run` with production defaults behind the
kubelet simulator on 8 and 64 GPUs, CPU over 60 s once settled, RSS and
threads. Goals: at most 0.5% of a core and 60 MiB on 8 GPUs, 2% on 64.

NVLink layouts: every GPU and HCA size on DGX-1, two DGX-1 meshes, PCIe
trees of 16, 32 and 64 GPUs with NVLink bridges between neighbouring
switches, and the 8-GPU NVSwitch node with two NUMA nodes, end to end as
above but with all sizes of a resource taking turns call by call (so the
machine's own hiccups spread over sizes instead of making one size's tail).
Goal: p99 under 20 ms for every size (the kubelet waits for the
answer before it admits the pod), the floor's p99 printed beside it; and no
search may run out of its budget.

DRA (`bench/dra.py`): the chart's claim templates for 1, 2, 4 and 8
GPU+HCA pairs on five layouts under random occupancy, allocated by the
scheduler's allocator imitation, against the same pairs constrained only by
pcieRoot and against the exhaustive optimum. Goal: 100% of 1-pair claims
and at least 95% of multi-pair claims with their worst pair at the best
level any free choice allows.

Preemption (`bench/preemption.py`): eight nodes of the four live layouts
filled with pods of priority 0/100/200, then priority-1000 pods that must
preempt; victims as kube-scheduler chooses them by counts, and through the
extender's verb, against every subset of each node's lower pods. Goal:
through the extender, every preemptor at the best level eviction gives
anywhere, with the fewest victims for it.

MIG (`bench/mig.py`): two MIG layouts of the HGX-H100 node under the mixed
strategy, a real daemon behind the kubelet simulator with the pod watch, a
seeded stream of MIG and whole-GPU pods (resources taken in random order)
with deletions; each container against every choice of the free devices.
Goal: 100% at the best level any free choice gives (the same streams from
the kubelet alone are printed beside it).

Quality: the answer is compared with an exhaustive search of the same
objective wherever that is affordable (every size on 8 GPUs, sizes 1-3 on
64 GPUs). `--quick` runs fewer iterations (used by the tests).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import grpc

from bench.cluster import cluster_bench
from bench.cluster_live import live_cluster_bench
from bench.dra import dra_bench
from bench.dra_live import dra_live_bench
from bench.extender_scale import extender_scale_bench
from bench.fleet import fleet_bench
from bench.idle import idle_bench
from bench.mig import mig_bench
from bench.preemption import preemption_bench
from bench.scheduler_cost import scheduler_cost_bench
from devplugin.api import deviceplugin_v1beta1_pb2 as pb
from devplugin.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from devplugin.config import Config, override
from devplugin.kinds.registry import paired_with
from devplugin.logs import setup_logging
from devplugin.model import DeviceKind
from devplugin.policy.allocator import (
    Allocator,
    Request,
    Role,
    evaluate,
    exhaustive,
    plan_request,
    planned_request,
)
from devplugin.policy.allocator import validate as validate_request
from devplugin.runtime import Daemon, build, settle_heap
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.fake_nvml import FakeNvml
from devplugin.testing.layouts import LAYOUTS
from devplugin.testing.node import build_node

# Absolute p99 targets, printed for reference: a loaded machine moves them,
# so they never fail the run. The goal is the median p50/floor ratio, both
# measured in the same run under the same load, and every answer optimal.
GOALS_MS = {"hgx-h100": 2.0, "64-gpu": 20.0}
# Issue 19's goals (the earlier 1.5 and 4.0 were met first; these since the compiled fold).
RATIO_GOALS = {"hgx-h100": 1.25, "64-gpu": 1.5}
POD_CACHE_GOAL = 1.5
NVLINK_LAYOUTS = (
    "dgx-1", "dgx-1x2", "16-gpu-bridged", "32-gpu-bridged", "64-gpu-bridged", "hgx-h100",
)  # fmt: skip
NVLINK_P99_MS = 20.0
# Up to 96 devices there: each subset costs more to score (the exactness on
# these layouts is shown by tests/unit/test_nvlink_search.py).
NVLINK_EXHAUSTIVE_LIMIT = 5_000
EXHAUSTIVE_LIMIT = 50_000  # subsets per quality check


class FloorServicer(pb_grpc.DevicePluginServicer):
    """Returns `allocation_size` of the listed ids, or an Allocate response of
    the usual shape: the gRPC path and nothing else."""

    def Allocate(
        self, request: pb.AllocateRequest, context: grpc.ServicerContext
    ) -> pb.AllocateResponse:
        response = pb.AllocateResponse()
        for container in request.container_requests:
            ids = list(container.devices_ids)
            entry = response.container_responses.add()
            entry.envs["NVIDIA_VISIBLE_DEVICES"] = ",".join(ids)
            for index in range(len(ids) + 3):
                path = f"/dev/nvidia{index}"
                entry.devices.add(container_path=path, host_path=path, permissions="rw")
        return response

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        response = pb.PreferredAllocationResponse()
        for container in request.container_requests:
            ids = container.available_deviceIDs[: container.allocation_size]
            response.container_responses.add(deviceIDs=ids)
        return response


def percentile(samples: Sequence[float], fraction: float) -> float:
    """Nearest rank: the smallest sample at least `fraction` of them do not
    exceed (p99 of 100 samples is the second slowest, of 200 the third)."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


Calls = Sequence[Callable[[], object]]


def measure_groups(
    groups: Sequence[tuple[Calls, Calls]], iterations: int, warmup: int
) -> list[tuple[list[float], list[float]]]:
    """Per group, our calls alternated with the floor's, so both meet the same
    conditions; the groups take turns call by call, so a burst of noise on
    the machine lands on a call or two of many groups rather than on the
    tail of one. (ours ms, floor ms) per group."""
    for index in range(warmup):
        for ours, floor in groups:
            ours[index % len(ours)]()
            floor[index % len(floor)]()
    results: list[tuple[list[float], list[float]]] = [([], []) for _ in groups]
    for index in range(iterations):
        for (ours, floor), (ours_ms, floor_ms) in zip(groups, results, strict=True):
            for calls, samples in ((ours, ours_ms), (floor, floor_ms)):
                call = calls[index % len(calls)]
                started = time.perf_counter()
                call()
                samples.append((time.perf_counter() - started) * 1000.0)
    return results


def measure_pair(
    ours: Calls, floor: Calls, iterations: int, warmup: int
) -> tuple[list[float], list[float]]:
    """One group measured on its own."""
    return measure_groups([(ours, floor)], iterations, warmup)[0]


@dataclass
class Row:
    node: str
    kind: str
    size: int
    p50: float
    p99: float
    floor_p50: float
    floor_p99: float
    quality: str

    @property
    def ratio(self) -> float:
        return self.p50 / self.floor_p50


def states(ids: list[str], size: int, rng: random.Random, count: int = 32) -> list[list[str]]:
    """Available sets: everything free, then partly used ones that still fit."""
    found = [list(ids)]
    while len(found) < count:
        keep = rng.randint(size, len(ids))
        found.append(sorted(rng.sample(ids, keep)))
    return found


def request_for(ids: list[str], size: int) -> pb.PreferredAllocationRequest:
    return pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(available_deviceIDs=ids, allocation_size=size)
        ]
    )


def quality(
    daemon: Daemon,
    kind: DeviceKind,
    available: list[str],
    answer: list[str],
    limit: int = EXHAUSTIVE_LIMIT,
) -> str:
    """'optimal' when the answer's objective equals an exhaustive search's
    (of at most `limit` subsets; '-' when that would take more)."""
    coordinator = daemon.core.coordinator
    topology = coordinator.topology
    other = coordinator.free(paired_with(kind))
    size = len(answer)
    request = Request(
        kind,
        frozenset(available),
        size,
        frozenset(),
        Role.FIRST,
        other,
        other,
        coordinator.expected_partners(kind, size),
    )
    candidates = validate_request(topology, request)
    expected = request.expected_partners
    if kind is DeviceKind.GPU and 0 < expected < size:
        # Two steps: the planned HCAs, then the GPUs against them.
        plan = daemon.core.coordinator.preferred(DeviceKind.GPU, available, (), size)[0].plan
        first = plan_request(request, candidates, expected)
        if math.comb(len(first.available), first.size) > limit:
            return "-"
        if evaluate(topology, first, plan).key() != exhaustive(topology, first).score.key():
            return "WORSE"
        request = planned_request(request, candidates, plan)
    elif kind is DeviceKind.HCA and 0 < expected <= len(other):
        # Two steps: the GPUs a first GPU request would plan, then the HCAs
        # against them.
        plan = daemon.core.coordinator.preferred(DeviceKind.HCA, available, (), size)[0].plan
        gpus = Request(
            DeviceKind.GPU, other, expected, frozenset(), Role.FIRST, candidates, candidates, size
        )
        if math.comb(len(other), expected) > limit:
            return "-"
        if evaluate(topology, gpus, plan).key() != exhaustive(topology, gpus).score.key():
            return "WORSE"
        planned = frozenset(plan)
        request = Request(
            DeviceKind.HCA, candidates, size, frozenset(), Role.SECOND, planned, other - planned
        )
    if math.comb(len(candidates), size) > limit:
        return "-"
    ours = evaluate(topology, request, answer).key()
    best = exhaustive(topology, request).score.key()
    return "optimal" if ours == best else "WORSE"


def allocate_request(ids: Sequence[str]) -> pb.AllocateRequest:
    return pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])


def allocate_sizes(count: int) -> list[int]:
    return sorted({1, 2, count // 2, count} - {0})


@dataclass
class NodeResult:
    preferred: list[Row]
    allocate: list[Row]
    drift: str
    shutdown_ms: float


def node_daemon(name: str, tag: str, base: Path, **settings: object) -> Daemon:
    """A daemon (not started) on a simulated `name` node built under `base`."""
    node = build_node(LAYOUTS[name](), base / tag)
    config = override(
        Config(),
        **{
            "paths.sysfs_root": str(node.sysfs_root),
            "paths.dev_root": str(node.dev_root),
            "paths.device_plugin_dir": str(base / f"{tag}-dp"),
            "paths.pod_resources_socket": str(base / f"{tag}-pr.sock"),
            "nvml.fixture": str(node.fixture),
            "lifecycle.checkpoint_file": str(base / f"{tag}-checkpoint.json"),
            "metrics.addresses": ["127.0.0.1:0"],
            **settings,
        },
    )
    return build(config, FakeNvml.from_file(node.fixture))


def measure_preferred(
    ours: pb_grpc.DevicePluginStub,
    bare: pb_grpc.DevicePluginStub,
    ids: list[str],
    size: int,
    *,
    rng: random.Random,
    iterations: int,
    warmup: int,
) -> tuple[list[pb.PreferredAllocationRequest], list[float], list[float]]:
    """GetPreferredAllocation of `size` over seeded available sets, ours and the floor's."""
    requests = [request_for(s, size) for s in states(ids, size, rng)]
    ours_ms, floor_ms = measure_pair(*preference_calls(ours, bare, requests), iterations, warmup)
    return requests, ours_ms, floor_ms


def preference_calls(
    ours: pb_grpc.DevicePluginStub,
    bare: pb_grpc.DevicePluginStub,
    requests: Sequence[pb.PreferredAllocationRequest],
) -> tuple[Calls, Calls]:
    """The same requests to our servicer and to the floor."""
    return (
        [partial(ours.GetPreferredAllocation, r) for r in requests],
        [partial(bare.GetPreferredAllocation, r) for r in requests],
    )


def start_floor(socket: str) -> grpc.Server:
    """The do-nothing servicer every measurement is compared with."""
    floor = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_DevicePluginServicer_to_server(FloorServicer(), floor)
    floor.add_insecure_port(f"unix://{socket}")
    floor.start()
    return floor


def plugin_sockets(directory: str) -> dict[DeviceKind, str]:
    return {
        DeviceKind.GPU: f"{directory}/devplugin-nvidia.com-gpu.sock",
        DeviceKind.HCA: f"{directory}/devplugin-rdma-hca.sock",
    }


def preferred_rows(
    daemon: Daemon,
    name: str,
    directory: str,
    bare: pb_grpc.DevicePluginStub,
    *,
    rng: random.Random,
    iterations: int,
    warmup: int,
    limit: int = EXHAUSTIVE_LIMIT,
    interleave: bool = False,
) -> list[Row]:
    """Every size of both resources against the floor (size after size, or
    with `interleave` all sizes of a resource in turn), each answer's quality
    checked (exhaustive search of at most `limit` subsets)."""
    rows: list[Row] = []
    for kind, socket in plugin_sockets(directory).items():
        ids = daemon.core.coordinator.topology.ids(kind)
        sizes = range(1, len(ids) + 1)
        requests = {size: [request_for(s, size) for s in states(ids, size, rng)] for size in sizes}
        with grpc.insecure_channel(f"unix://{socket}") as ours_channel:
            ours = pb_grpc.DevicePluginStub(ours_channel)
            groups = [preference_calls(ours, bare, requests[size]) for size in sizes]
            if interleave:
                measured = measure_groups(groups, iterations, warmup)
            else:
                measured = [measure_pair(*group, iterations, warmup) for group in groups]
            for size, (ours_ms, floor_ms) in zip(sizes, measured, strict=True):
                first = requests[size][0]
                answer = ours.GetPreferredAllocation(first)
                verdict = quality(
                    daemon,
                    kind,
                    list(first.container_requests[0].available_deviceIDs),
                    list(answer.container_responses[0].deviceIDs),
                    limit,
                )
                rows.append(
                    Row(
                        name,
                        kind.value,
                        size,
                        statistics.median(ours_ms),
                        percentile(ours_ms, 0.99),
                        statistics.median(floor_ms),
                        percentile(floor_ms, 0.99),
                        verdict,
                    )
                )
    return rows


def bench_node(name: str, iterations: int, warmup: int, base: Path) -> NodeResult:
    daemon = node_daemon(name, name, base)
    daemon.start()
    settle_heap()  # as `devplugin run` does once serving
    floor = start_floor(f"{base}/{name}-floor.sock")
    rows: list[Row] = []
    allocate_rows: list[Row] = []
    drift = ""
    rng = random.Random(name)
    try:
        sockets = plugin_sockets(f"{base}/{name}-dp")
        with grpc.insecure_channel(f"unix://{base}/{name}-floor.sock") as floor_channel:
            bare = pb_grpc.DevicePluginStub(floor_channel)
            # Every GetPreferredAllocation first: Allocates would change what is
            # free and make the next requests second ones of a pair.
            rows = preferred_rows(
                daemon,
                name,
                f"{base}/{name}-dp",
                bare,
                rng=rng,
                iterations=iterations,
                warmup=warmup,
            )
            for kind, socket in sockets.items():
                ids = daemon.core.coordinator.topology.ids(kind)
                with grpc.insecure_channel(f"unix://{socket}") as ours_channel:
                    ours = pb_grpc.DevicePluginStub(ours_channel)
                    for size in allocate_sizes(len(ids)):
                        sets = [rng.sample(ids, size) for _ in range(8)]
                        ours_allocs: list[Callable[[], object]] = [
                            partial(ours.Allocate, allocate_request(s)) for s in sets
                        ]
                        bare_allocs: list[Callable[[], object]] = [
                            partial(bare.Allocate, allocate_request(s)) for s in sets
                        ]
                        ours_ms, floor_ms = measure_pair(
                            ours_allocs, bare_allocs, iterations, warmup
                        )
                        allocate_rows.append(
                            Row(
                                name,
                                kind.value,
                                size,
                                statistics.median(ours_ms),
                                percentile(ours_ms, 0.99),
                                statistics.median(floor_ms),
                                percentile(floor_ms, 0.99),
                                "-",
                            )
                        )
        drift = allocate_drift(daemon, sockets[DeviceKind.GPU], iterations * 10)
    finally:
        floor.stop(0)
        started = time.perf_counter()
        daemon.stop()
        shutdown_ms = (time.perf_counter() - started) * 1000.0
        gc.unfreeze()  # the next daemon freezes its own start-up
    return NodeResult(rows, allocate_rows, drift, shutdown_ms)


def bench_pod_cache(name: str, iterations: int, warmup: int, base: Path) -> list[Row]:
    """GPU preferences while the daemon watches 250 pods on its node."""
    api = ApiServerImitation()
    api.start()
    rng = random.Random(f"{name}-pods")
    shapes = [{}, {}, {}, {"nvidia.com/gpu": 1}, {"nvidia.com/gpu": 2, "rdma/hca": 1}]
    for index in range(240):
        limits = rng.choice(shapes)
        api.put("pods", _pod(f"running-{index}", [limits, {}], index, "Running"))
    for size in range(1, 11):
        gpus = min(size, 8)
        limits = {"nvidia.com/gpu": gpus, "rdma/hca": gpus}
        api.put("pods", _pod(f"waiting-{size}", [limits], 1000 + size, "Pending"))
    kubeconfig = base / f"{name}-kubeconfig"
    kubeconfig.write_text(json.dumps(api.kubeconfig()))
    daemon = node_daemon(
        name,
        f"{name}-pods",
        base,
        **{
            "kubernetes.enabled": True,
            "kubernetes.kubeconfig": str(kubeconfig),
            "kubernetes.node_name": "node-1",
            # Each call identifies the same waiting container again (the
            # kubelet would admit it); the work per call is the same.
            "kubernetes.claim_seconds": 1e-6,
            "kubernetes.node_devices": False,
            "kubernetes.events": False,
        },
    )
    daemon.start()
    settle_heap()  # as `devplugin run` does once serving
    floor = start_floor(f"{base}/{name}-pods-floor.sock")
    rows: list[Row] = []
    try:
        if daemon.pods is None or not daemon.pods.synced.wait(10):
            raise RuntimeError("the pod cache did not sync")
        if len(daemon.pods.pods()) != 250:
            raise RuntimeError(f"the pod cache holds {len(daemon.pods.pods())} pods, not 250")
        ids = daemon.core.coordinator.topology.ids(DeviceKind.GPU)
        socket = plugin_sockets(f"{base}/{name}-pods-dp")[DeviceKind.GPU]
        with (
            grpc.insecure_channel(f"unix://{base}/{name}-pods-floor.sock") as floor_channel,
            grpc.insecure_channel(f"unix://{socket}") as ours_channel,
        ):
            bare = pb_grpc.DevicePluginStub(floor_channel)
            ours = pb_grpc.DevicePluginStub(ours_channel)
            for size in range(1, len(ids) + 1):
                _, ours_ms, floor_ms = measure_preferred(
                    ours, bare, ids, size, rng=rng, iterations=iterations, warmup=warmup
                )
                rows.append(
                    Row(
                        f"{name}+pods",
                        "gpu",
                        size,
                        statistics.median(ours_ms),
                        percentile(ours_ms, 0.99),
                        statistics.median(floor_ms),
                        percentile(floor_ms, 0.99),
                        "-",
                    )
                )
        exact = daemon.core.metrics.pod_aware.labels("nvidia.com/gpu", "exact")._value.get()
        calls = len(rows) * (iterations + warmup)
        if exact < calls:
            raise RuntimeError(f"only {exact:.0f} of {calls} preferences identified the pod")
    finally:
        floor.stop(0)
        daemon.stop()
        api.stop()
        gc.unfreeze()
    return rows


def bench_nvlink(name: str, iterations: int, warmup: int, base: Path) -> tuple[list[Row], int, str]:
    """Every GPU and HCA size on one NVLink layout: (rows, searches that hit
    their budget, how the daemon's allocator searches GPUs there)."""
    daemon = node_daemon(name, f"{name}-nvlink", base)
    daemon.start()
    settle_heap()  # as `devplugin run` does once serving
    floor = start_floor(f"{base}/{name}-nvlink-floor.sock")
    rng = random.Random(f"{name}-nvlink")
    rows: list[Row] = []
    try:
        with grpc.insecure_channel(f"unix://{base}/{name}-nvlink-floor.sock") as floor_channel:
            rows = preferred_rows(
                daemon,
                name,
                f"{base}/{name}-nvlink-dp",
                pb_grpc.DevicePluginStub(floor_channel),
                rng=rng,
                iterations=iterations,
                warmup=warmup,
                limit=NVLINK_EXHAUSTIVE_LIMIT,
                interleave=True,
            )
        hits = int(daemon.core.metrics.budget_hits._value.get())
        method = Allocator(daemon.core.coordinator.topology).method
    finally:
        floor.stop(0)
        daemon.stop()
        gc.unfreeze()
    return rows, hits, method


def nvlink_section(layouts: Sequence[str], iterations: int, warmup: int, base: Path) -> bool:
    """The NVLink table and its verdict: True when every layout met the goal."""
    print("GetPreferredAllocation on NVLink layouts, end to end over gRPC (ms)")
    print(
        f"{'node':14} {'kind':4} {'size':>4} {'p50':>7} {'p99':>7} {'fl p50':>7} "
        f"{'fl p99':>7} {'ratio':>5}  quality"
    )
    met = True
    for name in layouts:
        rows, hits, method = bench_nvlink(name, iterations, warmup, base)
        for row in rows:
            print_row(row, width=14)
        worst = max(rows, key=lambda row: row.p99)
        within = worst.p99 < NVLINK_P99_MS and hits == 0
        print(
            f"== {name} ({method} search): worst p99 {worst.p99:.3f} ms ({worst.kind} size "
            f"{worst.size}; goal < {NVLINK_P99_MS:.0f} ms: {'met' if within else 'MISSED'}); "
            f"floor's worst p99 {max(row.floor_p99 for row in rows):.3f} ms; "
            f"searches past the budget {hits}; quality: "
            f"{sum(r.quality == 'optimal' for r in rows)} optimal, "
            f"{sum(r.quality == 'WORSE' for r in rows)} worse, "
            f"{sum(r.quality == '-' for r in rows)} not checked"
        )
        met &= within and not any(row.quality == "WORSE" for row in rows)
    return met


def _pod(name: str, limits: list[dict[str, int]], index: int, phase: str) -> dict[str, object]:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(1_700_000_000 + index))
    return {
        "metadata": {"name": name, "namespace": "bench", "creationTimestamp": stamp},
        "spec": {
            "nodeName": "node-1",
            "containers": [
                {"name": f"c{i}", "image": "x", "resources": {"limits": dict(each)}}
                for i, each in enumerate(limits)
            ],
        },
        "status": {"phase": phase},
    }


def allocate_drift(daemon: Daemon, socket: str, count: int) -> str:
    """Allocates with PodResources unreachable: ledger size and latency, start vs end."""
    gpus = daemon.core.coordinator.topology.ids(DeviceKind.GPU)
    physical = len(gpus) + len(daemon.core.coordinator.topology.ids(DeviceKind.HCA))
    daemon.core.monitor.stop()  # as if PodResources were unreachable from now on
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        samples: list[float] = []
        for index in range(count):
            request = allocate_request([gpus[index % len(gpus)]])
            started = time.perf_counter()
            stub.Allocate(request)
            samples.append((time.perf_counter() - started) * 1000.0)
    window = max(1, count // 10)
    first, last = statistics.median(samples[:window]), statistics.median(samples[-window:])
    size = f"ledger {len(daemon.core.ledger)} entries (bound {physical})"
    return (
        f"{count} Allocates, PodResources down: p50 first {window} {first:.3f} ms, "
        f"last {window} {last:.3f} ms ({last / first:.2f}x); {size}"
    )


def print_row(row: Row, width: int = 9) -> None:
    print(
        f"{row.node:{width}} {row.kind:4} {row.size:>4} {row.p50:7.3f} {row.p99:7.3f} "
        f"{row.floor_p50:7.3f} {row.floor_p99:7.3f} {row.ratio:5.2f}  {row.quality}"
    )


def node_sections(
    nodes: Sequence[str], quick: bool, iterations: int, warmup: int, base: Path
) -> bool:
    """The 8- and 64-GPU tables, the pod cache, Allocate, the cluster: True
    when a goal was missed."""
    failed = False
    print("GetPreferredAllocation end to end over gRPC (ms); floor = do-nothing servicer")
    print(
        f"{'node':9} {'kind':4} {'size':>4} {'p50':>7} {'p99':>7} {'fl p50':>7} "
        f"{'fl p99':>7} {'ratio':>5}  quality"
    )
    results: dict[str, NodeResult] = {}
    for name in nodes:
        goal = GOALS_MS[name]
        result = results[name] = bench_node(name, iterations, warmup, base)
        rows = result.preferred
        for row in rows:
            print_row(row)
        worst_p99 = max(row.p99 for row in rows)
        ratio = statistics.median(row.ratio for row in rows)
        meets = ratio <= RATIO_GOALS[name]
        print(
            f"== {name}: median p50/floor ratio {ratio:.2f} (goal <= {RATIO_GOALS[name]}: "
            f"{'met' if meets else 'MISSED'}); worst p99 {worst_p99:.3f} ms (target < "
            f"{goal} ms, {'within' if worst_p99 < goal else 'over'}; floor's worst p99 "
            f"{max(row.floor_p99 for row in rows):.3f} ms); "
            f"quality: {sum(r.quality == 'optimal' for r in rows)} optimal, "
            f"{sum(r.quality == 'WORSE' for r in rows)} worse, "
            f"{sum(r.quality == '-' for r in rows)} not checked"
        )
        failed |= any(row.quality == "WORSE" for row in rows)
        failed |= not meets and not quick
    if "hgx-h100" in nodes:
        rows = bench_pod_cache("hgx-h100", iterations, warmup, base)
        for row in rows:
            print_row(row)
        ratio = statistics.median(row.ratio for row in rows)
        meets = ratio <= POD_CACHE_GOAL
        print(
            f"== hgx-h100 with 250 pods in the cache: median p50/floor ratio {ratio:.2f} "
            f"(goal <= {POD_CACHE_GOAL}: {'met' if meets else 'MISSED'}); worst p99 "
            f"{max(r.p99 for r in rows):.3f} ms"
        )
        failed |= not meets and not quick
    print()
    print("Allocate end to end over gRPC (ms); floor = servicer returning the same shape")
    for name, result in results.items():
        for row in result.allocate:
            print_row(row)
        ratio = statistics.median(row.ratio for row in result.allocate)
        print(
            f"== {name}: worst p99 {max(r.p99 for r in result.allocate):.3f} ms; "
            f"median p50/floor ratio {ratio:.2f}"
        )
    print()
    for name, result in results.items():
        print(f"{name}: {result.drift}; shutdown {result.shutdown_ms:.0f} ms")
    print()
    placed_well = cluster_bench(seeds=1 if quick else 3, events=80 if quick else 300)
    return failed or (not placed_well and not quick)


def main() -> int:
    args = _parser().parse_args()
    return _run(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--iterations", type=int, default=400)
    parser.add_argument("--quick", action="store_true", help="few iterations (smoke test)")
    parser.add_argument(
        "--node",
        choices=sorted(GOALS_MS),
        action="append",
        help="only these nodes (and no NVLink layout unless --nvlink names some)",
    )
    parser.add_argument(
        "--nvlink",
        choices=NVLINK_LAYOUTS,
        action="append",
        help="only these NVLink layouts (and no other node unless --node names some)",
    )
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="the cluster run with real daemons and the extender (alone unless --node or "
        "--nvlink names more; a full run includes it, --quick leaves it out)",
    )
    parser.add_argument(
        "--extender",
        action="store_true",
        help="the extender at 100 / 1,000 / 5,000 nodes (alone unless others are named; a "
        "full run includes it; with --quick, 100 nodes only)",
    )
    parser.add_argument(
        "--idle",
        action="store_true",
        help="an idle daemon's CPU, memory and threads on 8 and 64 GPUs (alone unless others "
        "are named; a full run includes it, --quick leaves it out)",
    )
    parser.add_argument(
        "--dra",
        action="store_true",
        help="DRA alignment of the chart's claim templates on five layouts (alone unless "
        "others are named; a full run includes it)",
    )
    parser.add_argument(
        "--fleet",
        action="store_true",
        help="API traffic per node, idle and under churn (alone unless others are named; "
        "a full run includes it, --quick leaves it out)",
    )
    parser.add_argument(
        "--mig",
        action="store_true",
        help="MIG devices paired with HCAs by a real daemon against the exhaustive optimum "
        "(alone unless others are named; a full run includes it)",
    )
    parser.add_argument(
        "--scheduler",
        action="store_true",
        help="the extender's cost inside a real kube-scheduler at 1,000 and 5,000 nodes "
        "(alone unless others are named; a full run includes it, --quick leaves it out)",
    )
    parser.add_argument(
        "--preemption",
        action="store_true",
        help="victims for priority pods, count-only against the extender's (alone unless "
        "others are named; a full run includes it)",
    )
    return parser


def _run(args: argparse.Namespace) -> int:
    iterations, warmup = (20, 5) if args.quick else (args.iterations, 50)
    selected = (
        args.node is not None
        or args.nvlink is not None
        or args.cluster
        or args.fleet
        or args.extender
        or args.idle
        or args.dra
        or args.preemption
        or args.mig
        or args.scheduler
    )
    nodes = [n for n in GOALS_MS if n in (args.node or ([] if selected else GOALS_MS))]
    layouts = args.nvlink or ([] if selected else list(NVLINK_LAYOUTS))
    quick = args.quick
    full = not (selected or quick)

    def nvlink() -> bool:
        # 200 calls per size: a p99 is then the third slowest, not one hiccup's.
        calls = iterations if quick else max(200, iterations // 2)
        return nvlink_section(layouts, calls, min(warmup, 10), base) or quick

    def live() -> bool:
        met = live_cluster_bench(quick=quick)
        print()
        return dra_live_bench(quick=quick) and met

    # In order: (runs, the section; False when its goal is not met).
    sections: list[tuple[bool, Callable[[], bool]]] = [
        (bool(nodes), lambda: not node_sections(nodes, quick, iterations, warmup, base)),
        (bool(layouts), nvlink),
        (args.cluster or full, live),
        (args.fleet or full, lambda: fleet_bench(quick=quick)),
        (args.extender or full, lambda: extender_scale_bench(quick=quick)),
        (args.scheduler or full, scheduler_cost_bench),
        (args.idle or full, lambda: idle_bench(quick=quick)),
        (args.dra or not selected, lambda: dra_bench(quick=quick)),
        (args.preemption or not selected, lambda: preemption_bench(quick=quick)),
        (args.mig or not selected, lambda: mig_bench(quick=quick)),
    ]
    setup_logging("text", "error")
    base = Path(tempfile.mkdtemp(prefix="dpb-", dir="/tmp"))
    failed = False
    ran = False
    try:
        for runs, section in sections:
            if not runs:
                continue
            if ran:
                print()
            ran = True
            failed |= not section()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
