"""The HTTP endpoint: metrics that move, and probes that tell the truth."""

from __future__ import annotations

import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from devplugin.api import deviceplugin_v1beta1_pb2 as pb
from devplugin.testing.kubelet import ContainerRequest
from devplugin.testing.node import hgx_node
from tests.conftest import GPU, HCA, Cluster
from tests.waiting import wait_until

Start = Callable[..., Cluster]


def url(cluster: Cluster, path: str) -> str:
    assert cluster.daemon.status is not None
    host, port = cluster.daemon.status.bound[0]
    return f"http://{host}:{port}{path}"


def get(cluster: Cluster, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url(cluster, path), timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def scrape(cluster: Cluster) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, text = get(cluster, "/metrics")
    assert status == 200
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_move_with_allocations_hooks_and_registrations(
    start_cluster: Start, tmp_path: Path
) -> None:
    hook = [sys.executable, "-c", "import sys; sys.stdin.read()"]
    cluster = start_cluster(hgx_node(), **{"resources.gpu.hooks.init": hook})
    before = scrape(cluster)
    assert value(before, "devplugin_devices", resource=GPU, health="Healthy") == 8
    assert value(before, "devplugin_devices", resource=HCA, health="Unhealthy") == 0
    assert value(before, "devplugin_registrations_total", resource=GPU) == 1
    cluster.kubelet.admit("p", [ContainerRequest("c", {GPU: 2, HCA: 2})], order=[GPU, HCA])
    assert wait_until(lambda: value(scrape(cluster), "devplugin_alignment_level_count") == 1)
    after = scrape(cluster)
    assert value(after, "devplugin_allocations_total", resource=GPU, result="ok") == 1
    assert value(after, "devplugin_allocations_total", resource=HCA, result="ok") == 1
    assert (
        value(
            after,
            "devplugin_preferred_allocation_requests_total",
            resource=GPU,
            role="first",
            result="ok",
        )
        == 1
    )
    assert (
        value(
            after,
            "devplugin_preferred_allocation_requests_total",
            resource=HCA,
            role="second",
            result="ok",
        )
        == 1
    )
    assert value(after, "devplugin_preferred_allocation_seconds_count", resource=GPU) == 1
    assert value(after, "devplugin_allocate_seconds_count", resource=HCA) == 1
    assert value(after, "devplugin_hook_runs_total", resource=GPU, phase="init", result="ok") == 1
    assert value(after, "devplugin_hook_duration_seconds_count", resource=GPU, phase="init") == 1
    # One container, aligned at PIX: in the lowest bucket, and in the gauge.
    assert value(after, "devplugin_alignment_level_bucket", le="1.0") == 1
    assert value(after, "devplugin_containers_by_alignment", level="PIX") == 1
    # A port goes down: the device gauge follows.
    hca = cluster.node.hcas[7]
    (hca.directory / "infiniband" / hca.name / "ports" / "1" / "state").write_text("1: DOWN\n")
    assert wait_until(
        lambda: value(scrape(cluster), "devplugin_devices", resource=HCA, health="Unhealthy") == 1
    )
    # A kubelet restart: both resources register again.
    cluster.kubelet.restart()
    assert wait_until(
        lambda: value(scrape(cluster), "devplugin_registrations_total", resource=HCA) == 2
    )


def test_refusals_are_counted(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node())
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=["x"])]
    )
    with pytest.raises(grpc.RpcError):
        cluster.kubelet.stub(GPU).Allocate(request, timeout=5)
    samples = scrape(cluster)
    assert value(samples, "devplugin_allocations_total", resource=GPU, result="refused") == 1
    assert value(samples, "devplugin_allocations_total", resource=GPU, result="ok") == 0


def test_readyz_follows_registration_and_healthz_the_process(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node(), start_kubelet=False)
    assert get(cluster, "/healthz") == (200, "ok\n")
    status, body = get(cluster, "/readyz")
    assert status == 503
    assert "not registered with the kubelet" in body
    cluster.kubelet.start()
    assert wait_until(lambda: get(cluster, "/readyz")[0] == 200)
    cluster.kubelet.stop()
    assert wait_until(lambda: get(cluster, "/readyz")[0] == 503)
    assert get(cluster, "/healthz")[0] == 200
    cluster.kubelet.start()
    assert wait_until(lambda: get(cluster, "/readyz")[0] == 200)
    assert get(cluster, "/nope")[0] == 404


def test_healthz_fails_when_a_grpc_server_is_down(start_cluster: Start) -> None:
    cluster = start_cluster(hgx_node())
    assert get(cluster, "/healthz")[0] == 200
    # The registrar restarts a server whose socket went (it takes that for a
    # kubelet restart) as soon as its directory watch fires; held still, the
    # server stays down long enough to be seen.
    cluster.daemon.registrar.stop()
    cluster.daemon.servers[0].stop()
    status, body = get(cluster, "/healthz")
    assert status == 503
    assert "gRPC server not running" in body
