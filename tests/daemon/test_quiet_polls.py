"""PodResources polls slow down while nothing changes and come back at once
when something does: an Allocate, a pod that appears or goes."""

from __future__ import annotations

from collections.abc import Callable

from devplugin.model import DeviceKind
from devplugin.testing.kubelet import ContainerRequest
from devplugin.testing.node import hgx_node
from tests.conftest import GPU, Cluster
from tests.waiting import wait_until

Start = Callable[..., Cluster]
QUICK = {
    "pod_resources.poll_interval_seconds": 0.1,
    "pod_resources.min_interval_seconds": 0.05,
    "pod_resources.quiet_interval_seconds": 0.4,
}


def test_polls_slow_while_quiet_and_return_with_an_allocate_or_a_change(
    start_cluster: Start,
) -> None:
    cluster = start_cluster(hgx_node(), **QUICK)
    monitor = cluster.daemon.core.monitor
    # Nothing happens: after five answers that changed nothing, the quiet pace.
    assert wait_until(lambda: monitor.next_interval() == 0.4, timeout=10)
    # An Allocate pokes the monitor: the poll pace at once, and kept while the
    # allocation awaits its container in a poll.
    pod = cluster.kubelet.admit("p", [ContainerRequest("c", {GPU: 1})])
    (gpu,) = pod.container("c").devices[GPU]
    assert monitor.next_interval() == 0.1
    assert wait_until(lambda: gpu in cluster.daemon.core.ledger.in_use(DeviceKind.GPU))
    assert wait_until(lambda: monitor.next_interval() == 0.4, timeout=10)
    # The pod ends with no event (no API here): the quiet poll still sees it,
    # the pace returns, and the release is confirmed at the poll pace.
    polls = monitor.polls
    cluster.kubelet.remove("p")
    assert wait_until(lambda: monitor.next_interval() == 0.1, timeout=10)
    assert monitor.polls > polls
    assert wait_until(lambda: gpu not in cluster.daemon.core.ledger.in_use(DeviceKind.GPU))


def test_the_quiet_pace_is_at_most_five_poll_intervals(start_cluster: Start) -> None:
    cluster = start_cluster(
        hgx_node(),
        **{**QUICK, "pod_resources.quiet_interval_seconds": 60.0},
    )
    monitor = cluster.daemon.core.monitor
    assert wait_until(lambda: monitor.next_interval() != 0.1, timeout=10)
    assert abs(monitor.next_interval() - 0.5) < 1e-9


def test_a_ledger_change_from_an_event_polls_at_once_even_when_quiet(
    start_cluster: Start,
) -> None:
    # Quiet polls every 1.5 s; the pod watch's word that a pod ended (what
    # it tells the ledger) brings a poll at once to confirm the release.
    pace = {
        "pod_resources.poll_interval_seconds": 0.3,
        "pod_resources.min_interval_seconds": 0.05,
        "pod_resources.quiet_interval_seconds": 1.5,
    }
    cluster = start_cluster(hgx_node(), **pace)
    monitor, ledger = cluster.daemon.core.monitor, cluster.daemon.core.ledger
    pod = cluster.kubelet.admit("p", [ContainerRequest("c", {GPU: 1})])
    (gpu,) = pod.container("c").devices[GPU]
    assert wait_until(lambda: gpu in ledger.taken(DeviceKind.GPU))
    assert wait_until(lambda: monitor.next_interval() == 1.5, timeout=10)
    polls = monitor.polls
    assert wait_until(lambda: monitor.polls > polls, timeout=5)  # just after a quiet poll
    polls = monitor.polls
    assert ledger.pod_ended("default", "p", "no-such-uid")
    assert wait_until(lambda: monitor.polls > polls, timeout=0.75)
