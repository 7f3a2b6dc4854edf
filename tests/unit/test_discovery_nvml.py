"""GPU discovery through the production NVML code, faked only at the pynvml boundary."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from devplugin.model import PciAddress
from devplugin.node.discovery.nvml import NvmlGpuSource
from devplugin.node.discovery.sysfs import read_pci_functions
from devplugin.testing.fake_nvml import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_NVLINK_DEVICE_TYPE_SWITCH,
    FakeNvml,
    FixtureError,
    load_fixture,
    parse_fixture,
)
from devplugin.testing.node import Gpu, NodeSpec, RootComplex, Switch, build_node


def fixture(**overrides: Any) -> dict[str, Any]:
    gpu = {
        "uuid": "GPU-aaaa",
        "name": "NVIDIA A100-SXM4-80GB",
        "pci_bus_id": "00000000:1A:00.0",
        "minor_number": 0,
        "memory_total_mib": 81920,
        "nvlink_peers": {"1": 12},
    }
    peer = dict(
        gpu, uuid="GPU-bbbb", pci_bus_id="00000000:1B:00.0", minor_number=1, nvlink_peers={"0": 12}
    )
    data: dict[str, Any] = {
        "driver_version": "550.54.15",
        "cuda_driver_version": 12040,
        "gpus": [gpu, peer],
    }
    data.update(overrides)
    return data


def test_fixture_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    path.write_text(json.dumps(fixture()))
    parsed = load_fixture(path)
    assert parsed.driver_version == "550.54.15"
    assert [gpu.uuid for gpu in parsed.gpus] == ["GPU-aaaa", "GPU-bbbb"]
    assert parsed.gpus[0].nvlink_peers == {1: 12}


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.update(extra=1), "fixture: extra"),
        (lambda d: d.pop("gpus"), "fixture: gpus"),
        (lambda d: d.update(cuda_driver_version="12"), "fixture: cuda_driver_version"),
        (lambda d: d["gpus"][0].update(colour="green"), "fixture: gpus[0].colour"),
        (lambda d: d["gpus"][1].pop("minor_number"), "fixture: gpus[1].minor_number"),
        (lambda d: d["gpus"][0].update(pci_bus_id="nonsense"), "fixture: gpus[0].pci_bus_id"),
        (lambda d: d["gpus"][1].update(uuid="GPU-aaaa"), "fixture: gpus[1].uuid"),
        (lambda d: d["gpus"][1].update(minor_number=0), "fixture: gpus[1].minor_number"),
        (lambda d: d["gpus"][0].update(memory_total_mib=-1), "fixture: gpus[0].memory_total_mib"),
        (lambda d: d["gpus"][0].update(nvlink_peers={"5": 1}), "fixture: gpus[0].nvlink_peers.5"),
        (lambda d: d["gpus"][0].update(nvlink_peers={"0": 1}), "fixture: gpus[0].nvlink_peers.0"),
        (lambda d: d["gpus"][0].update(nvlink_peers={"1": 4}), "fixture: gpus[0].nvlink_peers.1"),
        (
            lambda d: d["gpus"][0].update(nvlink_peers={"1": True}),
            "fixture: gpus[0].nvlink_peers.1",
        ),
        (
            lambda d: d["gpus"][0].update(cuda_compute_capability=[9]),
            "fixture: gpus[0].cuda_compute_capability",
        ),
        (
            lambda d: d["gpus"][1].update(cuda_compute_capability="9.0"),
            "fixture: gpus[1].cuda_compute_capability",
        ),
    ],
)
def test_fixture_errors_name_the_field(mutate: Any, field: str) -> None:
    data = fixture()
    mutate(data)
    with pytest.raises(FixtureError) as info:
        parse_fixture(data)
    assert str(info.value).startswith(field + ":"), str(info.value)
    assert "\n" not in str(info.value)


def test_fixture_file_that_is_not_json(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    path.write_text("{nope")
    with pytest.raises(FixtureError, match="not valid JSON"):
        load_fixture(path)


def two_gpu_node(tmp_path: Path) -> tuple[Any, FakeNvml]:
    node = build_node(
        NodeSpec(roots=[RootComplex(1, "8-15", [Switch([Gpu(), Gpu()])])], nvlink_all_to_all=4),
        tmp_path,
    )
    return node, FakeNvml.from_file(node.fixture)


def test_scan_reads_every_field_through_nvml(tmp_path: Path) -> None:
    node, lib = two_gpu_node(tmp_path)
    source = NvmlGpuSource(lib)
    gpus, status = source.scan(read_pci_functions(node.sysfs_root))
    assert status.ok
    assert status.driver_version == "550.54.15"
    assert status.cuda_driver_version == 12040
    assert [gpu.uuid for gpu in gpus] == [gpu.uuid for gpu in node.gpus]
    assert gpus[0].name == "NVIDIA H100 80GB HBM3"
    assert gpus[0].memory_total_mib == 81559
    assert gpus[1].minor_number == 1
    assert gpus[0].pci_address == node.gpus[0].address
    assert gpus[0].numa_node == 1
    assert gpus[0].nvlink_peers == ((1, 4),)
    assert gpus[1].nvlink_peers == ((0, 4),)
    source.close()
    assert not lib.initialised


def test_the_compute_capability_is_read_where_nvml_tells_it(tmp_path: Path) -> None:
    data = fixture()
    data["gpus"][0]["cuda_compute_capability"] = [8, 0]
    path = tmp_path / "f.json"
    path.write_text(json.dumps(data))
    lib = FakeNvml.from_file(path)
    source = NvmlGpuSource(lib)
    gpus, status = source.scan({})
    assert status.ok
    # The second GPU's fixture has none: NVML says Not Supported, and the GPU
    # is still found, only undescribed.
    assert [gpu.compute_capability for gpu in gpus] == [(8, 0), None]
    assert all(gpu.error is None for gpu in gpus)
    source.close()


def test_nvml_failure_is_one_clear_log_line_and_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    node, lib = two_gpu_node(tmp_path)
    lib.init_error = NVML_ERROR_DRIVER_NOT_LOADED
    source = NvmlGpuSource(lib)
    pci = read_pci_functions(node.sysfs_root)
    with caplog.at_level(logging.INFO, logger="devplugin.node.discovery.nvml"):
        for _ in range(3):
            gpus, status = source.scan(pci)
            assert gpus == ()
            assert not status.ok
            assert status.error == "Driver Not Loaded (NVML error 9)"
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1
        assert "NVML unavailable: Driver Not Loaded" in errors[0].getMessage()
        lib.init_error = None
        gpus, status = source.scan(pci)
    source.close()
    assert status.ok
    assert len(gpus) == 2
    assert any("NVML initialised after earlier failure" in r.getMessage() for r in caplog.records)


def test_lost_gpu_is_skipped_and_others_still_found(tmp_path: Path) -> None:
    node, lib = two_gpu_node(tmp_path)
    lib.lost.add(0)
    gpus, status = scan_once(lib, read_pci_functions(node.sysfs_root))
    assert status.ok
    assert [gpu.uuid for gpu in gpus] == [node.gpus[1].uuid]


def scan_once(lib: Any, pci: Any) -> Any:
    """One scan by a source that is closed after it (its read threads end)."""
    source = NvmlGpuSource(lib)
    try:
        return source.scan(pci)
    finally:
        source.close()


class SwitchedNvml(FakeNvml):
    """Every enabled link goes to an NVSwitch, as on HGX boards."""

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int) -> int:
        super().nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
        return NVML_NVLINK_DEVICE_TYPE_SWITCH


def test_nvswitch_links_join_every_switch_attached_pair(tmp_path: Path) -> None:
    node = build_node(
        NodeSpec(
            roots=[RootComplex(0, "0-7", [Switch([Gpu(), Gpu(), Gpu()])])], nvlink_all_to_all=6
        ),
        tmp_path,
    )
    lib = SwitchedNvml(load_fixture(node.fixture))
    gpus, _ = scan_once(lib, read_pci_functions(node.sysfs_root))
    # Each GPU has 12 switch links (6 described per peer, two peers).
    assert [gpu.nvlink_peers for gpu in gpus] == [
        ((1, 12), (2, 12)),
        ((0, 12), (2, 12)),
        ((0, 12), (1, 12)),
    ]


def test_real_pynvml_without_a_driver_reports_an_error() -> None:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:  # pragma: no cover - only on machines with an NVIDIA driver
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is present; this test is for driverless machines")
    gpus, status = scan_once(pynvml, {})
    assert gpus == ()
    assert status.error is not None
    assert "NVML error" in status.error


def test_fake_reports_bus_ids_in_nvml_form(tmp_path: Path) -> None:
    _, lib = two_gpu_node(tmp_path)
    lib.nvmlInit()
    info = lib.nvmlDeviceGetPciInfo(lib.nvmlDeviceGetHandleByIndex(0))
    assert info.busId.startswith("00000000:")
    assert info.busId == info.busId.upper()
    assert PciAddress.parse(info.busId).bus > 0
