"""A third kind added in the tests alone (tests/third_kind: its wing, its
node side, its registry line and CRD entry) is discovered, judged,
recorded, drawn, published in slices and described to hooks, with nothing
else edited."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from devplugin.cluster.record import Registration, Stamps, build_status
from devplugin.frontends.dra.slices import node_devices, switch_keys
from devplugin.kinds.registry import ANCHOR, KINDS, PARTNER, paired_with
from devplugin.model import DeviceKind, Health, Inventory, PciAddress, PluginDevice
from devplugin.node.lifecycle.devices import describe
from devplugin.node.resources import ResourceState
from devplugin.picture import picture
from devplugin.testing.layouts import LAYOUTS
from devplugin.testing.node import BuiltNode, build_node
from devplugin.testing.sysfs import PciNode, SysfsBuilder
from tests.support import scan
from tests.third_kind.node.resource import ENV, NvmeResource
from tests.third_kind.nvme import NVME_CLASS, SAMSUNG, NvmeKind, crd_entry

CRD = Path(__file__).resolve().parents[2] / "charts/devplugin/crds/nodedevices.yaml"
# Past every bus the node builder numbers.
FIRST_FREE_BUS = 0xE0


@pytest.fixture
def nvme() -> Iterator[NvmeKind]:
    wing = NvmeKind(DeviceKind.declare("nvme"))
    try:
        with KINDS.extended(wing):
            yield wing
    finally:
        DeviceKind.forget(wing.kind)


def _add_drive(node: BuiltNode, beside_gpu: int, bus: int) -> PciAddress:
    """An NVMe drive on a new downstream port of the switch GPU `beside_gpu`
    hangs from (PIX to it), as a GPUDirect Storage server is built."""
    gpu_port = node.gpus[beside_gpu].directory.parent
    upstream = gpu_port.parent
    numa = int((node.gpus[beside_gpu].directory / "numa_node").read_text())
    cpus = (node.gpus[beside_gpu].directory / "local_cpulist").read_text().strip()
    builder = SysfsBuilder(node.sysfs_root, node.dev_root)
    parent = PciNode(upstream, None, numa, cpus)
    port_address = PciAddress(0, int(gpu_port.name.split(":")[1], 16), 0x1F, 0)
    port = builder.function(parent, port_address, vendor=0x1000, device=0xC030, pci_class=0x060400)
    drive = PciAddress(0, bus, 0, 0)
    builder.function(port, drive, vendor=SAMSUNG, device=0xA80A, pci_class=NVME_CLASS)
    return drive


def _node_with_drives(tmp_path: Path) -> tuple[Inventory, list[PciAddress]]:
    node = build_node(LAYOUTS["hgx-h100"](), tmp_path)
    drives = [_add_drive(node, gpu, FIRST_FREE_BUS + gpu) for gpu in (0, 4)]
    return scan(node), drives


def _states(inv: Inventory, nvme: NvmeKind) -> dict[DeviceKind, ResourceState]:
    def healthy(ids: list[str]) -> ResourceState:
        return ResourceState(tuple(PluginDevice(i, Health.HEALTHY) for i in ids), {})

    return {
        ANCHOR: healthy([g.uuid for g in inv.gpus]),
        PARTNER: healthy([h.device_id for h in inv.hcas]),
        nvme.kind: NvmeResource(nvme).state(inv),
    }


def test_the_drives_are_found_judged_and_handed_out(nvme: NvmeKind, tmp_path: Path) -> None:
    inv, drives = _node_with_drives(tmp_path)
    assert [nvme.device_id(d) for d in nvme.devices(inv)] == [str(d) for d in drives]
    resource = NvmeResource(nvme)
    state = resource.state(inv)
    assert state.healthy_ids() == {str(d) for d in drives}
    given = resource.allocate(state, [str(drives[1])])
    assert given.envs == {ENV: str(drives[1])}
    # It pairs as a partner does: with the anchor.
    assert paired_with(nvme.kind) is ANCHOR


def test_the_record_lists_the_drives_and_the_crd_with_its_entry_takes_it(
    nvme: NvmeKind, tmp_path: Path
) -> None:
    inv, drives = _node_with_drives(tmp_path)
    status = build_status(inv, _states(inv, nvme), [], Registration(True, "registered"))
    listed = [d for d in status["devices"] if d["kind"] == "nvme"]
    assert [d["id"] for d in listed] == [str(d) for d in drives]
    gpu0 = next(d for d in status["devices"] if d["id"] == inv.gpus[0].uuid)
    # Under GPU 0's switch: the same tree path down to the switch.
    assert listed[0]["topologyPath"] == gpu0["topologyPath"]
    assert listed[0]["vendorId"] == "0x144d"
    assert status["summary"]["nvmesTotal"] == status["summary"]["nvmesFree"] == 2
    shipped = yaml.safe_load(CRD.read_text())
    extended = crd_entry(copy.deepcopy(shipped), nvme)
    status = Stamps().apply(status)  # as the writer stamps it
    jsonschema.validate(status, _strict(_status(extended)))
    # The shipped CRD alone does not take it: the entry is what a kind adds.
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(status, _strict(_status(shipped)))


def _status(crd: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return dict(found["properties"]["status"])


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with unknown fields refused, as the API server prunes them."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node:
                node.setdefault("additionalProperties", False)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def test_the_picture_draws_each_drive_under_its_switch(nvme: NvmeKind, tmp_path: Path) -> None:
    inv, drives = _node_with_drives(tmp_path)
    status = build_status(inv, _states(inv, nvme), [], Registration(True, "registered"))
    drawn = picture("n1", status)
    boxes = {n.key: n for n in drawn.nodes if n.kind == "nvme"}
    assert set(boxes) == {f"nvme:{d}" for d in drives}
    parents = {e.head: e.tail for e in drawn.edges if e.kind == "tree"}
    gpu0 = f"gpu:{inv.gpus[0].uuid}"
    assert parents[f"nvme:{drives[0]}"] == parents[gpu0]
    assert "2/2 NVMe drives" in drawn.title


def test_the_slices_publish_the_drives_on_their_gpus_switch(nvme: NvmeKind, tmp_path: Path) -> None:
    inv, drives = _node_with_drives(tmp_path)
    published = node_devices(inv, [ANCHOR, PARTNER, nvme.kind])
    found = {d.id: d for d in published if d.kind is nvme.kind}
    assert set(found) == {str(d) for d in drives}
    attributes = found[str(drives[0])].body["attributes"]
    assert attributes["type"] == {"string": "nvme"}
    keys = switch_keys(inv.gpus[0].pci)
    assert keys is not None
    assert attributes["pcieSwitch"] == {"string": keys[0]}
    assert found[str(drives[0])].name == f"nvme-0000-{FIRST_FREE_BUS:02x}-00-0"


def test_hooks_are_told_of_each_drive(nvme: NvmeKind, tmp_path: Path) -> None:
    inv, drives = _node_with_drives(tmp_path)
    told = describe(inv, nvme.kind, [str(drives[0])])
    assert told is not None
    assert told[0].as_json()["nvme_pci"] == str(drives[0])
    assert describe(inv, nvme.kind, ["0000:ff:00.0"]) is None


def test_outside_its_registry_line_the_house_has_its_two_kinds(tmp_path: Path) -> None:
    inv, _ = _node_with_drives(tmp_path)
    assert [k.key for k in KINDS] == ["gpu", "hca"]
    assert [k.value for k in DeviceKind] == ["gpu", "hca"]
    status = build_status(
        inv,
        {ANCHOR: ResourceState((), {}), PARTNER: ResourceState((), {})},
        [],
        Registration(True, "registered"),
    )
    assert {d["kind"] for d in status["devices"]} == {"gpu", "hca"}
