"""The extender's preemption verb: ExtenderPreemptionArgs in, the victims
that free an aligned set out (`k8s.io/kube-scheduler/extender/v1`; no JSON
tags, so the keys are the Go field names).

The scheduler sends, per candidate node, the victims its own dry run chose
(by counts): UIDs in `NodeNameToMetaVictims` when the extender is
nodeCacheCapable, whole pods in `NodeNameToVictims` otherwise. The answer
replaces each node's victims with those policy/preemption.py chooses from
the pods bound there (lower priority than the preemptor, holding devices
in the node's record), listed highest priority first, and keeps only the
nodes whose eviction gives the best level any node here can reach, with
the fewest victims that reach it there. The scheduler then picks one of
them by its own rules (fewest PDB violations, lowest highest priority,
...), so every node kept is one worth taking.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from devplugin.extender.budgets import DisruptionBudget
from devplugin.kinds.registry import ANCHOR, PARTNER
from devplugin.model import DeviceKind
from devplugin.policy.node_state import NodeState
from devplugin.policy.pod_request import Shape, shape_of
from devplugin.policy.podinfo import PodInfo
from devplugin.policy.preemption import Candidate

# Nodes per call at most (the scheduler sends at most max(10% of nodes,
# 100) candidates; a body this large is not one of its).
MAX_NODES = 10_000
MAX_VICTIMS = 4_096


def proposed_victims(args: Mapping[str, Any]) -> dict[str, tuple[list[str], int]]:
    """Node -> (victim UIDs, NumPDBViolations) as the scheduler proposed
    them; ValueError with the field at fault."""
    meta, full = args.get("NodeNameToMetaVictims"), args.get("NodeNameToVictims")
    if isinstance(meta, dict):
        field, nodes = "NodeNameToMetaVictims", meta
    elif isinstance(full, dict):
        field, nodes = "NodeNameToVictims", full
    else:
        raise ValueError("one of NodeNameToMetaVictims or NodeNameToVictims is required")
    if len(nodes) > MAX_NODES:
        raise ValueError(f"{field}: more than {MAX_NODES} nodes")
    found: dict[str, tuple[list[str], int]] = {}
    for node, victims in nodes.items():
        where = f"{field}[{str(node)[:100]!r}]"
        if not isinstance(victims, dict):
            raise ValueError(f"{where}: must be an object with Pods")
        pods = victims.get("Pods") or []
        if not isinstance(pods, list) or len(pods) > MAX_VICTIMS:
            raise ValueError(f"{where}.Pods: must be a list of at most {MAX_VICTIMS}")
        uids = [_uid(pod, meta is not None) for pod in pods]
        if not all(uids):
            raise ValueError(f"{where}.Pods: a victim without a UID")
        violations = victims.get("NumPDBViolations") or 0
        if not isinstance(violations, int) or isinstance(violations, bool):
            raise ValueError(f"{where}.NumPDBViolations: must be an integer")
        found[str(node)] = ([str(u) for u in uids], violations)
    return found


def _uid(pod: object, meta: bool) -> object:
    if not isinstance(pod, dict):
        return None
    if meta:
        return pod.get("UID")
    metadata = pod.get("metadata")
    return metadata.get("uid") if isinstance(metadata, dict) else None


def candidates(
    node: NodeState, bound: Iterable[PodInfo], priority: int, budgets: Iterable[DisruptionBudget]
) -> tuple[list[Candidate], dict[str, int]]:
    """The pods that may go for a preemptor of `priority`: bound to the node,
    of lower priority, holding devices per its record; and the budgets
    covering any of them (name -> disruptions allowed)."""
    devices: dict[str, set[str]] = {}
    by_name: dict[tuple[str, str], str] = {}
    live = {pod.uid: pod for pod in bound if pod.priority < priority}
    for pod in live.values():
        by_name[(pod.namespace, pod.name)] = pod.uid
    for holding in node.holdings:
        # By uid when the record has it (a namesake is another pod), else by name.
        uid = holding.uid or by_name.get((holding.namespace, holding.pod))
        if uid is not None and uid in live:
            devices.setdefault(uid, set()).update(holding.devices)
    every = list(budgets)
    found: list[Candidate] = []
    allowed: dict[str, int] = {}
    for uid, held in devices.items():
        pod = live[uid]
        covering = {
            f"{b.namespace}/{b.name}": b.allowed
            for b in every
            if b.selects(pod.namespace, pod.labels)
        }
        allowed.update(covering)
        found.append(Candidate(uid, pod.priority, frozenset(held), tuple(covering), pod.start))
    return found, allowed


def evictable(node: NodeState, bound: Iterable[PodInfo], priority: int) -> frozenset[str]:
    """The held devices preemption might free for a preemptor of
    `priority`: all but those of pods bound there at or above it. A holder
    the pod watch does not know counts as evictable: unsure, the filter
    lets the scheduler try (the verb then decides on what it knows)."""
    staying = {pod.uid for pod in bound if pod.priority >= priority}
    names = {(pod.namespace, pod.name) for pod in bound if pod.uid in staying}
    return frozenset(
        device
        for holding in node.holdings
        if holding.uid not in staying and (holding.namespace, holding.pod) not in names
        for device in holding.devices
    )


def counts_fit(
    node: NodeState, bound: Iterable[PodInfo], shape: Shape, uid: str, names: tuple[str, str]
) -> bool:
    """Whether the pod fits the node by counts as kube-scheduler's
    NodeResourcesFit judges them: allocatable (the healthy devices the
    kubelet reports) less the requests of every pod bound there. Where
    they fit, the scheduler's preemption dry run (default_preemption.go
    SelectVictimsOnNode, which re-runs only the in-tree filters) reprieves
    every victim, so no eviction there is ever proposed to the extender."""
    gpu, hca = names
    healthy = node.healthy or {}
    asked = _per_resource(shape)
    requested: dict[tuple[DeviceKind, str], int] = {}
    for pod in bound:
        if pod.uid == uid:
            continue  # the pod itself, bound already (a retry): not a rival
        for key, count in _per_resource(shape_of(pod, gpu, hca)).items():
            requested[key] = requested.get(key, 0) + count
    for (kind, resource), need in asked.items():
        pool = node.pool(kind, resource) & healthy.get(kind, frozenset())
        allocatable = sum(node.replicas.get(d, 1) for d in pool)
        left = sum(
            node.replicas[d] - node.used.get(d, 0) if d in node.replicas else 1
            for d in pool & node.free[kind]
        )
        # Devices the record shows held by holders the pod watch has not
        # seen bound yet count too: unsure, the node stays one preemption may help.
        taken = max(requested.get((kind, resource), 0), allocatable - left)
        if allocatable - taken < need:
            return False
    return True


def _per_resource(shape: Shape) -> dict[tuple[DeviceKind, str], int]:
    found: dict[tuple[DeviceKind, str], int] = {}
    for index, (g, h) in enumerate(shape.containers):
        g_res, h_res = shape.resources_of(index)
        for key, count in (((ANCHOR, g_res), g), ((PARTNER, h_res), h)):
            if count:
                found[key] = found.get(key, 0) + count
    return found


class Chosen(Protocol):
    """A node's victims as the answer reads them (verdicts.Victims)."""

    @property
    def uids(self) -> tuple[str, ...]: ...

    @property
    def violations(self) -> int: ...

    @property
    def level(self) -> int: ...


