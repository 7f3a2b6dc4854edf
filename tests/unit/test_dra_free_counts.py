"""The free counts on the slices and the claim templates' gate on them: a
node one device short is refused by the first scan, and a node that fits
gets exactly what it got without the gate."""

from __future__ import annotations

import random
from typing import Any

import pytest

from devplugin.frontends.dra.slices import FREE_GPUS, FREE_HCAS, FREE_IN_NVLINK_DOMAIN
from devplugin.policy.claim_templates import CHART_SHAPES, Shape, claim_spec, device_classes
from devplugin.testing.dra_scheduler import Allocator, spec_slices
from devplugin.testing.layouts import LAYOUTS
from devplugin.testing.node import hgx_node

DRIVER = "devplugin.io"
NODE = "node-1"
CLASSES = {c["metadata"]["name"]: c for c in device_classes(DRIVER)}
COUNTS = (FREE_GPUS, FREE_HCAS, FREE_IN_NVLINK_DOMAIN)
TARGET = 10_000


def entries(slices: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for item in slices for d in item["spec"]["devices"]}


def without_counts(slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The slices as a driver from before the counts published them."""
    bare = []
    for item in slices:
        devices = [
            {**d, "attributes": {k: v for k, v in d["attributes"].items() if k not in COUNTS}}
            for d in item["spec"]["devices"]
        ]
        bare.append({**item, "spec": {**item["spec"], "devices": devices}})
    return bare


def names(layout: str) -> tuple[list[str], list[str]]:
    slices, _ = spec_slices(LAYOUTS[layout](), DRIVER, NODE)
    found = list(entries(slices))
    return [n for n in found if n.startswith("gpu-")], [n for n in found if n.startswith("hca-")]


def test_free_counts_leave_out_held_and_unhealthy_devices_and_count_each_nvlink_domain() -> None:
    spec = hgx_node()
    slices, inventory = spec_slices(spec, DRIVER, NODE)
    gpus = sorted(n for n in entries(slices) if n.startswith("gpu-"))
    hcas = sorted(n for n in entries(slices) if n.startswith("hca-"))
    sick_uuid = entries(slices)[gpus[1]]["attributes"]["uuid"]["string"]
    held = {gpus[0], hcas[0], hcas[1]}
    counted, _ = spec_slices(spec, DRIVER, NODE, held=held, unhealthy=frozenset({sick_uuid}))
    for name, entry in entries(counted).items():
        attributes = entry["attributes"]
        # Every device says it, held, tainted or free: the gate reads the first it scans.
        assert attributes[FREE_GPUS] == {"int": len(gpus) - 2}, name
        assert attributes[FREE_HCAS] == {"int": len(hcas) - 2}, name
        if name.startswith("gpu-"):
            # hgx-h100: one NVLink domain of all eight GPUs.
            assert attributes[FREE_IN_NVLINK_DOMAIN] == {"int": len(gpus) - 2}, name
        else:
            assert FREE_IN_NVLINK_DOMAIN not in attributes
    # With unhealthy devices left out (dra.unhealthy: remove) the count is the same.
    removed, _ = spec_slices(
        spec, DRIVER, NODE, held=held, unhealthy=frozenset({sick_uuid}), mode="remove"
    )
    assert all(e["attributes"][FREE_GPUS] == {"int": 6} for e in entries(removed).values())
    assert len(inventory.gpus) == 8


def test_bridged_gpus_count_free_ones_per_nvlink_domain() -> None:
    slices, _ = spec_slices(LAYOUTS["16-gpu-bridged"](), DRIVER, NODE)
    gpus = {n: e for n, e in entries(slices).items() if "nvlinkDomain" in e["attributes"]}
    assert len(gpus) == 8  # four bridged pairs; the other eight GPUs have no NVLink
    domains: dict[str, list[str]] = {}
    for name, entry in gpus.items():
        domains.setdefault(entry["attributes"]["nvlinkDomain"]["string"], []).append(name)
    one = sorted(domains)[0]
    held = {domains[one][0]}
    counted, _ = spec_slices(LAYOUTS["16-gpu-bridged"](), DRIVER, NODE, held=held)
    for name, entry in entries(counted).items():
        if name in gpus:
            domain = gpus[name]["attributes"]["nvlinkDomain"]["string"]
            expected = len(domains[domain]) - (1 if domain == one else 0)
            assert entry["attributes"][FREE_IN_NVLINK_DOMAIN] == {"int": expected}
        else:
            assert FREE_IN_NVLINK_DOMAIN not in entry["attributes"]


@pytest.mark.parametrize(
    ("layout", "shape", "kind"),
    [
        ("hgx-h100", Shape(8, 8), "hca"),
        ("hgx-h100", Shape(8, 8), "gpu"),
        ("hgx-h100", Shape(4, 4), "hca"),
        ("64-gpu", Shape(8, 8), "hca"),
        ("32-gpu-bridged", Shape(2, 2), "hca"),
    ],
)
def test_a_node_one_device_short_is_refused_by_the_first_scan(
    layout: str, shape: Shape, kind: str
) -> None:
    gpus, hcas = names(layout)
    mine = gpus if kind == "gpu" else hcas
    need = shape.gpus if kind == "gpu" else shape.hcas
    held = set(mine[need - 1 :])
    taken = {(DRIVER, NODE, name) for name in held}
    slices, _ = spec_slices(LAYOUTS[layout](), DRIVER, NODE, held=held)
    gated = Allocator(slices, CLASSES, NODE)
    assert gated.allocate(claim_spec(shape, DRIVER), taken) is None
    assert gated.tries <= TARGET
    # The same node from a driver without the counts: the walk goes through
    # every order of the pairs before it gives up.
    blind = Allocator(without_counts(slices), CLASSES, NODE, budget=TARGET * 10)
    assert blind.allocate(claim_spec(shape, DRIVER), taken) is None
    assert blind.tries > TARGET


def test_nvlink_domains_too_small_for_the_claim_are_refused_at_once() -> None:
    slices, _ = spec_slices(LAYOUTS["16-gpu-bridged"](), DRIVER, NODE)
    shape = Shape(4, 4, nvlink=True)
    gated = Allocator(slices, CLASSES, NODE)
    assert gated.allocate(claim_spec(shape, DRIVER)) is None
    assert gated.tries <= TARGET
    blind = Allocator(without_counts(slices), CLASSES, NODE, budget=TARGET * 10)
    assert blind.allocate(claim_spec(shape, DRIVER)) is None
    assert blind.tries > TARGET


# One layout in the suite; the HGX node, the NVLink mesh and the asymmetric
# node (9 s, 7 s and 4.5 s of walks) with the slow simulations, which CI runs too.
@pytest.mark.parametrize(
    "layout",
    [
        "pcie-server",
        pytest.param("hgx-h100", marks=pytest.mark.slow),
        pytest.param("dgx-1", marks=pytest.mark.slow),
        pytest.param("asymmetric", marks=pytest.mark.slow),
    ],
)
def test_the_gate_changes_nothing_where_the_claim_fits_even_with_counts_behind(
    layout: str,
) -> None:
    """Whatever is held, and whether the counts have caught up with the
    claims the scheduler allocated or not: the gated walk picks what the
    ungated one picks, and refuses only where that one finds nothing."""
    rng = random.Random(f"gate-{layout}")
    gpus, hcas = names(layout)
    compared = refused = 0
    for _ in range(25):
        taken_names = {n for n in gpus + hcas if rng.random() < rng.uniform(0.0, 0.7)}
        # A claim allocated but not yet prepared: the counts miss it.
        published = {n for n in taken_names if rng.random() < 0.7}
        slices, _ = spec_slices(LAYOUTS[layout](), DRIVER, NODE, held=published)
        taken = {(DRIVER, NODE, n) for n in taken_names}
        for shape in CHART_SHAPES:
            spec = claim_spec(shape, DRIVER)
            gated = Allocator(slices, CLASSES, NODE, budget=20_000)
            blind = Allocator(without_counts(slices), CLASSES, NODE, budget=20_000)
            got, want = gated.allocate(spec, taken), blind.allocate(spec, taken)
            if blind.timed_out:
                continue
            assert got == want, (shape, sorted(taken_names))
            compared += 1
            refused += got is None
    assert compared >= 60
    assert 0 < refused < compared
