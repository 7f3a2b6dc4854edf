"""What the scheduler sends and gets back (`k8s.io/kube-scheduler/extender/v1`;
the Go types carry no JSON tags, so the keys are the Go field names): the
pod and its nodes out of ExtenderArgs, the ExtenderFilterResult, and the
pod's choice of GPU model applied to a list of nodes."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from devplugin.extender.liveness import Record
from devplugin.extender.serving import BadRequest
from devplugin.policy.labels import (
    EXCLUDE_ANNOTATION,
    PRODUCT_ANNOTATION,
    product_choice,
    product_refusal,
)
from devplugin.policy.pod_request import Requirement, Shape, requirement_of, shape_of
from devplugin.policy.podinfo import PodInfo, parse_pod


def pod_arg(args: Mapping[str, Any]) -> PodInfo:
    """The pod out of any verb's body; BadRequest naming the field at fault."""
    if not isinstance(args, dict):
        raise BadRequest("the body must be a JSON object")
    raw_pod = args.get("Pod")
    if not isinstance(raw_pod, dict):
        raise BadRequest("Pod: required, an object")
    data = dict(raw_pod)
    meta = data.get("metadata")
    if isinstance(meta, dict) and not meta.get("uid"):
        data["metadata"] = {**meta, "uid": f"{meta.get('namespace')}/{meta.get('name')}"}
    try:
        return parse_pod(data)
    except ValueError as exc:
        raise BadRequest(f"Pod: {exc}") from exc


def node_args(
    args: Mapping[str, Any],
) -> tuple[PodInfo, list[str], list[dict[str, Any]] | None]:
    """ExtenderArgs: the pod, the node names, and the Node objects when the
    scheduler sent them whole (not nodeCacheCapable)."""
    pod = pod_arg(args)
    names = args.get("NodeNames")
    nodes = args.get("Nodes")
    if names is not None:
        # type() mapped in C: a generator per name cost a millisecond at 5,000.
        if not isinstance(names, list) or not set(map(type, names)) <= {str}:
            raise BadRequest("NodeNames: must be a list of names")
        return pod, list(names), None
    if isinstance(nodes, dict):
        items = nodes.get("items") or []
        if not isinstance(items, list) or not all(isinstance(n, dict) for n in items):
            raise BadRequest("Nodes.items: must be a list of nodes")
        found = [node_name(n) for n in items]
        if not all(found):
            raise BadRequest("Nodes.items: a node without metadata.name")
        return pod, [str(n) for n in found], items
    raise BadRequest("one of NodeNames or Nodes is required")


def pod_kind(pod: PodInfo, gpu: str, hca: str) -> tuple[Shape, Requirement]:
    """The pod's device shape and the alignment it asks for."""
    shape = shape_of(pod, gpu, hca)
    try:
        requirement = requirement_of(pod.annotations)
    except ValueError as exc:
        raise BadRequest(f"Pod annotations: {exc}") from exc
    return shape, requirement


def node_name(node: Mapping[str, Any]) -> str | None:
    meta = node.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    return name if isinstance(name, str) and name else None


def filter_result(
    passing: list[str],
    failed: dict[str, str],
    unresolvable: dict[str, str],
    nodes: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    """ExtenderFilterResult, in the form it was asked in (names, or the
    passing Node objects)."""
    result: dict[str, Any] = {"FailedNodes": failed, "FailedAndUnresolvableNodes": unresolvable}
    result["Error"] = ""
    if nodes is not None:
        keep = set(passing)
        items = [n for n in nodes if node_name(n) in keep]
        result["Nodes"] = {"apiVersion": "v1", "kind": "NodeList", "items": items}
        result["NodeNames"] = None
    else:
        result["NodeNames"] = passing
        result["Nodes"] = None
    return result


def model_refusals(
    pod: PodInfo, names: Sequence[str], fresh: Callable[[str], Record | None]
) -> dict[str, str]:
    """The nodes whose GPU models the pod's devplugin.io/gpu-product(-exclude)
    annotations rule out, with why; a node without a live record cannot
    show what it has, so a pod that chose fails there too."""
    try:
        choice = product_choice(pod.annotations)
    except ValueError as exc:
        raise BadRequest(f"Pod annotations: {exc}") from exc
    if choice.empty:
        return {}
    which = PRODUCT_ANNOTATION if choice.include else EXCLUDE_ANNOTATION
    unknown = f"{which}: no live NodeDevices record says which GPUs the node has"
    judged: dict[tuple[str, ...], str | None] = {}
    refused: dict[str, str] = {}
    for name in names:
        record = fresh(name)
        if record is None:
            refused[name] = unknown
            continue
        products = record.parsed.products
        if products not in judged:
            judged[products] = product_refusal(choice, products)
        reason = judged[products]
        if reason is not None:
            refused[name] = reason
    return refused


def chosen_models(
    pod: PodInfo, names: list[str], fresh: Callable[[str], Record | None]
) -> tuple[list[str], dict[str, str]]:
    """The nodes left once the pod's choice of GPU model is applied, and
    those it rules out with why (a filter's unresolvable nodes)."""
    refused = model_refusals(pod, names, fresh)
    if not refused:
        return names, refused
    return [name for name in names if name not in refused], refused
