"""API objects as plain data, and the Node that a node agent's objects belong to."""

from __future__ import annotations

import logging
from typing import Any

from lightkube import ApiError, Client
from lightkube.generic_resource import create_global_resource

log = logging.getLogger(__name__)

RawNode = create_global_resource("", "v1", "Node", "nodes")


def as_dict(obj: Any) -> dict[str, Any]:
    """An object lightkube returned as plain data ({} when it is not one)."""
    data = obj.to_dict() if hasattr(obj, "to_dict") else obj
    return data if isinstance(data, dict) else {}


def node_owner(
    client: Client, node: str, *, controller: bool = False, what: str | None = None
) -> dict[str, Any] | None:
    """An ownerReference to the Node, so the garbage collector removes the
    object with it; None when the Node cannot be read or has no uid (with a
    log line saying `what` has no owner, when given)."""
    try:
        found = as_dict(client.get(RawNode, node))
    except ApiError as exc:
        if what is not None:
            log.info("Node %s not readable (%s): %s has no owner", node, exc.status.code, what)
        return None
    uid = found.get("metadata", {}).get("uid")
    if not isinstance(uid, str) or not uid:
        return None
    owner: dict[str, Any] = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid}
    if controller:
        owner["controller"] = True
    return owner
