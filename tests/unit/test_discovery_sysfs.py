"""Discovery on real sysfs trees built in tmp_path (directories, files, relative links)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from devplugin.model import PciAddress
from devplugin.node.discovery.sysfs import read_hcas, read_pci_functions
from devplugin.testing.node import (
    DOWN,
    Gpu,
    Hca,
    NodeSpec,
    Port,
    RootComplex,
    Switch,
    build_node,
)
from tests.support import nested_spec, scan


def test_tree_uses_relative_symlinks(tmp_path: Path) -> None:
    node = build_node(nested_spec(), tmp_path)
    links = [
        node.sysfs_root / "bus" / "pci" / "devices" / str(node.gpus[0].address),
        node.sysfs_root / "class" / "infiniband" / "mlx5_0",
        node.sysfs_root / "class" / "infiniband_verbs" / "uverbs0",
    ]
    for link in links:
        assert link.is_symlink()
        assert not os.readlink(link).startswith("/")


def test_pci_ancestry_follows_nested_switches(tmp_path: Path) -> None:
    node = build_node(nested_spec(), tmp_path)
    functions = read_pci_functions(node.sysfs_root)
    gpu1 = functions[node.gpus[1].address]
    # root port, top switch up + down, inner switch up + down, then the GPU.
    assert len(gpu1.path.chain) == 6
    assert gpu1.path.root == "pci0000:10"
    assert gpu1.path.chain[-1] == node.gpus[1].address
    assert all(bridge in node.bridges for bridge in gpu1.path.bridges)
    assert gpu1.vendor == 0x10DE
    assert gpu1.pci_class == 0x030200
    assert gpu1.driver == "nvidia"
    assert gpu1.numa_node == 0
    assert gpu1.local_cpulist == "0-15"
    gpu2 = functions[node.gpus[2].address]
    assert len(gpu2.path.chain) == 2  # directly behind a root port


def test_gpus_are_joined_to_their_pci_functions(tmp_path: Path) -> None:
    node = build_node(nested_spec(), tmp_path)
    inventory = scan(node)
    assert [gpu.uuid for gpu in inventory.gpus] == [gpu.uuid for gpu in node.gpus]
    for gpu, built in zip(inventory.gpus, node.gpus, strict=True):
        assert gpu.pci is not None
        assert gpu.pci.address == built.address
        assert gpu.minor_number == built.minor
    assert [gpu.numa_node for gpu in inventory.gpus] == [0, 0, 0, 1, 1]
    assert inventory.gpus[0].nvlink_peers == ((1, 12),)
    assert inventory.gpus[2].nvlink_peers == ()
    assert all(node.present for node in inventory.gpu_control_nodes)


def test_hca_ports_netdevs_and_char_devices(tmp_path: Path) -> None:
    node = build_node(nested_spec(), tmp_path)
    inventory = scan(node)
    by_name = {hca.name: hca for hca in inventory.hcas}
    assert sorted(by_name) == ["mlx5_0", "mlx5_1", "mlx5_2"]

    single = by_name["mlx5_0"]
    assert single.device_id == str(node.hca("mlx5_0").address)
    assert single.netdevs == (f"ibp{node.hca('mlx5_0').address.bus}s0",)
    assert [port.number for port in single.ports] == [1]
    assert single.ports[0].state == "4: ACTIVE"
    assert single.ports[0].phys_state == "5: LinkUp"
    assert single.ports[0].link_layer == "InfiniBand"
    assert single.ports[0].rate == "400 Gb/sec (4X NDR)"
    assert single.fw_ver == "28.39.1002"
    assert single.node_guid is not None
    assert single.uverbs is not None
    assert single.uverbs.path == "/dev/infiniband/uverbs0"

    dual = by_name["mlx5_1"]
    assert [port.number for port in dual.ports] == [1, 2]
    assert [node.path for node in dual.umads] == ["/dev/infiniband/umad1", "/dev/infiniband/umad2"]
    assert [node.path for node in dual.issms] == ["/dev/infiniband/issm1", "/dev/infiniband/issm2"]
    assert [node.path for node in dual.char_devices] == [
        "/dev/infiniband/uverbs1",
        "/dev/infiniband/umad1",
        "/dev/infiniband/umad2",
        "/dev/infiniband/issm1",
        "/dev/infiniband/issm2",
        "/dev/infiniband/rdma_cm",
    ]
    assert all(node.present for node in dual.char_devices)

    no_netdev = by_name["mlx5_2"]
    assert no_netdev.netdevs == ()
    assert no_netdev.numa_node == 0


def test_unknown_numa_node_is_none(tmp_path: Path) -> None:
    spec = NodeSpec(roots=[RootComplex(None, "0-7", [Switch([Gpu(), Hca()])])])
    node = build_node(spec, tmp_path)
    assert (node.gpus[0].directory / "numa_node").read_text().strip() == "-1"
    inventory = scan(node)
    assert inventory.gpus[0].numa_node is None
    assert inventory.hcas[0].numa_node is None


def test_missing_optional_files_degrade_only_their_field(tmp_path: Path) -> None:
    spec = NodeSpec(
        roots=[
            RootComplex(
                0,
                "0-7",
                [Switch([Gpu(omit=("local_cpulist", "numa_node")), Hca(omit=("class",))])],
            )
        ]
    )
    node = build_node(spec, tmp_path)
    (node.hcas[0].directory / "infiniband" / "mlx5_0" / "fw_ver").unlink()
    (node.hcas[0].directory / "infiniband" / "mlx5_0" / "ports" / "1" / "rate").unlink()
    inventory = scan(node)
    gpu = inventory.gpus[0]
    assert gpu.pci is not None
    assert gpu.pci.local_cpulist is None
    assert gpu.numa_node is None
    assert gpu.pci.vendor == 0x10DE
    hca = inventory.hcas[0]
    assert hca.pci is not None
    assert hca.pci.pci_class is None
    assert hca.pci.vendor == 0x15B3
    assert hca.fw_ver is None
    assert hca.ports[0].rate == ""
    assert hca.ports[0].state == "4: ACTIVE"


def test_missing_device_nodes_are_reported_not_present(tmp_path: Path) -> None:
    spec = NodeSpec(roots=[RootComplex(0, "0-7", [Switch([Hca(missing_nodes=("umad",))])])])
    node = build_node(spec, tmp_path)
    pci = read_pci_functions(node.sysfs_root)
    (hca,) = read_hcas(node.sysfs_root, node.dev_root, pci)
    assert hca.uverbs is not None
    assert hca.uverbs.present
    assert [(n.path, n.present) for n in hca.umads] == [("/dev/infiniband/umad0", False)]
    assert hca.rdma_cm.present


def test_device_paths_are_host_paths_whatever_the_dev_root(tmp_path: Path) -> None:
    node = build_node(NodeSpec(roots=[RootComplex(0, "0-7", [Hca()])]), tmp_path)
    (hca,) = read_hcas(node.sysfs_root, node.dev_root, read_pci_functions(node.sysfs_root))
    assert str(node.dev_root) != "/dev"
    assert all(n.path.startswith("/dev/infiniband/") for n in hca.char_devices)
    assert all(n.present for n in hca.char_devices)


def test_port_state_is_read_as_written(tmp_path: Path) -> None:
    spec = NodeSpec(roots=[RootComplex(0, "0-7", [Hca(ports=[Port(*DOWN)])])])
    node = build_node(spec, tmp_path)
    (hca,) = read_hcas(node.sysfs_root, node.dev_root, read_pci_functions(node.sysfs_root))
    assert hca.ports[0].state_code == 1
    assert hca.ports[0].phys_state_code == 3


def test_software_rdma_device_without_pci_function_is_skipped(tmp_path: Path) -> None:
    node = build_node(NodeSpec(roots=[RootComplex(0, "0-7", [Hca()])]), tmp_path)
    rxe = node.sysfs_root / "devices" / "virtual" / "infiniband" / "rxe0"
    (rxe / "ports" / "1").mkdir(parents=True)
    (rxe / "ports" / "1" / "state").write_text("4: ACTIVE\n")
    os.symlink(
        os.path.relpath(rxe, node.sysfs_root / "class" / "infiniband"),
        node.sysfs_root / "class" / "infiniband" / "rxe0",
    )
    hcas = read_hcas(node.sysfs_root, node.dev_root, read_pci_functions(node.sysfs_root))
    assert [hca.name for hca in hcas] == ["mlx5_0"]


def test_an_hca_device_link_in_any_relative_form_names_its_function(tmp_path: Path) -> None:
    # The kernel's link is ../../../<function>, read without resolving the
    # whole path; another form that reaches the same directory (../..) is
    # resolved instead: the same HCA either way.
    node = build_node(NodeSpec(roots=[RootComplex(0, "0-7", [Hca()])]), tmp_path)
    pci = read_pci_functions(node.sysfs_root)
    (before,) = read_hcas(node.sysfs_root, node.dev_root, pci)
    link = node.sysfs_root / "class" / "infiniband" / "mlx5_0" / "device"
    real = link.resolve()
    assert os.readlink(link) == f"../../../{real.name}"
    link.unlink()
    os.symlink("../..", link)
    assert link.resolve() == real
    (after,) = read_hcas(node.sysfs_root, node.dev_root, pci)
    assert after == before
    assert str(after.pci_address) == real.name


def test_empty_or_missing_sysfs_gives_empty_inventory(tmp_path: Path) -> None:
    assert read_pci_functions(tmp_path / "nothing") == {}
    assert read_hcas(tmp_path / "nothing", tmp_path / "dev", {}) == ()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0000:1a:00.0", PciAddress(0, 0x1A, 0, 0)),
        ("00000000:1A:00.0", PciAddress(0, 0x1A, 0, 0)),
        ("0001:b3:1f.7", PciAddress(1, 0xB3, 0x1F, 7)),
        ("1a:00.1", PciAddress(0, 0x1A, 0, 1)),
    ],
)
def test_pci_address_parses_sysfs_and_nvml_forms(text: str, expected: PciAddress) -> None:
    assert PciAddress.parse(text) == expected
    assert PciAddress.parse(str(expected)) == expected


@pytest.mark.parametrize("text", ["", "0000:1a:00", "zz:00.0", "0000:1a:00.8", "100000000:1a:00.0"])
def test_pci_address_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError, match="PCI"):
        PciAddress.parse(text)
