"""The scheduler's allocator imitation and the claim templates it is fed:
first fit with backtracking, prioritized lists, constraints, CEL selectors,
taints; and templates that reach the best level any free choice allows."""

from __future__ import annotations

import copy
import dataclasses
import random
from collections import Counter
from typing import Any

import pytest
import yaml

from devplugin.cli import main
from devplugin.frontends.dra.slices import NUMA_NODE, UNKNOWN_NUMA
from devplugin.kinds.gpu import nvlink_domains
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
from devplugin.testing.dra_scheduler import (
    AllocationError,
    Allocator,
    inventory_slices,
    node_ids,
    pair_levels,
    spec_slices,
)
from devplugin.testing.layouts import LAYOUTS
from devplugin.testing.node import NodeSpec, RootComplex, Switch, devices_from_spec, hgx_node

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
    assert allocator.tries > 2  # it backtracked past the first GPU


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
    allocator = Allocator(slices, CLASSES, NODE, version=(1, 35))
    spec = {"devices": {"requests": [{"name": "g", "firstAvailable": [
        {"name": "many", "deviceClassName": f"gpu.{DRIVER}", "count": 12},
        {"name": "few", "deviceClassName": f"gpu.{DRIVER}", "count": 2},
    ]}]}}  # fmt: skip
    results = allocator.allocate(spec)
    assert results is not None
    assert [r["request"] for r in results] == ["g/few", "g/few"]
    # As the stable allocator walks it: every order of the 8 GPUs is tried
    # for `many` before `few` is (it checks no counts first).
    assert allocator.tries > 1_000_000
    # From 1.36 the incubating allocator tries each set of GPUs once: the
    # same answer in a few hundred tries (issue 39, difference 4).
    incubating = Allocator(slices, CLASSES, NODE, version=(1, 37))
    assert incubating.incubating
    assert incubating.allocate(spec) == results
    assert incubating.tries < 1_000


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
    # A claim's allocation holds at most 32 results (AllocationResultsMaxSize):
    # the scheduler refuses a claim asking for more (issue 39, difference 2).
    claim_spec(Shape(32, 0), DRIVER)
    for shape in (Shape(40, 0), Shape(17, 16), Shape(0, 33)):
        with pytest.raises(TemplateError, match="at most 32"):
            claim_spec(shape, DRIVER)


def test_the_claim_template_command_refuses_more_than_32_devices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["claim-template", "--gpus", "40", "--hcas", "0"]) != 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "at most 32" in captured.err


def _exactly(name: str, count: int, klass: str = "gpu", **extra: Any) -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": f"{klass}.{DRIVER}", "count": count,
                                      **extra}}  # fmt: skip


def test_the_allocator_refuses_a_claim_of_more_than_32_devices() -> None:
    """allocator_stable.go: the least devices a claim can get, summed over
    its requests, above 32 is an error before the walk; within the walk a
    branch that would pass 32 fails and the walk goes on (a prioritized
    list then falls back)."""
    slices, _ = node_slices(LAYOUTS["64-gpu"]())
    allocator = Allocator(slices, CLASSES, NODE)
    for requests in ([_exactly("g", 33)], [_exactly("a", 20), _exactly("b", 13)]):
        with pytest.raises(AllocationError, match="exceeds the claim limit of 32"):
            allocator.allocate({"devices": {"requests": requests}})
    whole = allocator.allocate({"devices": {"requests": [_exactly("g", 32)]}})
    assert whole is not None
    assert len(whole) == 32
    ladder = {"name": "g", "firstAvailable": [
        {"name": "many", "deviceClassName": f"gpu.{DRIVER}", "count": 40},
        {"name": "few", "deviceClassName": f"gpu.{DRIVER}", "count": 2},
    ]}  # fmt: skip
    fallen = allocator.allocate({"devices": {"requests": [ladder]}})
    assert fallen is not None
    assert {r["request"] for r in fallen} == {"g/few"}


