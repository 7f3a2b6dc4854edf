"""Hot-unplug and hot-add of an HCA under a running daemon, both ways: udev
events (a fake monitor) and the periodic rescan."""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from devplugin.testing.node import hgx_node, replug, unplug_hca
from tests.conftest import HCA, Cluster
from tests.waiting import wait_until

Start = Callable[..., Cluster]
# Only the path under test may notice: the other checks run rarely.
SLOW = 120.0


@dataclass(frozen=True)
class Event:
    action: str
    subsystem: str
    sys_name: str


class FakeMonitor:
    """pyudev.Monitor's poll() interface, fed by the test."""

    def __init__(self) -> None:
        self.events: queue.Queue[Event] = queue.Queue()
        self.polls = 0

    def poll(self, timeout: float | None = None) -> Event | None:
        self.polls += 1
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None


def listed(cluster: Cluster) -> set[str]:
    return set(cluster.kubelet.devices(HCA))


def test_udev_events_drive_hot_unplug_and_hot_add(start_cluster: Start, tmp_path: Path) -> None:
    monitor = FakeMonitor()
    cluster = start_cluster(
        hgx_node(),
        hotplug_monitor=monitor,
        **{"health.interval_seconds": SLOW, "discovery.rescan_interval_seconds": SLOW},
    )
    hca = cluster.node.hca("mlx5_3")
    assert hca.device_id in listed(cluster)
    unplugged = unplug_hca(cluster.node, "mlx5_3", tmp_path / "stash")
    monitor.events.put(Event("remove", "infiniband", "mlx5_3"))
    monitor.events.put(Event("remove", "pci", str(hca.address)))
    assert cluster.kubelet.wait_for(lambda: hca.device_id not in listed(cluster), timeout=5)
    assert len(listed(cluster)) == 7
    replug(unplugged)
    monitor.events.put(Event("add", "pci", str(hca.address)))
    assert cluster.kubelet.wait_for(lambda: hca.device_id in listed(cluster), timeout=5)
    assert cluster.kubelet.devices(HCA)[hca.device_id].health == "Healthy"


def test_periodic_rescan_sees_the_same_without_udev(start_cluster: Start, tmp_path: Path) -> None:
    cluster = start_cluster(
        hgx_node(),
        **{
            "hotplug.udev": False,
            "health.interval_seconds": SLOW,
            "discovery.rescan_interval_seconds": 0.3,
        },
    )
    assert cluster.daemon.hotplug is None
    hca = cluster.node.hca("mlx5_6")
    unplugged = unplug_hca(cluster.node, "mlx5_6", tmp_path / "stash")
    assert cluster.kubelet.wait_for(lambda: hca.device_id not in listed(cluster), timeout=5)
    replug(unplugged)
    assert cluster.kubelet.wait_for(lambda: hca.device_id in listed(cluster), timeout=5)
    assert cluster.kubelet.devices(HCA)[hca.device_id].health == "Healthy"


def test_unrelated_udev_events_are_ignored(start_cluster: Start) -> None:
    monitor = FakeMonitor()
    cluster = start_cluster(
        hgx_node(),
        hotplug_monitor=monitor,
        **{"health.interval_seconds": SLOW, "discovery.rescan_interval_seconds": SLOW},
    )
    checks = cluster.daemon.checks
    monitor.events.put(Event("change", "pci", "0000:14:00.0"))
    polls = monitor.polls
    # The watcher has taken the event and polled again: it was handled.
    assert wait_until(lambda: monitor.polls >= polls + 2 and monitor.events.empty())
    assert cluster.daemon.checks == checks
    monitor.events.put(Event("add", "pci", "0000:99:00.0"))
    assert wait_until(lambda: cluster.daemon.checks == checks + 1)
