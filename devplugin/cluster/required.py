"""Containers given a worse GPU-HCA level than their pod requires.

A pod that says `devplugin.io/alignment-policy: required` is kept off
nodes that cannot give it the level it names by the scheduler extender;
without the extender (or with a stale record) the kubelet can still admit
it where only worse sets are free. The node is the one place that sees
what each container really got, so it counts and logs those containers
(an operator alerts on the count).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from devplugin.node.alignment import ContainerAlignment
from devplugin.node.metrics import Metrics
from devplugin.policy.pod_request import requirement_of
from devplugin.policy.podinfo import PodInfo
from devplugin.policy.topology import Level

log = logging.getLogger(__name__)


def shortfall(item: ContainerAlignment, annotations: Mapping[str, str]) -> Level | None:
    """The level the pod requires, when the container's worst level is past
    it; None when it meets it, asks for none, or only prefers one (a pod
    whose annotations cannot be read asks for nothing here: the extender
    refuses it with the reason)."""
    if item.worst is None:
        return None
    try:
        requirement = requirement_of(annotations)
    except ValueError:
        return None
    if not requirement.required or requirement.level is None:
        return None
    return requirement.level if item.worst > requirement.level else None


class BelowRequired:
    """Told of each new holder (the alignment monitor's on_new)."""

    def __init__(
        self,
        pod_of: Callable[[str, str], PodInfo | None],
        metrics: Metrics,
    ) -> None:
        self._pod_of = pod_of
        self._metrics = metrics

    def __call__(self, item: ContainerAlignment) -> None:
        pod = self._pod_of(item.namespace, item.pod)
        if pod is None:
            return
        required = shortfall(item, pod.annotations)
        if required is None:
            return
        self._metrics.below_required.labels(required.name).inc()
        assert item.worst is not None
        log.warning(
            "container %s got worst GPU-HCA level %s; its pod requires %s",
            item.name,
            item.worst.name,
            required.name,
        )
