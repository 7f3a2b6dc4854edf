"""The daemon registered with a real kubelet: both resources in the Node's
capacity and allocatable, and registered again after a kubelet restart."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.real_node.conftest import GPU, HCA, Running
from tests.waiting import wait_until

pytestmark = pytest.mark.node


def _counts(found: dict[str, Any]) -> tuple[str | None, str | None]:
    return found.get(GPU), found.get(HCA)


def test_both_resources_reach_the_nodes_capacity_and_allocatable(running: Running) -> None:
    assert wait_until(lambda: _counts(running.capacity()) == ("8", "8"), timeout=30)
    assert wait_until(lambda: _counts(running.allocatable()) == ("8", "8"), timeout=30)


def test_a_kubelet_restart_is_followed_by_registration_within_two_seconds(
    running: Running,
) -> None:
    assert wait_until(lambda: _counts(running.allocatable()) == ("8", "8"), timeout=30)
    registrar = running.served.registrar
    running.node.stop_kubelet()
    running.node.start_kubelet()
    # The new kubelet's socket appears when its device manager starts; from
    # then the daemon has two seconds to register both resources again.
    socket = running.node.device_plugin_dir / "kubelet.sock"
    assert wait_until(socket.exists, timeout=30)
    seen = time.monotonic()
    assert wait_until(lambda: all(registrar.registered().values()), timeout=10)
    assert time.monotonic() - seen <= 2.0
    assert running.node.wait_ready(30)
    assert wait_until(lambda: _counts(running.allocatable()) == ("8", "8"), timeout=30)
