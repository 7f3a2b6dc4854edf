"""MIG through the real daemon, over real gRPC with the kubelet simulator and
the fake NVML's MIG fixture: the strategies, alignment of a slice with its
HCA, faults of the parent, layout changes, and configs a node cannot serve."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from devplugin.cli import main
from devplugin.model import DeviceKind
from devplugin.policy.topology import Level
from devplugin.testing.fake_nvml import FixtureMig, FixtureMigDevice
from devplugin.testing.kubelet import ContainerRequest
from devplugin.testing.layouts import hgx_h100_mig
from devplugin.testing.node import build_node, hgx_node, mig_uuid
from tests.conftest import GPU, HCA, Cluster
from tests.waiting import wait_until

Start = Callable[..., Cluster]
MIXED = {"resources.gpu.mig.strategy": "mixed"}
ONE_G, TWO_G, THREE_G = "nvidia.com/mig-1g.10gb", "nvidia.com/mig-2g.20gb", "nvidia.com/mig-3g.40gb"


def recut_into_two() -> FixtureMig:
    """GPU 0 cut anew: two 1g.10gb devices with new instances and UUIDs."""
    return FixtureMig(
        True, tuple(FixtureMigDevice(f"MIG-recut-{i}", 9 + i, 0, 1, 1, 9856, 16) for i in range(2))
    )


def mixed(start_cluster: Start) -> Cluster:
    cluster = start_cluster(hgx_h100_mig(), wait=False, **MIXED)
    kubelet = cluster.kubelet
    for resource, count in ((GPU, 4), (THREE_G, 4), (TWO_G, 4), (ONE_G, 8), (HCA, 8)):
        assert kubelet.wait_for_devices(resource, count, timeout=10), resource
    return cluster


def test_mixed_serves_one_resource_per_profile_beside_whole_gpus(start_cluster: Start) -> None:
    cluster = mixed(start_cluster)
    kubelet, node = cluster.kubelet, cluster.node
    whole = {gpu.uuid for gpu in node.gpus[4:]}
    assert set(kubelet.devices(GPU)) == whole
    assert set(kubelet.devices(ONE_G)) == {
        mig_uuid(gpu.uuid, i) for gpu in node.gpus[:4] for i in (2, 3)
    }
    assert set(kubelet.devices(THREE_G)) == {mig_uuid(gpu.uuid, 0) for gpu in node.gpus[:4]}
    # A slice sits at its parent's NUMA node, as the parent does.
    assert {d.numa_nodes for d in kubelet.devices(THREE_G).values()} == {(0,)}


def test_a_slice_gets_the_hca_on_its_parents_switch_and_the_container_sees_the_slice(
    start_cluster: Start,
) -> None:
    cluster = mixed(start_cluster)
    topology = cluster.daemon.core.coordinator.topology
    for n in range(4):
        # The slice first: an HCA allocated before it is planned against
        # every free GPU-kind device, not knowing the profile (see docs/mig-and-sharing.md).
        pod = cluster.kubelet.admit(
            f"infer-{n}", [ContainerRequest("main", {ONE_G: 1, HCA: 1})], order=[ONE_G, HCA]
        )
        got = pod.container("main")
        (slice_id,) = got.devices[ONE_G]
        (hca,) = got.devices[HCA]
        assert topology.level(slice_id, hca) is Level.PIX, (n, slice_id, hca)
        env = got.responses[ONE_G].envs
        assert env["NVIDIA_VISIBLE_DEVICES"] == slice_id
        # The parent's device node: a MIG device is reached through it.
        parent = next(g for g in cluster.node.gpus if slice_id.startswith(mig_uuid(g.uuid, 0)[:-5]))
        paths = [d.host_path for d in got.responses[ONE_G].devices]
        assert f"/dev/nvidia{parent.minor}" in paths


def test_single_serves_every_mig_device_as_the_gpu_resource(start_cluster: Start) -> None:
    cuts = (("2g.20gb", "2g.20gb", "2g.20gb"),) * 8
    cluster = start_cluster(
        hgx_h100_mig(cuts), wait=False, **{"resources.gpu.mig.strategy": "single"}
    )
    assert cluster.kubelet.wait_for_devices(GPU, 24, timeout=10)
    assert cluster.kubelet.wait_for_devices(HCA, 8, timeout=10)
    assert all(device.startswith("MIG-") for device in cluster.kubelet.devices(GPU))
    pod = cluster.kubelet.admit(
        "train", [ContainerRequest("main", {GPU: 2, HCA: 1})], order=[GPU, HCA]
    )
    got = pod.container("main")
    topology = cluster.daemon.core.coordinator.topology
    # Two slices of one parent and that parent's HCA: PIX throughout.
    assert all(topology.level(g, got.devices[HCA][0]) is Level.PIX for g in got.devices[GPU])


def test_a_fault_of_the_parent_reaches_its_slices_and_one_of_a_slice_only_that_slice(
    start_cluster: Start,
) -> None:
    cluster = mixed(start_cluster)
    parent = cluster.node.gpus[1]
    slices = [mig_uuid(parent.uuid, i) for i in range(4)]

    def health(device: str) -> str:
        for resource in (THREE_G, TWO_G, ONE_G):
            found = cluster.kubelet.devices(resource).get(device)
            if found is not None:
                return found.health
        return "missing"

    # The second MIG device (GPU instance 2) faults alone.
    assert cluster.nvml.inject_xid(1, 79, gpu_instance=2, compute_instance=0) == 1
    assert wait_until(lambda: health(slices[1]) == "Unhealthy", timeout=3)
    assert [health(s) for s in slices] == ["Healthy", "Unhealthy", "Healthy", "Healthy"]
    # A fault of the whole GPU names no instance: every slice goes.
    assert cluster.nvml.inject_xid(1, 48) == 1
    assert wait_until(lambda: all(health(s) == "Unhealthy" for s in slices), timeout=3)
    # Another parent's slices are untouched.
    assert health(mig_uuid(cluster.node.gpus[2].uuid, 0)) == "Healthy"


def test_a_reconfigured_gpu_is_seen_by_the_next_rescan_and_its_old_slices_leave(
    start_cluster: Start,
) -> None:
    cluster = mixed(start_cluster)
    parent = cluster.node.gpus[0]
    old = [mig_uuid(parent.uuid, i) for i in range(4)]
    # An operator recuts GPU 0 into two 1g devices with new instances.
    cluster.nvml.set_mig(0, recut_into_two())
    cluster.daemon.rescan()
    listed = cluster.kubelet.devices

    def served() -> set[str]:
        return {d for r in (THREE_G, TWO_G, ONE_G) for d in listed(r)}

    recut = {"MIG-recut-0", "MIG-recut-1"}

    def recut_served() -> bool:
        # Each resource has its own ListAndWatch stream, so the kubelet sees
        # the profiles change one stream at a time: wait for all of them.
        return not set(old) & served() and recut <= set(listed(ONE_G))

    assert wait_until(recut_served, timeout=5)
    assert len(listed(ONE_G)) == 8 - 2 + 2
    assert len(listed(THREE_G)) == 3
    # Taken back whole (MIG disabled), it joins the GPU resource.
    cluster.nvml.set_mig(0, FixtureMig(False))
    cluster.daemon.rescan()
    assert wait_until(lambda: parent.uuid in listed(GPU) and not recut & served(), timeout=5)
    assert len(listed(ONE_G)) == 8 - 2


def test_the_record_and_the_topology_place_slices_at_their_parent(start_cluster: Start) -> None:
    cluster = mixed(start_cluster)
    inventory = cluster.daemon.inventory
    slices = [gpu for gpu in inventory.gpus if gpu.slice is not None]
    assert len(slices) == 16
    for gpu in slices:
        assert gpu.slice is not None
        parent = cluster.node.gpus[gpu.slice.parent_index]
        assert gpu.pci_address == parent.address
        assert gpu.nvlink_peers == ()
    topology = cluster.daemon.core.coordinator.topology
    assert len(topology.ids(DeviceKind.GPU)) == 16 + 4


@pytest.mark.parametrize(
    ("cuts", "strategy", "says"),
    [
        (None, "single", "no GPU on this node is MIG-capable (NVIDIA H100 80GB HBM3)"),
        (None, "mixed", "no GPU on this node is MIG-capable"),
        ("mixed-cuts", "single", "is not cut into MIG devices"),
        ("two-profiles", "single", "several profiles (1g.10gb, 2g.20gb)"),
    ],
)
def test_a_strategy_the_node_cannot_serve_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cuts: str | None, strategy: str, says: str
) -> None:
    layouts = {
        None: hgx_node(),
        "mixed-cuts": hgx_h100_mig(),
        "two-profiles": hgx_h100_mig((("1g.10gb",), ("2g.20gb",)) * 4),
    }
    node = build_node(layouts[cuts], tmp_path / "node")
    config = tmp_path / "config.yaml"
    settings = node.run_config(tmp_path / "sock", tmp_path / "checkpoint.json")
    settings["resources"] = {"gpu": {"mig": {"strategy": strategy}}}
    config.write_text(yaml.safe_dump(settings))
    assert main(["run", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"devplugin: config error: resources.gpu.mig.strategy: {strategy}: ")
    assert says in err
    assert "\n" not in err


def _mixed_inventory(tmp_path: Path) -> Any:
    from tests.extender_support import inventory

    return inventory(hgx_h100_mig(), tmp_path / "mig", mig_strategy="mixed")


def test_the_record_describes_slices_and_the_extender_pairs_one_with_its_hca(
    tmp_path: Path,
) -> None:
    import jsonschema

    from devplugin.policy.allocator import Allocator
    from devplugin.policy.node_record import node_from_record
    from devplugin.policy.placement import place
    from devplugin.policy.pod_request import Shape
    from tests.extender_support import record

    found = record(_mixed_inventory(tmp_path))
    devices = found["status"]["devices"]
    crd = yaml.safe_load(
        (Path(__file__).parents[2] / "charts/devplugin/crds/nodedevices.yaml").read_text()
    )
    (version,) = crd["spec"]["versions"]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    jsonschema.validate(devices, status["properties"]["devices"])
    slices = [d for d in devices if "mig" in d]
    assert len(slices) == 16
    assert {d["mig"]["profile"] for d in slices} == {"3g.40gb", "2g.20gb", "1g.10gb"}
    assert {d["product"] for d in slices} == {"NVIDIA H100 80GB HBM3"}
    # Slices of one GPU share its address and path; the extender reads them.
    state = node_from_record(found)
    outcome = place(state, Shape(((1, 1),), 1, 1), Allocator(state.topology))
    assert outcome.fits
    assert outcome.worst is Level.PIX


def test_dra_publishes_slices_as_mig_devices_at_their_parents_place(tmp_path: Path) -> None:
    from devplugin.frontends.dra.slices import node_devices

    inventory = _mixed_inventory(tmp_path)
    published = node_devices(inventory, [DeviceKind.GPU, DeviceKind.HCA])
    names = [device.name for device in published]
    assert len(names) == len(set(names))
    migs = [d for d in published if d.body["attributes"]["type"]["string"] == "mig"]
    assert len(migs) == 16
    parents = {g.uuid: g for g in inventory.gpus if g.slice is None}
    for device in migs:
        attributes = device.body["attributes"]
        gpu = next(g for g in inventory.gpus if g.uuid == device.id)
        assert gpu.slice is not None
        assert attributes["parentUUID"]["string"] == gpu.slice.parent_uuid
        assert attributes["profile"]["string"] == gpu.slice.device.profile
        assert device.body["capacity"]["multiprocessors"]["value"].isdigit()
        assert gpu.slice.parent_uuid not in parents  # the parent itself is not published
    hca_switch = {
        d.body["attributes"]["pcieSwitch"]["string"]
        for d in published
        if d.body["attributes"]["type"]["string"] == "hca"
    }
    assert {d.body["attributes"]["pcieSwitch"]["string"] for d in migs} <= hca_switch


def test_labels_describe_mig_as_each_strategy_serves_it(tmp_path: Path) -> None:
    from devplugin.cluster.node_labels import inventory_labels

    labels = inventory_labels(_mixed_inventory(tmp_path), "mixed")
    assert labels == {
        "devplugin.io/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "devplugin.io/gpu.count": "8",
        "devplugin.io/gpu.memory": "81559",
        "devplugin.io/gpu.family": "hopper",
        "devplugin.io/hca.count": "8",
        "devplugin.io/mig.strategy": "mixed",
        "devplugin.io/mig-1g.10gb.count": "8",
        "devplugin.io/mig-2g.20gb.count": "4",
        "devplugin.io/mig-3g.40gb.count": "4",
    }


def test_with_the_pod_watch_an_hca_allocated_first_is_planned_for_the_profile_asked(
    start_cluster: Start,
) -> None:
    from devplugin.testing.apiserver import ApiServerImitation

    api = ApiServerImitation()
    api.start()
    try:
        cluster = start_cluster(hgx_h100_mig(), api=api, wait=False, **MIXED)
        for resource, count in ((ONE_G, 8), (GPU, 4), (HCA, 8)):
            assert cluster.kubelet.wait_for_devices(resource, count, timeout=10)
        pods = cluster.daemon.pods
        assert pods is not None
        assert wait_until(lambda: pods.current, timeout=10)
        topology = cluster.daemon.core.coordinator.topology
        shapes = [(ONE_G, f"slice-{n}") for n in range(3)] + [(GPU, f"whole-{n}") for n in range(3)]
        for resource, name in shapes:
            pod = cluster.kubelet.admit(
                name, [ContainerRequest("main", {resource: 1, HCA: 1})], order=[HCA, resource]
            )
            got = pod.container("main")
            (device,) = got.devices[resource]
            (hca,) = got.devices[HCA]
            assert topology.level(device, hca) is Level.PIX, (name, device, hca)
    finally:
        api.stop()


def test_a_recut_gpus_new_devices_are_cleaned_before_anyone_gets_them(
    start_cluster: Start, tmp_path: Path
) -> None:
    from tests.support import hook, runs

    log = tmp_path / "cleanup.log"
    gate = tmp_path / "gate"
    gate.mkdir()
    cluster = start_cluster(
        hgx_h100_mig(),
        wait=False,
        **MIXED,
        **{"resources.gpu.hooks.cleanup": hook(log, f"gate:{gate}")},
    )
    for resource, count in ((ONE_G, 8), (GPU, 4)):
        assert cluster.kubelet.wait_for_devices(resource, count, timeout=10)
    cluster.nvml.set_mig(0, recut_into_two())
    cluster.daemon.rescan()

    def health() -> dict[str, str]:
        listed = cluster.kubelet.devices(ONE_G)
        return {d: listed[d].health for d in ("MIG-recut-0", "MIG-recut-1") if d in listed}

    # Listed, but not offered while their cleanups wait at the gate.
    assert wait_until(lambda: len(health()) == 2, timeout=5)
    assert set(health().values()) == {"Unhealthy"}
    for device in ("MIG-recut-0", "MIG-recut-1"):
        (gate / device).touch()
    assert wait_until(lambda: set(health().values()) == {"Healthy"}, timeout=10)
    cleaned = {r["env"]["DEVPLUGIN_DEVICE_IDS"] for r in runs(log) if "env" in r}
    assert cleaned == {"MIG-recut-0", "MIG-recut-1"}
    # Untouched GPUs' devices were never cleaned.
    assert not any(d.startswith(mig_uuid(cluster.node.gpus[1].uuid, 0)[:-5]) for d in cleaned)


def test_a_mig_device_comes_with_its_two_nvidia_caps_nodes(start_cluster: Start) -> None:
    cluster = mixed(start_cluster)
    pod = cluster.kubelet.admit(
        "caps", [ContainerRequest("main", {ONE_G: 1, HCA: 1})], order=[ONE_G, HCA]
    )
    got = pod.container("main")
    (device,) = got.devices[ONE_G]
    gpu = next(g for g in cluster.daemon.inventory.gpus if g.uuid == device)
    assert gpu.slice is not None
    gi, ci = gpu.slice.caps
    paths = [d.host_path for d in got.responses[ONE_G].devices]
    assert f"/dev/nvidia-caps/nvidia-cap{gi}" in paths
    assert f"/dev/nvidia-caps/nvidia-cap{ci}" in paths
    assert ci == gi + 1
    # What the driver's files say, for that GPU and its instances.
    instance = cluster.node.caps_root / f"gpu{gpu.minor_number}" / "mig"
    access = instance / f"gi{gpu.slice.device.gpu_instance}" / "access"
    assert f"DeviceFileMinor: {gi}" in access.read_text()


def test_device_nodes_alone_never_offer_a_mig_device_whose_caps_cannot_be_read(
    start_cluster: Start, tmp_path: Path
) -> None:
    cluster = start_cluster(
        hgx_h100_mig(),
        wait=False,
        **MIXED,
        **{
            "paths.nvidia_caps_root": str(tmp_path / "missing"),
            "resources.gpu.device_list_strategy": ["device-nodes"],
        },
    )
    assert cluster.kubelet.wait_for_devices(ONE_G, 8, timeout=10)
    listed = cluster.kubelet.devices(ONE_G)
    assert {d.health for d in listed.values()} == {"Unhealthy"}
    served = cluster.daemon.servicer(ONE_G).state.devices
    assert all("nvidia-caps access files are not readable" in d.reason for d in served)
    # Whole GPUs are unaffected.
    assert cluster.kubelet.wait_for_devices(GPU, 4, timeout=10)
    assert {d.health for d in cluster.kubelet.devices(GPU).values()} == {"Healthy"}


def test_discover_and_topo_show_mig_devices_under_their_strategy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    node = build_node(hgx_h100_mig(), tmp_path / "node")
    config = tmp_path / "config.yaml"
    settings = node.run_config(tmp_path / "sock", tmp_path / "checkpoint.json")
    settings["resources"] = {"gpu": {"mig": {"strategy": "mixed"}}}
    config.write_text(yaml.safe_dump(settings))
    assert main(["discover", "--json", "--config", str(config)]) == 0
    found = json.loads(capsys.readouterr().out)
    migs = [g for g in found["gpus"] if "profile" in g["mig"]]
    assert len(migs) == 16
    first = migs[0]["mig"]
    assert (first["parent_index"], first["profile"], first["gpu_instance"]) == (0, "3g.40gb", 1)
    assert len(first["caps_minors"]) == 2
    whole = [g for g in found["gpus"] if "profile" not in g["mig"]]
    assert {(g["mig"]["capable"], g["mig"]["enabled"]) for g in whole} == {(True, False)}
    assert main(["topo", "--config", str(config)]) == 0
    matrix = capsys.readouterr().out
    assert "MIG0:0" in matrix
    assert "MIG3:3" in matrix


def test_init_hooks_get_the_mig_devices_ids(start_cluster: Start, tmp_path: Path) -> None:
    from tests.support import hook, runs

    log = tmp_path / "init.log"
    cluster = start_cluster(
        hgx_h100_mig(), wait=False, **MIXED, **{"resources.gpu.hooks.init": hook(log, "ok")}
    )
    for resource, count in ((TWO_G, 4), (HCA, 8)):
        assert cluster.kubelet.wait_for_devices(resource, count, timeout=10)
    pod = cluster.kubelet.admit("hooked", [ContainerRequest("main", {TWO_G: 1, HCA: 1})])
    (device,) = pod.container("main").devices[TWO_G]
    assert device.startswith("MIG-")
    (run,) = [r for r in runs(log) if "env" in r]
    assert run["env"]["DEVPLUGIN_RESOURCE"] == TWO_G
    assert run["env"]["DEVPLUGIN_DEVICE_IDS"] == device


@pytest.mark.parametrize(
    ("cut", "why"),
    [
        # Overlapping placements: GPU instances of 4 + 3 + 2 slices on a 7-slice GPU.
        (
            (("MIG-a", 1, 4, 40192), ("MIG-b", 2, 3, 40192), ("MIG-c", 3, 2, 19968)),
            "9 of 7",
        ),
        ((("MIG-z", 1, 0, 9856),), "profile 0g.10gb"),  # a profile of no slices
        ((("MIG-y", 1, 1, 0),), "0 MiB"),  # no memory
    ],
    ids=["overlapping", "zero-slices", "zero-memory"],
)
def test_an_inconsistent_mig_report_fails_that_gpu_closed(
    start_cluster: Start, caplog: pytest.LogCaptureFixture, cut: Any, why: str
) -> None:
    cluster = mixed(start_cluster)
    parent = cluster.node.gpus[0]
    devices = tuple(
        FixtureMigDevice(uuid, instance, 0, slices, 1, memory, 16)
        for uuid, instance, slices, memory in cut
    )
    cluster.nvml.set_mig(0, FixtureMig(True, devices))
    cluster.daemon.rescan()
    listed = cluster.kubelet.devices
    old = {mig_uuid(parent.uuid, i) for i in range(4)}

    def served() -> set[str]:
        return {d for r in (THREE_G, TWO_G, ONE_G, GPU) for d in listed(r)}

    # Neither its old devices nor the reported ones are offered, nor the GPU whole.
    assert wait_until(lambda: not old & served(), timeout=5)
    assert not {uuid for uuid, *_ in cut} & served()
    assert parent.uuid not in served()
    # The other GPUs are served as before.
    assert len(listed(THREE_G)) == 3
    assert len(listed(GPU)) == 4
    lines = [r.getMessage() for r in caplog.records if "not served" in r.getMessage()]
    assert len(lines) == 1
    assert "GPU 0" in lines[0]
    assert why in lines[0]


def test_a_mig_uuid_listed_under_two_gpus_fails_both_closed(start_cluster: Start) -> None:
    cluster = mixed(start_cluster)
    twin = mig_uuid(cluster.node.gpus[0].uuid, 2)  # GPU 0's third device...
    listed = cluster.kubelet.devices
    # ... reported again under GPU 1.
    cluster.nvml.set_mig(1, FixtureMig(True, (FixtureMigDevice(twin, 5, 0, 1, 1, 9856, 16),)))
    cluster.daemon.rescan()

    def served() -> set[str]:
        return {d for r in (THREE_G, TWO_G, ONE_G, GPU) for d in listed(r)}

    first = {mig_uuid(cluster.node.gpus[0].uuid, i) for i in range(4)}
    second = {mig_uuid(cluster.node.gpus[1].uuid, i) for i in range(4)}
    assert wait_until(lambda: not (first | second) & served(), timeout=5)
    assert len(listed(THREE_G)) == 2


@pytest.mark.parametrize("after", ["recut", "whole"])
def test_a_gpu_cut_anew_while_an_old_device_is_held_waits_for_its_holder(
    start_cluster: Start, after: str
) -> None:
    cluster = mixed(start_cluster)
    kubelet, parent = cluster.kubelet, cluster.node.gpus[0]
    old = mig_uuid(parent.uuid, 0)  # GPU 0's 3g device
    holders = {}
    for i in range(4):  # every 3g device held, one per parent
        pod = kubelet.admit(f"big{i}", [ContainerRequest("main", {THREE_G: 1})], order=[THREE_G])
        (device,) = pod.container("main").devices[THREE_G]
        holders[device] = f"big{i}"
    assert old in holders
    cluster.nvml.set_mig(0, recut_into_two() if after == "recut" else FixtureMig(False))
    cluster.daemon.rescan()
    new = ["MIG-recut-0", "MIG-recut-1"] if after == "recut" else [parent.uuid]
    resource = ONE_G if after == "recut" else GPU

    def health() -> dict[str, str]:
        listed = kubelet.devices(resource)
        return {d: listed[d].health for d in new if d in listed}

    assert wait_until(lambda: len(health()) == len(new), timeout=5)
    # Listed, never offered while the old device's container runs (their
    # first-sight cleanup has long finished by the end of this second).
    assert not wait_until(lambda: "Healthy" in health().values(), timeout=1.0)
    # Another parent's holder ending frees nothing here.
    other = next(d for d in holders if d != old)
    kubelet.remove(holders[other])
    assert wait_until(lambda: other in kubelet.devices(THREE_G), timeout=5)
    assert not wait_until(lambda: "Healthy" in health().values(), timeout=1.0)
    # The old holder ends: cleaned, then offered.
    kubelet.remove(holders[old])
    assert wait_until(lambda: set(health().values()) == {"Healthy"}, timeout=10)


def test_a_held_mig_device_stays_held_across_podresources_polls(start_cluster: Start) -> None:
    # PodResources lists MIG devices under their profile's resource: a poll
    # that read only nvidia.com/gpu saw them go and released them in use.
    cluster = mixed(start_cluster)
    pod = cluster.kubelet.admit("small", [ContainerRequest("main", {ONE_G: 1})], order=[ONE_G])
    (device,) = pod.container("main").devices[ONE_G]
    core = cluster.daemon.core
    polls = core.monitor.polls
    assert wait_until(lambda: core.monitor.polls >= polls + 4, timeout=10)
    assert device in core.lifecycle.book.in_use(DeviceKind.GPU)
    assert device in core.ledger.in_use(DeviceKind.GPU)
