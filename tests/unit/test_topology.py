"""Levels between devices and the `topo` matrix, checked cell by cell."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from devplugin.model import GpuInfo, PciAddress, PciFunction, PciPath
from devplugin.node.report import topo_matrix, topo_text
from devplugin.policy.topology import Level, Topology, pci_level
from devplugin.testing.layouts import LAYOUTS
from devplugin.testing.node import build_node, devices_from_spec
from devplugin.testing.random_topology import random_spec
from tests.support import nested_spec, scan


def fn(root: str, *chain: str, numa: int | None = 0) -> PciFunction:
    addresses = tuple(PciAddress.parse(part) for part in chain)
    return PciFunction(address=addresses[-1], path=PciPath(root, addresses), numa_node=numa)


RP = "0000:10:01.0"
UP = "0000:11:00.0"


@pytest.mark.parametrize(
    ("a", "b", "level"),
    [
        # Two downstream ports of one switch.
        (
            fn("pci0000:10", RP, UP, "0000:12:00.0", "0000:13:00.0"),
            fn("pci0000:10", RP, UP, "0000:12:01.0", "0000:14:00.0"),
            Level.PIX,
        ),
        # Two functions of one device behind a root port.
        (fn("pci0000:10", RP, "0000:11:00.0"), fn("pci0000:10", RP, "0000:11:00.1"), Level.PIX),
        # Leaves of two inner switches under one top switch.
        (
            fn(
                "pci0000:10", RP, UP, "0000:12:00.0", "0000:13:00.0", "0000:14:00.0", "0000:15:00.0"
            ),
            fn(
                "pci0000:10", RP, UP, "0000:12:01.0", "0000:16:00.0", "0000:17:00.0", "0000:18:00.0"
            ),
            Level.PXB,
        ),
        # One directly on the top switch, the other one switch further down.
        (
            fn("pci0000:10", RP, UP, "0000:12:00.0", "0000:13:00.0"),
            fn(
                "pci0000:10", RP, UP, "0000:12:01.0", "0000:16:00.0", "0000:17:00.0", "0000:18:00.0"
            ),
            Level.PXB,
        ),
        # Different root ports of one host bridge.
        (
            fn("pci0000:10", RP, "0000:11:00.0"),
            fn("pci0000:10", "0000:10:02.0", "0000:20:00.0"),
            Level.PHB,
        ),
        # Different host bridges, same NUMA node.
        (
            fn("pci0000:10", RP, "0000:11:00.0"),
            fn("pci0000:30", "0000:30:01.0", "0000:31:00.0"),
            Level.NODE,
        ),
        # Different host bridges, different NUMA nodes.
        (
            fn("pci0000:10", RP, "0000:11:00.0", numa=0),
            fn("pci0000:30", "0000:30:01.0", "0000:31:00.0", numa=1),
            Level.SYS,
        ),
        # NUMA unknown on both sides: one node.
        (
            fn("pci0000:10", RP, "0000:11:00.0", numa=None),
            fn("pci0000:30", "0000:30:01.0", "0000:31:00.0", numa=None),
            Level.NODE,
        ),
        # NUMA unknown on one side only: not known to be the same node.
        (
            fn("pci0000:10", RP, "0000:11:00.0", numa=None),
            fn("pci0000:30", "0000:30:01.0", "0000:31:00.0", numa=1),
            Level.SYS,
        ),
    ],
)
def test_pci_level(a: PciFunction, b: PciFunction, level: Level) -> None:
    assert pci_level(a, b) is level
    assert pci_level(b, a) is level


def test_unknown_position_is_sys() -> None:
    assert pci_level(None, fn("pci0000:10", RP)) is Level.SYS


EXPECTED = {
    # GPU0, GPU1 under inner switches of one top switch (with mlx5_0, mlx5_1);
    # GPU2 on its own root port of the same host bridge; mlx5_2 on another
    # host bridge of NUMA 0; GPU3 and GPU4 share a switch on NUMA 1.
    "GPU0": ["X", "NV12", "PHB", "SYS", "SYS", "PIX", "PXB", "NODE"],
    "GPU1": ["NV12", "X", "PHB", "SYS", "SYS", "PXB", "PIX", "NODE"],
    "GPU2": ["PHB", "PHB", "X", "SYS", "SYS", "PHB", "PHB", "NODE"],
    "GPU3": ["SYS", "SYS", "SYS", "X", "PIX", "SYS", "SYS", "SYS"],
    "GPU4": ["SYS", "SYS", "SYS", "PIX", "X", "SYS", "SYS", "SYS"],
    "mlx5_0": ["PIX", "PXB", "PHB", "SYS", "SYS", "X", "PXB", "NODE"],
    "mlx5_1": ["PXB", "PIX", "PHB", "SYS", "SYS", "PXB", "X", "NODE"],
    "mlx5_2": ["NODE", "NODE", "NODE", "SYS", "SYS", "NODE", "NODE", "X"],
}
AFFINITY = {
    "GPU0": ("0-15", "0"),
    "GPU1": ("0-15", "0"),
    "GPU2": ("0-15", "0"),
    "GPU3": ("16-31", "1"),
    "GPU4": ("16-31", "1"),
    "mlx5_0": ("0-15", "0"),
    "mlx5_1": ("0-15", "0"),
    "mlx5_2": ("0-15", "0"),
}


def test_topo_matrix_cell_by_cell(tmp_path: Path) -> None:
    inventory = scan(build_node(nested_spec(), tmp_path))
    rows = topo_matrix(inventory)
    header = rows[0]
    labels = list(EXPECTED)
    assert header == ["", *labels, "CPU Affinity", "NUMA Affinity"]
    assert [row[0] for row in rows[1:]] == labels
    for row in rows[1:]:
        label = row[0]
        assert row[1 : 1 + len(labels)] == EXPECTED[label], label
        assert tuple(row[1 + len(labels) :]) == AFFINITY[label], label


def test_topo_text_is_aligned_and_has_legend(tmp_path: Path) -> None:
    inventory = scan(build_node(nested_spec(), tmp_path))
    text = topo_text(inventory)
    lines = text.splitlines()
    # The printed table holds the same cells as the matrix, whitespace separated.
    rows = topo_matrix(inventory)
    for line, row in zip(lines[1 : len(rows)], rows[1:], strict=True):
        cells = line.split()
        assert cells[:-2] == row[:-2]
        assert cells[-2:] == row[-2:]
    for word in ("X ", "NV#", "PIX", "PXB", "PHB", "NODE", "SYS"):
        assert any(line.strip().startswith(word.strip()) for line in lines if "=" in line), word
    assert "mlx5_0 = " in text


def test_topology_object_shares_levels_by_device_id(tmp_path: Path) -> None:
    node = build_node(nested_spec(), tmp_path)
    inventory = scan(node)
    topology = Topology.from_inventory(inventory)
    gpu0, gpu1 = node.gpus[0].uuid, node.gpus[1].uuid
    hca0 = node.hca("mlx5_0").device_id
    assert topology.level(gpu0, hca0) is Level.PIX
    assert topology.link(gpu0, gpu1).nvlinks == 12
    assert topology.link(gpu0, gpu1).label == "NV12"
    assert topology.level(gpu0, gpu1) is Level.PXB
    assert topology.numa_node(hca0) == 0


def _gpu(index: int, port: str, peers: tuple[tuple[int, int], ...] = ()) -> GpuInfo:
    address = f"0000:{0x20 + index:02x}:00.0"
    return GpuInfo(
        index=index,
        uuid=f"GPU-{index}",
        name="gpu",
        pci_address=PciAddress.parse(address),
        minor_number=index,
        memory_total_mib=1,
        nvlink_peers=peers,
        pci=fn("pci0000:10", RP, UP, port, address),
    )


def test_gpus_of_one_switch_without_nvlinks_are_one_class() -> None:
    # GPUs 0-2 sit on one switch with no NVLink at all; GPU 3 shares their
    # switch but has a bridge to GPU 4 on another switch, so it is not
    # interchangeable with them.
    gpus = [
        _gpu(0, "0000:12:00.0"),
        _gpu(1, "0000:12:01.0"),
        _gpu(2, "0000:12:02.0"),
        _gpu(3, "0000:12:03.0", ((4, 2),)),
        GpuInfo(
            4, "GPU-4", "gpu", PciAddress.parse("0000:30:00.0"), 4, 1, ((3, 2),),
            fn("pci0000:10", RP, "0000:30:00.0"),
        ),
    ]  # fmt: skip
    topology = Topology(gpus, [])
    groups = sorted(klass.devices for klass in topology.classes)
    assert groups == [("GPU-0", "GPU-1", "GPU-2"), ("GPU-3",), ("GPU-4",)]
    plain = next(k for k in topology.classes if len(k.devices) == 3)
    assert plain.internal_score == topology.score("GPU-0", "GPU-1") == 50


def test_every_domain_node_comes_after_its_parent() -> None:
    # The allocator finds the deepest domain two devices share as the highest
    # node index on both paths; that needs children numbered after parents.
    specs = [make() for make in LAYOUTS.values()]
    specs += [random_spec(random.Random(seed), max_gpus=16) for seed in range(50)]
    for spec in specs:
        topology = Topology(*devices_from_spec(spec))
        assert len(topology.nodes) > 1
        for node in topology.nodes:
            if node.parent is not None:
                assert node.index > node.parent
        for path in topology.class_path:
            assert list(path) == sorted(path, reverse=True)  # deepest first
