"""Device kinds are wings: what each kind alone knows lives in its wing, the
record's CRD agrees with what the wings write, a record read back gives
the node the daemon saw, and no code outside the wings and policy tests
which kind it holds."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from devplugin.kinds.base import PairRole
from devplugin.kinds.registry import ANCHOR, KINDS, PARTNER, paired_with, wing
from devplugin.policy.node_record import node_from_record, parse_record
from devplugin.policy.topology import Topology
from devplugin.testing.layouts import hgx_h100_mig
from tests.extender_support import inventory, record

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "devplugin"
CRD = ROOT / "charts/devplugin/crds/nodedevices.yaml"
# What every device of the record has, whatever its kind (cluster/record.py).
COMMON = {
    "id", "kind", "health", "reason", "pciAddress", "numaNode", "topologyPath",
    "resource", "replicas",
}  # fmt: skip
# Where testing which kind is held belongs: the wings, and pairing policy.
KIND_ROOMS = ("kinds", "policy", "testing", "api")
KIND_NAMES = {"GPU", "HCA"}
KIND_KEYS = {w.key for w in KINDS}


def _status_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return dict(schema["properties"]["status"])


# -- the CRD and the wings agree, field by field -------------------------------


def test_every_recorded_field_is_the_crds_and_owned_once() -> None:
    items = _status_schema()["properties"]["devices"]["items"]
    declared = dict(items["properties"])
    owned: dict[str, str] = {}
    for kind in KINDS:
        for name, schema in kind.record_schema.items():
            assert name not in COMMON, f"{kind.key} redefines the common field {name}"
            assert name not in owned, f"{name} is both {owned[name]}'s and {kind.key}'s"
            owned[name] = kind.key
            assert declared.get(name) == schema, f"the CRD's {name} is not the {kind.key} wing's"
    assert set(declared) == COMMON | set(owned), "the CRD declares a field no kind writes"
    assert items["properties"]["kind"]["enum"] == [kind.key for kind in KINDS]


def test_the_summary_has_a_total_and_a_free_count_per_kind() -> None:
    summary = _status_schema()["properties"]["summary"]["properties"]
    wanted = {"unhealthy"} | {f"{k.plural}{what}" for k in KINDS for what in ("Total", "Free")}
    assert set(summary) == wanted


# -- round trips: inventory -> record -> what placement reads --------------------


@pytest.mark.parametrize(
    ("layout", "mig"),
    [("hgx-h100", "none"), ("dgx-1", "none"), ("pcie-server", "none"), ("hgx-mig", "mixed")],
)
def test_a_record_read_back_gives_each_kind_the_node_the_daemon_saw(
    tmp_path: Path, layout: str, mig: str
) -> None:
    inv = inventory(hgx_h100_mig() if layout == "hgx-mig" else layout, tmp_path, mig)
    written = record(inv)
    devices = written["status"]["devices"]
    schema = _status_schema()["properties"]["devices"]
    jsonschema.validate(devices, schema)
    parsed = parse_record(written)
    read = {"gpu": parsed.gpus, "hca": parsed.hcas}
    for kind in KINDS:
        found = kind.devices(inv)
        assert found, f"{layout} has no {kind.noun}"
        entries = [d for d in devices if d["kind"] == kind.key]
        # Every device once, by its id, with the kind's own fields as written.
        assert [e["id"] for e in entries] == [kind.device_id(d) for d in found]
        for entry, device in zip(entries, found, strict=True):
            for name, value in kind.record_fields(device, inv).items():
                assert entry[name] == value
        back = {kind.device_id(d): d for d in read[kind.key]}
        assert set(back) == {kind.device_id(d) for d in found}
        for device in found:
            again = back[kind.device_id(device)]
            assert kind.pci(again)[0] == kind.pci(device)[0]
            assert kind.pci(again)[2] == kind.pci(device)[2]
    # What placement judges by: every pair's level and NVLinks, as on the node.
    seen, node = Topology.from_inventory(inv), node_from_record(written).topology
    ids = [i for kind in KINDS for i in seen.ids(kind.kind)]
    assert sorted(ids) == sorted(i for kind in KINDS for i in node.ids(kind.kind))
    for a, b in itertools.combinations(ids, 2):
        assert node.level(a, b) == seen.level(a, b), (a, b)
        assert node.nvlinks(a, b) == seen.nvlinks(a, b), (a, b)


def test_a_gpus_product_and_its_mig_devices_come_back(tmp_path: Path) -> None:
    inv = inventory(hgx_h100_mig(), tmp_path, mig_strategy="mixed")
    parsed = parse_record(record(inv))
    assert any(gpu.slice is not None for gpu in inv.gpus)
    assert set(parsed.mig) == {g.uuid for g in inv.gpus if g.slice is not None}
    assert parsed.products == tuple(g.name for g in sorted(inv.gpus, key=lambda g: g.index))


# -- pairing sees roles -----------------------------------------------------------


def test_one_anchor_and_each_partner_pairs_with_it() -> None:
    anchors = [k for k in KINDS if k.role is PairRole.ANCHOR]
    assert [k.kind for k in anchors] == [ANCHOR]
    assert wing(PARTNER).role is PairRole.PARTNER
    for kind in KINDS:
        expected = PARTNER if kind.role is PairRole.ANCHOR else ANCHOR
        assert paired_with(kind.kind) is expected


# -- no kind tested by name outside the wings and policy --------------------------


def _names_a_kind(node: ast.AST) -> bool:
    for part in ast.walk(node):
        if (
            isinstance(part, ast.Attribute)
            and part.attr in KIND_NAMES
            and isinstance(part.value, ast.Name)
            and part.value.id == "DeviceKind"
        ):
            return True
        if isinstance(part, ast.Compare):
            sides = [part.left, *part.comparators]
            if any(isinstance(s, ast.Constant) and s.value in KIND_KEYS for s in sides):
                return True
    return False


def kind_conditions(source: str) -> list[int]:
    """Lines of conditions (if, elif, while, conditional expressions,
    comprehension filters, assertions, match subjects) naming a kind."""
    found: list[int] = []
    for node in ast.walk(ast.parse(source)):
        tests: list[ast.AST] = []
        if isinstance(node, ast.If | ast.While | ast.IfExp | ast.Assert):
            tests.append(node.test)
        elif isinstance(node, ast.comprehension):
            tests.extend(node.ifs)
        elif isinstance(node, ast.Match):
            tests.append(node.subject)
        found.extend(getattr(t, "lineno", 0) for t in tests if _names_a_kind(t))
    return sorted(found)


def test_the_check_finds_a_condition_that_names_a_kind() -> None:
    planted = (
        "def f(kind, entry):\n"
        "    if kind is DeviceKind.GPU:\n"
        "        return 1\n"
        "    x = 2 if entry['kind'] == 'hca' else 3\n"
        "    return [k for k in kinds if k != DeviceKind.HCA]\n"
    )
    assert kind_conditions(planted) == [2, 4, 5]
    assert kind_conditions("def g(kind):\n    return wing(kind).cut\n") == []


def test_no_production_code_outside_the_wings_and_policy_tests_which_kind_it_holds() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        room = path.relative_to(PACKAGE).parts[0]
        if room in KIND_ROOMS:
            continue
        for line in kind_conditions(path.read_text()):
            offenders.append(f"{path.relative_to(ROOT)}:{line}")
    assert offenders == []


def test_kinds_are_named_by_member_in_few_places_outside_policy() -> None:
    """DeviceKind.GPU and .HCA outside kinds/ and policy/: the node side's
    resources and builders say which kind they serve (15 at most)."""
    count = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] in ("kinds", "policy"):
            continue
        tree = ast.parse(path.read_text())
        count += sum(
            isinstance(n, ast.Attribute)
            and n.attr in KIND_NAMES
            and isinstance(n.value, ast.Name)
            and n.value.id == "DeviceKind"
            for n in ast.walk(tree)
        )
    assert count <= 15
