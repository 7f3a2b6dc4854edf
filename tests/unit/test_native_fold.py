"""The compiled tree fold (devplugin/policy/_foldc.c) answers exactly as the Python
fold: the same devices, score and plan for every request, on the named
layouts and a seeded random corpus; it steps aside where 128 bits could
overflow, and it refuses malformed input with an exception, not a crash."""

from __future__ import annotations

import random

import pytest

from devplugin.model import DeviceKind
from devplugin.policy import fold_tables
from devplugin.policy.allocator import Allocator, Request, Role, native_fold_available
from devplugin.policy.fold import fold
from devplugin.policy.topology import Topology
from devplugin.testing.layouts import LAYOUTS
from devplugin.testing.node import devices_from_spec
from devplugin.testing.random_topology import random_requests, random_spec

GPU, HCA = DeviceKind.GPU, DeviceKind.HCA


def pair(topology: Topology) -> tuple[Allocator, Allocator]:
    # A budget no loaded test machine reaches: a search cut short by time
    # answers its best so far, which is not what these tests compare.
    native = Allocator(topology, budget=600.0)
    python = Allocator(topology, native=False, budget=600.0)
    assert python.fold == "python"
    return native, python


def test_the_compiled_fold_is_built_by_the_install() -> None:
    # `make` installs the package with setup.py's extension; a silent
    # fallback here would leave the C fold untested.
    assert native_fold_available()


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_named_layouts_answer_the_same_both_ways(name: str) -> None:
    gpus, hcas = devices_from_spec(LAYOUTS[name]())
    topology = Topology(gpus, hcas)
    native, python = pair(topology)
    assert native.fold == "native"
    rng = random.Random(name)
    requests = random_requests(rng, [g.uuid for g in gpus], [h.device_id for h in hcas], 60)
    # Every size from everything free, where GPUs first plan their HCAs.
    free_hcas = frozenset(h.device_id for h in hcas)
    every = frozenset(g.uuid for g in gpus)
    requests += [
        Request(GPU, every, size, partner=free_hcas, other_free=free_hcas, expected=expected)
        for size in range(1, len(gpus) + 1)
        for expected in (None, max(1, size // 2))
    ]
    for request in requests:
        assert native.choose(request) == python.choose(request), request


def test_random_nodes_answer_the_same_both_ways() -> None:
    cases = 0
    for seed in range(300):
        rng = random.Random(50_000 + seed)
        gpus, hcas = devices_from_spec(random_spec(rng, max_gpus=24))
        topology = Topology(gpus, hcas)
        native, python = pair(topology)
        for request in random_requests(rng, [g.uuid for g in gpus], [h.device_id for h in hcas], 6):
            assert native.choose(request) == python.choose(request), (seed, request)
            cases += 1
    assert cases == 1800


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_infinity_bounds_every_term_the_width_check_counts(name: str) -> None:
    # The 128-bit check multiplies the infinity by the number of terms: that
    # holds only while no table entry or level unit is larger.
    gpus, hcas = devices_from_spec(LAYOUTS[name]())
    tables = fold_tables.FoldTables(Topology(gpus, hcas))
    weights = tables.weights
    inf = weights.inf
    rows = [row for row in tables.spread_rows if row is not None]
    for kind in (GPU, HCA):
        of_kind = tables.kinds[kind]
        rows += [row for per in of_kind.class_values for row in per]
        rows += [row for row in of_kind.node_penalty if row is not None]
    assert rows
    assert max(abs(value) for row in rows for value in row) < inf
    assert 5 * weights.total < inf
    assert weights.reach + sum(weights.support) < inf


def test_a_topology_whose_values_could_pass_128_bits_keeps_the_python_fold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpus, hcas = devices_from_spec(LAYOUTS["hgx-h100"]())
    topology = Topology(gpus, hcas)
    monkeypatch.setattr(fold_tables, "NATIVE_BITS", 40)
    narrow = Allocator(topology)
    assert narrow.fold == "python"
    free = frozenset(h.device_id for h in hcas)
    request = Request(GPU, frozenset(g.uuid for g in gpus), 4, partner=free, other_free=free)
    monkeypatch.undo()
    assert narrow.choose(request) == Allocator(topology).choose(request)


def test_malformed_input_raises_instead_of_crashing() -> None:
    from devplugin.policy import _foldc

    gpus, hcas = devices_from_spec(LAYOUTS["hgx-h100"]())
    tables = Allocator(Topology(gpus, hcas))._native[GPU]
    assert tables is not None
    classes = len(Topology(gpus, hcas).classes)
    good = [1] * classes
    units = [0] * 6
    with pytest.raises(ValueError, match="cap: expected"):
        tables.fold([1], good, good, good, good, 1, 0, units)
    with pytest.raises(ValueError, match="out of range"):
        tables.fold([-1] * classes, good, good, good, good, 1, 0, units)
    with pytest.raises(ValueError, match="cost: a level is at most 5"):
        tables.fold(good, good, [9] * classes, good, good, 1, 0, units)
    with pytest.raises(ValueError, match="size or prune"):
        tables.fold(good, good, good, good, good, 1, 7, units)
    with pytest.raises(ValueError, match="one value per level"):
        tables.fold(good, good, good, good, good, 1, 0, [0] * 5)
    with pytest.raises(ValueError, match="six rows per class"):
        _foldc.Tables(1, [], [[[0]]], [None], 1)
    with pytest.raises(ValueError, match="node or level out of range"):
        _foldc.Tables(1, [(3, 0, (), (), ())], [], [None], 1)
    with pytest.raises(ValueError, match="one entry per node"):
        _foldc.Tables(2, [], [], [None], 1)
    # A fold whose room passes the finishing rows it was given fails
    # (the allocator then answers with the Python fold) instead of reading
    # past them.
    short = _foldc.Tables(1, [(0, 0, (), (0,), ())], [[[0, 0]] * 6], [[[0]]], 1 << 40)
    with pytest.raises(RuntimeError, match="more room below a node"):
        short.fold([1], [0], [0], [0], [0], 1, -1, units)


def test_the_compiled_fold_knows_no_weights_only_rows() -> None:
    # The objective's arithmetic lives in fold_tables.py: the compiled fold is
    # given its rows and, per call, the value of covering a partner at each
    # level, and answers as the Python fold does at every threshold.
    gpus, hcas = devices_from_spec(LAYOUTS["hgx-h100"]())
    topology = Topology(gpus, hcas)
    native, python = pair(topology)
    hca_ids = frozenset(h.device_id for h in hcas)
    chosen = frozenset(g.uuid for g in gpus[:2])
    request = Request(HCA, hca_ids, 1, role=Role.SECOND, partner=chosen, other_free=frozenset())
    assert native.choose(request) == python.choose(request)
    tables = native.tables
    inputs = tables.inputs(request, hca_ids)
    compiled = native._native[HCA]
    assert compiled is not None
    for threshold in range(6):
        units = tables.cover_units(request, threshold)
        found = compiled.fold(
            inputs.cap, inputs.must, inputs.cost, inputs.partner, inputs.other, 1, -1, units
        )
        assert found == fold(tables, request, threshold, inputs)
