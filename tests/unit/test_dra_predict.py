"""The extender's prediction of the allocator: its CEL subset judges as
cel-python does, and its walk picks what the scheduler's imitation picks."""

from __future__ import annotations

import random
from typing import Any

import celpy
import pytest
from celpy.adapter import json_to_cel

from devplugin.policy.cel import EvalError, Unsupported, compile_selector, matches
from devplugin.policy.claim_templates import CHART_SHAPES, Shape, claim_spec, device_classes
from devplugin.policy.dra_predict import (
    NodeDevices,
    Prediction,
    Selectors,
    Unpredictable,
    pair_level,
    predict,
    ranks,
)
from devplugin.policy.dra_walk import candidates
from devplugin.policy.topology import Level, Topology
from devplugin.testing.dra_scheduler import Allocator, node_ids, pair_levels, spec_slices
from devplugin.testing.layouts import LAYOUTS

DRIVER = "devplugin.io"
SLOW_LAYOUTS = ["dgx-a100", "asymmetric", "16-gpu", "dgx-1x2"]
NODE = "node-1"
CLASSES = {c["metadata"]["name"]: c for c in device_classes(DRIVER)}

DEVICE = {
    "driver": DRIVER,
    "attributes": {
        DRIVER: {"type": "gpu", "freeGpus": 3, "ok": True, "name": 'a "quoted" name'},
        "resource.kubernetes.io": {"numaNode": -1},
    },
    "capacity": {},
}
EXPRESSIONS = [
    f'device.driver == "{DRIVER}"',
    f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "gpu"',
    f'device.attributes["{DRIVER}"].type == "hca"',
    f'device.attributes["{DRIVER}"].freeGpus >= 3',
    f'device.attributes["{DRIVER}"].freeGpus > 3 || device.attributes["{DRIVER}"].ok',
    f'!has(device.attributes["{DRIVER}"].freeHcas) || device.attributes["{DRIVER}"].freeHcas >= 1',
    f'has(device.attributes["{DRIVER}"].freeGpus) && device.attributes["{DRIVER}"].freeGpus != 2',
    'device.attributes["resource.kubernetes.io"].numaNode == -1',
    'device.attributes["resource.kubernetes.io"]["numaNode"] < 0',
    f'device.attributes["{DRIVER}"].name == "a \\"quoted\\" name"',
    f'!(device.attributes["{DRIVER}"].ok) || false',
    # Errors: a missing key, a type mismatch; absorbed where the other side decides.
    f'device.attributes["{DRIVER}"].missing == 1',
    f'device.attributes["{DRIVER}"].type == 1',
    f'false && device.attributes["{DRIVER}"].missing == 1',
    f'device.attributes["{DRIVER}"].missing == 1 || true',
    f'device.attributes["{DRIVER}"].missing == 1 && false',
]


@pytest.mark.parametrize("expression", EXPRESSIONS)
def test_the_cel_subset_judges_as_cel_python_does(expression: str) -> None:
    env = celpy.Environment()
    try:
        want: bool | str = bool(
            env.program(env.compile(expression)).evaluate({"device": json_to_cel(DEVICE)})
        )
    except Exception:  # noqa: BLE001 - any CEL runtime error
        want = "error"
    try:
        got: bool | str = matches(compile_selector(expression), DEVICE)
    except EvalError:
        got = "error"
    assert got == want


@pytest.mark.parametrize(
    "expression",
    [
        f'device.capacity["{DRIVER}"].memory.compareTo(quantity("40Gi")) >= 0',
        f'device.attributes["{DRIVER}"].name.startsWith("a")',
        f'device.attributes["{DRIVER}"].type in ["gpu", "hca"]',
        "1 + 1 == 2",
        "other.driver == 'x'",
        f'device.attributes["{DRIVER}"].cc == 9.0',
        "device.driver ==",
        "(" * 40 + "true" + ")" * 40,
    ],
)
def test_what_is_outside_the_subset_is_refused_when_compiled(expression: str) -> None:
    with pytest.raises(Unsupported):
        compile_selector(expression)


def _used(names: list[str], rng: random.Random) -> set[tuple[str, str, str]]:
    busy = rng.uniform(0.0, 0.7)
    return {(DRIVER, NODE, name) for name in names if rng.random() < busy}


