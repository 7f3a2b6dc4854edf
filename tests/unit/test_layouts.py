"""The named layouts: in-memory devices match what discovery reads from disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from devplugin.node.discovery import Discoverer, NvmlGpuSource, Roots
from devplugin.policy.topology import Topology
from devplugin.testing.fake_nvml import FakeNvml
from devplugin.testing.layouts import LAYOUTS
from devplugin.testing.node import build_node, devices_from_spec


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_in_memory_layout_equals_discovered_layout(name: str, tmp_path: Path) -> None:
    spec = LAYOUTS[name]()
    node = build_node(spec, tmp_path)
    discoverer = Discoverer(
        Roots(node.sysfs_root, node.dev_root), NvmlGpuSource(FakeNvml.from_file(node.fixture))
    )
    inventory = discoverer.scan()
    discoverer.close()
    gpus, hcas = devices_from_spec(spec)
    assert [(g.uuid, g.pci_address, g.nvlink_peers) for g in gpus] == [
        (g.uuid, g.pci_address, g.nvlink_peers) for g in inventory.gpus
    ]
    assert [g.pci.path if g.pci else None for g in gpus] == [
        g.pci.path if g.pci else None for g in inventory.gpus
    ]
    assert [(h.device_id, h.name, h.pci.path if h.pci else None) for h in hcas] == [
        (h.device_id, h.name, h.pci.path if h.pci else None) for h in inventory.hcas
    ]
    memory, disk = Topology(gpus, hcas), Topology.from_inventory(inventory)
    ids = list(memory.kind)
    assert [[memory.link(a, b) for b in ids if b != a] for a in ids] == [
        [disk.link(a, b) for b in ids if b != a] for a in ids
    ]
