"""The scheduler's allocator imitation and the claim templates it is fed:
first fit with backtracking, prioritized lists, constraints, CEL selectors,
taints; and templates that reach the best level any free choice allows."""

from __future__ import annotations

import random
from typing import Any

import pytest
import yaml

from devplugin.cli import main
from devplugin.model import Inventory
from devplugin.policy.claim_templates import (
    CHART_SHAPES,
    Shape,
    TemplateError,
    claim_spec,
    claim_template,
    device_classes,
)
from devplugin.policy.topology import Level, Topology
from devplugin.testing.dra_scheduler import Allocator, node_ids, pair_levels, spec_slices
from devplugin.testing.layouts import LAYOUTS
from devplugin.testing.node import devices_from_spec, hgx_node

DRIVER = "devplugin.io"
NODE = "node-1"
CLASSES = {c["metadata"]["name"]: c for c in device_classes(DRIVER)}


def node_slices(
    spec: Any, unhealthy: frozenset[str] = frozenset()
) -> tuple[list[dict[str, Any]], Inventory]:
    return spec_slices(spec, DRIVER, NODE, unhealthy=unhealthy)


ids = node_ids


def test_exact_counts_selectors_and_first_fit_order() -> None:
    slices, _ = node_slices(hgx_node())
    allocator = Allocator(slices, CLASSES, NODE)
    spec = {"devices": {"requests": [
        {"name": "g", "exactly": {"deviceClassName": f"gpu.{DRIVER}", "count": 3}},
        {"name": "h", "exactly": {"deviceClassName": f"hca.{DRIVER}", "count": 1, "selectors": [
            {"cel": {"expression": f'device.attributes["{DRIVER}"].ibdev == "mlx5_4"'}}]}},
    ]}}  # fmt: skip
    results = allocator.allocate(spec)
    assert results is not None
    order = [d.name for d in allocator.devices]
    gpus = [r["device"] for r in results if r["request"] == "g"]
    assert gpus == [n for n in order if n.startswith("gpu-")][:3]  # first fit
    (hca,) = [r for r in results if r["request"] == "h"]
    assert allocator.devices[order.index(hca["device"])].attributes[f"{DRIVER}/ibdev"] == "mlx5_4"
    nine = {"devices": {"requests": [
        {"name": "g", "exactly": {"deviceClassName": f"gpu.{DRIVER}", "count": 9}}]}}  # fmt: skip
    assert allocator.allocate(nine) is None


def test_constraints_backtrack_and_taken_devices_are_skipped() -> None:
    slices, inventory = node_slices(hgx_node())
    allocator = Allocator(slices, CLASSES, NODE)
    names = ids(slices)
    topology = Topology.from_inventory(inventory)
    hcas = [d for d in allocator.devices if d.name.startswith("hca-")]
    gpus = [d for d in allocator.devices if d.name.startswith("gpu-")]
    # The first GPU's own HCA is taken: a PIX pair must use another GPU.
    taken = {(DRIVER, NODE, hcas[0].name)}
    spec = {"devices": {
        "requests": [
            {"name": "gpu", "exactly": {"deviceClassName": f"gpu.{DRIVER}"}},
            {"name": "hca", "exactly": {"deviceClassName": f"hca.{DRIVER}"}},
        ],
        "constraints": [{"requests": ["gpu", "hca"], "matchAttribute": f"{DRIVER}/pcieSwitch"}],
    }}  # fmt: skip
    results = allocator.allocate(spec, taken)
    assert results is not None
    chosen = {r["request"]: r["device"] for r in results}
    assert chosen["gpu"] != gpus[0].name
    assert topology.level(names[chosen["gpu"]], names[chosen["hca"]]) is Level.PIX
    assert allocator.steps > 2  # it backtracked past the first GPU


def test_tainted_devices_are_used_only_when_tolerated() -> None:
    gpus, _ = devices_from_spec(hgx_node())
    slices, _ = node_slices(hgx_node(), unhealthy=frozenset(g.uuid for g in gpus[1:]))
    allocator = Allocator(slices, CLASSES, NODE)
    two = {"devices": {"requests": [
        {"name": "g", "exactly": {"deviceClassName": f"gpu.{DRIVER}", "count": 2}}]}}  # fmt: skip
    assert allocator.allocate(two) is None
    tolerant = {"devices": {"requests": [{"name": "g", "exactly": {
        "deviceClassName": f"gpu.{DRIVER}", "count": 2,
        "tolerations": [{"key": f"{DRIVER}/unhealthy", "operator": "Exists"}]}}]}}  # fmt: skip
    assert allocator.allocate(tolerant) is not None


