"""What each container of a DRA pod gets from a claim's CDI spec, as the
kubelet hands out CDI ids (per request) and a runtime applies them, and a
claim prepared before a reboot."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from devplugin.testing.cdi import CdiRuntime, Edits
from devplugin.testing.dra_kubelet import container_cdi_ids
from devplugin.testing.node import hgx_node
from tests.dra_support import DRIVER, DraCluster, published, start_dra
from tests.support import hook, runs
from tests.waiting import wait_until

__all__ = ["start_dra"]

Start = Callable[..., DraCluster]


def pairs(cluster: DraCluster, count: int) -> list[tuple[str, str]]:
    """`count` (gpu, hca) device names that share a PCIe switch."""
    devices = cluster.devices()
    found = []
    for gpu in sorted(name for name in devices if name.startswith("gpu-")):
        switch = cluster.attribute(gpu, "pcieSwitch")
        hca = next(
            (
                name
                for name in sorted(devices)
                if name.startswith("hca-")
                and cluster.attribute(name, "pcieSwitch") == switch
                and all(name != taken for _, taken in found)
            ),
            None,
        )
        if hca is not None:
            found.append((gpu, hca))
        if len(found) == count:
            return found
    raise AssertionError("not enough pairs")


def two_pair_claim(cluster: DraCluster) -> tuple[Any, list[tuple[str, str]]]:
    chosen = pairs(cluster, 2)
    results = []
    for i, (gpu, hca) in enumerate(chosen):
        results += [(f"gpu-{i}/pix", gpu), (f"hca-{i}", hca)]
    return cluster.claim("pairs", results), chosen


def container(cluster: DraCluster, devices: list[dict[str, Any]], *requests: str) -> Edits:
    """What a runtime applies to a container naming these requests of the
    claim (none: the whole claim)."""
    ids: list[str] = []
    for request in requests or ("",):
        ids += container_cdi_ids(devices, request)
    runtime = CdiRuntime([cluster.cdi_dir], host_dev=cluster.node.dev_root)
    return runtime.resolve(ids)


def gpu_nodes(cluster: DraCluster, names: list[str]) -> set[str]:
    uuids = {cluster.attribute(name, "uuid") for name in names}
    return {f"/dev/nvidia{g.minor}" for g in cluster.node.gpus if g.uuid in uuids}


def hca_names(cluster: DraCluster, names: list[str]) -> str:
    return "=" + ",".join(cluster.attribute(name, "ibdev") for name in names)


def test_each_container_gets_only_the_devices_and_variables_of_the_requests_it_names(
    start_dra: Start,
) -> None:
    cluster = start_dra(hgx_node())
    assert wait_until(lambda: published(cluster, 16), timeout=10)
    claim, chosen = two_pair_claim(cluster)
    answer = cluster.prepare(claim)[claim.uid]
    assert answer["error"] == ""
    devices = answer["devices"]
    (gpu0, hca0), (gpu1, hca1) = chosen
    uuid = {name: cluster.attribute(name, "uuid") for name in (gpu0, gpu1)}

    # One HCA request: its HCA's nodes and name, no GPU node, no GPU variable.
    only_hca = container(cluster, devices, "hca-0")
    paths = set(only_hca.nodes())
    assert not any(path.startswith("/dev/nvidia") for path in paths)
    assert "/dev/infiniband/rdma_cm" in paths
    assert only_hca.environment() == {"NCCL_IB_HCA": hca_names(cluster, [hca0])}
    assert {p for p in paths if "uverbs" in p} == {
        f"/dev/infiniband/uverbs{h.uverbs}"
        for h in cluster.node.hcas
        if h.name == cluster.attribute(hca0, "ibdev")
    }

    # One GPU request: its GPU and the control nodes, its UUID only.
    only_gpu = container(cluster, devices, "gpu-1")
    assert {p for p in only_gpu.nodes() if p.startswith("/dev/nvidia")} == gpu_nodes(
        cluster, [gpu1]
    ) | {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}
    assert not any(p.startswith("/dev/infiniband") for p in only_gpu.nodes())
    assert only_gpu.environment() == {"NVIDIA_VISIBLE_DEVICES": uuid[gpu1]}

    # A pair split in two requests, named together.
    pair = container(cluster, devices, "gpu-0", "hca-0")
    assert pair.environment() == {
        "NVIDIA_VISIBLE_DEVICES": uuid[gpu0],
        "NCCL_IB_HCA": hca_names(cluster, [hca0]),
    }

    # The whole claim: every device, and variables naming all of them.
    whole = container(cluster, devices)
    assert whole.environment() == {
        "NVIDIA_VISIBLE_DEVICES": f"{uuid[gpu0]},{uuid[gpu1]}",
        "NCCL_IB_HCA": hca_names(cluster, [hca0, hca1]),
    }
    assert gpu_nodes(cluster, [gpu0, gpu1]) <= set(whole.nodes())

    # Every node the daemon knows the number of is named whole: no lookup.
    spec = json.loads((cluster.cdi_dir / f"k8s.{DRIVER}-claim_{claim.uid}.json").read_text())
    for device in spec["devices"]:
        for node in device["containerEdits"].get("deviceNodes", []):
            if node["path"].startswith(("/dev/infiniband/", "/dev/nvidia")) and not (
                node["path"].startswith("/dev/nvidia-uvm") or node["path"] == "/dev/nvidiactl"
            ):
                assert node["type"] == "c", node
                assert node["major"] > 0, node
            assert node["permissions"] == "rw"
    minor = _minor(cluster, gpu0)
    assert whole.nodes()[f"/dev/nvidia{minor}"] == ("c", 195, minor)


def _minor(cluster: DraCluster, gpu: str) -> int:
    uuid = cluster.attribute(gpu, "uuid")
    return next(g.minor for g in cluster.node.gpus if g.uuid == uuid)


def test_a_node_named_by_path_only_fails_the_container_when_the_host_lacks_it(
    start_dra: Start,
) -> None:
    cluster = start_dra(hgx_node())
    assert wait_until(lambda: published(cluster, 16), timeout=10)
    claim, _ = two_pair_claim(cluster)
    devices = cluster.prepare(claim)[claim.uid]["devices"]
    # nvidiactl's number comes from the node itself (the simulated tree's
    # files are not character devices): named by path only, looked up.
    (cluster.node.dev_root / "nvidiactl").unlink()
    with pytest.raises(LookupError, match="nvidiactl"):
        container(cluster, devices, "gpu-0")
    # A container of the same claim with no GPU is not touched by it.
    assert container(cluster, devices, "hca-0").environment()


def test_a_claim_prepared_before_a_reboot_is_prepared_again(
    start_dra: Start, tmp_path: Path
) -> None:
    log = tmp_path / "init.log"
    boot = tmp_path / "boot_id"
    boot.write_text("11111111-1111-1111-1111-111111111111\n")
    checkpoint = tmp_path / "kept" / "checkpoint.json"
    settings = {
        "resources.gpu.hooks.init": hook(log, "ok"),
        "resources.hca.hooks.init": hook(log, "ok"),
        "paths.boot_id": str(boot),
        "lifecycle.checkpoint_file": str(checkpoint),
    }
    first = start_dra(hgx_node(), known_clean=False, **settings)
    assert wait_until(lambda: published(first, 16), timeout=10)
    claim, _ = two_pair_claim(first)
    answer = first.prepare(claim)[claim.uid]
    assert answer["error"] == ""
    assert len(runs(log)) == 2  # one init per kind
    spec_file = first.cdi_dir / f"k8s.{DRIVER}-claim_{claim.uid}.json"
    saved = json.loads(checkpoint.read_text())
    assert saved["claims"][0]["boot_id"] == "11111111-1111-1111-1111-111111111111"

    # The same boot, the daemon restarted: answered as before, nothing runs.
    first.daemon.stop()
    first.kubelet.stop()
    again = start_dra(hgx_node(), known_clean=False, **settings)
    assert again.prepare(claim)[claim.uid] == answer
    assert len(runs(log)) == 2

    # A reboot: /var/run/cdi is empty, the boot id is new, the checkpoint kept.
    again.daemon.stop()
    again.kubelet.stop()
    shutil.rmtree(first.cdi_dir)
    boot.write_text("22222222-2222-2222-2222-222222222222\n")
    rebooted = start_dra(hgx_node(), known_clean=False, **settings)
    redone = rebooted.prepare(claim)[claim.uid]
    assert redone["error"] == ""
    assert redone == answer  # the same devices and names ...
    assert spec_file.is_file()  # ... with a spec behind them again
    assert len(runs(log)) == 4  # and the init hooks ran on the rebooted devices
    whole = container(rebooted, redone["devices"])
    assert whole.environment()["NVIDIA_VISIBLE_DEVICES"].count(",") == 1
    saved = json.loads(checkpoint.read_text())
    assert saved["claims"][0]["boot_id"] == "22222222-2222-2222-2222-222222222222"
    # Asked once more in the new boot: answered as it was, nothing runs.
    assert rebooted.prepare(claim)[claim.uid] == answer
    assert len(runs(log)) == 4
