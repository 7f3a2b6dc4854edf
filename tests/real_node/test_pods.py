"""Pods on the real node: the kubelet asks the daemon (GetPreferredAllocation,
then Allocate), containerd resolves the CDI names of the answer, and the
container sees exactly the chosen, aligned devices, checked from inside."""

from __future__ import annotations

import pytest

from tests.real_node.conftest import GPU, HCA, Running
from tests.real_node.pods import added, create, delete, held, metric, phase, pod, seen, switch
from tests.real_runtime import expected_nodes, ib_names
from tests.waiting import wait_until

pytestmark = pytest.mark.node


def test_a_gpu_and_hca_pod_sees_exactly_the_devices_the_daemon_chose(running: Running) -> None:
    assert wait_until(lambda: running.allocatable().get(GPU) == "8", timeout=30)
    assert wait_until(lambda: running.allocatable().get(HCA) == "8", timeout=30)
    asked = metric(running, "devplugin_preferred_allocation_requests_total", resource=GPU)
    name = create(running, pod("pair", running.node.name, {"main": {GPU: 2, HCA: 2}}))
    saw = seen(running, name)
    assert wait_until(lambda: phase(running, name) == "Running", timeout=30)
    # The kubelet asked for a preference before it allocated.
    assert metric(running, "devplugin_preferred_allocation_requests_total", resource=GPU) > asked
    # What the kubelet recorded as the container's devices (its PodResources).
    holding = held(running, name)
    gpus, hcas = holding.get(GPU, []), holding.get(HCA, [])
    assert (len(gpus), len(hcas)) == (2, 2)
    hardware = running.hardware
    assert added(running, saw) == expected_nodes(hardware, gpus, hcas)
    # The exact HCAs (the kubelet's Allocate lists them in no fixed order).
    value = saw.env.get("NCCL_IB_HCA", "")
    assert value.startswith("=")
    assert sorted(value[1:].split(",")) == sorted(ib_names(hardware, hcas)[1:].split(","))
    # Aligned: on the HGX layout each GPU shares its PCIe switch with an HCA.
    by_uuid = {gpu.uuid: gpu for gpu in hardware.gpus}
    assert {switch(by_uuid[g].directory) for g in gpus} == {
        switch(hardware.hca_by_id(h).directory) for h in hcas
    }
    delete(running, name)
