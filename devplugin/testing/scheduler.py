"""The kube-scheduler's side of the extender protocol, imitated for tests and
the benchmark: the extender's verbs called over HTTP with the JSON the
kube-scheduler sends (`nodeCacheCapable`: node names only), and its choice
among the nodes that fit by counts (the best score wins; ties: the first
name given)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any


def call_extender(url: str, verb: str, body: Any, timeout: float = 10.0) -> Any:
    """POST one extender verb (`filter`, `prioritize`) and decode the answer."""
    request = urllib.request.Request(
        f"{url}/scheduler/{verb}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.loads(answer.read())


def pending_pod(name: str, limits: Mapping[str, int], *, uid: str | None = None) -> dict[str, Any]:
    """A single-container pod as the scheduler holds it before binding."""
    return {
        "metadata": {"name": name, "namespace": "default", "uid": uid or f"uid-{name}"},
        "spec": {"containers": [{"name": "main", "resources": {
            "limits": {k: str(v) for k, v in limits.items() if v}}}]},
    }  # fmt: skip


def choose_node(url: str, pod: Mapping[str, Any], fits: Sequence[str]) -> str | None:
    """Filter, then prioritize what passed; the best score wins (None: no node)."""
    if not fits:
        return None
    passing = call_extender(url, "filter", {"Pod": pod, "NodeNames": list(fits)})["NodeNames"]
    if not passing:
        return None
    ranked = call_extender(url, "prioritize", {"Pod": pod, "NodeNames": passing})
    top = max(entry["Score"] for entry in ranked)
    return str(next(entry["Host"] for entry in ranked if entry["Score"] == top))


def selector_fits(pod: Mapping[str, Any], labels: Mapping[str, str], name: str = "") -> bool:
    """Whether a node with these labels and this name passes the pod's
    spec.nodeSelector and required node affinity, as the NodeAffinity filter
    judges them (k8s.io/component-helpers/scheduling/corev1/nodeaffinity/
    nodeaffinity.go: every nodeSelector pair must hold; the affinity's terms
    are ORed; within a term the label expressions and the field expressions
    (`matchFields`, on metadata.name) must all hold; a term with neither
    matches nothing, and so does a term that does not parse)."""
    spec = pod.get("spec") or {}
    for key, value in (spec.get("nodeSelector") or {}).items():
        if labels.get(key) != value:
            return False
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = required.get("nodeSelectorTerms")
    if terms is None:
        return True
    fields = {"metadata.name": name} if name else {}
    return any(_term_fits(term, labels, fields) for term in terms)


def _term_fits(
    term: Mapping[str, Any], labels: Mapping[str, str], fields: Mapping[str, str]
) -> bool:
    expressions = term.get("matchExpressions") or []
    field_terms = term.get("matchFields") or []
    if not expressions and not field_terms:
        return False
    checks = [_field_check(f) for f in field_terms]
    if any(check is None for check in checks):
        return False  # does not parse: the term matches nothing
    if expressions and not all(_expression_fits(e, labels) for e in expressions):
        return False
    # Fields are judged only where the node has them (a node without a name).
    return not fields or all(
        (fields.get(key, "") == value) == equal
        for key, equal, value in (c for c in checks if c is not None)
    )


def _field_check(requirement: Mapping[str, Any]) -> tuple[str, bool, str] | None:
    """(key, equal?, value) of a field requirement: In and NotIn with exactly
    one value are the only ones a field selector takes."""
    values = list(requirement.get("values") or [])
    operator = requirement.get("operator")
    if operator not in ("In", "NotIn") or len(values) != 1:
        return None
    return str(requirement["key"]), operator == "In", str(values[0])


def _expression_fits(expression: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key, operator = expression["key"], expression["operator"]
    values = list(expression.get("values") or [])
    present = key in labels
    if operator == "In":
        return present and labels[key] in values
    if operator == "NotIn":
        return not present or labels[key] not in values
    if operator == "Exists":
        return present
    if operator == "DoesNotExist":
        return not present
    if operator in ("Gt", "Lt"):
        try:
            have, bound = int(labels[key]), int(values[0])
        except (KeyError, IndexError, ValueError):
            return False
        return have > bound if operator == "Gt" else have < bound
    raise ValueError(f"unknown node selector operator {operator!r}")
