"""The NodeDevices record and the pod events, written by the real daemon to the
API server imitation over HTTP, checked against the CRD the chart ships."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from devplugin.picture import HEALTH_FILL
from devplugin.testing.apiserver import ApiServerImitation
from devplugin.testing.kubelet import ContainerRequest
from devplugin.testing.node import hgx_node
from tests.conftest import GPU, HCA, Cluster
from tests.extender_support import inventory
from tests.extender_support import record as extender_record
from tests.waiting import wait_until

Start = Callable[..., Cluster]
CRD = Path(__file__).resolve().parents[2] / "charts/devplugin/crds/nodedevices.yaml"
FAST = {"kubernetes.record_min_interval_seconds": 0.2, "kubernetes.record_resync_seconds": 0.5}


def schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = crd["spec"]["versions"]
    found: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return found


def record(api: ApiServerImitation) -> dict[str, Any] | None:
    return api.get("nodedevices", "node-1")


def status(api: ApiServerImitation) -> dict[str, Any]:
    found = record(api)
    return (found or {}).get("status") or {}


def test_the_crd_names_the_record_and_prints_useful_columns() -> None:
    crd = yaml.safe_load(CRD.read_text())
    assert crd["spec"]["group"] == "devplugin.io"
    assert crd["spec"]["scope"] == "Cluster"
    assert crd["spec"]["names"]["plural"] == "nodedevices"
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1"
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["GPUs-Free"] == ".status.summary.gpusFree"
    assert columns["HCAs"] == ".status.summary.hcasTotal"
    assert columns["Unhealthy"] == ".status.summary.unhealthy"
    assert columns["Age"] == ".metadata.creationTimestamp"
    jsonschema.Draft7Validator.check_schema(schema())


def test_the_daemon_publishes_a_valid_record_owned_by_its_node(
    start_cluster: Start, api: ApiServerImitation
) -> None:
    api.put("nodes", {"metadata": {"name": "node-1", "uid": "node-uid-1"}})
    cluster = start_cluster(hgx_node(), api=api, **FAST)
    assert wait_until(lambda: status(api).get("summary", {}).get("gpusTotal") == 8, timeout=10)
    assert wait_until(lambda: status(api)["conditions"][0]["status"] == "True", timeout=10)
    found = record(api)
    assert found is not None
    jsonschema.validate(found, schema())
    assert found["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": "node-1", "uid": "node-uid-1"}
    ]
    devices = {d["id"]: d for d in found["status"]["devices"]}
    assert len(devices) == len(cluster.node.gpus) + len(cluster.node.hcas)
    gpu = next(d for d in devices.values() if d["kind"] == "gpu")
    assert gpu["health"] == "Healthy"
    assert gpu["topologyPath"][0].startswith("numa")
    assert len(gpu["topologyPath"]) == 4
    # What each device is: the GPU's product and memory (this fixture gives
    # no compute capability: none is claimed), each HCA port's link and rate.
    assert (gpu["product"], gpu["memoryMiB"]) == ("NVIDIA H100 80GB HBM3", 81559)
    assert "computeCapability" not in gpu
    assert "family" not in gpu
    hca = next(d for d in devices.values() if d["kind"] == "hca")
    assert hca["ports"]
    assert all(p["linkLayer"] and p["rate"] for p in hca["ports"])
    # HCAs under the same switch as a GPU share its whole path (PIX).
    assert any(
        d["topologyPath"] == hca["topologyPath"] for d in devices.values() if d["kind"] == "gpu"
    )
    assert found["status"]["summary"] == {
        "gpusFree": 8,
        "gpusTotal": 8,
        "hcasFree": 8,
        "hcasTotal": 8,
        "unhealthy": 0,
    }


def test_the_cli_draws_a_live_daemons_record_from_the_api(
    start_cluster: Start, api: ApiServerImitation, tmp_path: Path
) -> None:
    api.put("nodes", {"metadata": {"name": "node-1", "uid": "node-uid-1"}})
    cluster = start_cluster(hgx_node(), api=api, **FAST)
    kubelet = cluster.kubelet
    kubelet.admit("train", [ContainerRequest("c", {GPU: 4, HCA: 2})], order=[GPU, HCA])
    kubelet.admit("infer", [ContainerRequest("c", {GPU: 1, HCA: 1})], order=[GPU, HCA])
    hca = cluster.node.hcas[7]
    (hca.directory / "infiniband" / hca.name / "ports" / "1" / "state").write_text("1: DOWN\n")
    assert wait_until(
        lambda: (
            len(status(api).get("allocations", [])) == 2
            and status(api)["summary"]["unhealthy"] == 1
        ),
        timeout=10,
    )
    sick = next(d for d in status(api)["devices"] if d["id"] == hca.device_id)
    assert sick["ports"][0]["state"] == "1: DOWN"
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(api.kubeconfig()))

    def draw(node: str) -> subprocess.CompletedProcess[str]:
        command = ["topo", "--node", node, "--kubeconfig", str(kubeconfig), "--format", "dot"]
        return subprocess.run(
            [sys.executable, "-m", "devplugin", *command],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    done = draw("node-1")
    assert done.returncode == 0, done.stderr
    source = done.stdout
    # Each held device and the legend name the holder.
    assert source.count("held by default/train") == 6 + 1
    assert source.count("held by default/infer") == 2 + 1
    line = next(row for row in source.splitlines() if row.startswith(f'  "hca:{hca.device_id}"'))
    assert HEALTH_FILL["Unhealthy"] in line
    assert "1: DOWN" in line
    assert "node-1: 3/8 GPUs and 5/8 HCAs free, 1 unhealthy" in source
    absent = draw("node-9")
    assert absent.returncode == 1
    assert "NodeDevices node-9" in absent.stderr


def test_a_gpu_whose_compute_capability_nvml_tells_gets_it_and_its_family(
    tmp_path: Path,
) -> None:
    inv = inventory("hgx-h100", tmp_path)
    gpus = tuple(dataclasses.replace(g, compute_capability=(9, 0)) for g in inv.gpus)
    found = extender_record(dataclasses.replace(inv, gpus=gpus))
    devices = schema()["properties"]["status"]["properties"]["devices"]
    jsonschema.validate(found["status"]["devices"], devices)
    described = [d for d in found["status"]["devices"] if d["kind"] == "gpu"]
    assert {(d["computeCapability"], d["family"]) for d in described} == {("9.0", "hopper")}


def test_an_allocation_reaches_the_record_within_two_seconds_with_an_event(
    start_cluster: Start, api: ApiServerImitation
) -> None:
    cluster = start_cluster(hgx_node(), api=api, **FAST)
    assert wait_until(lambda: status(api).get("summary", {}).get("gpusFree") == 8, timeout=10)
    started = time.monotonic()
    pod = cluster.kubelet.admit("train", [ContainerRequest("main", {GPU: 4, HCA: 4})])
    assert wait_until(lambda: status(api)["summary"]["gpusFree"] == 4, timeout=5)
    assert time.monotonic() - started < 2.0
    (allocation,) = status(api)["allocations"]
    got = pod.container("main").devices
    assert allocation["namespace"] == "default"
    assert allocation["pod"] == "train"
    assert allocation["container"] == "main"
    assert sorted(allocation["devices"]) == sorted([*got[GPU], *got[HCA]])
    assert allocation["worstLevel"] == "PIX"
    jsonschema.validate(record(api), schema())
    # kubectl describe pod shows what the container got.
    assert wait_until(lambda: len(api.items("events")) == 1, timeout=5)
    (event,) = api.items("events")
    assert event["reason"] == "Aligned"
    assert event["message"].startswith("Aligned: 4 GPUs + 4 HCAs, worst GPU-HCA level PIX")
    pod_object = api.get("pods", "train", "default")
    assert pod_object is not None
    assert event["involvedObject"]["uid"] == pod_object["metadata"]["uid"]
    assert event["involvedObject"]["name"] == "train"
    assert event["type"] == "Normal"


def test_unhealthy_devices_and_a_lost_kubelet_show_in_the_record(
    start_cluster: Start, api: ApiServerImitation
) -> None:
    cluster = start_cluster(hgx_node(), api=api, **FAST)
    assert wait_until(lambda: status(api).get("summary", {}).get("unhealthy") == 0, timeout=10)
    cluster.nvml.inject_xid(2, 79)
    assert wait_until(lambda: status(api)["summary"]["unhealthy"] == 1, timeout=5)
    bad = [d for d in status(api)["devices"] if d["health"] == "Unhealthy"]
    assert [d["kind"] for d in bad] == ["gpu"]
    cluster.kubelet.stop()
    assert wait_until(lambda: status(api)["conditions"][0]["status"] == "False", timeout=5)
    assert "not registered" in status(api)["conditions"][0]["message"]


def test_a_deleted_record_is_recreated(start_cluster: Start, api: ApiServerImitation) -> None:
    start_cluster(hgx_node(), api=api, **FAST)
    assert wait_until(lambda: bool(status(api).get("devices")), timeout=10)
    api.remove("nodedevices", "node-1")
    # Nothing changed on the node: the periodic read finds it gone.
    assert wait_until(lambda: bool(status(api).get("devices")), timeout=5)


def test_a_conflicting_write_is_read_again_and_retried(
    start_cluster: Start, api: ApiServerImitation
) -> None:
    settings = {**FAST, "kubernetes.record_resync_seconds": 600}
    cluster = start_cluster(hgx_node(), api=api, **settings)
    assert wait_until(lambda: bool(status(api).get("devices")), timeout=10)
    # Someone else writes the record (a newer resourceVersion) just before
    # the daemon's next write: the 409 is answered by reading and retrying.
    found = record(api)
    assert found is not None
    found["metadata"]["labels"] = {"touched": "yes"}
    api.put("nodedevices", found)
    cluster.kubelet.admit("p", [ContainerRequest("main", {GPU: 1})])
    assert wait_until(lambda: status(api)["summary"]["gpusFree"] == 7, timeout=5)
    metrics = cluster.daemon.core.metrics.record_writes
    assert metrics.labels("conflict")._value.get() >= 1
    labels = (record(api) or {})["metadata"].get("labels", {})
    assert labels.get("touched") == "yes"


@pytest.mark.parametrize("code", [500, 403])
def test_a_failing_api_server_delays_the_record_but_never_allocation(
    start_cluster: Start, api: ApiServerImitation, code: int
) -> None:
    cluster = start_cluster(hgx_node(), api=api, **FAST)
    assert wait_until(lambda: bool(status(api).get("devices")), timeout=10)
    api.fail_next(10_000, code=code)
    pod = cluster.kubelet.admit("p", [ContainerRequest("main", {GPU: 2, HCA: 1})])
    assert len(pod.container("main").devices[GPU]) == 2
    assert wait_until(
        lambda: cluster.daemon.core.metrics.record_writes.labels("error")._value.get() >= 1,
        timeout=5,
    )
    api.clear_failures()
    assert wait_until(lambda: status(api)["summary"]["gpusFree"] == 6, timeout=10)


def test_record_writes_are_rate_limited_and_the_last_state_lands(
    start_cluster: Start, api: ApiServerImitation
) -> None:
    cluster = start_cluster(hgx_node(), api=api, **{"kubernetes.record_min_interval_seconds": 1.0})
    assert wait_until(lambda: status(api).get("summary", {}).get("gpusFree") == 8, timeout=10)
    publisher = next(loop for loop in cluster.daemon.cluster_loops if hasattr(loop, "writes"))
    writes, started = publisher.writes, time.monotonic()
    for index in range(8):
        cluster.kubelet.admit(f"p{index}", [ContainerRequest("main", {GPU: 1})])
        cluster.daemon.core.monitor.poke()
    assert wait_until(lambda: status(api)["summary"]["gpusFree"] == 0, timeout=10)
    elapsed = time.monotonic() - started
    # Eight changes, at most one write per second (plus the one in flight).
    assert publisher.writes - writes <= int(elapsed / 1.0) + 2
    assert len(status(api)["allocations"]) == 8


def test_a_release_reaches_the_record_within_a_second_of_the_pod_event_not_a_poll(
    start_cluster: Start, api: ApiServerImitation
) -> None:
    # PodResources polls far apart: only Allocate and the pod watch move things.
    cluster = start_cluster(
        hgx_node(),
        api=api,
        **{
            "pod_resources.poll_interval_seconds": 60,
            "pod_resources.min_interval_seconds": 60,
        },
    )
    monitor = cluster.daemon.core.monitor
    assert wait_until(lambda: monitor.polls >= 1 and bool(status(api).get("devices")), timeout=10)
    polls = monitor.polls
    latencies = []
    for index in range(2):
        name = f"p{index}"
        cluster.kubelet.admit(name, [ContainerRequest("main", {GPU: 2, HCA: 2})])

        def shows(name: str = name) -> bool:
            return any(a["pod"] == name for a in status(api).get("allocations", []))

        assert wait_until(shows, timeout=5)
        started = time.monotonic()
        cluster.kubelet.remove(name)
        assert wait_until(lambda shows=shows: not shows(), timeout=5)
        latencies.append(time.monotonic() - started)
    assert monitor.polls == polls  # no PodResources answer was needed
    # At most one write per second: a release right after a write waits for it.
    assert max(latencies) < 1.5, latencies
    assert status(api)["summary"]["gpusFree"] == 8


def test_under_churn_the_record_is_written_at_most_once_a_second_and_lands(
    start_cluster: Start, api: ApiServerImitation
) -> None:
    cluster = start_cluster(hgx_node(), api=api)
    assert wait_until(lambda: status(api).get("summary", {}).get("gpusFree") == 8, timeout=10)
    writes = cluster.daemon.core.metrics.record_writes.labels("ok")
    before, started = writes._value.get(), time.monotonic()
    live: list[str] = []
    for index in range(60):  # pods 20 ms apart, each deleted four arrivals later
        name = f"c{index}"
        cluster.kubelet.admit(name, [ContainerRequest("main", {GPU: 2, HCA: 2})])
        live.append(name)
        if len(live) > 3:
            cluster.kubelet.remove(live.pop(0))
        time.sleep(0.02)
    remaining = set(live)
    assert wait_until(
        lambda: {a["pod"] for a in status(api).get("allocations", [])} == remaining, timeout=5
    )
    elapsed = time.monotonic() - started
    written = writes._value.get() - before
    assert written <= int(elapsed) + 1, (written, elapsed)
    assert written >= 2  # it did follow along, not only at the end


def test_an_idle_daemon_renews_its_lease_and_never_rewrites_its_record(
    start_cluster: Start, api: ApiServerImitation
) -> None:
    api.put("nodes", {"metadata": {"name": "node-1", "uid": "node-uid-1"}})
    cluster = start_cluster(
        hgx_node(),
        api=api,
        **{
            "kubernetes.lease_renew_seconds": 0.2,
            "kubernetes.record_resync_seconds": 0.3,
            "kubernetes.lease_namespace": "gpu-infra",
        },
    )
    registered = [{"type": "Registered", "status": "True"}]
    assert wait_until(
        lambda: (
            [{k: c[k] for k in ("type", "status")} for c in status(api).get("conditions", [])]
            == registered
        ),
        timeout=10,
    )
    # Everything learnt: the NUMA nodes come from the PodResources poll's
    # loop, which a loaded runner may first run after the first write.
    assert wait_until(lambda: "numaNodes" in status(api), timeout=10)
    lease = next(loop for loop in cluster.daemon.cluster_loops if hasattr(loop, "renewals"))
    assert wait_until(lambda: lease.renewals >= 2, timeout=10)
    writes = len([r for r in api.requests if r[0] == "PUT" and "nodedevices" in r[1]])
    renewals = lease.renewals
    # Idle for a while: read back several times, renewed many, written never.
    assert wait_until(lambda: lease.renewals >= renewals + 8, timeout=10)
    assert len([r for r in api.requests if r[0] == "PUT" and "nodedevices" in r[1]]) == writes
    found = api.get("leases", "devplugin-node-1", "gpu-infra")
    assert found is not None
    assert found["metadata"]["labels"] == {"devplugin.io/node": "node-1"}
    assert found["spec"]["holderIdentity"] == "node-1"
    assert found["spec"]["leaseDurationSeconds"] == 40
    assert found["metadata"]["ownerReferences"][0]["kind"] == "Node"
    # A change is still written at once.
    cluster.kubelet.admit("p", [ContainerRequest("main", {GPU: 1})])
    assert wait_until(lambda: status(api)["summary"]["gpusFree"] == 7, timeout=5)