# One layout in the suite, the rest (two to five seconds of walks each) with
# the slow simulations, which CI runs too.
@pytest.mark.parametrize(
    "layout",
    [
        "hgx-h100",
        *(pytest.param(name, marks=pytest.mark.slow) for name in SLOW_LAYOUTS),
    ],
)
def test_the_prediction_is_the_allocators_choice(layout: str) -> None:
    rng = random.Random(f"predict-{layout}")
    selectors = Selectors()
    agreed = fitted = 0
    for _ in range(12):
        slices, inventory = spec_slices(LAYOUTS[layout](), DRIVER, NODE)
        names = [d.name for d in candidates(slices, NODE)]
        used = _used(names, rng)
        held = {name for _, _, name in used}
        slices, _ = spec_slices(LAYOUTS[layout](), DRIVER, NODE, held=held)
        node = NodeDevices(candidates(slices, NODE))
        topology = Topology.from_inventory(inventory)
        ids = node_ids(slices)
        for shape in CHART_SHAPES:
            spec = claim_spec(shape, DRIVER)
            scheduler = Allocator(slices, CLASSES, NODE, device_taints=True)
            picked = scheduler.allocate(spec, used)
            predicted = predict(node, [spec], CLASSES, used, selectors, device_taints=True)
            assert predicted.fits == (picked is not None)
            agreed += 1
            if picked is None:
                continue
            fitted += 1
            levels = pair_levels(picked, ids, topology)
            if levels:
                # The level read from the attributes is the topology's level.
                assert predicted.worst == max(levels)
                assert predicted.total == sum(int(level) for level in levels)
    assert agreed == 12 * len(CHART_SHAPES)
    assert fitted > 0


def test_pods_with_two_claims_are_walked_together() -> None:
    slices, _ = spec_slices(LAYOUTS["hgx-h100"](), DRIVER, NODE)
    node = NodeDevices(candidates(slices, NODE))
    specs = [claim_spec(Shape(4, 4), DRIVER), claim_spec(Shape(4, 4), DRIVER)]
    both = predict(node, specs, CLASSES, set(), Selectors(), device_taints=True)
    assert both.fits
    assert both.worst == Level.PIX
    scheduler = Allocator(slices, CLASSES, NODE)
    picked = scheduler.allocate_all(specs)
    assert picked is not None
    first = {r["device"] for r in picked[0]}
    second = {r["device"] for r in picked[1]}
    assert len(first) == len(second) == 8
    assert not first & second
    # Each claim's gate reads the node's counts alone: claims that fit one by
    # one but not together are walked to the end. Past its budget the
    # extender says nothing rather than hold the call.
    three = [*specs, claim_spec(Shape(1, 1), DRIVER)]
    with pytest.raises(Unpredictable, match="device tries"):
        predict(node, three, CLASSES, set(), Selectors(), device_taints=True, budget=5_000)


def test_what_cannot_be_followed_is_unpredictable_not_a_guess() -> None:
    slices, _ = spec_slices(LAYOUTS["hgx-h100"](), DRIVER, NODE)
    node = NodeDevices(candidates(slices, NODE))
    spec: dict[str, Any] = claim_spec(Shape(1, 1), DRIVER)
    spec["devices"]["requests"][1]["exactly"]["selectors"] = [
        {"cel": {"expression": f'device.capacity["{DRIVER}"].memory.isGreaterThan(1)'}}
    ]
    with pytest.raises(Unpredictable, match="supported CEL"):
        predict(node, [spec], CLASSES, set(), Selectors(), device_taints=True)
    missing = claim_spec(Shape(1, 1), "other.example.com")
    with pytest.raises(Unpredictable, match="device class"):
        predict(node, [missing], CLASSES, set(), Selectors(), device_taints=True)
    erring = claim_spec(Shape(1, 0, prefer="NONE"), DRIVER)
    erring["devices"]["requests"][0]["exactly"]["selectors"] = [
        {"cel": {"expression": f'device.attributes["{DRIVER}"].nothing == 1'}}
    ]
    with pytest.raises(Unpredictable, match="selector error"):
        predict(node, [erring], CLASSES, set(), Selectors(), device_taints=True)


def test_pair_levels_come_from_the_rung_attributes() -> None:
    slices, inventory = spec_slices(LAYOUTS["dgx-a100"](), DRIVER, NODE)
    devices = candidates(slices, NODE)
    topology = Topology.from_inventory(inventory)
    ids = node_ids(slices)
    gpus = [d for d in devices if d.name.startswith("gpu-")]
    hcas = [d for d in devices if d.name.startswith("hca-")]
    seen = set()
    for gpu in gpus:
        for hca in hcas:
            level = pair_level(gpu, hca)
            assert level == topology.level(ids[gpu.name], ids[hca.name])
            seen.add(level)
    assert {Level.PIX, Level.SYS} <= seen


def test_ranks_put_the_best_worst_pair_first_and_give_nothing_to_misfits() -> None:
    predictions = {
        "a": Prediction(True, Level.PIX, 2),
        "b": Prediction(True, Level.PXB, 3),
        "c": Prediction(True, Level.PIX, 3),
        "d": Prediction(False),
        "e": None,
    }
    scored = ranks(predictions)
    assert scored == {"a": 10, "c": 9, "b": 8, "d": 0, "e": 0}