def answer(
    evictions: Mapping[str, Chosen],
    untold: Mapping[str, tuple[list[str], int]],
) -> dict[str, Any]:
    """ExtenderPreemptionResult: the nodes whose eviction reaches the best
    level among them with the fewest victims, each with its victims (the
    scheduler's own pick would otherwise take more pods of lower
    priority). `untold`: nodes the extender knows nothing about (no fresh
    record), kept as proposed only when no node it knows can take the pod."""
    result: dict[str, Any] = {}
    if evictions:
        best = min((e.level, len(e.uids)) for e in evictions.values())
        for node, eviction in evictions.items():
            if (eviction.level, len(eviction.uids)) == best:
                result[node] = {
                    "Pods": [{"UID": uid} for uid in eviction.uids],
                    "NumPDBViolations": eviction.violations,
                }
    else:
        for node, (uids, violations) in untold.items():
            if uids:
                result[node] = {"Pods": [{"UID": u} for u in uids], "NumPDBViolations": violations}
    return {"NodeNameToMetaVictims": result}


def unchanged(proposed: Mapping[str, tuple[Sequence[str], int]]) -> dict[str, Any]:
    """The proposal as given, in the meta form (a pod without devices)."""
    return {
        "NodeNameToMetaVictims": {
            node: {"Pods": [{"UID": u} for u in uids], "NumPDBViolations": violations}
            for node, (uids, violations) in proposed.items()
        }
    }
