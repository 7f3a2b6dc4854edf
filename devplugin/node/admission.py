"""Which container the kubelet is admitting, from this node's pods.

The kubelet asks for one resource of one container at a time and never says
which. It admits pods one by one and, within a pod, containers in order:
init containers first, then app containers, each getting every resource it
asks for before the next. So for a request of `size` devices of a resource,
the container being admitted is, in some pod bound here and not finished,
the first container (in that order) that asks for the resource and does not
hold any of it yet, provided it asks for exactly `size`. Pods are looked at
oldest first; a pod with a started container is past admission.

When every such candidate asks for the same number of the other resource,
that number is the partner count to plan for (`Outcome.EXACT`); when they
disagree the answer is `AMBIGUOUS`; with none, `NO_POD`. Pure: the caller
passes the pods (its cache) and who holds what (the ledger).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable, Set
from dataclasses import dataclass

from devplugin.policy.podinfo import ContainerInfo, PodInfo

# (namespace, pod, container)
ContainerKey = tuple[str, str, str]


class Outcome(enum.Enum):
    EXACT = "exact"
    NO_POD = "fallback-no-pod"
    AMBIGUOUS = "fallback-ambiguous"
    # The pod cache is not current: not asked at all.
    NOT_CURRENT = "fallback-not-current"


@dataclass(frozen=True)
class Candidate:
    pod: PodInfo
    container: ContainerInfo
    init: bool
    # How many devices of the other resource the same container asks for.
    partners: int
    # Which resource of the other kind it asks them of, where the other kind
    # is served as several (mixed MIG: whole GPUs and one per profile);
    # None when it asks for none, or for several.
    partner_resource: str | None = None


@dataclass(frozen=True)
class Admission:
    outcome: Outcome
    candidates: tuple[Candidate, ...]

    @property
    def partners(self) -> int | None:
        """The other resource's count to plan for; None unless EXACT."""
        if self.outcome is not Outcome.EXACT:
            return None
        return self.candidates[0].partners


def admission_order(pod: PodInfo) -> list[tuple[ContainerInfo, bool]]:
    return [(c, True) for c in pod.init_containers] + [(c, False) for c in pod.containers]


def next_for(pod: PodInfo, resource: str, held: Set[ContainerKey]) -> ContainerInfo | None:
    """The pod's next container to get `resource`, or None if none still needs it.

    Containers get their devices in admission order, so every container
    before the last one known to hold `resource` has been served too (a
    finished init container is not listed by PodResources, yet its devices
    were allocated before the app containers')."""
    found: ContainerInfo | None = None
    for group in (pod.init_containers, pod.containers):
        for container in group:
            if container.requests.get(resource, 0) <= 0:
                continue
            if (pod.namespace, pod.name, container.name) in held:
                found = None  # served, and so was everything before it
            elif found is None:
                found = container
    return found


def admitting(
    pods: Iterable[PodInfo],
    *,
    resource: str,
    other: str | Collection[str],
    size: int,
    held: Set[ContainerKey],
    waiting: bool = False,
) -> Admission:
    """Who is being admitted for `size` devices of `resource`; see the module doc.

    `other`: the other kind's resource, or all of them where that kind is
    served as several. `held`: the containers that already hold devices of
    `resource`.
    `waiting`: `pods` are already only those not past admission, oldest
    first (as the pod cache keeps them)."""
    ordered = (
        list(pods)
        if waiting
        else sorted(
            (p for p in pods if not p.terminal and not p.deleting and not p.started),
            key=lambda p: (p.created, p.namespace, p.name),
        )
    )
    others = (other,) if isinstance(other, str) else tuple(other)
    candidates: list[Candidate] = []
    for pod in ordered:
        container = next_for(pod, resource, held)
        if container is None or container.requests.get(resource, 0) != size:
            continue
        init = any(c is container for c in pod.init_containers)
        asked = {name: container.requests.get(name, 0) for name in others}
        named = [name for name, count in asked.items() if count > 0]
        partner = named[0] if len(named) == 1 and len(others) > 1 else None
        candidates.append(Candidate(pod, container, init, sum(asked.values()), partner))
    if not candidates:
        return Admission(Outcome.NO_POD, ())
    if len({(c.partners, c.partner_resource) for c in candidates}) > 1:
        return Admission(Outcome.AMBIGUOUS, tuple(candidates))
    return Admission(Outcome.EXACT, tuple(candidates))
