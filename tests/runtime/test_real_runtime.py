"""The real-runtime tier: what the daemon answers, run by podman and runc.

A pod's Allocate answers (CDI names for both resources, `cdi-cri`) and
each DRA claim's CDI ids become `podman run --device ...`; the container's
character devices (path and numbers) and its variables must be exactly
those of the devices the daemon chose, worked out here from the simulated
node, not from the daemon's specs. Skipped, with the reason, where podman,
runc or root are missing; `.ci/run` installs what it needs.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from devplugin.policy.cdi import SpecError, validate_spec
from devplugin.testing.cdi import (
    CdiRuntime,
    Unresolvable,
    nvidia_like_spec,
    realize,
    write_spec,
)
from devplugin.testing.dra_kubelet import container_cdi_ids
from devplugin.testing.kubelet import ContainerRequest
from devplugin.testing.layouts import LAYOUTS
from devplugin.testing.oci_image import Seen
from tests.conftest import GPU, HCA, Cluster
from tests.dra_support import DraCluster, start_dra
from tests.real_runtime import (
    CDI_DIRS,
    Podman,
    expected_nodes,
    ib_names,
    podman,
    vendor,
)
from tests.waiting import wait_until

__all__ = ["podman", "start_dra", "vendor"]

pytestmark = pytest.mark.real_runtime

# -- device plugin: Allocate answers with CDI names ----------------------------------


def dp_cluster(start_cluster: Callable[..., Cluster], layout: str, vendor: str) -> Cluster:
    cluster = start_cluster(
        LAYOUTS[layout](),
        wait=False,
        on_built=realize,
        **{
            "resources.gpu.device_list_strategy": ["cdi-cri"],
            "resources.hca.device_list_strategy": ["cdi-cri"],
            "cdi.gpu_kind": f"{vendor}/gpu",
            "cdi.hca_kind": f"{vendor}/hca",
            "cdi.spec_dirs": [str(d) for d in CDI_DIRS],
        },
    )
    node = cluster.node
    # What NVIDIA's toolkit would have written for this node's GPUs.
    write_spec(
        CDI_DIRS[0],
        f"{vendor}-gpu.json",
        nvidia_like_spec(node, kind=f"{vendor}/gpu", host_dev=node.dev_root, driver_files=False),
    )
    kubelet = cluster.kubelet
    assert kubelet.wait_for(lambda: healthy(cluster, GPU) == len(node.gpus), 10)
    assert kubelet.wait_for(lambda: healthy(cluster, HCA) == len(node.hcas), 10)
    return cluster


def healthy(cluster: Cluster, resource: str) -> int:
    return sum(d.health == "Healthy" for d in cluster.kubelet.devices(resource).values())


SHAPES = [(2, 2), (1, 1), (4, 2), (1, 0), (0, 1), (8, 4)]


@pytest.mark.parametrize("layout", ["hgx-h100", "pcie-server"])
def test_allocate_answers_start_containers_with_exactly_the_chosen_devices(
    start_cluster: Callable[..., Cluster], podman: Podman, vendor: str, layout: str
) -> None:
    cluster = dp_cluster(start_cluster, layout, vendor)
    node = cluster.node
    for index, (most_gpus, most_hcas) in enumerate(SHAPES):
        gpus, hcas = min(most_gpus, len(node.gpus)), min(most_hcas, len(node.hcas))
        requests = {k: v for k, v in ((GPU, gpus), (HCA, hcas)) if v}
        pod = cluster.kubelet.admit(f"p{index}", [ContainerRequest("main", requests)])
        got = pod.container("main")
        names: list[str] = []
        env: dict[str, str] = {}
        for response in got.responses.values():
            assert list(response.devices) == []  # CDI only
            names += [device.name for device in response.cdi_devices]
            env.update(response.envs)
        seen = podman.added(podman.run(names, env))
        chosen_gpus, chosen_hcas = got.devices.get(GPU, ()), got.devices.get(HCA, ())
        assert dict(seen.nodes) == expected_nodes(node, chosen_gpus, chosen_hcas), requests
        wanted = {}
        if chosen_gpus:
            wanted["NVIDIA_VISIBLE_DEVICES"] = "void"  # the toolkit's spec says so
        if chosen_hcas:
            wanted["NCCL_IB_HCA"] = ib_names(node, chosen_hcas)
        assert dict(seen.env) == wanted
        cluster.kubelet.remove(f"p{index}")


def test_a_container_holding_an_hca_restarts_while_no_daemon_runs(
    start_cluster: Callable[..., Cluster], podman: Podman, vendor: str
) -> None:
    cluster = dp_cluster(start_cluster, "hgx-h100", vendor)
    pod = cluster.kubelet.admit("p", [ContainerRequest("main", {HCA: 2})])
    response = pod.container("main").responses[HCA]
    names = [device.name for device in response.cdi_devices]
    before = podman.added(podman.run(names))
    cluster.daemon.stop()  # a rollout: the old daemon stops cleanly
    after = podman.added(podman.run(names))
    assert after == before
    assert len(after.nodes) >= 3


# -- DRA: each claim's CDI ids, per container -----------------------------------------


def dra_cluster(
    start: Callable[..., DraCluster], layout: str, vendor: str, **extra: Any
) -> DraCluster:
    cluster = start(
        LAYOUTS[layout](),
        on_built=realize,
        **{
            "dra.driver": vendor,
            "cdi.spec_dirs": [str(d) for d in CDI_DIRS],
            **extra,
        },
    )
    count = len(cluster.node.gpus) + len(cluster.node.hcas)
    assert wait_until(lambda: len(cluster.devices()) == count, timeout=10)
    return cluster


def uuid_of(cluster: DraCluster, device: str) -> str:
    return str(cluster.attribute(device, "uuid"))


def hca_id(cluster: DraCluster, device: str) -> str:
    return str(cluster.attribute(device, "resource.kubernetes.io/pciBusID"))


def closest_pairs(cluster: DraCluster, count: int) -> list[tuple[str, str]]:
    """`count` (gpu, hca) pairs, each on one switch where the node has one."""
    devices = cluster.devices()
    gpus = sorted(name for name in devices if name.startswith("gpu-"))
    hcas = sorted(name for name in devices if name.startswith("hca-"))
    found: list[tuple[str, str]] = []
    for gpu in gpus:
        switch = cluster.attribute(gpu, "pcieSwitch")
        free = [h for h in hcas if all(h != taken for _, taken in found)]
        near = [h for h in free if cluster.attribute(h, "pcieSwitch") == switch]
        if near or free:
            found.append((gpu, (near or free)[0]))
        if len(found) == count:
            break
    return found


def run_container(podman: Podman, devices: list[dict[str, Any]], *requests: str) -> Seen:
    ids: list[str] = []
    for request in requests or ("",):
        ids += container_cdi_ids(devices, request)
    return podman.added(podman.run(ids))


def wanted(
    cluster: DraCluster, gpus: list[str], hcas: list[str]
) -> tuple[dict[str, tuple[int, int]], dict[str, str]]:
    node = cluster.node
    uuids, ids = [uuid_of(cluster, g) for g in gpus], [hca_id(cluster, h) for h in hcas]
    env = {}
    if uuids:
        env["NVIDIA_VISIBLE_DEVICES"] = ",".join(uuids)
    if ids:
        env["NCCL_IB_HCA"] = ib_names(node, ids)
    return expected_nodes(node, uuids, ids), env


@pytest.mark.parametrize("layout", ["hgx-h100", "pcie-server"])
def test_claim_cdi_ids_start_containers_with_exactly_the_requests_devices(
    start_dra: Callable[..., DraCluster], podman: Podman, vendor: str, layout: str
) -> None:
    cluster = dra_cluster(start_dra, layout, vendor)
    (gpu0, hca0), (gpu1, hca1) = closest_pairs(cluster, 2)
    # The chart's 2-pair shape: each pair split in a GPU and an HCA request.
    pairs = cluster.claim(
        "pairs", [("gpu-0/pix", gpu0), ("hca-0", hca0), ("gpu-1/any", gpu1), ("hca-1", hca1)]
    )
    answer = cluster.prepare(pairs)[pairs.uid]
    assert answer["error"] == ""
    devices = answer["devices"]
    cases = {
        (): ([gpu0, gpu1], [hca0, hca1]),
        ("hca-0",): ([], [hca0]),
        ("gpu-1",): ([gpu1], []),
        ("gpu-0", "hca-0"): ([gpu0], [hca0]),
        ("hca-0", "hca-1"): ([], [hca1]),  # two of one kind: the later one's variable
    }
    for requests, (gpus, hcas) in cases.items():
        seen = run_container(podman, devices, *requests)
        nodes, env = wanted(cluster, gpus, hcas)
        if requests == ("hca-0", "hca-1"):
            nodes = wanted(cluster, [], [hca0, hca1])[0]
        assert dict(seen.nodes) == nodes, requests
        assert dict(seen.env) == env, requests
    # Unprepared: the spec is gone, and so are the names.
    assert cluster.unprepare(pairs)[pairs.uid] == ""
    assert podman.refuses(container_cdi_ids(devices, "")) is not None
    # The same devices again, in a claim with one request of each kind.
    counted = cluster.claim(
        "counted", [("gpus", gpu0), ("gpus", gpu1), ("hcas", hca0), ("hcas", hca1)]
    )
    answer = cluster.prepare(counted)[counted.uid]
    assert answer["error"] == ""
    for requests, (gpus, hcas) in {
        (): ([gpu0, gpu1], [hca0, hca1]),
        ("hcas",): ([], [hca0, hca1]),
        ("gpus",): ([gpu0, gpu1], []),
    }.items():
        seen = run_container(podman, answer["devices"], *requests)
        nodes, env = wanted(cluster, gpus, hcas)
        assert (dict(seen.nodes), dict(seen.env)) == (nodes, env), requests


def test_a_claim_prepared_before_a_reboot_starts_containers_after_it(
    start_dra: Callable[..., DraCluster], podman: Podman, vendor: str, tmp_path: Path
) -> None:
    boot = tmp_path / "boot_id"
    boot.write_text("aaaaaaaa-0000-0000-0000-000000000001\n")
    settings = {"paths.boot_id": str(boot), "lifecycle.checkpoint_file": str(tmp_path / "cp.json")}
    first = dra_cluster(start_dra, "hgx-h100", vendor, known_clean=False, **settings)
    ((gpu, hca),) = closest_pairs(first, 1)
    claim = first.claim("pair", [("gpu", gpu), ("hca", hca)])
    answer = first.prepare(claim)[claim.uid]
    ids = container_cdi_ids(answer["devices"])
    assert podman.refuses(ids) is None
    first.daemon.stop()
    first.kubelet.stop()
    # The reboot: /var/run/cdi emptied (of this test's specs), a new boot id.
    for path in CDI_DIRS[1].iterdir():
        if vendor in path.name:
            path.unlink()
    assert podman.refuses(ids) is not None
    boot.write_text("aaaaaaaa-0000-0000-0000-000000000002\n")
    second = dra_cluster(start_dra, "hgx-h100", vendor, known_clean=False, **settings)
    again = second.prepare(claim)[claim.uid]
    assert again == answer
    seen = run_container(podman, again["devices"])
    assert (dict(seen.nodes), dict(seen.env)) == wanted(second, [gpu], [hca])


# -- the spec rules, held against the real library -------------------------------------


def spec(**device_node: Any) -> dict[str, Any]:
    node = {"path": "/dev/x", **device_node}
    edits = {"deviceNodes": [node]}
    return {
        "cdiVersion": "0.5.0",
        "kind": "KIND",
        "devices": [{"name": "d", "containerEdits": edits}],
    }


CASES: dict[str, Callable[[Path], dict[str, Any]]] = {
    "numbered": lambda _: spec(type="c", major=1, minor=3, permissions="rw"),
    "permissions none": lambda _: spec(type="c", major=1, minor=3, permissions="none"),
    "permissions rwm": lambda _: spec(type="c", major=1, minor=3, permissions="rwm"),
    "version 1.1.0": lambda _: {**spec(type="c", major=1, minor=3), "cdiVersion": "1.1.0"},
    "unknown field": lambda _: {**spec(type="c", major=1, minor=3), "extra": 1},
    "host path that exists": lambda dev: spec(hostPath=str(dev / "null")),
    "host path that is missing": lambda dev: spec(hostPath=str(dev / "absent")),
    "path only, missing on the host": lambda _: spec(),
    "a device that edits nothing": lambda _: {
        "cdiVersion": "0.5.0",
        "kind": "KIND",
        "devices": [{"name": "d"}],
    },
    # The library at 0.5.2 (podman 4.3.1) panics on a one-letter class.
    "a one-letter class": lambda _: {**spec(type="c", major=1, minor=3), "kind": "KIND-x"},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_resolver_refuses_exactly_what_the_real_runtime_refuses(
    podman: Podman, vendor: str, tmp_path: Path, case: str
) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "null").write_text("c 1:3\n")  # the simulated tree's way of saying "device"
    real = tmp_path / "real"
    real.mkdir()
    os.mknod(real / "null", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    kind = f"{vendor}/dev"

    def made(root: Path) -> dict[str, Any]:
        text = json.dumps(CASES[case](root))
        return dict(json.loads(text.replace("KIND-x", f"{vendor}/x").replace("KIND", kind)))

    document = made(real)
    kind = document["kind"]
    write_spec(CDI_DIRS[1], f"{vendor}-dev.json", document)
    podman_says = podman.refuses([f"{kind}=d"])
    # The model: validation, then the host lookup of nodes named by path.
    modelled = made(dev)
    ours: str | None = None
    try:
        validate_spec(modelled)
        write_spec(tmp_path / "cdi", "x.json", modelled)
        CdiRuntime([tmp_path / "cdi"], host_dev=dev).resolve([f"{kind}=d"])
    except (SpecError, Unresolvable) as exc:
        ours = str(exc)
    assert (ours is None) == (podman_says is None), (case, ours, podman_says)
