"""A pod as the daemon needs it: who it is, where it runs, what each container asks for.

Pure data and a parser from the API's JSON; no client, no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

TERMINAL = frozenset({"Succeeded", "Failed"})
# spec.terminationGracePeriodSeconds when a pod does not set it (the API's default).
DEFAULT_GRACE = 30


@dataclass(frozen=True)
class ContainerInfo:
    name: str
    # Extended resources (and anything else) the container asks for, as counts.
    requests: Mapping[str, int]
    # Restartable init containers (sidecars) run for the pod's whole life.
    sidecar: bool = False
    # Whole CPUs a static CPU manager gives it exclusively (a Guaranteed
    # pod's integer CPU request; 0 otherwise).
    cpus: int = 0


@dataclass(frozen=True)
class PodInfo:
    uid: str
    namespace: str
    name: str
    node: str
    phase: str
    created: str
    deleting: bool
    init_containers: tuple[ContainerInfo, ...]
    containers: tuple[ContainerInfo, ...]
    # The kubelet allocates every container's devices when it admits a pod,
    # before starting any: a pod with a started container is past admission.
    started: bool = False
    annotations: Mapping[str, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    # spec.priority (0 when unset, as the scheduler reads it), metadata.labels
    # (PodDisruptionBudgets select by them) and status.startTime: what
    # preemption weighs.
    priority: int = 0
    labels: Mapping[str, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    start: str = ""
    # The ResourceClaims it uses (by name, in its namespace): those named in
    # spec.resourceClaims and those made for it from templates
    # (status.resourceClaimStatuses).
    claims: tuple[str, ...] = ()
    # status.nominatedNodeName: where the scheduler's preemption made room
    # for it ("" when none), and spec.terminationGracePeriodSeconds (what a
    # victim may take to go; the API's default when unset).
    nominated: str = ""
    grace: int = DEFAULT_GRACE

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL


def _count(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    raise ValueError(f"not a device count: {value!r}")


def _container(entry: object, *, init: bool) -> ContainerInfo:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise ValueError("a container without a name")
    resources = entry.get("resources") or {}
    if not isinstance(resources, dict):
        raise ValueError(f"container {entry['name']}: resources is not an object")
    counts: dict[str, int] = {}
    # Extended resources must have requests equal to limits; either may be set.
    for section in ("limits", "requests"):
        values = resources.get(section) or {}
        if not isinstance(values, dict):
            raise ValueError(f"container {entry['name']}: {section} is not an object")
        for name, value in values.items():
            if "/" in str(name):
                counts[str(name)] = _count(value)
    sidecar = init and entry.get("restartPolicy") == "Always"
    cpu = _cpus(resources)
    return ContainerInfo(entry["name"], MappingProxyType(counts), sidecar, cpu)


# Quantity suffixes (k8s.io/apimachinery resource.Quantity): binary, then decimal.
_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
           "n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9,
           "T": 1e12, "P": 1e15, "E": 1e18}  # fmt: skip


def quantity(value: object) -> float:
    """A resource quantity's value ("500m" -> 0.5, "1Gi" -> 1073741824);
    ValueError for one that is not."""
    text = str(value).strip()
    if not text or len(text) > 64:
        raise ValueError(f"not a quantity: {text[:64]!r}")
    for suffix in sorted(_SUFFIX, key=len, reverse=True):
        if suffix and text.endswith(suffix):
            number, scale = text[: -len(suffix)], _SUFFIX[suffix]
            break
    else:
        number, scale = text, 1
    try:
        return float(number) * scale
    except ValueError as exc:
        raise ValueError(f"not a quantity: {text!r}") from exc


def _cpus(resources: Mapping[str, Any]) -> int:
    """The whole CPUs a container asks (its CPU limit, or request where no
    limit says), as a static CPU manager counts them: 0 unless whole."""
    for section in ("limits", "requests"):
        values = resources.get(section) or {}
        if isinstance(values, dict) and "cpu" in values:
            amount = quantity(values["cpu"])
            return int(amount) if amount == int(amount) and amount >= 1 else 0
    return 0


def _guaranteed(entries: list[Any]) -> bool:
    """The pod's QoS class is Guaranteed (pkg/apis/core/v1/helper/qos):
    every container sets CPU and memory limits, and requests equal to them."""
    for entry in entries:
        resources = entry.get("resources") if isinstance(entry, dict) else None
        if not isinstance(resources, dict):
            return False
        limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
        if not isinstance(limits, dict) or not isinstance(requests, dict):
            return False
        for name in ("cpu", "memory"):
            if name not in limits:
                return False
            try:
                if name in requests and quantity(requests[name]) != quantity(limits[name]):
                    return False
            except ValueError:
                return False
    return bool(entries)


def _started(status: Mapping[str, Any]) -> bool:
    if status.get("phase") == "Running":
        return True
    for field in ("initContainerStatuses", "containerStatuses"):
        entries = status.get(field)
        if not isinstance(entries, list):
            continue
        for entry in entries:
            state = entry.get("state") if isinstance(entry, dict) else None
            if isinstance(state, dict) and ("running" in state or "terminated" in state):
                return True
    return False


def parse_pod(obj: Mapping[str, Any]) -> PodInfo:
    """The fields the daemon uses; ValueError when the object is not a pod it understands."""
    meta, spec = obj.get("metadata"), obj.get("spec")
    status = obj.get("status") or {}
    if not isinstance(meta, dict) or not isinstance(spec, dict) or not isinstance(status, dict):
        raise ValueError("metadata, spec and status must be objects")
    for field in ("uid", "namespace", "name"):
        if not isinstance(meta.get(field), str) or not meta[field]:
            raise ValueError(f"metadata.{field} missing")
    init = spec.get("initContainers") or []
    main = spec.get("containers") or []
    if not isinstance(init, list) or not isinstance(main, list):
        raise ValueError("spec.containers and spec.initContainers must be lists")
    init_containers = tuple(_container(c, init=True) for c in init)
    containers = tuple(_container(c, init=False) for c in main)
    if not _guaranteed([*init, *main]):
        init_containers = tuple(dataclasses.replace(c, cpus=0) for c in init_containers)
        containers = tuple(dataclasses.replace(c, cpus=0) for c in containers)
    return PodInfo(
        uid=meta["uid"],
        namespace=meta["namespace"],
        name=meta["name"],
        node=str(spec.get("nodeName") or ""),
        phase=str(status.get("phase") or "Pending"),
        created=str(meta.get("creationTimestamp") or ""),
        deleting=bool(meta.get("deletionTimestamp")),
        init_containers=init_containers,
        containers=containers,
        started=_started(status),
        annotations=_annotations(meta.get("annotations")),
        priority=_priority(spec.get("priority")),
        labels=_annotations(meta.get("labels")),
        start=str(status.get("startTime") or ""),
        claims=_claims(spec, status),
        nominated=str(status.get("nominatedNodeName") or ""),
        grace=_grace(spec.get("terminationGracePeriodSeconds")),
    )


def _claims(spec: Mapping[str, Any], status: Mapping[str, Any]) -> tuple[str, ...]:
    found: list[str] = []
    for source in (spec.get("resourceClaims"), status.get("resourceClaimStatuses")):
        for entry in source if isinstance(source, list) else ():
            name = entry.get("resourceClaimName") if isinstance(entry, dict) else None
            if isinstance(name, str) and name and name not in found:
                found.append(name)
    return tuple(found)


def _grace(value: object) -> int:
    if value is None:
        return DEFAULT_GRACE
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"spec.terminationGracePeriodSeconds must be a count, not {value!r}")
    return value


def _priority(value: object) -> int:
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"spec.priority must be an integer, not {value!r}")
    return value


def _annotations(value: object) -> Mapping[str, str]:
    if not isinstance(value, dict):
        return MappingProxyType({})
    return MappingProxyType(
        {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}
    )
