"""MIG: the strategies' pure rules, NVML discovery of MIG devices through the
production code (faked only at the pynvml boundary), and the fixture."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from devplugin.cluster.node_labels import inventory_labels
from devplugin.model import GpuInfo, Inventory, MigDevice, PciAddress
from devplugin.node.discovery.nvml import NvmlGpuSource
from devplugin.policy.mig import (
    mig_problem,
    profile_name,
    profile_resource,
    profiles_of,
    served_gpus,
)
from devplugin.testing.fake_nvml import (
    NVML_ERROR_UNKNOWN,
    FakeNvml,
    FixtureError,
    FixtureMig,
    FixtureMigDevice,
    NVMLError,
    load_fixture,
    parse_fixture,
)
from devplugin.testing.layouts import hgx_h100_mig
from devplugin.testing.node import build_node


@pytest.mark.parametrize(
    ("slices", "compute", "memory", "name"),
    [
        (1, 1, 9856, "1g.10gb"),
        (1, 1, 4864, "1g.5gb"),  # A100 40GB
        (3, 3, 40192, "3g.40gb"),
        (7, 7, 81408, "7g.80gb"),
        (3, 1, 40192, "1c.3g.40gb"),  # a compute instance smaller than its GPU instance
    ],
)
def test_profile_names_follow_nvidia(slices: int, compute: int, memory: int, name: str) -> None:
    assert profile_name(slices, compute, memory) == name


def test_the_mixed_strategy_names_a_resource_per_profile_in_the_gpu_resources_domain() -> None:
    assert profile_resource("nvidia.com/gpu", "1g.10gb") == "nvidia.com/mig-1g.10gb"
    assert profile_resource("example.org/accel", "3g.40gb") == "example.org/mig-3g.40gb"


def _gpu(index: int, *, cut: tuple[str, ...] | None = None, peers: tuple[int, ...] = ()) -> GpuInfo:
    devices = tuple(
        MigDevice(f"MIG-{index}-{i}", i, i + 1, 0, profile, 9856, 16)
        for i, profile in enumerate(cut or ())
    )
    return GpuInfo(
        index=index,
        uuid=f"GPU-{index}",
        name="NVIDIA H100 80GB HBM3",
        pci_address=PciAddress(0, 0x10 * (index + 1), 0, 0),
        minor_number=index,
        memory_total_mib=81559,
        nvlink_peers=tuple((p, 18) for p in peers),
        mig_capable=cut is not None,
        mig_enabled=bool(cut),
        mig_devices=devices,
    )


def test_served_gpus_put_mig_devices_in_their_parents_place_without_nvlink() -> None:
    gpus = [
        _gpu(0, cut=("3g.40gb", "1g.10gb"), peers=(1, 2)),
        _gpu(1, cut=(), peers=(0, 2)),
        _gpu(2, peers=(0, 1)),
    ]
    assert served_gpus(gpus, "none") == tuple(gpus)
    served = served_gpus(gpus, "mixed")
    assert [g.uuid for g in served] == ["MIG-0-0", "MIG-0-1", "GPU-1", "GPU-2"]
    first = served[0]
    assert first.slice is not None
    assert (first.slice.parent_uuid, first.slice.parent_index) == ("GPU-0", 0)
    assert first.slice.parent_memory_mib == 81559
    assert (first.pci_address, first.minor_number) == (gpus[0].pci_address, 0)
    assert first.nvlink_peers == ()
    assert first.index not in {g.index for g in gpus}
    # A whole GPU keeps its NVLinks to whole GPUs only.
    assert served[2].nvlink_peers == ((2, 18),)
    lost = dataclasses.replace(gpus[0], error="GPU is lost")
    assert {g.error for g in served_gpus([lost], "single")} == {"GPU is lost"}


def test_strategies_a_node_cannot_serve_are_named() -> None:
    whole = [_gpu(0), _gpu(1)]
    assert mig_problem(served_gpus(whole, "single"), "single") is not None
    assert "no GPU on this node is MIG-capable" in str(mig_problem(whole, "mixed"))
    mixed = served_gpus([_gpu(0, cut=("1g.10gb",)), _gpu(1, cut=())], "single")
    assert "GPU 1 is not cut" in str(mig_problem(mixed, "single"))
    assert mig_problem(mixed, "mixed") is None
    two = served_gpus([_gpu(0, cut=("1g.10gb",)), _gpu(1, cut=("2g.20gb",))], "single")
    assert "several profiles (1g.10gb, 2g.20gb)" in str(mig_problem(two, "single"))
    one = served_gpus([_gpu(0, cut=("1g.10gb", "1g.10gb")), _gpu(1, cut=("1g.10gb",))], "single")
    assert mig_problem(one, "single") is None
    assert profiles_of(one) == {"1g.10gb": 3}
    assert mig_problem(whole, "none") is None


def test_single_labels_describe_the_mig_devices_served_as_gpus() -> None:
    gpus = served_gpus([_gpu(0, cut=("1g.10gb",) * 3), _gpu(1, cut=("1g.10gb",) * 3)], "single")
    labels = inventory_labels(Inventory(gpus=gpus), "single")
    assert labels["devplugin.io/gpu.product"] == "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb"
    assert labels["devplugin.io/gpu.count"] == "6"
    assert labels["devplugin.io/gpu.memory"] == "9856"
    assert labels["devplugin.io/mig.strategy"] == "single"


def _source(tmp_path: Path) -> tuple[FakeNvml, NvmlGpuSource]:
    node = build_node(hgx_h100_mig(), tmp_path)
    lib = FakeNvml(load_fixture(node.fixture))
    return lib, NvmlGpuSource(lib)


def test_nvml_discovery_reads_each_gpus_mig_mode_and_devices(tmp_path: Path) -> None:
    _, source = _source(tmp_path)
    try:
        gpus, status = source.scan({})
    finally:
        source.close()
    assert status.ok
    cut, whole = gpus[0], gpus[5]
    assert (cut.mig_capable, cut.mig_enabled) == (True, True)
    assert [d.profile for d in cut.mig_devices] == ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
    assert [(d.gpu_instance, d.compute_instance) for d in cut.mig_devices][:2] == [(1, 0), (2, 0)]
    assert cut.mig_devices[0].multiprocessors == 60
    assert (whole.mig_capable, whole.mig_enabled, whole.mig_devices) == (True, False, ())


def test_a_gpu_whose_mig_devices_cannot_be_listed_is_reported_not_served_whole(
    tmp_path: Path,
) -> None:
    lib, source = _source(tmp_path)

    def broken(handle: Any, index: int) -> Any:
        raise NVMLError(NVML_ERROR_UNKNOWN)

    lib.nvmlDeviceGetMigDeviceHandleByIndex = broken  # type: ignore[method-assign]
    try:
        gpus, _ = source.scan({})
    finally:
        source.close()
    # The cut GPUs' reads failed: NVML never saw them, so none is served
    # whole by mistake; the GPUs MIG does not cut are found as ever.
    assert {g.index for g in gpus} == {4, 5, 6, 7}


def test_a_gpu_that_is_not_mig_capable_is_found_as_ever(tmp_path: Path) -> None:
    node = build_node(hgx_h100_mig((None,) * 8), tmp_path)
    source = NvmlGpuSource(FakeNvml(load_fixture(node.fixture)))
    try:
        gpus, _ = source.scan({})
    finally:
        source.close()
    assert len(gpus) == 8
    assert not any(g.mig_capable for g in gpus)


def _with_mig(mig: Any) -> dict[str, Any]:
    gpu = {
        "uuid": "GPU-a", "name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "00000000:1A:00.0",
        "minor_number": 0, "memory_total_mib": 81559, "nvlink_peers": {}, "mig": mig,
    }  # fmt: skip
    return {"driver_version": "550.54.15", "cuda_driver_version": 12040, "gpus": [gpu]}


DEVICE = {
    "uuid": "MIG-a", "gpu_instance": 1, "compute_instance": 0, "gpu_slices": 1,
    "compute_slices": 1, "memory_mib": 9856, "multiprocessors": 16,
}  # fmt: skip


@pytest.mark.parametrize(
    ("mig", "field"),
    [
        ([], "gpus[0].mig"),
        ({"enabled": "yes"}, "gpus[0].mig.enabled"),
        ({"enabled": True, "devices": [DEVICE] * 8}, "gpus[0].mig.devices"),
        ({"enabled": False, "devices": [DEVICE]}, "gpus[0].mig.devices"),
        ({"enabled": True, "devices": [dict(DEVICE, uuid="GPU-a")]}, "gpus[0].mig.devices[0].uuid"),
        ({"enabled": True, "devices": [dict(DEVICE, memory_mib=-1)]}, "memory_mib"),
        ({"enabled": True, "devices": [{"uuid": "MIG-a"}]}, "gpus[0].mig.devices[0]."),
        ({"enabled": True, "extra": 1}, "gpus[0].mig.extra"),
    ],
)
def test_mig_fixture_errors_name_the_field(mig: Any, field: str) -> None:
    with pytest.raises(FixtureError) as info:
        parse_fixture(_with_mig(mig))
    assert field in str(info.value)


def test_a_valid_mig_fixture_parses() -> None:
    parsed = parse_fixture(_with_mig({"enabled": True, "devices": [DEVICE]}))
    mig = parsed.gpus[0].mig
    assert mig is not None
    assert mig.enabled
    assert mig.devices[0].uuid == "MIG-a"


def test_caps_are_read_once_per_mig_device_and_a_failed_read_is_tried_again(
    tmp_path: Path,
) -> None:
    import shutil

    from devplugin.node.deadline import Deadlines
    from devplugin.node.discovery import Discoverer, Roots

    node = build_node(hgx_h100_mig(), tmp_path)
    assert node.caps_root is not None
    lib = FakeNvml(load_fixture(node.fixture))
    deadlines = Deadlines(5)
    discoverer = Discoverer(
        Roots(node.sysfs_root, node.dev_root),
        NvmlGpuSource(lib, deadlines),
        deadlines,
        mig_strategy="mixed",
        caps_root=node.caps_root,
    )

    def caps() -> dict[str, tuple[int, ...]]:
        found = discoverer.scan(full=False).gpus
        return {g.uuid: g.slice.caps for g in found if g.slice is not None}

    try:
        first = caps()
        assert len(first) == 16
        assert all(len(c) == 2 for c in first.values())
        # Read once: the files going away changes nothing for known devices.
        moved = tmp_path / "moved"
        shutil.move(str(node.caps_root), moved)
        assert caps() == first
        # A device cut anew is read afresh: unreadable now, so no caps ...
        lib.set_mig(0, FixtureMig(True, (FixtureMigDevice("MIG-new", 9, 0, 1, 1, 9856, 16),)))
        assert caps()["MIG-new"] == ()
        # ... and tried again at the next scan, once the driver's files are there.
        shutil.move(str(moved), node.caps_root)
        access = node.caps_root / "gpu0" / "mig" / "gi9"
        (access / "ci0").mkdir(parents=True)
        (access / "access").write_text("DeviceFileMinor: 40\n")
        (access / "ci0" / "access").write_text("DeviceFileMinor: 41\n")
        assert caps()["MIG-new"] == (40, 41)
    finally:
        discoverer.close()
