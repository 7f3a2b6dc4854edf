"""What the daemon tells of its kubelet: the Topology and CPU Managers'
policies from the kubelet's config file (read again when it changes, its
own settings saying what flags set), the NUMA nodes and their CPUs from
sysfs, and the CPUs a static CPU manager can still give, from the
kubelet's PodResources; all in the record it would publish (/record)."""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from devplugin.api import deviceplugin_v1beta1_pb2 as pb
from devplugin.model import DeviceKind
from devplugin.testing.kubelet import ContainerRequest
from devplugin.testing.layouts import LAYOUTS
from tests.conftest import Cluster
from tests.waiting import wait_until

FAST = {"pod_resources.poll_interval_seconds": 0.1, "pod_resources.min_interval_seconds": 0.05}


def record(cluster: Cluster) -> dict[str, Any]:
    assert cluster.daemon.status is not None
    host, port = cluster.daemon.status.bound[0]
    with urllib.request.urlopen(f"http://{host}:{port}/record", timeout=5) as answer:
        found: dict[str, Any] = json.loads(answer.read())["status"]
    return found


def write(path: Path, settings: dict[str, Any]) -> None:
    body = {"apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            **settings}  # fmt: skip
    path.write_text(yaml.safe_dump(body))
    # A new mtime even within the file system's granularity.
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))


def test_the_record_says_the_kubelets_policies_numa_nodes_and_free_cpus(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    config = tmp_path / "kubelet.yaml"
    write(config, {"topologyManagerPolicy": "single-numa-node", "topologyManagerScope": "pod",
                   "cpuManagerPolicy": "static", "reservedSystemCPUs": "0"})  # fmt: skip
    cluster = start_cluster(LAYOUTS["hgx-h100"](), **{**FAST, "kubelet.config_file": str(config)})
    kubelet = cluster.kubelet
    # hgx-h100: NUMA 0 has CPUs 0-55, NUMA 1 56-111; CPU 0 reserved.
    kubelet.allocatable_cpus = frozenset(range(1, 112))
    expected = {
        "topologyManagerPolicy": "single-numa-node", "topologyManagerScope": "pod",
        "cpuManagerPolicy": "static", "source": f"the kubelet's config file {config}",
    }  # fmt: skip
    assert wait_until(lambda: record(cluster).get("kubelet") == expected, timeout=10)
    numa = [{"id": 0, "cpus": 56, "freeCpus": 55}, {"id": 1, "cpus": 56, "freeCpus": 56}]
    assert wait_until(lambda: record(cluster).get("numaNodes") == numa, timeout=10)
    # A container given CPUs 56-59 exclusively: the kubelet's List says so.
    kubelet.admit("pinned", [ContainerRequest("c", {"nvidia.com/gpu": 1})])
    kubelet.exclusive_cpus[("default", "pinned", "c")] = (56, 57, 58, 59)
    numa[1] = {"id": 1, "cpus": 56, "freeCpus": 52}
    assert wait_until(lambda: record(cluster)["numaNodes"] == numa, timeout=10)
    # The file changes: read again. A file that is not a KubeletConfiguration:
    # no policy said (nothing predicted), why in the source, still serving.
    write(config, {"topologyManagerPolicy": "restricted"})
    assert wait_until(
        lambda: record(cluster)["kubelet"].get("topologyManagerPolicy") == "restricted", 10
    )
    assert record(cluster)["kubelet"]["cpuManagerPolicy"] == "none"  # the kubelet's default
    assert "freeCpus" not in record(cluster)["numaNodes"][0]  # no static CPU manager
    config.write_text("topologyManagerPolicy: [strict\n")
    os.utime(config, ns=(0, config.stat().st_mtime_ns + 2 * 10**9))
    assert wait_until(lambda: "not YAML" in record(cluster)["kubelet"]["source"], timeout=10)
    assert "topologyManagerPolicy" not in record(cluster)["kubelet"]
    assert cluster.kubelet.registered("nvidia.com/gpu")


def test_the_daemons_settings_say_what_the_kubelets_flags_set(
    start_cluster: Callable[..., Cluster],
) -> None:
    cluster = start_cluster(
        LAYOUTS["hgx-h100"](),
        **FAST,
        **{
            "kubelet.topology_manager_policy": "single-numa-node",
            "kubelet.topology_manager_scope": "container",
        },
    )
    said = {"topologyManagerPolicy": "single-numa-node", "topologyManagerScope": "container",
            "source": "the daemon's kubelet settings"}  # fmt: skip
    assert wait_until(lambda: record(cluster).get("kubelet") == said, timeout=10)
    assert [n["id"] for n in record(cluster)["numaNodes"]] == [0, 1]


def test_a_kubelet_asking_within_its_numa_affinity_leaves_the_other_nodes_free(
    start_cluster: Callable[..., Cluster],
) -> None:
    """A Topology Manager narrows GetPreferredAllocation's available list to
    its affinity's NUMA nodes (devicemanager/manager.go devicesToAllocate):
    the devices left out elsewhere are not held by anyone. The daemon once
    took them as held and said so in its record (found on the real kubelet
    with single-numa-node)."""
    cluster = start_cluster(LAYOUTS["hgx-h100"](), **FAST)
    topology = cluster.daemon.core.coordinator.topology
    first = sorted(g.uuid for g in cluster.node.gpus if topology.numa_node(g.uuid) == 0)
    request = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(available_deviceIDs=first, allocation_size=2)
        ]
    )
    answer = cluster.kubelet.stub("nvidia.com/gpu").GetPreferredAllocation(request, timeout=5)
    assert set(answer.container_responses[0].deviceIDs) <= set(first)
    status = record(cluster)
    assert status["allocations"] == []
    assert status["summary"]["gpusFree"] == 8
    assert len(cluster.daemon.core.coordinator.free(DeviceKind.GPU)) == 8