def test_prioritized_list_falls_back_in_order_and_names_the_subrequest() -> None:
    slices, _ = node_slices(hgx_node())
    allocator = Allocator(slices, CLASSES, NODE)
    spec = {"devices": {"requests": [{"name": "g", "firstAvailable": [
        {"name": "many", "deviceClassName": f"gpu.{DRIVER}", "count": 12},
        {"name": "few", "deviceClassName": f"gpu.{DRIVER}", "count": 2},
    ]}]}}  # fmt: skip
    results = allocator.allocate(spec)
    assert results is not None
    assert [r["request"] for r in results] == ["g/few", "g/few"]


@pytest.mark.parametrize("layout", ["hgx-h100", "dgx-a100", "pcie-server", "asymmetric", "16-gpu"])
def test_a_one_pair_template_reaches_the_best_free_level(layout: str) -> None:
    slices, inventory = node_slices(LAYOUTS[layout]())
    names = ids(slices)
    topology = Topology.from_inventory(inventory)
    allocator = Allocator(slices, CLASSES, NODE)
    spec = claim_spec(Shape(1, 1), DRIVER)
    rng = random.Random(7)
    devices = [d.name for d in allocator.devices]
    for _ in range(25):
        taken = {(DRIVER, NODE, n) for n in devices if rng.random() < 0.5}
        free_gpus = [n for n in devices if n.startswith("gpu-") and (DRIVER, NODE, n) not in taken]
        free_hcas = [n for n in devices if n.startswith("hca-") and (DRIVER, NODE, n) not in taken]
        if not free_gpus or not free_hcas:
            continue
        best = min(topology.level(names[g], names[h]) for g in free_gpus for h in free_hcas)
        results = allocator.allocate(spec, taken)
        assert results is not None
        (level,) = pair_levels(results, names, topology)
        assert level == best


def test_templates_respect_the_claim_limits() -> None:
    for shape in CHART_SHAPES:
        devices = claim_spec(shape, DRIVER)["devices"]
        assert len(devices["requests"]) <= 32
        assert len(devices.get("constraints", [])) <= 32
        for request in devices["requests"]:
            assert len(request.get("firstAvailable", [])) <= 8
    with pytest.raises(TemplateError, match="at most 8"):
        claim_spec(Shape(9, 9), DRIVER)
    with pytest.raises(TemplateError, match="at least one"):
        claim_spec(Shape(0, 0), DRIVER)


def test_claim_template_command_prints_a_template(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["claim-template", "--gpus", "2", "--hcas", "2"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == claim_template(Shape(2, 2), DRIVER)
    constraints = printed["spec"]["spec"]["devices"]["constraints"]
    assert constraints[0] == {
        "requests": ["gpu-0/pix", "hca-0"],
        "matchAttribute": f"{DRIVER}/pcieSwitch",
    }
    assert (
        main(
            [
                "claim-template",
                "--gpus",
                "4",
                "--hcas",
                "2",
                "--prefer",
                "PXB",
                "--driver",
                "x.example",
                "--name",
                "mine",
            ]
        )
        == 0
    )
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["metadata"]["name"] == "mine"
    requests = printed["spec"]["spec"]["devices"]["requests"]
    assert [r["name"] for r in requests] == ["gpu-0", "hca-0", "gpu-1", "hca-1", "gpus"]
    assert [s["name"] for s in requests[0]["firstAvailable"]] == ["pxb", "phb", "node", "any"]
    assert main(["claim-template", "--gpus", "9", "--hcas", "9"]) == 2
    assert "at most 8" in capsys.readouterr().err


def test_memory_is_published_as_the_api_server_stores_it() -> None:
    from devplugin.frontends.dra.slices import mebibytes
    from devplugin.testing.dra_limits import slice_defaults

    assert mebibytes(81920) == "80Gi"
    assert mebibytes(81559) == "81559Mi"
    assert mebibytes(192 * 1024 * 1024) == "192Ti"
    rng = random.Random(3)
    for value in [rng.randrange(1, 1 << 22) * rng.choice([1, 1024, 4096]) for _ in range(200)]:
        stored = {"spec": {"devices": [{"capacity": {"memory": {"value": f"{value}Mi"}}}]}}
        slice_defaults(stored, "2026-12-04T00:00:00Z")
        assert stored["spec"]["devices"][0]["capacity"]["memory"]["value"] == mebibytes(value)
