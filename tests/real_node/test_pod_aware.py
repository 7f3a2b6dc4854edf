"""The pod-aware path on the real node: with the pod watch, the daemon knows
which container the real kubelet is admitting, and PodResources (the real
kubelet's) which devices the pod's earlier containers took, so each
container of a two-container pod gets the best worst GPU-HCA level any
choice could give, as the imitation's tests hold (tests/cluster/
test_pod_aware.py)."""

from __future__ import annotations

import pytest

from devplugin.node.alignment import alignment, best_worst_level
from devplugin.policy.topology import Topology
from devplugin.testing.controlplane import ControlPlane
from tests.real_node.conftest import GPU, HCA, Running, with_api
from tests.real_node.pods import create, delete, gone, held, metric, pod, seen
from tests.waiting import wait_until

pytestmark = pytest.mark.node

# Pods admitted one after the other, each of two containers (name ->
# GPUs, HCAs); the ones before stay, so the later ones meet a used node.
SHAPES = [
    {"a": (1, 1), "b": (2, 2)},
    {"a": (2, 1), "b": (1, 1)},
    {"a": (1, 2), "b": (1, 0)},
]


@pytest.mark.parametrize("running", [with_api], indirect=True)
def test_each_container_of_a_two_container_pod_gets_the_best_level_free(
    charted: ControlPlane, running: Running
) -> None:
    assert wait_until(lambda: running.allocatable().get(GPU) == "8", timeout=30)
    assert wait_until(lambda: running.allocatable().get(HCA) == "8", timeout=30)
    hardware = running.hardware
    topology = Topology.from_inventory(running.served.inventory)
    free_g = {gpu.uuid for gpu in hardware.gpus}
    free_h = {hca.device_id for hca in hardware.hcas}
    exact = metric(running, "devplugin_pod_aware_choices_total", outcome="exact")
    names = []
    for shape in SHAPES:
        asks = {c: {GPU: g, HCA: h} for c, (g, h) in shape.items()}
        name = create(running, pod("paired", running.node.name, asks))
        names.append(name)
        for container_name in shape:
            seen(running, name, container_name)
        # The kubelet admits a pod's containers in order.
        for container_name, (gpus, hcas) in shape.items():
            holding = held(running, name, container_name)
            got_g, got_h = holding.get(GPU, []), holding.get(HCA, [])
            assert (len(got_g), len(got_h)) == (gpus, hcas)
            if gpus and hcas:
                best = best_worst_level(topology, free_g, free_h, gpus, hcas)
                achieved = alignment(topology, got_g, got_h)
                assert achieved is not None
                assert achieved[0] == best, (shape, container_name)
            free_g -= set(got_g)
            free_h -= set(got_h)
    # The plans were made knowing the container, not blind.
    assert metric(running, "devplugin_pod_aware_choices_total", outcome="exact") > exact
    for name in names:
        delete(running, name)
    assert wait_until(lambda: all(gone(running, name) for name in names), timeout=60)