def test_admin_access_takes_devices_in_use_and_holds_none() -> None:
    """allocator_stable.go allocateDevice: an adminAccess request may take a
    device another claim holds (only its own claim's are off limits); the
    scheduler does not count its results as allocated
    (dynamicresources/allocateddevices.go)."""
    from devplugin.testing.dra_scheduler import taken_devices

    slices, _ = node_slices(hgx_node())
    allocator = Allocator(slices, CLASSES, NODE)
    gpus = [d.name for d in allocator.devices if d.name.startswith("gpu-")]
    taken = {(DRIVER, NODE, name) for name in gpus}  # every GPU held by other claims
    assert allocator.allocate({"devices": {"requests": [_exactly("g", 1)]}}, taken) is None
    admin = {"devices": {"requests": [_exactly("g", 2, adminAccess=True)]}}
    results = allocator.allocate(admin, taken)
    assert results is not None
    assert [r["device"] for r in results] == gpus[:2]  # two different devices, both in use
    assert all(r["adminAccess"] is True for r in results)
    # Its results hold nothing: an ordinary claim still gets those devices.
    claims = [{"status": {"allocation": {"devices": {"results": results}}}}]
    assert taken_devices(claims) == set()
    ordinary = allocator.allocate({"devices": {"requests": [_exactly("g", 8)]}}, set())
    assert ordinary is not None
    assert {r["device"] for r in ordinary} >= set(gpus[:2])
    # Within one pod, a device an admin request took is in use for the
    # others: with only two GPUs free, the walk backtracks until the admin
    # request leaves both to the ordinary claim.
    both = allocator.allocate_all(
        [admin, {"devices": {"requests": [_exactly("g", 2)]}}],
        {(DRIVER, NODE, name) for name in gpus[2:]},
    )
    assert both is not None
    watching, working = ({r["device"] for r in claim} for claim in both)
    assert working == set(gpus[:2])
    assert not watching & working


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
    assert main(["claim-template", "--gpus", "1", "--hcas", "1", "--mig", "1g.10gb"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == claim_template(Shape(1, 1, mig="1g.10gb"), DRIVER)
    assert printed["metadata"]["name"] == "1-pair-mig-1g.10gb"
    assert main(["claim-template", "--gpus", "1", "--hcas", "1", "--mig", "big"]) == 2
    assert "not a MIG profile" in capsys.readouterr().err


def test_memory_is_published_as_the_api_server_stores_it() -> None:
    from devplugin.testing.dra_limits import slice_defaults
    from devplugin.wire.resourceslice import mebibytes

    assert mebibytes(81920) == "80Gi"
    assert mebibytes(81559) == "81559Mi"
    assert mebibytes(192 * 1024 * 1024) == "192Ti"
    rng = random.Random(3)
    for value in [rng.randrange(1, 1 << 22) * rng.choice([1, 1024, 4096]) for _ in range(200)]:
        stored = {"spec": {"devices": [{"capacity": {"memory": {"value": f"{value}Mi"}}}]}}
        slice_defaults(stored, "2026-12-04T00:00:00Z")
        assert stored["spec"]["devices"][0]["capacity"]["memory"]["value"] == mebibytes(value)


# -- devices that lack a place attribute (issue 30) ----------------------------------


def without_numa(spec: NodeSpec) -> NodeSpec:
    """The layout on a host whose sysfs gives every device NUMA node -1
    (single-socket hosts, most VMs)."""
    return dataclasses.replace(
        spec, roots=[dataclasses.replace(root, numa_node=None) for root in spec.roots]
    )


def hca_on_a_root_port() -> NodeSpec:
    """hgx-h100 with one pair's HCA moved off its switch onto a root port of
    its own (no PCIe switch above it)."""
    spec = hgx_node()
    first = spec.roots[0]
    switch = first.children[0]
    assert isinstance(switch, Switch)
    moved = dataclasses.replace(first, children=[Switch([switch.children[0]])])
    alone = RootComplex(numa_node=first.numa_node, local_cpulist=first.local_cpulist)
    alone.children.append(switch.children[1])
    return dataclasses.replace(spec, roots=[moved, alone, *spec.roots[1:]])


def hcas_path(inventory: Inventory) -> tuple[object, ...]:
    """The PCI chain of the HCA with the longest one."""
    return max((h.pci.path.chain for h in inventory.hcas if h.pci), key=len)


def best_free_level_is_reached(
    slices: list[dict[str, Any]], topology: Topology, *, rounds: int = 25
) -> int:
    """The one-pair template, over random sets of taken devices, allocates a
    pair at the best level free each time; how many rounds allocated."""
    names = ids(slices)
    allocator = Allocator(slices, CLASSES, NODE)
    spec = claim_spec(Shape(1, 1), DRIVER)
    devices = [d.name for d in allocator.devices]
    rng = random.Random(11)
    allocated = 0
    for _ in range(rounds):
        taken = {(DRIVER, NODE, n) for n in devices if rng.random() < 0.5}
        free_gpus = [n for n in devices if n.startswith("gpu-") and (DRIVER, NODE, n) not in taken]
        free_hcas = [n for n in devices if n.startswith("hca-") and (DRIVER, NODE, n) not in taken]
        if not free_gpus or not free_hcas:
            continue
        best = min(topology.level(names[g], names[h]) for g in free_gpus for h in free_hcas)
        results = allocator.allocate(spec, taken)
        assert results is not None, f"nothing allocated with a {best.name} pair free"
        (level,) = pair_levels(results, names, topology)
        assert level == best
        allocated += 1
    return allocated


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_with_every_numa_node_unknown_the_best_free_pair_is_allocated(layout: str) -> None:
    slices, inventory = node_slices(without_numa(LAYOUTS[layout]()))
    assert all(
        device["attributes"][NUMA_NODE] == {"int": UNKNOWN_NUMA}
        for item in slices
        for device in item["spec"]["devices"]
    )
    assert best_free_level_is_reached(slices, Topology.from_inventory(inventory)) > 0
    # Every chart template that fits the node allocates on it, free.
    allocator = Allocator(slices, CLASSES, NODE)
    domains = Counter(nvlink_domains(inventory.gpus).values())
    for shape in CHART_SHAPES:
        if shape.gpus > len(inventory.gpus) or shape.hcas > len(inventory.hcas):
            continue
        if shape.nvlink and max(domains.values(), default=0) < shape.gpus:
            continue
        assert allocator.allocate(claim_spec(shape, DRIVER)) is not None, shape


def test_an_hca_without_a_switch_pairs_at_the_best_level_it_has() -> None:
    slices, inventory = node_slices(hca_on_a_root_port())
    topology = Topology.from_inventory(inventory)
    assert best_free_level_is_reached(slices, topology) > 0
    # Its own GPU's old partner now shares only the NUMA node with it: with
    # everything else taken, that pair is still allocated (at NODE).
    names = ids(slices)
    # The moved HCA: the one with the shortest path (no switch above it).
    alone = min(inventory.hcas, key=lambda h: len(h.pci.path.chain) if h.pci else 0)
    assert alone.pci is not None
    assert len(alone.pci.path.chain) < len(hcas_path(inventory))
    gpu = inventory.gpus[0]
    allocator = Allocator(slices, CLASSES, NODE)
    keep = {n for n, i in names.items() if i in (alone.device_id, gpu.uuid)}
    taken = {(DRIVER, NODE, d.name) for d in allocator.devices if d.name not in keep}
    results = allocator.allocate(claim_spec(Shape(1, 1), DRIVER), taken)
    assert results is not None
    assert pair_levels(results, names, topology) == [topology.level(gpu.uuid, alone.device_id)]


def test_a_device_of_unknown_position_is_paired_only_by_the_any_rung() -> None:
    gpus, hcas = devices_from_spec(hgx_node())
    lost = dataclasses.replace(hcas[0], pci=None)
    inventory = Inventory(gpus=gpus, hcas=[lost, *hcas[1:]])
    slices = inventory_slices(inventory, DRIVER, NODE)
    names = ids(slices)
    allocator = Allocator(slices, CLASSES, NODE)
    (lost_name,) = [n for n, i in names.items() if i == lost.device_id]
    attributes = next(d.attributes for d in allocator.devices if d.name == lost_name)
    assert attributes[f"{DRIVER}/{NUMA_NODE}"] < UNKNOWN_NUMA
    # Only it and one GPU are free: the pair is made, by the `any` rung.
    keep = {lost_name, next(n for n in names if n.startswith("gpu-"))}
    taken = {(DRIVER, NODE, d.name) for d in allocator.devices if d.name not in keep}
    results = allocator.allocate(claim_spec(Shape(1, 1), DRIVER), taken)
    assert results is not None
    assert {r["request"] for r in results} == {"gpu-0/any", "hca-0"}


# -- taints and the scheduler's version (issue 30) ---------------------------------


def test_before_1_36_the_scheduler_ignores_taints_so_unhealthy_devices_are_left_out() -> None:
    spec = hgx_node()
    gpus, hcas = devices_from_spec(spec)
    # A pair's devices are awaiting their cleanup (Unhealthy until it ends).
    owed = frozenset({gpus[0].uuid, hcas[0].device_id})
    claim = claim_spec(Shape(1, 1), DRIVER)

    def allocated(mode: str, version: tuple[int, int]) -> set[str]:
        slices, _ = node_slices_with(spec, owed, mode)
        names = ids(slices)
        allocator = Allocator(slices, CLASSES, NODE, version=version)
        results = allocator.allocate(claim)
        assert results is not None
        return {names[r["device"]] for r in results}

    # The taint is what keeps them out on 1.36, where the gate is on by default.
    assert not allocated("taint", (1, 36)) & owed
    # On 1.34 and 1.35 a tainted device is handed out (and its prepare refused).
    assert allocated("taint", (1, 34)) == owed
    assert allocated("taint", (1, 35)) == owed
    # With those versions' chart default (remove), it is never allocated,
    # whatever else is taken: every claim over the rest of the node.
    for version in ((1, 34), (1, 35)):
        slices, _ = node_slices_with(spec, owed, "remove")
        names = ids(slices)
        allocator = Allocator(slices, CLASSES, NODE, version=version)
        taken: set[tuple[str, str, str]] = set()
        while (results := allocator.allocate(claim, taken)) is not None:
            assert not {names[r["device"]] for r in results} & owed
            taken |= {(DRIVER, NODE, r["device"]) for r in results}
        assert len(taken) == 2 * (len(gpus) - 1)


def node_slices_with(
    spec: NodeSpec, unhealthy: frozenset[str], mode: str
) -> tuple[list[dict[str, Any]], Inventory]:
    return spec_slices(spec, DRIVER, NODE, unhealthy=unhealthy, mode=mode)


# -- where the real allocator errors out, and its walk (issue 30) -------------------


def two_gpus(class_name: str = f"gpu.{DRIVER}", mode: str = "ExactCount") -> dict[str, Any]:
    body: dict[str, Any] = {"deviceClassName": class_name, "allocationMode": mode}
    if mode == "ExactCount":
        body["count"] = 2
    return {"devices": {"requests": [{"name": "g", "exactly": body}]}}


def test_a_missing_device_class_is_an_error_not_a_non_match() -> None:
    slices, _ = node_slices(hgx_node())
    allocator = Allocator(slices, CLASSES, NODE)
    with pytest.raises(AllocationError, match="could not retrieve device class nope"):
        allocator.allocate(two_gpus("nope"))


def test_a_cel_runtime_error_aborts_the_allocation() -> None:
    slices, _ = node_slices(hgx_node())
    classes = dict(CLASSES)
    broken = copy.deepcopy(classes[f"gpu.{DRIVER}"])
    # An attribute no device has, read without has(): a runtime error.
    broken["spec"]["selectors"] = [
        {"cel": {"expression": f'device.attributes["{DRIVER}"].vendorSecret == "x"'}}
    ]
    classes["broken"] = broken
    allocator = Allocator(slices, classes, NODE)
    with pytest.raises(AllocationError, match="CEL runtime error"):
        allocator.allocate(two_gpus("broken"))


def test_all_mode_is_strict_one_device_in_use_fails_it() -> None:
    slices, _ = node_slices(hgx_node())
    allocator = Allocator(slices, CLASSES, NODE)
    every = two_gpus(mode="All")
    results = allocator.allocate(every)
    assert results is not None
    assert len(results) == 8
    first_gpu = next(d.name for d in allocator.devices if d.name.startswith("gpu-"))
    assert allocator.allocate(every, {(DRIVER, NODE, first_gpu)}) is None


def test_all_mode_with_a_constraint_it_cannot_meet_is_an_error() -> None:
    slices, _ = node_slices(hgx_node())
    allocator = Allocator(slices, CLASSES, NODE)
    spec = two_gpus(mode="All")
    spec["devices"]["constraints"] = [{"matchAttribute": f"{DRIVER}/pcieSwitch"}]
    with pytest.raises(AllocationError, match="constraint would not be satisfied"):
        allocator.allocate(spec)


def test_slices_are_walked_in_the_order_given() -> None:
    slices, _ = node_slices(LAYOUTS["64-gpu"]())
    assert len(slices) > 1
    one = {
        "devices": {"requests": [{"name": "g", "exactly": {"deviceClassName": f"gpu.{DRIVER}"}}]}
    }

    def first_gpu(order: list[dict[str, Any]]) -> str:
        names = [d["name"] for item in order for d in item["spec"]["devices"]]
        return next(name for name in names if name.startswith("gpu-"))

    stable = (1, 35)
    forward = Allocator(slices, CLASSES, NODE, version=stable).allocate(one)
    backward = Allocator(list(reversed(slices)), CLASSES, NODE, version=stable).allocate(one)
    assert forward is not None
    assert backward is not None
    assert forward[0]["device"] == first_gpu(slices)
    assert backward[0]["device"] == first_gpu(list(reversed(slices)))
    assert forward[0]["device"] != backward[0]["device"]


def test_from_1_36_slices_are_walked_sorted_by_name_whatever_the_order_given() -> None:
    """incubating/pools_incubating.go: a pool's slices sorted by name (and
    pools by driver and name) before the walk (issue 39, difference 4)."""
    slices, _ = node_slices(LAYOUTS["64-gpu"]())
    one = {
        "devices": {"requests": [{"name": "g", "exactly": {"deviceClassName": f"gpu.{DRIVER}"}}]}
    }
    by_name = sorted(slices, key=lambda item: item["metadata"]["name"])
    names = [d["name"] for item in by_name for d in item["spec"]["devices"]]
    first = next(name for name in names if name.startswith("gpu-"))
    for order in (slices, list(reversed(slices))):
        found = Allocator(order, CLASSES, NODE, version=(1, 37)).allocate(one)
        assert found is not None
        assert found[0]["device"] == first


def test_the_extenders_claim_view_does_not_count_admin_access_results() -> None:
    from devplugin.extender.dra_views import parse_claim

    results = [
        {"request": "g", "driver": DRIVER, "pool": NODE, "device": "gpu-a", "adminAccess": True},
        {"request": "h", "driver": DRIVER, "pool": NODE, "device": "hca-a"},
    ]
    claim = {"metadata": {"namespace": "ops", "name": "watch"},
             "status": {"allocation": {"devices": {"results": results}}}}  # fmt: skip
    _, parsed = parse_claim(claim)
    assert parsed.allocated
    assert parsed.held == ((DRIVER, NODE, "hca-a"),)
