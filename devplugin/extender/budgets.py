"""PodDisruptionBudgets as preemption weighs them: which pods each selects
and how many more disruptions it allows (`status.disruptionsAllowed`, kept
by the disruption controller). Watched, never fetched on a call."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightkube import Client
from lightkube.generic_resource import create_namespaced_resource

from devplugin.cluster.client import Heartbeat
from devplugin.cluster.watch import WatchCache, WatchTiming

PodDisruptionBudget = create_namespaced_resource(
    "policy", "v1", "PodDisruptionBudget", "poddisruptionbudgets"
)

# A selector requirement: (key, operator, values).
Requirement = tuple[str, str, frozenset[str]]
OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


@dataclass(frozen=True)
class DisruptionBudget:
    namespace: str
    name: str
    labels: Mapping[str, str]  # matchLabels
    expressions: tuple[Requirement, ...]  # matchExpressions
    selects_all: bool  # an empty selector: every pod of the namespace
    allowed: int

    def selects(self, namespace: str, labels: Mapping[str, str]) -> bool:
        """Whether a pod with these labels is one this budget covers (a
        LabelSelector's rules: every label and every expression must hold)."""
        if namespace != self.namespace:
            return False
        if self.selects_all:
            return True
        if not self.labels and not self.expressions:
            return False  # no selector: nothing
        if any(labels.get(k) != v for k, v in self.labels.items()):
            return False
        for key, operator, values in self.expressions:
            present = key in labels
            if operator == "In" and not (present and labels[key] in values):
                return False
            if operator == "NotIn" and present and labels[key] in values:
                return False
            if operator == "Exists" and not present:
                return False
            if operator == "DoesNotExist" and present:
                return False
        return True


def parse_budget(data: Mapping[str, Any]) -> tuple[str, DisruptionBudget]:
    meta = data.get("metadata") or {}
    namespace, name = meta.get("namespace"), meta.get("name")
    if not isinstance(namespace, str) or not isinstance(name, str) or not name:
        raise ValueError("a PodDisruptionBudget without a namespace or name")
    spec = data.get("spec") or {}
    selector = spec.get("selector")
    labels: dict[str, str] = {}
    expressions: list[Requirement] = []
    if isinstance(selector, dict):
        for key, value in (selector.get("matchLabels") or {}).items():
            labels[str(key)] = str(value)
        for entry in selector.get("matchExpressions") or []:
            operator = entry.get("operator") if isinstance(entry, dict) else None
            if operator not in OPERATORS:
                raise ValueError(f"selector operator {operator!r} is not one of {OPERATORS}")
            values = frozenset(str(v) for v in entry.get("values") or [])
            expressions.append((str(entry.get("key")), str(operator), values))
    allowed = (data.get("status") or {}).get("disruptionsAllowed", 0)
    if not isinstance(allowed, int) or isinstance(allowed, bool):
        raise ValueError("status.disruptionsAllowed must be an integer")
    selects_all = isinstance(selector, dict) and not labels and not expressions
    budget = DisruptionBudget(namespace, name, labels, tuple(expressions), selects_all, allowed)
    return f"{namespace}/{name}", budget


def budget_cache(
    client: Client, timing: WatchTiming, heartbeat: Heartbeat | None = None
) -> WatchCache[DisruptionBudget]:
    return WatchCache(
        client,
        PodDisruptionBudget,
        parse_budget,
        name="poddisruptionbudgets",
        namespaced=True,
        timing=timing,
        heartbeat=heartbeat,
    )
